//! The router of one table: which source answers a lookup, and when to ask
//! another.
//!
//! A lookup starts at the first admissible source in the configured order
//! (breaker not open, not excluded for its version, not draining). The
//! next source is asked too when the current one fails (failover), or when
//! the hedge delay passes without an answer (hedge); the hedge never waits
//! past the table's deadline (its window at the node's token rate plus the
//! grace), since another source may answer in time. The first answer that
//! passes its checks wins; the others are cancelled. At the hard timeout
//! the donors are given up on, but the node's own copy (`ssd`, `local`), in
//! flight or not yet asked, gets its read (bounded by one more hard
//! timeout, at least [`COPY_READ_LIMIT`]): no lookup fails while the copy
//! is readable. When that is over,
//! or when every source has failed, the table's policy decides: a typed
//! error (`fail`) or zero rows (`zeros`, counted and logged). Rows that
//! fail a check never reach the caller.
//!
//! A wide sweep (a prefill) is cut into chunks by the caller
//! (`crate::model::fetch::fetch_rows`), each a lookup of its own through
//! [`Router::fetch_stripe`]: it starts at the donor its lane is striped to,
//! fails over like any lookup, is not hedged, and has the hard timeout as
//! its deadline.
//!
//! Settings and sources can be replaced while lookups run
//! ([`Router::reconfigure`], used by a config reload): each lookup takes one
//! snapshot of both when it starts, so it never sees half of a change.

pub mod health;
mod lookup;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cluster_config::{Hedge, Policy};
use engram_protocol::encoding::RowEncoding;
use engram_sync::{Mutex, RwLock};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use thiserror::Error;
use tokio::time::Instant;

pub use health::{Breaker, Skip, SourceHealth};
use lookup::{Event, Lookup, Out};

use crate::metrics::{ErrorLabels, NodeMetrics, SourceLabels, TableLabels};
use crate::source::{FetchJob, FetchSlot, SourceError, SourceKind};

/// The least time the node's own copy gets past the hard timeout: a read
/// that is slow (a cold disk, writeback in the way: tens of milliseconds
/// on a VM) still beats a failed token; only a dead disk hits it.
pub const COPY_READ_LIMIT: Duration = Duration::from_secs(1);

/// How one table's lookups are bounded.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteSettings {
    /// Table id.
    pub table: u32,
    /// How the table's rows are encoded (V4.1's 264-byte rows, or another
    /// model's): a lookup's rows are this encoding's row size each, and an
    /// answer is checked by its rule.
    pub encoding: RowEncoding,
    /// The table's window at the node's token rate.
    pub window: Duration,
    /// Added to the window to make the deadline.
    pub grace: Duration,
    /// A lookup never takes longer.
    pub hard_timeout: Duration,
    /// When the next source is asked too.
    pub hedge: Hedge,
    /// What happens when every source failed.
    pub policy: Policy,
    /// Time hedges and deadlines to the microsecond (tokio's timers count
    /// whole milliseconds, longer than table 1's window at 100 tokens/s)
    /// with the node's precise timer thread (`crate::timer`).
    /// Off only for tests under paused time.
    pub precise_timers: bool,
}

/// How a lookup went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// The source whose rows were returned (`None`: zeros by policy).
    pub source: Option<Arc<str>>,
    /// Sources asked as hedges.
    pub hedges: u32,
    /// Sources asked after a failure.
    pub failovers: u32,
    /// Whether the answer came after the deadline.
    pub late: bool,
    /// Time from the start of the lookup to its answer.
    pub elapsed: Duration,
}

impl Fetched {
    /// True when the rows are zeros by policy (Engram suppressed).
    pub fn is_zeros(&self) -> bool {
        self.source.is_none()
    }
}

/// Why a lookup failed (policy `fail`, or a request no source can answer).
#[derive(Debug, Clone, Error)]
pub enum RouterError {
    /// Every source failed or was unavailable by the hard timeout.
    #[error("table {table}: no source answered within {elapsed:?}: {}", describe(.attempts))]
    AllFailed {
        /// The table id.
        table: u32,
        /// Time from the lookup's start to giving up.
        elapsed: Duration,
        /// Each source that failed or was not asked, and why (typed).
        attempts: Vec<Miss>,
    },
    /// The request is wrong (out-of-range row, buffer size): no source can answer it.
    #[error("table {table}: bad request: {message}")]
    BadRequest {
        /// The table id.
        table: u32,
        /// What is wrong with the request.
        message: String,
    },
}

