//! The rings' client: one native thread per host client (per
//! [`RingHub`]) polls the request words of every ring it serves, starts
//! each request's fetch on the node's memory (V4.1's Engram memory, or a
//! node's tables of any family at their own row size: [`NodeMemory`]; one
//! message per table, as any prefetch), writes the rows into the slot when they come, then
//! its status, then publishes the done word (release). No Python and no
//! CUDA call on this path: an engine whose main thread waits in its engine
//! loop cannot stall it, and it runs the same during graph capture.
//!
//! Requests are served in `seq` order per ring. A request whose rows are
//! not in by the client's own deadline (set below the GPU's, so the GPU
//! never reaches its own) gets zeros and [`Status::Late`]; a table whose
//! every source failed gets zeros and [`Status::Zeros`] or
//! [`Status::Failed`] by its policy; positions with invalid ids get zeros
//! and [`Status::BadIds`]. When idle the thread spins for
//! [`RingOptions::idle_spin`], then naps [`RingOptions::idle_sleep`] at a
//! time.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use engram_protocol::ROW_BYTES;
use engram_protocol::hashing::ENGRAM_LAYERS;
use engram_protocol::ring::Shape;
use engram_protocol::ring::{
    GPU_TIMEOUT, NO_ROW, SERVED_FAILOVER, SERVED_HEDGED, SERVED_LATE, SERVED_SSD, WAIT_BUCKETS,
    wait_bucket_bounds,
};
use engram_sync::Mutex;

use super::{Fault, RingMemory, Status, client_state, header, slot};
use crate::embed::{EmbedError, NodeMemory, RowLayers, Served, Ticket};
use crate::metrics::{NodeMetrics, RingLabels};

/// How a ring is served.
#[derive(Debug, Clone, Copy)]
pub struct RingOptions {
    /// Keep spinning this long after the last request before napping.
    pub idle_spin: Duration,
    /// One nap when idle (the latency a request after a quiet spell pays).
    pub idle_sleep: Duration,
    /// Give up on a request this long after it is seen (zeros,
    /// [`Status::Late`]); capped below the ring's GPU deadline.
    pub deadline: Duration,
}

impl Default for RingOptions {
    fn default() -> Self {
        Self {
            idle_spin: Duration::from_millis(2),
            idle_sleep: Duration::from_micros(20),
            deadline: Duration::from_millis(200),
        }
    }
}

/// What a ring's client has done.
#[derive(Debug, Default)]
pub struct RingCounters {
    /// Requests seen.
    pub requests: AtomicU64,
    /// Layer sections answered with rows.
    pub served: AtomicU64,
    /// Layer sections answered with zeros: failed, by policy, or late.
    pub zeros: AtomicU64,
    /// Of those, given up at the client's deadline.
    pub late: AtomicU64,
    /// Positions whose ids were invalid.
    pub bad_positions: AtomicU64,
    /// Requests the engine rewrote while they were read or served.
    pub stale: AtomicU64,
    /// Sections whose wait passed the GPU's deadline (the engine's word).
    pub gpu_timeouts: AtomicU64,
    /// Faults: sections without rows whose table's policy is `fail`,
    /// told to the engine through the header (it raises an error).
    pub faults: AtomicU64,
}

/// One host client's rings and the thread that serves them all.
#[derive(Debug)]
pub struct RingHub {
    mem: NodeMemory,
    opts: RingOptions,
    added: Arc<Mutex<Vec<RingState>>>,
    stop: Arc<AtomicBool>,
    /// CLOCK_MONOTONIC at the thread's last pass over its rings.
    pass: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

/// A ring a hub serves; dropping it lets the ring go (its header then says
/// the client is gone).
#[derive(Debug)]
pub struct RingHandle {
    gone: Arc<AtomicBool>,
    counters: Arc<RingCounters>,
    ring: Arc<RingMemory>,
    deadline: Duration,
}

impl RingHandle {
    /// Its counters.
    pub fn counters(&self) -> &RingCounters {
        &self.counters
    }

    /// The ring.
    pub fn ring(&self) -> &Arc<RingMemory> {
        &self.ring
    }

