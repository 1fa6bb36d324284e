//! The host source's mapper: the work a new generation brings beside the
//! lookups, never on their path. A thread of the source's own coordinates
//! it; the page work runs on a helper thread at idle priority
//! (`SCHED_IDLE`), which holds no lock a lookup could wait for, and, when
//! the host has had no idle core for [`IDLE_FOR`], goes on at nice 19,
//! so that it ends (the old generation's memory is held until then).
//!
//! - **Ready** a new generation before it serves: map its pages into this
//!   process a slice at a time (`MADV_POPULATE_READ`, 4 MiB a call, so the
//!   address space's lock is held briefly), while lookups go on reading
//!   the generation in service (the same version: the same rows). Only
//!   then does it replace it, in one pointer swap under the table map's
//!   lock, taken at normal priority: a thread at idle priority holding it
//!   could wait behind any other work on its core while lookups wait for
//!   it. A donor that moves on meanwhile (another generation, another
//!   version, gone) abandons it.
//! - **Warm** a table's very first mapping (the node starting), which
//!   serves at once: its pages mapped in the same way while it serves.
//!   Any later one is readied first, even with none in service (after
//!   another version): lookups meanwhile go to the route's other sources,
//!   as they did while that version was served. Measured with 660 MB
//!   tables, lookups that reached a mapping being populated spent up to
//!   19 ms faulting its pages in.
//! - **Retire** a generation out of service once no lookup or view holds
//!   it: its page tables cleared a slice at a time (`MADV_DONTNEED`),
//!   then unmapped, and its memory let go (for a donor that restarted,
//!   the last reference to its old memfd: freeing it takes time in
//!   proportion to its size), at idle priority, rather than on the thread
//!   of whoever let go of it last.
//!
//! Measured before this existed (docs/benchmarks.md): the watcher freed
//! the old generation while holding the table map's write lock, so a
//! lookup waited for all of it (406 ms for a 660 MB table); a new
//! generation served at once and was populated by a thread per table at
//! normal priority, with lookups faulting on its pages meanwhile.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use engram_store::background::{Background, lower_this_thread, slices};
use engram_sync::{Condvar, Mutex};

use super::{Mapped, RETRY, State};

/// Bytes one system call maps in or out: 1,024 pages of 4 KiB.
const SLICE: usize = 4 << 20;

/// How often a generation out of service is looked at again while a
/// lookup or a view still holds it.
const RECHECK: Duration = Duration::from_millis(20);

/// How long a job's page work waits for idle cores before it goes on at
/// nice 19.
const IDLE_FOR: Duration = Duration::from_secs(2);

/// Work for the mapper.
#[derive(Debug)]
enum Job {
    /// Populate a generation, then put it in service for `table` if it is
    /// still the one wanted.
    Ready(u32, Arc<Mapped>),
    /// Populate a generation in service while it serves.
    Warm(Arc<Mapped>),
    /// Unmap a generation out of service once nothing holds it.
    Retire(Arc<Mapped>),
}

/// The mapper's queue, and the generation of each table being readied.
#[derive(Debug, Default)]
pub(super) struct Mapper {
    queue: Mutex<Queue>,
    wake: Condvar,
}

#[derive(Debug, Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// The generation being readied to replace each table's mapping.
    wanted: HashMap<u32, Arc<Mapped>>,
}

impl Mapper {
    /// Ready `m` for `table` in the background: it replaces the table's
    /// mapping once its pages are mapped, unless [`Self::forget`] (or
    /// another `ready`) comes first.
    pub(super) fn ready(&self, table: u32, m: Arc<Mapped>) {
        let mut q = self.queue.lock();
        if let Some(old) = q.wanted.insert(table, Arc::clone(&m)) {
            old.done.store(true, Ordering::Release);
        }
        // A generation of the table still waiting its turn is not wanted
        // any more: let go at once, so that a donor sending generation
        // after generation holds at most one waiting here.
        for job in q.jobs.iter_mut() {
            if let Job::Ready(t, old) = job
                && *t == table
            {
                *job = Job::Retire(Arc::clone(old));
            }
        }
        q.jobs.push_back(Job::Ready(table, m));
        self.wake.notify_one();
    }

    /// Populate `m`, a table's mapping in service, while it serves.
    pub(super) fn warm(&self, m: Arc<Mapped>) {
        self.push(Job::Warm(m));
    }