/// One source that did not answer a lookup, and why.
#[derive(Debug, Clone)]
pub struct Miss {
    /// The source's name (`(all)` for the hard timeout).
    pub source: String,
    /// Why it did not answer.
    pub why: MissReason,
}

/// Why a source did not answer a lookup: typed, so a caller (and the
/// metrics) tell a version mismatch from a lost connection or a hard
/// timeout without reading strings.
#[derive(Debug, Clone, Error)]
pub enum MissReason {
    /// The source was not asked.
    #[error("{0}")]
    Skipped(Skip),
    /// The source was asked and failed; the error says whether another
    /// source may do better ([`SourceError::retry_elsewhere`]).
    #[error(transparent)]
    Failed(#[from] SourceError),
    /// The lookup's hard timeout passed with nothing usable.
    #[error("hard timeout {0:?}")]
    HardTimeout(Duration),
}

fn describe(attempts: &[Miss]) -> String {
    if attempts.is_empty() {
        return "no source configured".into();
    }
    attempts
        .iter()
        .map(|a| format!("{}: {}", a.source, a.why))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Per-source metric handles, taken once.
#[derive(Debug)]
struct SourceSeries {
    /// The source's name, shared by every answer it wins.
    name: Arc<str>,
    fetch: Histogram,
    rows: Counter,
    hedges_won: Counter,
    versions: Counter,
    checksums: Counter,
    errors: [Counter; 7],
}

#[derive(Debug)]
struct TableSeries {
    lookups: Counter,
    misses: Counter,
    hedges: Counter,
    failovers: Counter,
    zeros: Counter,
    failed: Counter,
}

const ERROR_KINDS: [&str; 7] = [
    "timeout",
    "unavailable",
    "version",
    "corrupt",
    "draining",
    "failed",
    "bad_request",
];

fn error_kind(e: &SourceError) -> usize {
    match e {
        SourceError::Timeout => 0,
        SourceError::Unavailable(_) => 1,
        SourceError::VersionMismatch { .. } => 2,
        SourceError::Corrupt(_) => 3,
        SourceError::Draining => 4,
        SourceError::Failed(_) => 5,
        SourceError::BadRequest(_) => 6,
    }
}

/// What a lookup uses: the settings and the sources with their series.
/// Replaced whole by [`Router::reconfigure`]; a lookup keeps the one it
/// started with.
#[derive(Debug)]
struct RouteState {
    settings: RouteSettings,
    sources: Vec<Arc<SourceHealth>>,
    series: Vec<SourceSeries>,
}

impl RouteState {
    fn new(settings: RouteSettings, sources: Vec<Arc<SourceHealth>>, m: &NodeMetrics) -> Self {
        let t = settings.table.to_string();
        let series = sources
            .iter()
            .map(|s| {
                let l = SourceLabels {
                    table: t.clone(),
                    source: s.source.name().to_string(),
                };
                SourceSeries {
                    name: Arc::from(s.source.name()),
                    fetch: m.fetch_seconds.get_or_create(&l).clone(),
                    rows: m.rows_served.get_or_create(&l).clone(),
                    hedges_won: m.hedges_won.get_or_create(&l).clone(),
                    versions: m.version_mismatches.get_or_create(&l).clone(),
                    checksums: m.checksum_failures.get_or_create(&l).clone(),
                    errors: ERROR_KINDS.map(|kind| {
                        m.source_errors
                            .get_or_create(&ErrorLabels {
                                table: t.clone(),
                                source: l.source.clone(),
                                kind: kind.into(),
                            })
                            .clone()
                    }),
                }
            })
            .collect();
        Self {
            settings,
            sources,
            series,
        }
    }
}

/// What attempts leave behind for the next ones: buffers, row lists and
/// fetch slots, so that a lookup in the steady state allocates nothing.
#[derive(Default)]
struct AttemptBuffers {
    buffers: Vec<Vec<u8>>,
    rows: Vec<Vec<u64>>,
    slots: Vec<FetchSlot>,
}

impl std::fmt::Debug for AttemptBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttemptBuffers")
            .field("buffers", &self.buffers.len())
            .field("rows", &self.rows.len())
            .field("slots", &self.slots.len())
            .finish()
    }
}

