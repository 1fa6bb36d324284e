//! What the donor is doing, readable at any moment by the control plane and
//! `/metrics`: its phase (loading, serving, draining, failed), each table's
//! load state and progress, the data-plane counters, and the drain request
//! a control client can make. It exists before any table is loaded, so
//! health and progress are visible during a minutes-long load. It also
//! carries orders (a reload, a table swap) from the signal handler and the
//! control plane to the serving loop, which alone changes what is served.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use engram_protocol::{ROW_BYTES, TableDigest};
use engram_sync::Mutex;
use tokio::sync::{Notify, mpsc, watch};

use crate::orders::Order;
use crate::stats::Stats;

/// The donor's phase, as health checks see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Tables are loading or verifying: NOT_SERVING.
    Loading,
    /// Every table is resident and verified: SERVING.
    Serving,
    /// A drain started: NOT_SERVING.
    Draining,
    /// A table failed to load; the donor is about to exit: NOT_SERVING.
    Failed,
}

/// Where one table's load is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadState {
    /// Reading rows into memory (hashing them unless the digest is trusted).
    Loading,
    /// Every row is in memory; digest compared, memory being locked.
    Verifying,
    /// Resident and served.
    Ready,
    /// Loading failed.
    Failed,
}

impl LoadState {
    /// Every state, in order (metrics show one series per state).
    pub const ALL: [Self; 4] = [Self::Loading, Self::Verifying, Self::Ready, Self::Failed];

    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Loading => "loading",
            Self::Verifying => "verifying",
            Self::Ready => "ready",
            Self::Failed => "failed",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Verifying,
            2 => Self::Ready,
            3 => Self::Failed,
            _ => Self::Loading,
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            Self::Loading => 0,
            Self::Verifying => 1,
            Self::Ready => 2,
            Self::Failed => 3,
        }
    }
}

/// What a table's header says, once read.
#[derive(Debug, Clone, Default)]
struct Header {
    path: PathBuf,
    id: Option<u32>,
    layer: u32,
    rows: u64,
    digest: Option<TableDigest>,
    error: Option<String>,
    /// Bytes per row, once known (0 until then: V4.1's 264 is shown).
    row_bytes: u64,
}

/// One table's load, updated by the loader and read by anyone.
#[derive(Debug)]
pub struct TableStatus {
    /// True when the digest is recomputed while loading.
    pub verify: bool,
    header: Mutex<Header>,
    state: AtomicU8,
    rows_done: AtomicU64,
    /// Bytes of memory the rows take as served (0 until resident).
    memory: AtomicU64,
}

/// A table's load at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableView {
    /// Id it is served under (the configured id; else its layer once known; else 0).
    pub id: u32,
    /// Model layer (0 until the header is read).
    pub layer: u32,
    /// Rows (0 until the header is read).
    pub rows: u64,
    /// Version (none until the header is read).
    pub digest: Option<TableDigest>,
    /// Load state.
    pub state: LoadState,
    /// Row bytes in memory so far.
    pub bytes_done: u64,
    /// Row bytes in all.
    pub bytes_total: u64,
    /// Memory the rows take as served (0 until resident): their file's
    /// pages (15 rows and slack to 4 KiB, `map_files`), the rows back to
    /// back, or planar (values, then scales from a 4 KiB boundary).
    pub memory_bytes: u64,
    /// Why loading failed.
    pub error: Option<String>,
    /// The file.
    pub path: PathBuf,
    /// True when the digest is recomputed while loading.
    pub verify: bool,
}