    /// Let `m` go (out of service) once nothing holds it.
    pub(super) fn retire(&self, m: Arc<Mapped>) {
        m.done.store(true, Ordering::Release);
        self.push(Job::Retire(m));
    }

    /// Whether `generation` is being readied for `table`.
    pub(super) fn readying(&self, table: u32, generation: u64) -> bool {
        let q = self.queue.lock();
        q.wanted
            .get(&table)
            .is_some_and(|m| m.generation == generation)
    }

    /// Stop readying anything for `table`: what is under way is retired.
    pub(super) fn forget(&self, table: u32) {
        if let Some(m) = self.queue.lock().wanted.remove(&table) {
            m.done.store(true, Ordering::Release);
        }
    }

    fn push(&self, job: Job) {
        self.queue.lock().jobs.push_back(job);
        self.wake.notify_one();
    }

    /// The next job, waiting at most `wait`.
    fn next(&self, wait: Duration) -> Option<Job> {
        let mut q = self.queue.lock();
        if q.jobs.is_empty() {
            q = self.wake.wait_timeout(q, wait).0;
        }
        q.jobs.pop_front()
    }
}

/// The mapper of donor `name`'s source, until the source is dropped.
pub(super) fn run(name: &str, st: &State) {
    let mut retiring: Vec<Arc<Mapped>> = Vec::new();
    while !st.stop.load(Ordering::Relaxed) {
        let wait = if retiring.is_empty() { RETRY } else { RECHECK };
        match st.mapper.next(wait) {
            Some(Job::Ready(table, m)) => ready(name, table, m, st, &mut retiring),
            Some(Job::Warm(m)) => {
                let t0 = Instant::now();
                if populate(name, &m, st) {
                    let ms = t0.elapsed().as_millis() as u64;
                    let table = m.table.id;
                    tracing::debug!(
                        donor = name,
                        table,
                        ms,
                        "host socket: every page of the table mapped"
                    );
                }
            }
            Some(Job::Retire(m)) => retiring.push(m),
            None => {}
        }
        let (free, held): (Vec<_>, Vec<_>) = retiring.drain(..).partition(unheld);
        retiring = held;
        if !free.is_empty() {
            free.into_iter().for_each(|m| let_go(name, m));
        }
    }
}

/// Ready generation `m` of `table`, then put it in service if it is still
/// wanted; what it replaces (or `m`, abandoned) goes to `retiring`.
fn ready(name: &str, table: u32, m: Arc<Mapped>, st: &State, retiring: &mut Vec<Arc<Mapped>>) {
    let t0 = Instant::now();
    let populated = populate(name, &m, st);
    let populated_ms = t0.elapsed().as_millis() as u64;
    let old = {
        // Checked and swapped under the queue's lock: a `forget` (the
        // donor moved on) either comes first, and `m` is abandoned, or
        // after, and takes out of service what was put in.
        let mut q = st.mapper.queue.lock();
        let wanted = q.wanted.get(&table).is_some_and(|w| Arc::ptr_eq(w, &m));
        if !(populated && wanted) {
            drop(q);
            m.done.store(true, Ordering::Release);
            retiring.push(m);
            return;
        }
        q.wanted.remove(&table);
        // Counted under the maps' lock: whoever sees the new generation
        // also sees it counted.
        let mut maps = st.maps.write();
        st.count_generation();
        maps.insert(table, Arc::clone(&m))
    };
    st.other.lock().remove(&table);
    tracing::info!(
        donor = name,
        table,
        generation = m.generation,
        replaced = old.as_ref().map(|o| o.generation),
        populated_ms,
        "host socket: new generation in service, its pages mapped first"
    );
    if let Some(old) = old {
        old.done.store(true, Ordering::Release);
        retiring.push(old);
    }
}

/// Run `step(0)`, `step(1)`, ... `step(n - 1)` (each returns false to
/// stop there) on helper threads: at idle priority for the first
/// [`IDLE_FOR`], then on at nice 19, so that a host that stays busy still
/// sees the work end (a new generation served, an old one's memory back)
/// instead of it waiting for an idle core that never comes. Whether every
/// step ran.
fn in_background<F: FnMut(usize) -> bool + Send>(name: &str, n: usize, step: F) -> bool {
    in_background_for(name, IDLE_FOR, n, step)
}