    /// The age at which the client gives up on a request (below the
    /// ring's GPU deadline).
    pub fn deadline(&self) -> Duration {
        self.deadline
    }
}

impl Drop for RingHandle {
    fn drop(&mut self) {
        self.gone.store(true, Ordering::Release);
    }
}

impl RingHub {
    /// A hub serving from `mem` (V4.1's memory, or any family's tables),
    /// its thread started.
    pub fn start(mem: NodeMemory, opts: RingOptions) -> Result<Self, EmbedError> {
        let added = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let pass = Arc::new(AtomicU64::new(monotonic_ns()));
        let (a, s, p) = (Arc::clone(&added), Arc::clone(&stop), Arc::clone(&pass));
        let thread = std::thread::Builder::new()
            .name("engram-rings".into())
            .spawn(move || run(&a, &s, &p, opts))
            .map_err(|e| EmbedError::Internal(format!("the ring thread cannot start: {e}")))?;
        Ok(Self {
            mem,
            opts,
            added,
            stop,
            pass,
            thread: Some(thread),
        })
    }

    /// Whether the ring thread has made a pass over its rings within
    /// `within` (a wedged thread has not: what a watchdog asks).
    pub fn alive(&self, within: Duration) -> bool {
        let last = self.pass.load(Ordering::Relaxed);
        monotonic_ns().saturating_sub(last) <= within.as_nanos() as u64
    }