impl TableStatus {
    fn header(&self) -> engram_sync::MutexGuard<'_, Header> {
        self.header.lock()
    }

    /// The file's header was read: the table's identity is known.
    pub fn opened(&self, id: u32, layer: u32, rows: u64, digest: TableDigest) {
        let mut h = self.header();
        h.id = Some(id);
        h.layer = layer;
        h.rows = rows;
        h.digest = Some(digest);
    }

    /// Its rows are `n` bytes each (another encoding than V4.1's).
    pub fn row_bytes(&self, n: usize) {
        self.header().row_bytes = n as u64;
    }

    /// `rows` rows are in memory; all of them moves the table to verifying.
    pub fn progress(&self, rows: u64, total: u64) {
        self.rows_done.store(rows, Ordering::Relaxed);
        if rows >= total {
            self.set_state(LoadState::Verifying);
        }
    }

    /// The table is resident in `bytes` of memory ([`TableView::memory_bytes`]).
    pub fn resident(&self, bytes: u64) {
        self.memory.store(bytes, Ordering::Relaxed);
    }

    /// Move to `state`.
    pub fn set_state(&self, state: LoadState) {
        self.state.store(state.to_u8(), Ordering::Relaxed);
    }

    /// A new version replaced the table: `path`, `rows` and `digest` are
    /// what is served now (in place: loading starts from zero).
    pub fn replaced(&self, path: PathBuf, rows: u64, digest: TableDigest, state: LoadState) {
        let mut h = self.header();
        h.path = path;
        h.rows = rows;
        h.digest = Some(digest);
        h.error = None;
        drop(h);
        self.rows_done.store(0, Ordering::Relaxed);
        self.set_state(state);
    }

    /// Record why a swap failed, keeping the state (the old version may still serve).
    pub fn note_error(&self, why: String) {
        self.header().error = Some(why);
    }

    /// The file served (or loading).
    pub fn path(&self) -> PathBuf {
        self.header().path.clone()
    }

    /// Loading failed because of `why`.
    pub fn failed(&self, why: String) {
        self.header().error = Some(why);
        self.set_state(LoadState::Failed);
    }

    /// The load state now.
    pub fn state(&self) -> LoadState {
        LoadState::from_u8(self.state.load(Ordering::Relaxed))
    }

    /// Everything at one moment.
    pub fn view(&self) -> TableView {
        let h = self.header().clone();
        let state = self.state();
        let row = if h.row_bytes == 0 {
            ROW_BYTES as u64
        } else {
            h.row_bytes
        };
        let bytes_total = h.rows * row;
        let done = self.rows_done.load(Ordering::Relaxed) * row;
        TableView {
            id: h.id.unwrap_or(0),
            layer: h.layer,
            rows: h.rows,
            digest: h.digest,
            state,
            bytes_done: if state == LoadState::Ready {
                bytes_total
            } else {
                done.min(bytes_total)
            },
            bytes_total,
            memory_bytes: self.memory.load(Ordering::Relaxed),
            error: h.error,
            path: h.path,
            verify: self.verify,
        }
    }
}

/// The donor's state, shared by the loader, the data plane and the control
/// plane: its name, phase and drain request, each table's load status, the
/// data-plane counters, the mailbox of orders for the serving loop and the
/// TLS state.
#[derive(Debug)]
pub struct DonorState {
    /// Name announced in Welcome.
    pub name: String,
    /// When the donor started.
    pub started: Instant,
    drain_timeout_ms: AtomicU64,
    /// Data-plane counters.
    pub stats: Arc<Stats>,
    /// Tables, in load order.
    pub tables: Vec<TableStatus>,
    phase: watch::Sender<Phase>,
    drain_requested: AtomicBool,
    drain: Notify,
    orders: mpsc::Sender<Order>,
    order_rx: Mutex<Option<mpsc::Receiver<Order>>>,
    /// The TLS state, set once at start when the rack has a PKI.
    pub tls: std::sync::OnceLock<Arc<crate::tls::DonorTls>>,
}

/// Orders waiting for the serving loop; more are refused.
const MAX_ORDERS: usize = 16;

