//! The loop's rows from the node's routers. Each table has a lane: a task
//! on the node's tokio runtime kept for the whole run, which the loop
//! hands a step's rows and whose answer it waits for, so hedges,
//! failovers and answers progress while the loop's thread computes, and
//! no task, channel or buffer is made per step (the buffers go round: the
//! loop gives each fetch back once it has fused its rows). A fetch's end
//! is timed on the lane, when the last row arrived, not when the loop
//! looked.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError, sync_channel};
use std::time::{Duration, Instant};

use engram_sync::{Condvar, Mutex};
use tokio::runtime::Handle;
use tokio::sync::Notify;

use super::{Fetch, Fetcher};
use crate::router::Router;

/// How long a wait polls before it blocks: a blocked thread takes tens to
/// hundreds of microseconds to wake (more on a virtual machine), and the
/// loop has nothing else to do while its rows are late. It yields between
/// polls, so an I/O thread sharing its core sends and receives meanwhile.
const SPIN: Duration = Duration::from_millis(2);

/// How long a blocked wait sleeps before it checks that its lane is still
/// running (the runtime may be shutting down).
const CHECK: Duration = Duration::from_millis(100);

/// How long a warm-up keeps the node's I/O thread polling after the
/// fetches it was for should have started, at most, when they have not
/// all ended: it is for rows due within a window of a few hundred
/// microseconds, not for a failover.
const WARM_HOLD: Duration = Duration::from_millis(1);

/// What the loop hands a lane: the rows, and the fetch whose buffers the
/// answer reuses.
#[derive(Default)]
struct Job {
    rows: Vec<u64>,
    sweep: bool,
    asked: Duration,
    spare: Fetch,
}

/// One table's lane ([`RouterFetcher`]): the job handed over, the answer
/// handed back.
#[derive(Default)]
struct Lane {
    job: Mutex<Job>,
    go: Notify,
    done: Mutex<Option<Fetch>>,
    ready: Condvar,
    /// Set by the fetcher's drop: the lane's task ends.
    stop: AtomicBool,
    /// Cleared when the lane's task ends (its runtime shutting down): a
    /// wait then ends without rows.
    alive: AtomicBool,
}

/// Clears [`Lane::alive`] when the lane's task ends, however it ends.
struct Alive(Arc<Lane>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.alive.store(false, Ordering::Release);
        let _g = self.0.done.lock();
        self.0.ready.notify_all();
    }
}

/// The counts a warm-up waits on: fetches started ever, and in flight now.
#[derive(Debug, Default)]
pub(crate) struct FetchCounts {
    pub(crate) started: AtomicU64,
    pub(crate) in_flight: AtomicUsize,
}

/// Fetches through one router per slot.
pub struct RouterFetcher {
    handle: Handle,
    routers: Vec<Arc<Router>>,
    origin: Instant,
    chunk_rows: usize,
    counts: Arc<FetchCounts>,
    lanes: Vec<Arc<Lane>>,
    /// Whether each lane has a fetch the loop has not waited for (a second
    /// fetch of that table meanwhile, a draft prefetch's, runs as a task
    /// of its own).
    busy: Vec<bool>,
    /// Fetches given back ([`Fetcher::recycle`]), for the next job.
    spare: Vec<Option<Fetch>>,
    warmer: Warmer,
}

impl std::fmt::Debug for RouterFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterFetcher")
            .field("chunk_rows", &self.chunk_rows)
            .field("counts", &self.counts)
            .finish_non_exhaustive()
    }
}