/// Kept in the pool beyond one of each per source: the lookups a sweep
/// runs at once, a hedge.
const POOL_SPARE: usize = 8;

/// One table's sources and how to use them.
#[derive(Debug)]
pub struct Router {
    table_id: u32,
    state: RwLock<Arc<RouteState>>,
    table: TableSeries,
    pool: Mutex<AttemptBuffers>,
    zeros_warned_ms: AtomicU64,
    started: std::time::Instant,
}

impl Router {
    /// A router over `sources` in order of preference.
    pub fn new(settings: RouteSettings, sources: Vec<Arc<SourceHealth>>, m: &NodeMetrics) -> Self {
        let tl = TableLabels {
            table: settings.table.to_string(),
        };
        let table = TableSeries {
            lookups: m.lookups.get_or_create(&tl).clone(),
            misses: m.deadline_misses.get_or_create(&tl).clone(),
            hedges: m.hedges_sent.get_or_create(&tl).clone(),
            failovers: m.failovers.get_or_create(&tl).clone(),
            zeros: m.zeros_served.get_or_create(&tl).clone(),
            failed: m.failed_lookups.get_or_create(&tl).clone(),
        };
        Self {
            table_id: settings.table,
            state: RwLock::new(Arc::new(RouteState::new(settings, sources, m))),
            table,
            pool: Mutex::new(AttemptBuffers::default()),
            zeros_warned_ms: AtomicU64::new(0),
            started: std::time::Instant::now(),
        }
    }

    /// The table it routes.
    pub fn table(&self) -> u32 {
        self.table_id
    }

    fn state(&self) -> Arc<RouteState> {
        self.state.read().clone()
    }

    /// Bytes per row of its table (its encoding's: 264 for V4.1's).
    pub fn row_bytes(&self) -> usize {
        self.state.read().settings.encoding.row_bytes()
    }

    /// Its settings now.
    pub fn settings(&self) -> RouteSettings {
        self.state().settings.clone()
    }

    /// Its sources now, in order, with their health.
    pub fn sources(&self) -> Vec<Arc<SourceHealth>> {
        self.state().sources.clone()
    }

    /// Use `settings` and `sources` from the next lookup on; lookups in
    /// flight finish with what they started with. The table cannot change:
    /// `settings.table` is ignored.
    pub fn reconfigure(
        &self,
        mut settings: RouteSettings,
        sources: Vec<Arc<SourceHealth>>,
        m: &NodeMetrics,
    ) {
        settings.table = self.table_id;
        let next = Arc::new(RouteState::new(settings, sources, m));
        *self.state.write() = next;
    }

