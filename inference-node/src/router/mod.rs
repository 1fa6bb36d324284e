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
//! Settings and sources can be replaced while lookups run
//! ([`Router::reconfigure`], used by a config reload): each lookup takes one
//! snapshot of both when it starts, so it never sees half of a change.

pub mod health;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::Poll;
use std::time::Duration;

use cluster_config::{Hedge, Policy};
use engram_protocol::ROW_BYTES;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use thiserror::Error;
use tokio::time::Instant;

pub use health::{Breaker, SourceHealth};

use crate::metrics::{ErrorLabels, NodeMetrics, SourceLabels, TableLabels};
use crate::source::{SourceError, SourceKind};

/// The least time the node's own copy gets past the hard timeout: a read
/// that is slow (a cold disk, writeback in the way: tens of milliseconds
/// on a VM) still beats a failed token; only a dead disk hits it.
pub const COPY_READ_LIMIT: Duration = Duration::from_secs(1);

/// How one table's lookups are bounded.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteSettings {
    /// Table id.
    pub table: u32,
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
    pub source: Option<String>,
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
        table: u32,
        elapsed: Duration,
        attempts: Vec<(String, String)>,
    },
    /// The request is wrong (out-of-range row, buffer size): no source can answer it.
    #[error("table {table}: bad request: {message}")]
    BadRequest { table: u32, message: String },
}