impl DonorState {
    /// A donor about to load `tables` (`(configured id, file)` each).
    pub fn new(
        name: impl Into<String>,
        drain_timeout: Duration,
        tables: impl IntoIterator<Item = (Option<u32>, PathBuf)>,
        verify: bool,
    ) -> Arc<Self> {
        let (orders, order_rx) = mpsc::channel(MAX_ORDERS);
        let tables = tables
            .into_iter()
            .map(|(id, path)| TableStatus {
                verify,
                header: Mutex::new(Header {
                    path,
                    id,
                    ..Header::default()
                }),
                state: AtomicU8::new(LoadState::Loading.to_u8()),
                rows_done: AtomicU64::new(0),
                memory: AtomicU64::new(0),
            })
            .collect();
        Arc::new(Self {
            name: name.into(),
            started: Instant::now(),
            drain_timeout_ms: AtomicU64::new(
                u64::try_from(drain_timeout.as_millis()).unwrap_or(u64::MAX),
            ),
            stats: Arc::default(),
            tables,
            phase: watch::channel(Phase::Loading).0,
            drain_requested: AtomicBool::new(false),
            drain: Notify::new(),
            orders,
            order_rx: Mutex::new(Some(order_rx)),
            tls: std::sync::OnceLock::new(),
        })
    }

    /// Queue an order for the serving loop; false when the queue is full.
    /// Orders given while tables load are carried out once serving starts.
    pub fn order(&self, order: Order) -> Result<(), Order> {
        self.orders.try_send(order).map_err(|e| match e {
            mpsc::error::TrySendError::Full(o) | mpsc::error::TrySendError::Closed(o) => o,
        })
    }

    /// The receiving end of the orders (the serving loop takes it once).
    pub fn take_orders(&self) -> Option<mpsc::Receiver<Order>> {
        self.order_rx.lock().take()
    }

    /// How long a drain waits for clients.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms.load(Ordering::Relaxed))
    }

    /// A reload changed the drain timeout.
    pub fn set_drain_timeout(&self, t: Duration) {
        let ms = u64::try_from(t.as_millis()).unwrap_or(u64::MAX);
        self.drain_timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// The phase now.
    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// Move to `phase` (watchers are told).
    pub fn set_phase(&self, phase: Phase) {
        self.phase.send_replace(phase);
    }

    /// Watch phase changes.
    pub fn watch_phase(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }

    /// Ask for a drain (the control plane's Drain, or a signal) and enter
    /// [`Phase::Draining`] unless failed; false when one was already asked for.
    pub fn request_drain(&self) -> bool {
        if self.drain_requested.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.phase.send_if_modified(|p| {
            let change = *p != Phase::Failed && *p != Phase::Draining;
            if change {
                *p = Phase::Draining;
            }
            change
        });
        self.drain.notify_one();
        true
    }

    /// Resolves once a drain is asked for.
    pub async fn drain_requested(&self) {
        if self.drain_requested.load(Ordering::Acquire) {
            return;
        }
        self.drain.notified().await;
    }

    /// True once a drain was asked for.
    pub fn is_drain_requested(&self) -> bool {
        self.drain_requested.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_views_follow_the_load() {
        let s = DonorState::new(
            "d",
            Duration::from_secs(1),
            [(Some(7), PathBuf::from("/t.etab"))],
            true,
        );
        let t = &s.tables[0];
        let v = t.view();
        assert_eq!(
            (v.id, v.rows, v.state, v.digest),
            (7, 0, LoadState::Loading, None)
        );
        t.opened(7, 1, 100, TableDigest([3; 32]));
        t.progress(40, 100);
        let v = t.view();
        assert_eq!((v.bytes_done, v.bytes_total), (40 * 264, 100 * 264));
        assert_eq!(v.state, LoadState::Loading);
        t.progress(100, 100);
        assert_eq!(t.state(), LoadState::Verifying);
        t.set_state(LoadState::Ready);
        assert_eq!(t.view().bytes_done, 100 * 264);
        // Rows of another encoding count at their size.
        t.row_bytes(160);
        assert_eq!(t.view().bytes_total, 100 * 160);
        t.failed("boom".into());
        assert_eq!(t.view().error.as_deref(), Some("boom"));
    }

    #[tokio::test]
    async fn a_drain_is_requested_once() {
        let s = DonorState::new("d", Duration::from_secs(1), [], false);
        let mut phases = s.watch_phase();
        assert_eq!(s.phase(), Phase::Loading);
        assert!(s.request_drain());
        assert!(!s.request_drain());
        s.drain_requested().await;
        phases.changed().await.expect("changed");
        assert_eq!(*phases.borrow(), Phase::Draining);
    }
}