impl RouterFetcher {
    /// Fetch through `routers` (one per slot: V4.1's layer 1's and layer
    /// 14's, a Qwen4Exp node's one table's) on `handle`, timing on
    /// a clock whose zero is `origin`; a wide fetch is a sweep of chunks of
    /// at most `chunk_rows` rows ([`fetch_rows`]). Starts every lane's task
    /// and the warm-up's; dropping the fetcher ends them.
    pub fn new(
        handle: Handle,
        routers: Vec<Arc<Router>>,
        origin: Instant,
        chunk_rows: usize,
    ) -> Self {
        let chunk_rows = chunk_rows.max(1);
        let counts = Arc::new(FetchCounts::default());
        let lanes: Vec<Arc<Lane>> = routers.iter().map(|_| Arc::new(Lane::default())).collect();
        for (lane, router) in lanes.iter().zip(&routers) {
            lane.alive.store(true, Ordering::Release);
            handle.spawn(run_lane(
                Alive(Arc::clone(lane)),
                Arc::clone(router),
                origin,
                chunk_rows,
                Arc::clone(&counts),
            ));
        }
        let warmer = Warmer::new(&handle, routers.clone(), Arc::clone(&counts));
        let n = routers.len();
        Self {
            handle,
            routers,
            origin,
            chunk_rows,
            counts,
            lanes,
            busy: vec![false; n],
            spare: (0..n).map(|_| None).collect(),
            warmer,
        }
    }
}

impl Drop for RouterFetcher {
    fn drop(&mut self) {
        for lane in &self.lanes {
            lane.stop.store(true, Ordering::Release);
            lane.go.notify_one();
        }
    }
}

/// A lane's task: each job handed over is fetched and its answer handed
/// back, until the fetcher is dropped.
async fn run_lane(
    alive: Alive,
    router: Arc<Router>,
    origin: Instant,
    chunk: usize,
    counts: Arc<FetchCounts>,
) {
    let lane = &alive.0;
    let mut rows = Vec::new();
    loop {
        lane.go.notified().await;
        if lane.stop.load(Ordering::Acquire) {
            return;
        }
        let picked = origin.elapsed();
        let (sweep, asked, mut f) = {
            let mut job = lane.job.lock();
            std::mem::swap(&mut rows, &mut job.rows);
            (job.sweep, job.asked, std::mem::take(&mut job.spare))
        };
        f.reset();
        // A step's rows go in one message up to the frame cap, however
        // many sequences the batch holds; a prefill is a sweep.
        if sweep || rows.len() > chunk {
            f = fetch_rows(&router, &rows, chunk).await;
        } else {
            fetch_message(&router, &rows, &mut f).await;
        }
        f.ready = origin.elapsed();
        (f.asked, f.picked) = (Some(asked), Some(picked));
        counts.in_flight.fetch_sub(1, Ordering::AcqRel);
        *lane.done.lock() = Some(f);
        lane.ready.notify_one();
    }
}

/// The name a fetch answered with zeros by policy lists as its source.
fn zeros_name() -> Arc<str> {
    static ZEROS: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("zeros"));
    Arc::clone(&ZEROS)
}

