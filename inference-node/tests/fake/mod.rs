//! A fake source with fault injection, and a router over fakes, for the
//! router's tests under paused tokio time.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use cluster_config::{Hedge, Policy};
use engram_protocol::synthetic::{first_mismatch, synthetic_encoded_row, synthetic_row};
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_sync::Mutex;
use inference_node::metrics::NodeMetrics;
use inference_node::router::{RouteSettings, Router, RouterError, SourceHealth};
use inference_node::source::{FetchFuture, ProbeFuture, RowSource, SourceError, SourceKind};
use tokio::time::Instant;

pub const TABLE: u32 = 1;
pub const SEED: u64 = 7;
pub const PINNED: TableDigest = TableDigest([1; 32]);
pub const OTHER: TableDigest = TableDigest([2; 32]);

/// What a fake source does with the next lookups.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Answer correctly after a delay.
    Ok(Duration),
    /// Never answer (a hung process with an open socket).
    Hang,
    /// Fail after a delay with this error.
    Fail(Duration, SourceError),
    /// Deliver rows that fail the row check (corrupt bytes past the checksum).
    BadBytes(Duration),
}

#[derive(Debug)]
pub struct Fake {
    pub name: String,
    pub fault: Mutex<Fault>,
    pub digest: Mutex<TableDigest>,
    pub healthy: AtomicBool,
    pub draining: AtomicBool,
    pub calls: AtomicU32,
    pub kind: SourceKind,
    /// Where the last buffer it filled lives (its address).
    pub filled: AtomicUsize,
    /// The rows it serves (V4.1's unless set).
    pub encoding: engram_protocol::encoding::RowEncoding,
}

impl Fake {
    pub fn new(name: &str, fault: Fault) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            fault: Mutex::new(fault),
            digest: Mutex::new(PINNED),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            calls: AtomicU32::new(0),
            kind: SourceKind::Donor,
            filled: AtomicUsize::new(0),
            encoding: engram_protocol::encoding::RowEncoding::V41,
        })
    }

    /// A donor fake serving rows of `encoding`
    /// (`synthetic_encoded_row(encoding, SEED, 1, row)`).
    pub fn encoded(
        name: &str,
        fault: Fault,
        encoding: engram_protocol::encoding::RowEncoding,
    ) -> Arc<Self> {
        let mut f = Arc::into_inner(Self::new(name, fault)).expect("just made");
        f.encoding = encoding;
        Arc::new(f)
    }

    /// A fake of the node's own copy (kind `ssd`).
    pub fn copy(name: &str, fault: Fault) -> Arc<Self> {
        let mut f = Arc::into_inner(Self::new(name, fault)).expect("just made");
        f.kind = SourceKind::Ssd;
        Arc::new(f)
    }

    pub fn set(&self, f: Fault) {
        *self.fault.lock() = f;
    }

    pub fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }
}

impl RowSource for Fake {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> SourceKind {
        self.kind
    }

    fn accepting(&self) -> bool {
        !self.draining.load(Ordering::SeqCst)
    }