    /// Serve `ring` too: checked against the node's tables first.
    pub fn add(&self, ring: Arc<RingMemory>) -> Result<RingHandle, EmbedError> {
        let st = RingState::new(self.mem.clone(), Arc::clone(&ring), self.opts)?;
        let handle = RingHandle {
            gone: Arc::clone(&st.gone),
            counters: Arc::clone(&st.counters),
            ring,
            deadline: st.opts.deadline,
        };
        self.added.lock().push(st);
        Ok(handle)
    }
}

impl Drop for RingHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One ring served by a hub of its own (an engine process serving its own
/// ring); dropping it stops the thread.
#[derive(Debug)]
pub struct RingServer {
    handle: RingHandle,
    hub: RingHub,
}

impl RingServer {
    /// Its counters.
    pub fn counters(&self) -> &RingCounters {
        self.handle.counters()
    }

    /// The ring.
    pub fn ring(&self) -> &Arc<RingMemory> {
        self.handle.ring()
    }

    /// The client's give-up age.
    pub fn deadline(&self) -> Duration {
        self.handle.deadline()
    }

    /// Stop serving and wait for the thread.
    pub fn stop(self) {
        drop(self.handle);
        drop(self.hub);
    }
}

/// Serve `ring` from `mem` on a thread of its own.
pub fn serve(
    mem: NodeMemory,
    ring: Arc<RingMemory>,
    opts: RingOptions,
) -> Result<RingServer, EmbedError> {
    let hub = RingHub::start(mem, opts)?;
    let handle = hub.add(ring)?;
    Ok(RingServer { handle, hub })
}

/// The hub's thread: every ring's one pass, spinning while any is busy.
fn run(added: &Mutex<Vec<RingState>>, stop: &AtomicBool, pass: &AtomicU64, opts: RingOptions) {
    // Naps of a few microseconds, not the default 50 us of slack.
    // SAFETY: prctl with integer arguments on this thread.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0, 0, 0) };
    let mut rings: Vec<RingState> = Vec::new();
    let mut last_event = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        pass.store(monotonic_ns(), Ordering::Relaxed);
        if let Some(mut new) = added.try_lock()
            && !new.is_empty()
        {
            rings.append(&mut new);
        }
        rings.retain(|r| {
            let gone = r.gone.load(Ordering::Acquire);
            if gone {
                r.ring.set_client(0, client_state::GONE);
            }
            !gone
        });
        let mut busy = false;
        let mut inflight = false;
        for r in &mut rings {
            busy |= r.poll();
            inflight |= !r.inflight.is_empty();
        }
        if busy {
            last_event = Instant::now();
        }
        if busy || inflight || last_event.elapsed() < opts.idle_spin {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(opts.idle_sleep);
        }
    }
    for r in &rings {
        r.ring.set_client(0, client_state::GONE);
    }
}

/// One request on its way.
#[derive(Debug)]
struct Inflight {
    slot: u32,
    seq: u64,
    positions: u32,
    /// Layer sections still to answer.
    left: u32,
    /// Sections with invalid positions.
    bad: u32,
    /// `None`: nothing to fetch (every position DEAD or invalid).
    ticket: Option<Ticket>,
    seen: Instant,
}

#[derive(Debug)]
struct RingState {
    mem: NodeMemory,
    ring: Arc<RingMemory>,
    /// Rows in each layer section's table.
    rows: [u64; 2],
    /// Each layer section's table id.
    tables: [u32; 2],
    opts: RingOptions,
    counters: Arc<RingCounters>,
    gone: Arc<AtomicBool>,
    /// The last request seen in each slot.
    seen: Vec<u64>,
    /// The last GPU give-up seen in each slot.
    gave_up: Vec<u64>,
    /// Each slot's last request taken and its step tag, `(seq, step)`.
    tags: Vec<(u64, u64)>,
    /// Whether each layer section's table fails (policy `fail`) rather
    /// than answering zeros when no rows come.
    fails: [bool; 2],
    inflight: Vec<Inflight>,
    /// The node's series, with each section's labels.
    metrics: Arc<NodeMetrics>,
    labels: [RingLabels; 2],
    /// The wait histograms as last read, and when.
    waits_seen: [[u64; WAIT_BUCKETS]; 2],
    waits_read: Instant,
}

/// How often a ring's wait histograms are read into the metrics.
const WAITS_EVERY: Duration = Duration::from_millis(50);
/// Most waits taken from one bucket at one reading: a header claiming more
/// (no GPU waits that often: 4,096 in 50 ms is 80,000 a second) is not
/// believed beyond it, so an engine writing nonsense there cannot hold the
/// thread that serves every ring of the host for long.
const MOST_WAITS_READ: u64 = 1 << 12;

/// CLOCK_MONOTONIC in ns: the same clock in every process on the host.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl RingState {
    /// A ring's state, checked against the node's tables, its header told
    /// who serves it and when it gives up.
    fn new(mem: NodeMemory, ring: Arc<RingMemory>, opts: RingOptions) -> Result<Self, EmbedError> {
        let sh = *ring.shape();
        let RingTables {
            rows,
            fails,
            tables,
        } = ring_tables(&mem, &sh)?;
        // The client gives up before the GPU does, so the GPU reads its
        // zeros and status, not its own deadline.
        let gpu = Duration::from_nanos(sh.gpu_deadline_ns);
        let deadline = opts.deadline.min(gpu.mul_f64(0.8));
        ring.word(header::CLIENT_DEADLINE_NS as u64)
            .store(deadline.as_nanos() as u64, Ordering::Relaxed);
        let fail_sections = (0..sh.layers)
            .filter(|&l| fails[l as usize])
            .fold(0u32, |m, l| m | 1 << l);
        ring.word32(header::FAIL_SECTIONS as u64)
            .store(fail_sections, Ordering::Relaxed);
        ring.set_client(std::process::id(), client_state::SERVING);
        let gave_up = (0..sh.slots)
            .map(|s| {
                ring.word(sh.slot_at(s) + slot::GPU_GAVE_UP as u64)
                    .load(Ordering::Acquire)
            })
            .collect();
        let metrics = match &mem {
            NodeMemory::V41(m) => m.metrics()?,
            NodeMemory::Tables(t) => t.metrics()?,
        };
        let labels = sh.layer_ids.map(|id| RingLabels {
            layer: id.to_string(),
        });
        let waits_seen = [ring.waits(0), ring.waits(1)];
        let mut st = Self {
            mem,
            ring,
            rows,
            tables,
            opts: RingOptions { deadline, ..opts },
            counters: Arc::default(),
            gone: Arc::default(),
            seen: vec![0; sh.slots as usize],
            gave_up,
            tags: vec![(0, 0); sh.slots as usize],
            fails,
            inflight: Vec::new(),
            metrics,
            labels,
            waits_seen,
            waits_read: Instant::now(),
        };
        st.adopt_answered();
        Ok(st)
    }

    /// One pass: the heartbeat, new requests, finished fetches; true when
    /// anything happened.
    fn poll(&mut self) -> bool {
        self.ring
            .word(header::HEARTBEAT_NS as u64)
            .store(monotonic_ns(), Ordering::Release);
        let busy = self.take_requests();
        let busy = busy | self.finish();
        self.take_gpu_timeouts();
        if self.waits_read.elapsed() >= WAITS_EVERY {
            self.take_waits();
        }
        busy
    }