/// Merge one message's outcome into the fetch's.
fn merge(f: &mut Fetch, res: Result<crate::router::Fetched, crate::router::RouterError>) {
    f.messages += 1;
    match res {
        Ok(x) => {
            let name = x.source.unwrap_or_else(|| {
                f.zeros = true;
                zeros_name()
            });
            if !f.sources.iter().any(|s| **s == *name) {
                f.sources.push(name);
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
/// (`rows.len()` rows at the table's row size); `ready` is left for the caller to stamp on
/// its own clock.
pub async fn fetch_rows(router: &Router, rows: &[u64], chunk: usize) -> Fetch {
    let replicas = router.replicas().max(1);
    let size = stripe_rows(rows.len(), replicas, chunk);
    if rows.len() <= size {
        let mut f = Fetch::default();
        fetch_message(router, rows, &mut f).await;
        return f;
    }
    let mut f = Fetch::default();
    let row_bytes = router.row_bytes();
    let mut bytes = vec![0; rows.len() * row_bytes];
    let results = {
        let chunks = Mutex::new(rows.chunks(size).zip(bytes.chunks_mut(size * row_bytes)));
        let lane = |stripe: usize| {
            let chunks = &chunks;
            async move {
                let mut out = Vec::new();
                loop {
                    let next = chunks.lock().next();
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
/// frame cap's rows), into `f` (a fresh or [reset](Fetch::reset) fetch,
/// whose buffer the source's answer is exchanged for: no copy here, no
/// allocation when the buffers going round are of the size).
pub async fn fetch_message(router: &Router, rows: &[u64], f: &mut Fetch) {
    let res = router.fetch_vec(rows, &mut f.bytes).await;
    // A failed fetch (its error recorded) still has its size.
    f.bytes.resize(rows.len() * router.row_bytes(), 0);
    merge(f, res);
}

/// A fetch in flight: on its table's lane, or (a second fetch of a table
/// whose lane is taken) on a task of its own.
#[derive(Debug)]
pub enum Pending {
    /// On the lane of this table slot.
    Lane(usize),
    /// On a task of its own, which sends its fetch here.
    Task(Receiver<Fetch>),
}

impl Fetcher for RouterFetcher {
    type Pending = Pending;

    fn start(&mut self, slot: usize, rows: &[u64], sweep: bool) -> Pending {
        self.counts.in_flight.fetch_add(1, Ordering::AcqRel);
        self.counts.started.fetch_add(1, Ordering::AcqRel);
        let asked = self.origin.elapsed();
        if !self.busy[slot] {
            self.busy[slot] = true;
            let lane = &self.lanes[slot];
            {
                let mut job = lane.job.lock();
                job.rows.clear();
                job.rows.extend_from_slice(rows);
                (job.sweep, job.asked) = (sweep, asked);
                if let Some(spare) = self.spare[slot].take() {
                    job.spare = spare;
                }
            }
            lane.go.notify_one();
            return Pending::Lane(slot);
        }
        let (tx, rx) = sync_channel(1);
        let router = self.routers[slot].clone();
        let (origin, chunk, rows) = (self.origin, self.chunk_rows, rows.to_vec());
        let counts = Arc::clone(&self.counts);
        self.handle.spawn(async move {
            let picked = origin.elapsed();
            let mut f = if sweep || rows.len() > chunk {
                fetch_rows(&router, &rows, chunk).await
            } else {
                let mut f = Fetch::default();
                fetch_message(&router, &rows, &mut f).await;
                f
            };
            f.ready = origin.elapsed();
            (f.asked, f.picked) = (Some(asked), Some(picked));
            counts.in_flight.fetch_sub(1, Ordering::AcqRel);
            // The loop may have stopped; nothing to tell it then.
            let _ = tx.send(f);
        });
        Pending::Task(rx)
    }

    /// Ping each table's first source, and keep one of the runtime's
    /// threads polling (a task that yields: between its polls the thread
    /// checks its sockets without sleeping) until the fetches started
    /// after this have all ended, or `lead` plus [`WARM_HOLD`] has passed.
    /// The fetches then find a thread awake, and their answers a thread
    /// at the socket.
    fn warm(&mut self, lead: Duration) {
        self.warmer.warm(lead);
    }

    fn wait(&mut self, pending: Pending) -> Fetch {
        match pending {
            Pending::Lane(slot) => {
                self.busy[slot] = false;
                wait_lane(&self.lanes[slot], self.origin)
            }
            Pending::Task(rx) => wait_task(&rx, self.origin),
        }
    }

    fn recycle(&mut self, slot: usize, f: Fetch) {
        if let Some(s) = self.spare.get_mut(slot) {
            *s = Some(f);
        }
    }
}

/// Wait for a lane's answer: poll for [`SPIN`], then block.
fn wait_lane(lane: &Lane, origin: Instant) -> Fetch {
    let spin_until = Instant::now() + SPIN;
    while Instant::now() < spin_until {
        if let Some(f) = lane.done.lock().take() {
            return f;
        }
        std::thread::yield_now();
    }
    let mut done = lane.done.lock();
    loop {
        if let Some(f) = done.take() {
            return f;
        }
        if !lane.alive.load(Ordering::Acquire) {
            return lost(origin);
        }
        done = lane.ready.wait_timeout(done, CHECK).0;
    }
}

/// Wait for a task's answer: poll for [`SPIN`], then block.
fn wait_task(rx: &Receiver<Fetch>, origin: Instant) -> Fetch {
    let spin_until = Instant::now() + SPIN;
    loop {
        match rx.try_recv() {
            Ok(f) => return f,
            Err(TryRecvError::Empty) if Instant::now() < spin_until => {
                std::thread::yield_now();
            }
            Err(TryRecvError::Empty) => break,
            Err(TryRecvError::Disconnected) => return lost(origin),
        }
    }
    rx.recv().unwrap_or_else(|_| lost(origin))
}

/// What a warm-up asks of the warm-up task ([`Warmer`]).
#[derive(Debug)]
struct WarmState {
    go: Notify,
    stop: AtomicBool,
    /// Fetches started by when the warm-up is over; and its end, in
    /// nanoseconds from `base`.
    want: AtomicU64,
    until_ns: AtomicU64,
    base: Instant,
}

/// The warm-up of a run's path ([`Fetcher::warm`]): one task kept for the
/// run, woken before each step (nothing spawned per step). Dropping it
/// ends the task.
#[derive(Debug)]
pub(crate) struct Warmer {
    state: Arc<WarmState>,
    counts: Arc<FetchCounts>,
    /// Fetches a step starts (one per router).
    per_step: u64,
}

impl Warmer {
    /// The warm-up task for `routers` on `handle`, waiting on `counts`.
    pub(crate) fn new(
        handle: &Handle,
        routers: Vec<Arc<Router>>,
        counts: Arc<FetchCounts>,
    ) -> Self {
        let per_step = routers.len() as u64;
        let state = Arc::new(WarmState {
            go: Notify::new(),
            stop: AtomicBool::new(false),
            want: AtomicU64::new(0),
            until_ns: AtomicU64::new(0),
            base: Instant::now(),
        });
        let (st, c) = (Arc::clone(&state), Arc::clone(&counts));
        handle.spawn(async move {
            loop {
                st.go.notified().await;
                if st.stop.load(Ordering::Acquire) {
                    return;
                }
                let until = || st.base + Duration::from_nanos(st.until_ns.load(Ordering::Acquire));
                let want = || st.want.load(Ordering::Acquire);
                warm_poll(&routers, &c, want, until).await;
            }
        });
        Self {
            state,
            counts,
            per_step,
        }
    }

    /// Warm the path to the next fetches, due in about `lead`.
    pub(crate) fn warm(&self, lead: Duration) {
        let s = &self.state;
        let want = self.counts.started.load(Ordering::Acquire) + self.per_step;
        let until = (Instant::now() + lead + WARM_HOLD).saturating_duration_since(s.base);
        s.want.store(want, Ordering::Release);
        s.until_ns.store(
            u64::try_from(until.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Release,
        );
        s.go.notify_one();
    }
}

impl Drop for Warmer {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        self.state.go.notify_one();
    }
}

/// Warm the path to the next fetches' rows on `handle` with a task of its
/// own (the embedded memory's warm-up, whose routers may change between
/// calls): as [`Warmer::warm`] does.
pub(crate) fn spawn_warm(
    handle: &Handle,
    routers: Vec<Arc<Router>>,
    counts: Arc<FetchCounts>,
    lead: Duration,
) {
    let want = counts.started.load(Ordering::Acquire) + routers.len() as u64;
    let until = Instant::now() + lead + WARM_HOLD;
    handle.spawn(async move { warm_poll(&routers, &counts, || want, || until).await });
}

/// Ping each of `routers`' first sources, and keep this runtime thread
/// polling (a task that yields: between its polls the thread checks its
/// sockets without sleeping) until `want()` fetches have started and none
/// is in flight, or `until()` has passed. The node's loop does this before
/// each step; the embedded memory's `warm` too.
async fn warm_poll(
    routers: &[Arc<Router>],
    counts: &FetchCounts,
    want: impl Fn() -> u64,
    until: impl Fn() -> Instant,
) {
    for r in routers {
        r.warm();
    }
    while Instant::now() < until()
        && !(counts.started.load(Ordering::Acquire) >= want()
            && counts.in_flight.load(Ordering::Acquire) == 0)
    {
        // Other runnable threads first (the loop that is about to ask
        // for the rows, on a host of few cores), then the runtime's
        // sockets and tasks.
        std::thread::yield_now();
        tokio::task::yield_now().await;
    }
}

/// The fetch task ended without an answer (the runtime is shutting down).
fn lost(origin: Instant) -> Fetch {
    Fetch {
        ready: origin.elapsed(),
        error: Some("the fetch task ended without an answer (shutting down)".into()),
        ..Fetch::default()
    }
}
