//! The host source's mapper: a thread of its own, at idle priority
//! (`SCHED_IDLE`), that does the work a new generation brings beside the
//! lookups, never on their path:
//!
//! - **Ready** a new generation before it serves: map its pages into this
//!   process a slice at a time (`MADV_POPULATE_READ`, 4 MiB a call, so the
//!   address space's lock is held briefly), while lookups go on reading
//!   the generation in service (the same version: the same rows). Only
//!   then does it replace it, in one pointer swap. A donor that moves on
//!   meanwhile (another generation, another version, gone) abandons it.
//! - **Warm** a table's first mapping, which serves at once (there is
//!   nothing else to read here): its pages mapped in the same way while
//!   it serves.
//! - **Retire** a generation out of service once no lookup or view holds
//!   it: its page tables cleared a slice at a time (`MADV_DONTNEED`),
//!   then unmapped, and its memory let go (for a donor that restarted,
//!   the last reference to its old memfd: freeing it takes time in
//!   proportion to its size), here rather than on the thread of whoever
//!   let go of it last.
//!
//! Measured before this thread existed (docs/benchmarks.md): the watcher
//! freed the old generation while holding the table map's write lock, so
//! a lookup waited for all of it (406 ms for a 660 MB table), and a new
//! generation was populated by a thread per table at normal priority,
//! with lookups faulting on its pages meanwhile.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use engram_store::background::{Background, lower_this_thread, slices};
use engram_store::resident::ResidentTable;
use engram_sync::{Condvar, Mutex};

use super::{Mapped, RETRY, State};

/// Bytes one system call maps in or out: 1,024 pages of 4 KiB.
const SLICE: usize = 4 << 20;

/// How often a generation out of service is looked at again while a
/// lookup or a view still holds it.
const RECHECK: Duration = Duration::from_millis(20);

/// Work for the mapper.
#[derive(Debug)]
enum Job {
    /// Populate a generation, then put it in service for `table` if it is
    /// still the one wanted.
    Ready(u32, Arc<Mapped>),
    /// Populate a generation in service while it serves.
    Warm(u32, Arc<Mapped>),
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
    wanted: HashMap<u32, u64>,
}

impl Mapper {
    /// Ready `m` for `table` in the background: it replaces the table's
    /// mapping once its pages are mapped, unless [`Self::forget`] (or
    /// another `ready`) comes first.
    pub(super) fn ready(&self, table: u32, m: Arc<Mapped>) {
        let mut q = self.queue.lock();
        q.wanted.insert(table, m.generation);
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

    /// Populate `m`, table `table`'s mapping in service, while it serves.
    pub(super) fn warm(&self, table: u32, m: Arc<Mapped>) {
        self.push(Job::Warm(table, m));
    }

    /// Let `m` go once nothing holds it.
    pub(super) fn retire(&self, m: Arc<Mapped>) {
        self.push(Job::Retire(m));
    }

    /// Whether `generation` is being readied for `table`.
    pub(super) fn readying(&self, table: u32, generation: u64) -> bool {
        self.queue.lock().wanted.get(&table) == Some(&generation)
    }

    /// Stop readying anything for `table`: what is under way is retired.
    pub(super) fn forget(&self, table: u32) {
        self.queue.lock().wanted.remove(&table);
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

/// The mapper thread of donor `name`'s source, until the source is dropped.
pub(super) fn run(name: &str, st: &State) {
    if let Err(e) = lower_this_thread(Background::Idle) {
        tracing::debug!(donor = name, error = %e, "host socket: the mapper stays at normal priority");
    }
    let mut retiring: Vec<Arc<Mapped>> = Vec::new();
    while !st.stop.load(Ordering::Relaxed) {
        let wait = if retiring.is_empty() { RETRY } else { RECHECK };
        match st.mapper.next(wait) {
            Some(Job::Ready(table, m)) => ready(name, table, m, st, &mut retiring),
            Some(Job::Warm(table, m)) => {
                let t0 = Instant::now();
                let serving = || {
                    !st.stop.load(Ordering::Relaxed)
                        && st
                            .maps
                            .read()
                            .get(&table)
                            .is_some_and(|x| Arc::ptr_eq(x, &m))
                };
                if populate(&m.table, serving) {
                    let ms = t0.elapsed().as_millis() as u64;
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
        retiring.retain(|m| !let_go(m));
    }
}

/// Ready generation `m` of `table`, then put it in service if it is still
/// wanted; what it replaces (or `m`, abandoned) goes to `retiring`.
fn ready(name: &str, table: u32, m: Arc<Mapped>, st: &State, retiring: &mut Vec<Arc<Mapped>>) {
    let t0 = Instant::now();
    let wanted = || !st.stop.load(Ordering::Relaxed) && st.mapper.readying(table, m.generation);
    if !populate(&m.table, wanted) {
        retiring.push(m);
        return;
    }
    let populated_ms = t0.elapsed().as_millis() as u64;
    let old = {
        // Checked and swapped under the queue's lock: a `forget` (the
        // donor moved on) either comes first, and `m` is abandoned, or
        // after, and removes what was put in service.
        let mut q = st.mapper.queue.lock();
        if q.wanted.get(&table) != Some(&m.generation) {
            drop(q);
            retiring.push(m);
            return;
        }
        q.wanted.remove(&table);
        st.maps.write().insert(table, Arc::clone(&m))
    };
    st.other.lock().remove(&table);
    st.count_generation();
    tracing::info!(
        donor = name,
        table,
        generation = m.generation,
        replaced = old.as_ref().map(|o| o.generation),
        populated_ms,
        "host socket: new generation in service, its pages mapped first"
    );
    retiring.extend(old);
}

/// Map every page of `t` into this process, a slice at a time, while
/// `go_on()`; whether it got to the end.
fn populate(t: &ResidentTable, mut go_on: impl FnMut() -> bool) -> bool {
    for range in slices(t.memory_bytes().len(), SLICE) {
        if !go_on() {
            return false;
        }
        t.populate_range(range);
    }
    true
}

/// Let generation `m` go if nothing but the mapper holds it (no lookup,
/// no view: out of the table map, neither can take it again): its page
/// tables cleared a slice at a time, then unmapped. Whether it went.
fn let_go(m: &Arc<Mapped>) -> bool {
    if Arc::strong_count(m) > 1 || Arc::strong_count(&m.table) > 1 {
        return false;
    }
    for range in slices(m.table.memory_bytes().len(), SLICE) {
        m.table.release_range(range);
    }
    true
}

#[cfg(test)]
mod tests {
    use std::sync::Weak;

    use engram_protocol::synthetic::first_mismatch;
    use engram_store::generate::{GenSpec, generate};
    use engram_store::resident::{Backing, LoadOptions};

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
        Arc::new(Mapped {
            table: Arc::new(t),
            generation,
        })
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