    /// The GPU's waits since the last reading into the node's histogram,
    /// each at its bucket's midpoint. Counts that went back (a ring
    /// rewritten) start over; a jump past [`MOST_WAITS_READ`] is clipped.
    fn take_waits(&mut self) {
        self.waits_read = Instant::now();
        for l in 0..self.ring.shape().layers {
            let now = self.ring.waits(l);
            let seen = &mut self.waits_seen[l as usize];
            let h = self
                .metrics
                .ring_gpu_wait_seconds
                .get_or_create(&self.labels[l as usize]);
            for (b, (&n, was)) in now.iter().zip(seen.iter_mut()).enumerate() {
                let new = n.saturating_sub(*was).min(MOST_WAITS_READ);
                *was = n;
                let (lo, hi) = wait_bucket_bounds(b);
                for _ in 0..new {
                    h.observe((lo + hi) * 0.5e-9);
                }
            }
        }
    }

    /// Record a fault for the engine: section `l` of request `seq` had no
    /// rows and its table's policy is `fail`. The count is written last,
    /// so an engine that sees it grow reads this fault's details.
    fn fault(&self, seq: u64, l: u32, status: u32) {
        self.counters.faults.fetch_add(1, Ordering::Relaxed);
        if let Some(labels) = self.labels.get(l as usize) {
            self.metrics.ring_faults.get_or_create(labels).inc();
        }
        let s = (seq % u64::from(self.ring.shape().slots)) as usize;
        let step = match self.tags[s] {
            (tagged, step) if tagged == seq => step,
            _ => 0,
        };
        self.ring.log_fault(Fault {
            seq,
            step,
            section: l,
            status,
        });
        tracing::error!(
            seq,
            step,
            section = l,
            status,
            "engine ring: a request had no rows and its table's policy is fail; the engine \
             fails the step's requests"
        );
    }

    /// Waits that passed the GPU's deadline since the last pass: zeros on
    /// the GPU, a fault where the table's policy is `fail`.
    fn take_gpu_timeouts(&mut self) {
        let sh = *self.ring.shape();
        for s in 0..sh.slots {
            let at = sh.slot_at(s) + slot::GPU_GAVE_UP as u64;
            let seq = self.ring.word(at).load(Ordering::Acquire);
            if seq <= self.gave_up[s as usize] {
                continue;
            }
            self.gave_up[s as usize] = seq;
            self.counters.gpu_timeouts.fetch_add(1, Ordering::Relaxed);
            let mask = self
                .ring
                .word32(sh.slot_at(s) + slot::MASK as u64)
                .load(Ordering::Relaxed);
            for l in (0..sh.layers).filter(|l| mask & (1 << l) != 0) {
                self.metrics
                    .ring_gpu_timeouts
                    .get_or_create(&self.labels[l as usize])
                    .inc();
            }
            let l = (0..sh.layers)
                .find(|&l| mask & (1 << l) != 0 && self.fails[l as usize])
                .or_else(|| (0..sh.layers).find(|&l| self.fails[l as usize]));
            if let Some(l) = l {
                self.fault(seq, l, GPU_TIMEOUT);
            }
        }
    }

    /// Requests already answered when the ring is attached (a client that
    /// restarted): not served again.
    fn adopt_answered(&mut self) {
        let sh = *self.ring.shape();
        for s in 0..sh.slots {
            let seq = self.ring.request(s);
            if (0..sh.layers).all(|l| self.ring.done(s, l) >= seq) {
                self.seen[s as usize] = seq;
            }
        }
    }

    /// Start the fetches of new requests, oldest first; true when any.
    fn take_requests(&mut self) -> bool {
        let sh = *self.ring.shape();
        let mut new: Vec<(u64, u32)> = Vec::new();
        for s in 0..sh.slots {
            let seq = self.ring.request(s);
            if seq > self.seen[s as usize] {
                self.seen[s as usize] = seq;
                new.push((seq, s));
            }
        }
        new.sort_unstable();
        for &(seq, s) in &new {
            self.counters.requests.fetch_add(1, Ordering::Relaxed);
            self.start(s, seq);
        }
        !new.is_empty()
    }