fn describe(attempts: &[(String, String)]) -> String {
    if attempts.is_empty() {
        return "no source configured".into();
    }
    attempts
        .iter()
        .map(|(s, e)| format!("{s}: {e}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Per-source metric handles, taken once.
#[derive(Debug)]
struct SourceSeries {
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

type Attempt<'a> = Pin<Box<dyn Future<Output = (Result<(), SourceError>, Vec<u8>)> + Send + 'a>>;

/// An attempt in flight: which source, whether it was a hedge, when sent.
struct InFlight<'a> {
    fut: Attempt<'a>,
    source: usize,
    hedge: bool,
    sent: Instant,
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

/// One table's sources and how to use them.
#[derive(Debug)]
pub struct Router {
    table_id: u32,
    state: RwLock<Arc<RouteState>>,
    table: TableSeries,
    buffers: Mutex<Vec<Vec<u8>>>,
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
            buffers: Mutex::new(Vec::new()),
            zeros_warned_ms: AtomicU64::new(0),
            started: std::time::Instant::now(),
        }
    }

    /// The table it routes.
    pub fn table(&self) -> u32 {
        self.table_id
    }

    fn state(&self) -> Arc<RouteState> {
        self.state.read().unwrap_or_else(|p| p.into_inner()).clone()
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
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = next;
    }

    fn buffer(&self, len: usize) -> Vec<u8> {
        let mut b = self
            .buffers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_default();
        b.resize(len, 0);
        b
    }

    fn recycle(&self, st: &RouteState, b: Vec<u8>) {
        let mut pool = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < st.sources.len() + 2 {
            pool.push(b);
        }
    }

    /// Whether source `i` is the node's own copy (`ssd` or `local`): the
    /// last resort, which gets one read past the hard timeout.
    fn is_copy(st: &RouteState, i: usize) -> bool {
        st.sources[i].source.kind() != SourceKind::Donor
    }

    /// The next source in `order` from `*next` to ask, advancing `*next`
    /// past it; past the hard timeout only a copy is still worth asking.
    fn next_source(
        st: &RouteState,
        order: &[usize],
        next: &mut usize,
        past_hard: bool,
    ) -> Option<usize> {
        let k = order
            .get(*next..)?
            .iter()
            .position(|&i| !past_hard || Self::is_copy(st, i))?;
        let i = order[*next + k];
        *next += k + 1;
        Some(i)
    }

    /// Send the lookup to source `i`. A donor gets until the hard timeout;
    /// the node's own copy until one more hard timeout after it, at least
    /// [`COPY_READ_LIMIT`] (its read normally takes well under a
    /// millisecond; the bound is for a dead disk).
    fn attempt<'a>(
        &self,
        st: &RouteState,
        i: usize,
        rows: &'a [u64],
        hard: Instant,
        hedge: bool,
    ) -> InFlight<'a> {
        let mut buf = self.buffer(rows.len() * ROW_BYTES);
        let src = st.sources[i].source.clone();
        let table = st.settings.table;
        let until = if Self::is_copy(st, i) {
            hard + st.settings.hard_timeout.max(COPY_READ_LIMIT)
        } else {
            hard
        };
        InFlight {
            fut: Box::pin(async move {
                let res = src.fetch(table, rows, &mut buf, until).await;
                (res, buf)
            }),
            source: i,
            hedge,
            sent: Instant::now(),
        }
    }

    /// Attempts still out when the lookup ends: those sent before the
    /// winner (or out at the hard timeout) were too slow, and that counts
    /// against their breaker; a healthy source rarely loses to a hedge it
    /// started ahead of several times in a row, a hung one always does.
    fn slow(st: &RouteState, inflight: Vec<InFlight<'_>>, winner_sent: Option<Instant>) {
        for a in inflight {
            match winner_sent {
                // Out of time: a plain failure.
                None => Self::failure(st, a.source, &SourceError::Timeout),
                // Beaten by a source asked after it: slower, not wrong.
                Some(w) if a.sent < w => {
                    st.series[a.source].errors[error_kind(&SourceError::Timeout)].inc();
                    st.sources[a.source].on_lost_race();
                }
                Some(_) => {}
            }
        }
    }

    /// Fetch `rows` of the table into `out` (`rows.len() * 264` bytes).
    pub async fn fetch(&self, rows: &[u64], out: &mut [u8]) -> Result<Fetched, RouterError> {
        // One snapshot for the whole lookup: a reconfiguration meanwhile
        // applies from the next one.
        let state = self.state();
        let st = &*state;
        let s = &st.settings;
        let start = Instant::now();
        let deadline = start + s.window + s.grace;
        let hard = start + s.hard_timeout;
        self.table.lookups.inc();
        if out.len() != rows.len() * ROW_BYTES {
            return Err(RouterError::BadRequest {
                table: s.table,
                message: format!(
                    "output buffer is {} bytes, {} rows need {}",
                    out.len(),
                    rows.len(),
                    rows.len() * ROW_BYTES
                ),
            });
        }
        let mut failed: Vec<(String, String)> = Vec::new();
        let order: Vec<usize> = (0..st.sources.len())
            .filter(|&i| {
                let ok = st.sources[i].admissible(s.table);
                if !ok {
                    failed.push((
                        st.sources[i].source.name().to_string(),
                        st.sources[i].why_not(s.table).to_string(),
                    ));
                }
                ok
            })
            .collect();
        let mut next = 0;
        let mut hedges = 0u32;
        let mut failovers = 0u32;
        let mut inflight: Vec<InFlight<'_>> = Vec::with_capacity(order.len());
        let mut launch_at = None;
        if let Some(&first) = order.first() {
            inflight.push(self.attempt(st, first, rows, hard, false));
            next = 1;
            launch_at = Self::next_launch(st, first, start, deadline);
        }
        // Past the hard timeout only the node's own copy is waited for.
        let mut past_hard = false;
        while !inflight.is_empty() {
            let can_launch = next < order.len() && !past_hard;
            let hedge_at = launch_at.unwrap_or(hard);
            let done = tokio::select! {
                biased;
                d = next_done(&mut inflight) => d,
                () = sleep_until(s.precise_timers, hedge_at), if can_launch && launch_at.is_some() => {
                    let i = order[next];
                    next += 1;
                    hedges += 1;
                    self.table.hedges.inc();
                    inflight.push(self.attempt(st, i, rows, hard, true));
                    let now = Instant::now();
                    launch_at = Self::next_launch(st, i, now, deadline.max(now));
                    continue;
                }
                () = sleep_until(s.precise_timers, hard), if !past_hard => {
                    // The donors are out of time. The node's own copy, in
                    // flight or not yet asked, gets its read: a lookup never
                    // fails while the copy can be read, and takes at most the
                    // hard timeout plus one read of it.
                    past_hard = true;
                    let (copies, donors): (Vec<_>, Vec<_>) =
                        inflight.into_iter().partition(|a| Self::is_copy(st, a.source));
                    Self::slow(st, donors, None);
                    inflight = copies;
                    if inflight.is_empty() {
                        match Self::next_source(st, &order, &mut next, past_hard) {
                            Some(i) => {
                                failovers += 1;
                                self.table.failovers.inc();
                                inflight.push(self.attempt(st, i, rows, hard, false));
                            }
                            None => break,
                        }
                    }
                    continue;
                }
            };
            let (a, (res, buf)) = done;
            let (i, was_hedge, sent) = (a.source, a.hedge, a.sent);
            let res = res.and_then(|()| {
                engram_protocol::row::check_rows(&buf)
                    .map_err(|(at, e)| SourceError::Corrupt(format!("row {at}: {e}")))
            });
            match res {
                Ok(()) => {
                    let now = Instant::now();
                    out.copy_from_slice(&buf);
                    self.recycle(st, buf);
                    let latency = now - sent;
                    st.sources[i].on_success(latency);
                    let ser = &st.series[i];
                    ser.fetch.observe(latency.as_secs_f64());
                    ser.rows.inc_by(rows.len() as u64);
                    if was_hedge {
                        ser.hedges_won.inc();
                    }
                    let late = now > deadline;
                    if late {
                        self.table.misses.inc();
                    }
                    Self::slow(st, inflight, Some(sent));
                    return Ok(Fetched {
                        source: Some(st.sources[i].source.name().to_string()),
                        hedges,
                        failovers,
                        late,
                        elapsed: now - start,
                    });
                }
                Err(e) => {
                    self.recycle(st, buf);
                    Self::failure(st, i, &e);
                    failed.push((st.sources[i].source.name().to_string(), e.to_string()));
                    if !e.retry_elsewhere() {
                        return Err(RouterError::BadRequest {
                            table: s.table,
                            message: e.to_string(),
                        });
                    }
                    if let Some(j) = Self::next_source(st, &order, &mut next, past_hard) {
                        failovers += 1;
                        self.table.failovers.inc();
                        inflight.push(self.attempt(st, j, rows, hard, false));
                        let now = Instant::now();
                        launch_at = Self::next_launch(st, j, now, deadline.max(now));
                    }
                }
            }
        }
        // Hard timeout (attempts still out) or every source failed.
        Self::slow(st, inflight, None);
        self.give_up(st, rows, out, start, failed)
    }

    /// When to ask the source after `i` if `i` has not answered.
    fn next_launch(st: &RouteState, i: usize, from: Instant, deadline: Instant) -> Option<Instant> {
        match st.sources[i].hedge_delay(st.settings.hedge) {
            Some(d) => Some((from + d).min(deadline)),
            None if st.settings.hedge == Hedge::Off => (from < deadline).then_some(deadline),
            // A percentile without enough history yet: wait for the deadline.
            None => Some(deadline),
        }
    }

    fn failure(st: &RouteState, i: usize, e: &SourceError) {
        let ser = &st.series[i];
        ser.errors[error_kind(e)].inc();
        match e {
            SourceError::VersionMismatch { .. } => {
                ser.versions.inc();
            }
            SourceError::Corrupt(_) => {
                ser.checksums.inc();
            }
            _ => {}
        }
        st.sources[i].on_failure(st.settings.table, e);
    }

    fn give_up(
        &self,
        st: &RouteState,
        rows: &[u64],
        out: &mut [u8],
        start: Instant,
        mut failed: Vec<(String, String)>,
    ) -> Result<Fetched, RouterError> {
        let elapsed = start.elapsed();
        if elapsed >= st.settings.hard_timeout {
            failed.push((
                "(all)".into(),
                format!("hard timeout {:?}", st.settings.hard_timeout),
            ));
        }
        match st.settings.policy {
            Policy::Fail => {
                self.table.failed.inc();
                Err(RouterError::AllFailed {
                    table: self.table_id,
                    elapsed,
                    attempts: failed,
                })
            }
            Policy::Zeros => {
                out.fill(0);
                self.table.zeros.inc();
                self.warn_zeros(rows.len(), &failed);
                Ok(Fetched {
                    source: None,
                    hedges: 0,
                    failovers: 0,
                    late: true,
                    elapsed,
                })
            }
        }
    }

    /// Loud, but at most once a second.
    fn warn_zeros(&self, rows: usize, failed: &[(String, String)]) {
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

/// The first attempt to finish, removed from the set.
async fn next_done<'a>(
    inflight: &mut Vec<InFlight<'a>>,
) -> (InFlight<'a>, (Result<(), SourceError>, Vec<u8>)) {
    std::future::poll_fn(|cx| {
        for k in 0..inflight.len() {
            if let Poll::Ready(r) = inflight[k].fut.as_mut().poll(cx) {
                return Poll::Ready((inflight.swap_remove(k), r));
            }
        }
        Poll::Pending
    })
    .await
}