/// [`in_background`], at idle priority for `idle_for`.
fn in_background_for<F: FnMut(usize) -> bool + Send>(
    name: &str,
    idle_for: Duration,
    n: usize,
    mut step: F,
) -> bool {
    let until = Instant::now() + idle_for;
    let mut next = 0;
    // (every step ran, a step stopped the work)
    let mut run = |deadline: Option<Instant>| -> (bool, bool) {
        while next < n {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return (false, false);
            }
            if !step(next) {
                return (false, true);
            }
            next += 1;
        }
        (true, false)
    };
    match at(name, Background::Idle, || run(Some(until))) {
        (true, _) => true,
        (false, true) => false,
        (false, false) => at(name, Background::Low, || run(None)).0,
    }
}

/// Run `work` on a helper thread lowered to `how` and wait for it (run
/// here, at this thread's priority, where no thread can be started).
fn at<T: Send + Default>(name: &str, how: Background, work: impl FnOnce() -> T + Send) -> T {
    let job = Mutex::new(Some(work));
    let run = || job.lock().take().map(|w| w());
    std::thread::scope(|s| {
        let helper = std::thread::Builder::new().name(format!("idle-{name}"));
        let lowered = || {
            if let Err(e) = lower_this_thread(how) {
                tracing::debug!(donor = name, error = %e, "host socket: mapping at normal priority");
            }
            run()
        };
        let done = match helper.spawn_scoped(s, lowered) {
            Ok(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            Err(e) => {
                tracing::debug!(donor = name, error = %e, "host socket: no helper thread; mapping here");
                None
            }
        };
        // The job runs once, on the helper or (when it could not start) here.
        done.or_else(run).unwrap_or_default()
    })
}

/// Map every page of `m` into this process, a slice at a time, while it
/// is wanted (and the source not dropped); whether it got to the end.
/// The helpers take no lock: the first runs at idle priority.
fn populate(name: &str, m: &Mapped, st: &State) -> bool {
    let ranges: Vec<_> = slices(m.table.memory_bytes().len(), SLICE).collect();
    in_background(name, ranges.len(), |i| {
        if m.done.load(Ordering::Acquire) || st.stop.load(Ordering::Relaxed) {
            return false;
        }
        m.table.populate_range(ranges[i].clone());
        true
    })
}

/// Whether nothing but the mapper holds `m` (no lookup, no view: out of
/// the table map, neither can take it again).
fn unheld(m: &Arc<Mapped>) -> bool {
    Arc::strong_count(m) == 1 && Arc::strong_count(&m.table) == 1
}

/// Let an unheld generation go: its page tables cleared a slice at a
/// time, then unmapped (and its memory freed when it was the last
/// reference to it), on the helpers.
fn let_go(name: &str, m: Arc<Mapped>) {
    let ranges: Vec<_> = slices(m.table.memory_bytes().len(), SLICE).collect();
    let mut held = Some(m);
    in_background(name, ranges.len() + 1, |i| {
        match (ranges.get(i), &held) {
            (Some(r), Some(m)) => {
                m.table.release_range(r.clone());
            }
            _ => drop(held.take()),
        }
        true
    });
}

#[cfg(test)]
mod tests {
    use std::sync::Weak;

    use engram_protocol::synthetic::first_mismatch;
    use engram_store::generate::{GenSpec, generate};
    use engram_store::resident::{Backing, LoadOptions, ResidentTable};

    use super::*;

    const ROWS: u64 = 40_000;

    /// A generation of table 1 in a memfd, as a host socket's mapping is.
    fn generation(dir: &std::path::Path, generation: u64) -> Arc<Mapped> {
        let path = dir.join("t.etab");
        if !path.exists() {
            let spec = GenSpec {
                layer: 1,
                rows: ROWS,
                seed: 5,
                hash_preset: None,
                hash_base: None,
                threads: 1,
            };
            generate(&path, &spec, None).expect("generate");
        }
        let opts = LoadOptions {
            backing: Backing::Memfd,
            trust_digest: true,
            threads: 1,
            ..LoadOptions::default()
        };
        let (t, _) = ResidentTable::load_with(Some(1), &path, &opts, |_| None).expect("load");
        assert!(t.kept().is_some(), "a memfd copy");
        Arc::new(Mapped::new(t, generation))
    }

    /// A state serving `m` for table 1, with its mapper running.
    fn serving(m: &Arc<Mapped>) -> (Arc<State>, std::thread::JoinHandle<()>) {
        let st = Arc::new(State::default());
        st.maps.write().insert(1, Arc::clone(m));
        let s2 = Arc::clone(&st);
        let mapper = std::thread::spawn(move || run("d", &s2));
        (st, mapper)
    }

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let t0 = Instant::now();
        while !f() {
            assert!(t0.elapsed() < Duration::from_secs(10), "timed out: {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn in_service(st: &State) -> Option<u64> {
        st.maps.read().get(&1).map(|m| m.generation)
    }

    #[test]
    fn a_new_generation_serves_once_mapped_and_the_old_goes_when_let_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (old, new) = (generation(dir.path(), 1), generation(dir.path(), 2));
        let (st, mapper) = serving(&old);
        // A reader's hold on the old generation, across the switch.
        let held = Arc::clone(&old);
        let gone: Weak<Mapped> = Arc::downgrade(&old);
        drop(old);
        st.mapper.ready(1, new);
        wait_for("the new generation in service", || {
            in_service(&st) == Some(2)
        });
        assert!(!st.mapper.readying(1, 2));
        assert_eq!(st.generations.load(Ordering::Relaxed), 1);
        // Held: still whole, still mapped.
        let rows: Vec<u64> = (0..ROWS).step_by(997).collect();
        let bytes: Vec<u8> = rows
            .iter()
            .flat_map(|&r| held.table.row(r).expect("row").to_vec())
            .collect();
        assert_eq!(first_mismatch(5, 1, &rows, &bytes), None);
        std::thread::sleep(RECHECK * 3);
        assert!(gone.upgrade().is_some(), "not let go while held");
        drop(held);
        wait_for("the old generation let go", || gone.upgrade().is_none());
        st.stop.store(true, Ordering::Relaxed);
        mapper.join().expect("mapper");
    }

    /// The calling thread's policy and nice value.
    fn priority() -> (i32, i32) {
        // SAFETY: both read the calling thread's own settings.
        unsafe {
            let tid = libc::gettid() as libc::id_t;
            (
                libc::sched_getscheduler(0),
                libc::getpriority(libc::PRIO_PROCESS, tid),
            )
        }
    }

    #[test]
    fn background_work_waits_for_idle_cores_only_so_long_and_stops_when_told() {
        let idle = (libc::SCHED_IDLE, 0);
        let low = (libc::SCHED_OTHER, 19);
        let mut seen = Vec::new();
        assert!(in_background_for("d", Duration::from_secs(60), 3, |_| {
            seen.push(priority());
            true
        }));
        assert_eq!(seen, vec![idle; 3]);
        // Past its time at idle priority, the rest at nice 19.
        let mut seen = Vec::new();
        assert!(in_background_for("d", Duration::ZERO, 3, |_| {
            seen.push(priority());
            true
        }));
        assert_eq!(seen, vec![low; 3]);
        // A step that says stop ends it there.
        let mut ran = 0;
        assert!(!in_background_for("d", Duration::from_secs(60), 5, |i| {
            ran += 1;
            i < 1
        }));
        assert_eq!(ran, 2);
        // This thread kept its own priority.
        assert_ne!(priority().0, libc::SCHED_IDLE);
    }

    #[test]
    fn a_generation_forgotten_or_overtaken_never_serves() {
        let dir = tempfile::tempdir().expect("tempdir");
        let st = Arc::new(State::default());
        st.maps.write().insert(1, generation(dir.path(), 1));
        // Before the mapper runs: 2 is overtaken by 3 before its turn, and
        // 3 is forgotten (the donor moved on).
        let (two, three) = (generation(dir.path(), 2), generation(dir.path(), 3));
        let (w2, w3) = (Arc::downgrade(&two), Arc::downgrade(&three));
        st.mapper.ready(1, two);
        st.mapper.ready(1, three);
        assert!(st.mapper.readying(1, 3) && !st.mapper.readying(1, 2));
        st.mapper.forget(1);
        let s2 = Arc::clone(&st);
        let mapper = std::thread::spawn(move || run("d", &s2));
        wait_for("both let go", || {
            w2.upgrade().is_none() && w3.upgrade().is_none()
        });
        assert_eq!(in_service(&st), Some(1));
        assert_eq!(st.generations.load(Ordering::Relaxed), 0);
        st.stop.store(true, Ordering::Relaxed);
        mapper.join().expect("mapper");
    }
}