    /// Read slot `s`'s request `seq` and start its fetch.
    fn start(&mut self, s: u32, seq: u64) {
        let sh = *self.ring.shape();
        let base = sh.slot_at(s);
        let positions = self
            .ring
            .word32(base + slot::POSITIONS as u64)
            .load(Ordering::Relaxed);
        let mask = self
            .ring
            .word32(base + slot::MASK as u64)
            .load(Ordering::Relaxed);
        let mask = mask & ((1 << sh.layers) - 1);
        let positions = positions.min(sh.positions);
        let (ids, bad) = self.read_ids(s, mask, positions);
        let step = self.ring.step_tag(s);
        // The engine may have moved on while the ids and the tag were read.
        if self.ring.request(s) != seq {
            self.counters.stale.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.tags[s as usize] = (seq, step);
        let mut f = Inflight {
            slot: s,
            seq,
            positions,
            left: mask,
            bad,
            ticket: None,
            seen: Instant::now(),
        };
        let live = ids.iter().any(|&r| r != crate::embed::NO_ROW);
        if mask != 0 && live {
            match self.prefetch(&ids, mask) {
                Ok(t) => f.ticket = Some(t),
                Err(e) => {
                    tracing::warn!(error = %e, "engine ring: a request could not start");
                    self.answer_all(&f, Status::Failed, 0);
                    return;
                }
            }
        }
        if f.ticket.is_none() {
            // Nothing to fetch: every position DEAD (graph padding,
            // dummy batches) or invalid.
            let status = if bad != 0 { Status::BadIds } else { Status::Ok };
            self.answer_all(&f, status, 0);
            return;
        }
        self.inflight.push(f);
    }

    /// Start the fetch of the sections in `mask` (`ids` as
    /// [`Self::read_ids`] gives them).
    fn prefetch(&self, ids: &[u64], mask: u32) -> Result<Ticket, EmbedError> {
        let sh = self.ring.shape();
        match &self.mem {
            NodeMemory::V41(m) => {
                let layers = match mask {
                    3 => RowLayers::Both,
                    m => RowLayers::One(sh.layer_ids[m.trailing_zeros() as usize]),
                };
                let cols = sh.first_column as usize..(sh.first_column + sh.columns) as usize;
                m.prefetch_rows(ids, layers, cols)
            }
            NodeMemory::Tables(t) => {
                let tables: Vec<u32> = (0..sh.layers)
                    .filter(|l| mask & (1 << l) != 0)
                    .map(|l| self.tables[l as usize])
                    .collect();
                t.prefetch(&tables, ids, sh.columns as usize)
            }
        }
    }

    /// Slot `s`'s ids of the sections in `mask`, per position the
    /// sections' columns in order (what `prefetch_rows` takes), checked:
    /// a position with any id out of range, or (V4.1's) a no-row id beside
    /// live ones, becomes DEAD; the mask of sections where that happened.
    fn read_ids(&self, s: u32, mask: u32, positions: u32) -> (Vec<u64>, u32) {
        let sh = *self.ring.shape();
        let base = sh.slot_at(s);
        let cols = sh.columns as usize;
        let sections: Vec<u32> = (0..sh.layers).filter(|l| mask & (1 << l) != 0).collect();
        let per = sections.len() * cols;
        let mut out = vec![crate::embed::NO_ROW; positions as usize * per];
        let mut bad = 0u32;
        let mut raw = vec![0i64; cols];
        let whole = matches!(self.mem, NodeMemory::V41(_));
        for p in 0..positions {
            let mut ok = true;
            let mut dead = true;
            let dst = &mut out[p as usize * per..(p as usize + 1) * per];
            for (k, &l) in sections.iter().enumerate() {
                let at = base + sh.id_at(l, p, 0);
                // SAFETY: the position's ids lie inside the slot (the
                // position is below the shape's bound).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.ring.as_ptr().add(at as usize),
                        raw.as_mut_ptr().cast::<u8>(),
                        cols * 8,
                    )
                };
                for (c, &id) in raw.iter().enumerate() {
                    if id == NO_ROW {
                        continue;
                    }
                    dead = false;
                    if id < 0 || id as u64 >= self.rows[l as usize] {
                        ok = false;
                        bad |= 1 << l;
                    }
                    dst[k * cols + c] = id as u64;
                }
            }
            // V4.1's positions are whole; a table of another family's
            // (a version 2 ring) may ask for some of a position's rows.
            let partial = whole && dst.contains(&crate::embed::NO_ROW);
            if !dead && (!ok || partial) {
                if ok {
                    bad |= mask;
                }
                self.counters.bad_positions.fetch_add(1, Ordering::Relaxed);
                dst.fill(crate::embed::NO_ROW);
            }
        }
        (out, bad)
    }

    /// Answer the sections whose rows are in, or whose time is up; true
    /// when any was answered.
    fn finish(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.inflight.len() {
            let done = self.finish_one(i);
            any |= done.1;
            if done.0 {
                self.inflight.swap_remove(i);
            } else {
                i += 1;
            }
        }
        any
    }

    /// (request finished, a section answered).
    fn finish_one(&mut self, i: usize) -> (bool, bool) {
        let sh = *self.ring.shape();
        let f = &self.inflight[i];
        let late = f.seen.elapsed() >= self.opts.deadline;
        let mut answered = 0u32;
        for l in (0..sh.layers).filter(|l| f.left & (1 << l) != 0) {
            let layer = sh.layer_ids[l as usize];
            let Some(t) = &f.ticket else { continue };
            if t.ready(layer).unwrap_or(true) {
                answered |= 1 << l;
                self.answer_from(f, l, t, layer);
            } else if late {
                answered |= 1 << l;
                self.counters.late.fetch_add(1, Ordering::Relaxed);
                self.answer(f, l, Status::Late, SERVED_LATE, false);
            }
        }
        let f = &mut self.inflight[i];
        f.left &= !answered;
        (f.left == 0, answered != 0)
    }

    /// Section `l`'s rows from its ticket into the slot.
    fn answer_from(&self, f: &Inflight, l: u32, t: &Ticket, layer: u32) {
        if self.ring.request(f.slot) != f.seq {
            self.counters.stale.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let out = self.rows_of(f, l);
        match t.wait(layer, out, Some(Duration::ZERO)) {
            Ok(served) => {
                let (status, zeros) = if served.zeros {
                    (Status::Zeros, true)
                } else if f.bad & (1 << l) != 0 {
                    (Status::BadIds, false)
                } else {
                    (Status::Ok, false)
                };
                self.answer(f, l, status, served_bits(&served), !zeros);
            }
            Err(e) => {
                tracing::warn!(error = %e, layer, "engine ring: no rows");
                self.answer(f, l, Status::Failed, 0, false);
            }
        }
    }

    /// Layer section `l`'s rows of request `f`, in the slot.
    #[allow(clippy::mut_from_ref)]
    fn rows_of(&self, f: &Inflight, l: u32) -> &mut [u8] {
        let sh = self.ring.shape();
        let at = sh.slot_at(f.slot) + sh.layer_rows_at(l);
        let n = f.positions as usize * sh.columns as usize * sh.row_bytes as usize;
        // SAFETY: the section's first `positions` rows lie inside the slot;
        // until its done word is published only this thread writes them,
        // and the engine reads them only after.
        unsafe { std::slice::from_raw_parts_mut(self.ring.as_ptr().add(at as usize), n) }
    }

    /// Every section of `f` answered with `status` (zeros unless Ok).
    fn answer_all(&self, f: &Inflight, status: Status, served: u32) {
        for l in (0..self.ring.shape().layers).filter(|l| f.left & (1 << l) != 0) {
            self.answer(f, l, status, served, false);
        }
    }

    /// Publish section `l`'s answer: rows (zeros unless `rows_in`), then
    /// status, then the done word.
    fn answer(&self, f: &Inflight, l: u32, status: Status, served: u32, rows_in: bool) {
        if self.ring.request(f.slot) != f.seq {
            self.counters.stale.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if !rows_in {
            self.rows_of(f, l).fill(0);
        }
        let base = self.ring.shape().slot_at(f.slot);
        let c = &self.counters;
        let hdr = if matches!(status, Status::Ok | Status::BadIds) && rows_in {
            c.served.fetch_add(1, Ordering::Relaxed);
            header::SERVED
        } else {
            c.zeros.fetch_add(1, Ordering::Relaxed);
            header::FAILED
        };
        self.ring.word(hdr as u64).fetch_add(1, Ordering::Relaxed);
        if matches!(status, Status::Failed | Status::Late) && self.fails[l as usize] {
            self.fault(f.seq, l, status as u32);
        }
        let off = 4 * u64::from(l);
        self.ring
            .word32(base + slot::SERVED as u64 + off)
            .store(served, Ordering::Relaxed);
        self.ring
            .word32(base + slot::STATUS as u64 + off)
            .store(status as u32, Ordering::Relaxed);
        self.ring
            .word(base + slot::DONE as u64 + 8 * u64::from(l))
            .store(f.seq, Ordering::Release);
    }
}

/// What a ring's sections are in the node's memory.
struct RingTables {
    /// Rows of each section's table.
    rows: [u64; 2],
    /// Whether each section's table's policy is `fail`.
    fails: [bool; 2],
    /// Each section's table id.
    tables: [u32; 2],
}

/// A ring's sections checked against the node's memory: V4.1's memory
/// takes rings of 264-byte rows whose sections are layers 1 and 14 (in
/// that order); a node's tables, rings whose sections are the layers of
/// tables it routes, of the ring's row size.
fn ring_tables(mem: &NodeMemory, sh: &Shape) -> Result<RingTables, EmbedError> {
    let bad = |m: String| Err(EmbedError::BadInput(m));
    let mut out = RingTables {
        rows: [0; 2],
        fails: [false; 2],
        tables: [0; 2],
    };
    let used = &sh.layer_ids[..sh.layers as usize];
    match mem {
        NodeMemory::V41(m) => {
            if sh.row_bytes as usize != ROW_BYTES {
                return bad(format!(
                    "the ring's rows are {} bytes; DeepSeek V4.1's are {ROW_BYTES}",
                    sh.row_bytes
                ));
            }
            let (rows, policies, tables) = (m.table_rows()?, m.policies()?, m.tables()?);
            for (l, id) in used.iter().enumerate() {
                let slot = ENGRAM_LAYERS.iter().position(|x| x == id).ok_or_else(|| {
                    EmbedError::BadInput(format!(
                        "the ring's layer section {l} is layer {id}: the Engram layers are 1 and 14"
                    ))
                })?;
                out.rows[l] = rows[slot];
                out.fails[l] = policies[slot] == cluster_config::Policy::Fail;
                out.tables[l] = tables[slot];
            }
            if sh.layers == 2 && sh.layer_ids[0] >= sh.layer_ids[1] {
                return bad("a ring's two layer sections are layer 1's, then layer 14's".into());
            }
        }
        NodeMemory::Tables(t) => {
            let info = t.tables()?;
            for (l, id) in used.iter().enumerate() {
                let Some(table) = info.iter().find(|x| x.layer == *id) else {
                    let have: Vec<String> = info
                        .iter()
                        .map(|x| format!("table {} (layer {})", x.table, x.layer))
                        .collect();
                    return bad(format!(
                        "the ring's layer section {l} is layer {id}: the node routes {}",
                        have.join(", ")
                    ));
                };
                if table.row_bytes != sh.row_bytes as usize {
                    return bad(format!(
                        "the ring's rows are {} bytes; table {}'s ({}) are {}",
                        sh.row_bytes,
                        table.table,
                        table.encoding.name(),
                        table.row_bytes
                    ));
                }
                out.rows[l] = table.rows;
                out.fails[l] = table.policy == cluster_config::Policy::Fail;
                out.tables[l] = table.table;
            }
            if sh.layers == 2 && sh.layer_ids[0] == sh.layer_ids[1] {
                return bad("a ring's two layer sections are two layers' tables".into());
            }
        }
    }
    Ok(out)
}

/// The `SERVED_*` bits of an answer.
fn served_bits(s: &Served) -> u32 {
    let mut b = 0;
    if s.sources.iter().any(|x| x == "ssd") {
        b |= SERVED_SSD;
    }
    if s.hedges > 0 {
        b |= SERVED_HEDGED;
    }
    if s.failovers > 0 {
        b |= SERVED_FAILOVER;
    }
    if s.late {
        b |= SERVED_LATE;
    }
    b
}