    fn fetch<'a>(
        &'a self,
        table: u32,
        rows: &'a [u64],
        mut buf: Vec<u8>,
        deadline: Instant,
    ) -> FetchFuture<'a> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let fault = self.fault.lock().clone();
        Box::pin(async move {
            assert_eq!(table, TABLE);
            let out = &mut buf[..];
            let work = async {
                match fault {
                    Fault::Ok(d) | Fault::BadBytes(d) => {
                        tokio::time::sleep(d).await;
                        let e = self.encoding;
                        if e == engram_protocol::encoding::RowEncoding::V41 {
                            for (r, o) in rows.iter().zip(out.chunks_exact_mut(ROW_BYTES)) {
                                let o: &mut [u8; ROW_BYTES] = o.try_into().expect("row");
                                synthetic_row(SEED, 1, *r, o);
                            }
                        } else {
                            for (r, o) in rows.iter().zip(out.chunks_exact_mut(e.row_bytes())) {
                                synthetic_encoded_row(e, SEED, 1, *r, o);
                            }
                        }
                        if matches!(fault, Fault::BadBytes(_)) {
                            // An E4M3 NaN where the encoding has E4M3 codes:
                            // a value (V4.1, FP8) or a block scale (NVFP4).
                            let at = if e == engram_protocol::encoding::RowEncoding::V41 {
                                5
                            } else {
                                e.row_bytes() - 1
                            };
                            out[at] = 0x7F;
                        }
                        Ok(())
                    }
                    Fault::Hang => std::future::pending().await,
                    Fault::Fail(d, e) => {
                        tokio::time::sleep(d).await;
                        Err(e)
                    }
                }
            };
            let res = tokio::time::timeout_at(deadline, work)
                .await
                .map_err(|_| SourceError::Timeout)
                .and_then(|r| r);
            self.filled.store(buf.as_ptr() as usize, Ordering::SeqCst);
            (res, buf)
        })
    }

    fn probe(&self) -> ProbeFuture<'_> {
        Box::pin(async move {
            if self.healthy.load(Ordering::SeqCst) {
                Ok(vec![(TABLE, *self.digest.lock())])
            } else {
                Err(SourceError::Unavailable("probe refused".into()))
            }
        })
    }
}

/// Test time unit: tokio's timer (and so paused time) counts whole
/// milliseconds, so the tests run the router's logic on a millisecond scale
/// with its tokio timers (`precise_timers: false`).
pub fn us(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub fn settings(hedge: Hedge, policy: Policy) -> RouteSettings {
    RouteSettings {
        table: TABLE,
        encoding: engram_protocol::encoding::RowEncoding::V41,
        window: us(250),
        grace: us(50),
        hard_timeout: us(2_000),
        hedge,
        policy,
        precise_timers: false,
    }
}

pub struct Rig {
    pub router: Router,
    pub health: Vec<Arc<SourceHealth>>,
    pub metrics: Arc<NodeMetrics>,
}

pub fn rig(sources: &[&Arc<Fake>], s: RouteSettings) -> Rig {
    let metrics = Arc::new(NodeMetrics::new());
    let health: Vec<Arc<SourceHealth>> = sources.iter().map(|f| health(&metrics, f)).collect();
    let router = Router::new(s, health.clone(), &metrics);
    Rig {
        router,
        health,
        metrics,
    }
}

/// A fake with its health record (breaker threshold 3).
pub fn health(metrics: &NodeMetrics, f: &Arc<Fake>) -> Arc<SourceHealth> {
    let src: Arc<dyn RowSource> = f.clone();
    Arc::new(SourceHealth::new(
        src,
        vec![(TABLE, PINNED)],
        3,
        metrics
            .breaker_state
            .get_or_create(&inference_node::metrics::SourceOnly {
                source: f.name.clone(),
            })
            .clone(),
    ))
}

pub const ROWS: [u64; 24] = [
    3,
    99,
    1000,
    7,
    12345,
    5,
    6,
    77,
    1 << 20,
    42,
    43,
    44,
    9,
    10,
    11,
    12,
    13,
    14,
    15,
    16,
    17,
    18,
    19,
    20,
];

pub async fn fetch(
    r: &Rig,
) -> (
    Result<inference_node::router::Fetched, RouterError>,
    Vec<u8>,
) {
    let mut out = vec![0xAAu8; ROWS.len() * ROW_BYTES];
    let res = r.router.fetch(&ROWS, &mut out).await;
    (res, out)
}

pub fn assert_rows(out: &[u8]) {
    assert_eq!(
        first_mismatch(SEED, 1, &ROWS, out),
        None,
        "wrong rows returned"
    );
}

pub fn metric(r: &Rig, needle: &str) -> String {
    let text = r.metrics.render();
    text.lines()
        .find(|l| l.starts_with(needle))
        .map(|l| l.rsplit(' ').next().unwrap_or("").to_string())
        .unwrap_or_else(|| panic!("no series {needle} in:\n{text}"))
}