    fn pool(&self) -> engram_sync::MutexGuard<'_, AttemptBuffers> {
        self.pool.lock()
    }

    /// A fetch of `rows` of `table` by `deadline`, and a slot to run it
    /// in, from the pool when it has them (nothing allocated then).
    fn job(
        &self,
        settings: &RouteSettings,
        rows: &[u64],
        deadline: Instant,
    ) -> (FetchJob, FetchSlot) {
        let (mut list, mut buf, slot) = {
            let mut p = self.pool();
            (
                p.rows.pop().unwrap_or_default(),
                p.buffers.pop().unwrap_or_default(),
                p.slots.pop(),
            )
        };
        list.clear();
        list.extend_from_slice(rows);
        buf.resize(rows.len() * settings.encoding.row_bytes(), 0);
        let job = FetchJob {
            table: settings.table,
            rows: list,
            buf,
            deadline,
        };
        (job, slot.unwrap_or_else(crate::source::empty_slot))
    }

    /// Keep what an ended attempt used for the next ones (a few of each;
    /// fewer buffers, which a sweep's chunks make large).
    fn recycle(&self, st: &RouteState, job: FetchJob, slot: FetchSlot) {
        let keep = st.sources.len() + POOL_SPARE;
        let mut p = self.pool();
        if p.buffers.len() < st.sources.len() + 2 {
            p.buffers.push(job.buf);
        }
        if p.rows.len() < keep {
            p.rows.push(job.rows);
        }
        if p.slots.len() < keep {
            p.slots.push(slot);
        }
    }

    /// An attempt nobody waits for any more: its fetch is dropped now (a
    /// donor's request let go, an SSD job skipped), its slot kept.
    fn forget(&self, mut slot: FetchSlot) {
        crate::source::clear_slot(&mut slot);
        let mut p = self.pool();
        if p.slots.len() < POOL_SPARE {
            p.slots.push(slot);
        }
    }

    /// Fetch `rows` of the table into `out` (`rows.len()` times the
    /// table's row size: 264 bytes for V4.1's).
    pub async fn fetch(&self, rows: &[u64], out: &mut [u8]) -> Result<Fetched, RouterError> {
        self.lookup(rows, Out::Slice(out), None).await
    }

    /// [`Router::fetch`] without the last copy: on success `out` is
    /// replaced by the buffer the winning source filled (`rows.len()` rows
    /// at the table's row size), and the buffer it held goes to the router's pool for the
    /// next lookups. A caller that keeps passing the same `Vec` gets the
    /// rows copied once, by the source (from the socket's frame, the SSD
    /// page, or local RAM), and allocates nothing.
    pub async fn fetch_vec(&self, rows: &[u64], out: &mut Vec<u8>) -> Result<Fetched, RouterError> {
        self.lookup(rows, Out::Vec(out), None).await
    }

    /// Fetch one chunk of a wide sweep (a prefill): like [`Router::fetch`],
    /// but asking the admissible donor `stripe` first (modulo their count;
    /// the next ones, then the node's own copy, on failure), with no hedge
    /// (every replica carries its own share of the sweep) and the hard
    /// timeout as the chunk's deadline.
    pub async fn fetch_stripe(
        &self,
        rows: &[u64],
        out: &mut [u8],
        stripe: usize,
    ) -> Result<Fetched, RouterError> {
        self.lookup(rows, Out::Slice(out), Some(stripe)).await
    }

    /// Wake the path to the source the next lookup goes to first, ahead of
    /// a lookup expected soon ([`crate::source::RowSource::warm`]).
    pub fn warm(&self) {
        let st = self.state();
        if let Some(first) = st.sources.iter().find(|s| s.admissible(self.table_id)) {
            first.source.warm();
        }
    }

    /// Donors a lookup may use now (breaker not open, not excluded, not
    /// draining): how many replicas a wide sweep can be striped across.
    pub fn replicas(&self) -> usize {
        let st = self.state();
        st.sources
            .iter()
            .filter(|s| s.source.kind() == SourceKind::Donor && s.admissible(self.table_id))
            .count()
    }

    async fn lookup(
        &self,
        rows: &[u64],
        mut out: Out<'_>,
        stripe: Option<usize>,
    ) -> Result<Fetched, RouterError> {
        // One snapshot for the whole lookup: a reconfiguration meanwhile
        // applies from the next one.
        let state = self.state();
        self.table.lookups.inc();
        let mut lookup = Lookup::begin(self, &state, rows, out.fixed_len(), stripe)?;
        while !lookup.is_over() {
            match lookup.next_event().await {
                Event::Answer(a) => {
                    if let Some(done) = lookup.answered(a, &mut out)? {
                        return Ok(done);
                    }
                }
                Event::HedgeDue => lookup.hedge(),
                Event::HardTimeout => lookup.past_hard_timeout(),
            }
        }
        lookup.give_up(&mut out)
    }

    /// Loud, but at most once a second.
    fn warn_zeros(&self, rows: usize, failed: &[Miss]) {
        let now_ms = self.started.elapsed().as_millis() as u64 + 1_000;
        let last = self.zeros_warned_ms.load(Ordering::Relaxed);
        if now_ms >= last + 1_000
            && self
                .zeros_warned_ms
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                table = self.table_id,
                rows,
                served_zeros_total = self.table.zeros.get(),
                why = %describe(failed),
                "every source failed: serving zeros (Engram suppressed for this token)"
            );
        }
    }
}

/// Sleep until `t`; `precise`: on the node's precise timer thread, else
/// on tokio's (whole milliseconds; paused time in tests).
async fn sleep_until(precise: bool, t: Instant) {
    if !precise {
        return tokio::time::sleep_until(t).await;
    }
    crate::timer::sleep_until(t.into_std()).await;
}
