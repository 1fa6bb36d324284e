//! The loop's rows from the node's routers: each fetch runs as a task on
//! the node's tokio runtime (so hedges, failovers and answers progress
//! while the loop's thread computes), and its end is timed there, when the
//! last row arrived, not when the loop looked.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError, sync_channel};
use std::time::{Duration, Instant};

use engram_protocol::ROW_BYTES;
use tokio::runtime::Handle;

use super::{Fetch, Fetcher};
use crate::router::Router;

/// How long a wait polls before it blocks: a blocked thread takes tens to
/// hundreds of microseconds to wake (more on a virtual machine), and the
/// loop has nothing else to do while its rows are late. It yields between
/// polls, so an I/O thread sharing its core sends and receives meanwhile.
const SPIN: Duration = Duration::from_millis(2);

/// How long a warm-up keeps the node's I/O thread polling after the
/// fetches it was for should have started, at most, when they have not
/// all ended: it is for rows due within a window of a few hundred
/// microseconds, not for a failover.
const WARM_HOLD: Duration = Duration::from_millis(1);

/// Fetches through one router per slot.
#[derive(Debug)]
pub struct RouterFetcher {
    handle: Handle,
    routers: [Arc<Router>; 2],
    origin: Instant,
    chunk_rows: usize,
    /// Fetches started, ever; and in flight now (what a warm-up waits
    /// for).
    started: Arc<AtomicU64>,
    in_flight: Arc<AtomicUsize>,
}

impl RouterFetcher {
    /// Fetch through `routers` (layer 1's, layer 14's) on `handle`, timing on
    /// a clock whose zero is `origin`; a wide fetch is a sweep of chunks of
    /// at most `chunk_rows` rows ([`fetch_rows`]).
    pub fn new(
        handle: Handle,
        routers: [Arc<Router>; 2],
        origin: Instant,
        chunk_rows: usize,
    ) -> Self {
        Self {
            handle,
            routers,
            origin,
            chunk_rows: chunk_rows.max(1),
            started: Arc::new(AtomicU64::new(0)),
            in_flight: Arc::new(AtomicUsize::new(0)),
        }
    }
}

/// Merge one message's outcome into the fetch's.
fn merge(f: &mut Fetch, res: Result<crate::router::Fetched, crate::router::RouterError>) {
    f.messages += 1;
    match res {
        Ok(x) => {
            let name = x.source.unwrap_or_else(|| {
                f.zeros = true;
                "zeros".into()
            });
            if !f.sources.iter().any(|s| **s == *name) {
                f.sources.push(name.to_string());
            }
            f.hedges += x.hedges;
            f.failovers += x.failovers;
            f.late |= x.late;
        }
        Err(e) => {
            if f.error.is_none() {
                f.error = Some(e.to_string());
            }
        }
    }
}

/// Chunks each replica has in flight during a wide sweep: one on the wire
/// while the donor gathers the next.
pub const STRIPE_DEPTH: usize = 2;

/// The smallest chunk a wide sweep is cut into (below it, per-message costs
/// outweigh what striping and pipelining win).
pub const MIN_STRIPE_ROWS: usize = 2048;

/// The largest chunk of a wide sweep (about 1 MB): a chunk is a lookup of
/// its own, with the hard timeout as its deadline, so it must cross a slow
/// link (a few Gbit/s, with the other lanes' chunks beside it) in a small
/// part of that; larger chunks win nothing measurable.
pub const MAX_STRIPE_ROWS: usize = 4096;

/// Rows per chunk for a sweep of `rows` over `replicas` donors, at most
/// `cap` (the frame cap) and [`MAX_STRIPE_ROWS`]: enough chunks for every
/// lane ([`STRIPE_DEPTH`] per replica), none under [`MIN_STRIPE_ROWS`].
pub fn stripe_rows(rows: usize, replicas: usize, cap: usize) -> usize {
    let lanes = replicas.max(1) * STRIPE_DEPTH;
    rows.div_ceil(lanes)
        .clamp(MIN_STRIPE_ROWS, MAX_STRIPE_ROWS)
        .min(cap.max(1))
}

/// Fetch `rows` of one table through `router`: one message when they fit
/// in one chunk ([`stripe_rows`]), else a sweep: chunks taken in order by
/// [`STRIPE_DEPTH`] lanes per replica, lane `j` asking the table's `j`-th
/// admissible donor first (each chunk is a lookup of its own: checked,
/// failed over and timed out alone). The rows come back in the order asked
/// (`rows.len() * 264` bytes); `ready` is left for the caller to stamp on
/// its own clock.
pub async fn fetch_rows(router: &Router, rows: &[u64], chunk: usize) -> Fetch {
    let replicas = router.replicas().max(1);
    let size = stripe_rows(rows.len(), replicas, chunk);
    if rows.len() <= size {
        return fetch_message(router, rows).await;
    }
    let mut f = Fetch::default();
    let mut bytes = vec![0; rows.len() * ROW_BYTES];
    let results = {
        let chunks =
            std::sync::Mutex::new(rows.chunks(size).zip(bytes.chunks_mut(size * ROW_BYTES)));
        let lane = |stripe: usize| {
            let chunks = &chunks;
            async move {
                let mut out = Vec::new();
                loop {
                    let next = chunks.lock().unwrap_or_else(|p| p.into_inner()).next();
                    let Some((r, o)) = next else { break out };
                    out.push(router.fetch_stripe(r, o, stripe).await);
                }
            }
        };
        futures_util::future::join_all((0..replicas * STRIPE_DEPTH).map(lane)).await
    };
    f.bytes = bytes;
    for res in results.into_iter().flatten() {
        merge(&mut f, res);
    }
    f
}

/// Fetch `rows` of one table through `router` in one message (at most the
/// frame cap's rows).
pub async fn fetch_message(router: &Router, rows: &[u64]) -> Fetch {
    let mut f = Fetch::default();
    // The winning source's buffer itself: no copy here.
    let res = router.fetch_vec(rows, &mut f.bytes).await;
    // A failed fetch (its error recorded) still has its size.
    f.bytes.resize(rows.len() * ROW_BYTES, 0);
    merge(&mut f, res);
    f
}

impl Fetcher for RouterFetcher {
    type Pending = Receiver<Fetch>;

    fn start(&mut self, slot: usize, rows: Vec<u64>, sweep: bool) -> Receiver<Fetch> {
        let (tx, rx) = sync_channel(1);
        let router = self.routers[slot].clone();
        let origin = self.origin;
        let chunk = self.chunk_rows;
        let in_flight = Arc::clone(&self.in_flight);
        in_flight.fetch_add(1, Ordering::AcqRel);
        self.started.fetch_add(1, Ordering::AcqRel);
        let asked = origin.elapsed();
        self.handle.spawn(async move {
            let picked = origin.elapsed();
            // A step's rows go in one message up to the frame cap, however
            // many sequences the batch holds; a prefill is a sweep.
            let mut f = if sweep || rows.len() > chunk {
                fetch_rows(&router, &rows, chunk).await
            } else {
                fetch_message(&router, &rows).await
            };
            f.ready = origin.elapsed();
            (f.asked, f.picked) = (Some(asked), Some(picked));
            in_flight.fetch_sub(1, Ordering::AcqRel);
            // The loop may have stopped; nothing to tell it then.
            let _ = tx.send(f);
        });
        rx
    }

    /// Ping each table's first source, and keep one of the runtime's
    /// threads polling (a task that yields: between its polls the thread
    /// checks its sockets without sleeping) until the fetches started
    /// after this have all ended, or `lead` plus [`WARM_HOLD`] has passed.
    /// The fetches' spawn then finds a thread awake, and their answers a
    /// thread at the socket.
    fn warm(&mut self, lead: Duration) {
        spawn_warm(
            &self.handle,
            self.routers.clone(),
            Arc::clone(&self.started),
            Arc::clone(&self.in_flight),
            lead,
        );
    }

    fn wait(&mut self, rx: Receiver<Fetch>) -> Fetch {
        let spin_until = Instant::now() + SPIN;
        loop {
            match rx.try_recv() {
                Ok(f) => return f,
                Err(TryRecvError::Empty) if Instant::now() < spin_until => {
                    std::thread::yield_now();
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return lost(self.origin),
            }
        }
        rx.recv().unwrap_or_else(|_| lost(self.origin))
    }
}

/// Warm the path to the next fetches' rows on `handle`: ping each of
/// `routers`' first sources, and keep one of the runtime's threads polling
/// (a task that yields: between its polls the thread checks its sockets
/// without sleeping) until the fetches started after this have all ended
/// (`started` counts fetches ever started, `in_flight` those not ended; a
/// step starts one per router at least), or `lead` plus [`WARM_HOLD`] has
/// passed. The node's loop does this before each step; the embedded
/// memory's `warm` too.
pub(crate) fn spawn_warm(
    handle: &Handle,
    routers: [Arc<Router>; 2],
    started: Arc<AtomicU64>,
    in_flight: Arc<AtomicUsize>,
    lead: Duration,
) {
    let want = started.load(Ordering::Acquire) + routers.len() as u64;
    let until = Instant::now() + lead + WARM_HOLD;
    handle.spawn(async move {
        for r in &routers {
            r.warm();
        }
        while Instant::now() < until
            && !(started.load(Ordering::Acquire) >= want && in_flight.load(Ordering::Acquire) == 0)
        {
            // Other runnable threads first (the loop that is about to ask
            // for the rows, on a host of few cores), then the runtime's
            // sockets and tasks.
            std::thread::yield_now();
            tokio::task::yield_now().await;
        }
    });
}

/// The fetch task ended without an answer (the runtime is shutting down).
fn lost(origin: Instant) -> Fetch {
    Fetch {
        ready: origin.elapsed(),
        error: Some("the fetch task ended without an answer (shutting down)".into()),
        ..Fetch::default()
    }
}
