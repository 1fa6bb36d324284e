//! The SSD reader under injected faults: interrupted waits, a full
//! submission queue, a ring that keeps failing, stale completions, and
//! pages flipped on disk. In every case no wrong row is ever returned and
//! the next batch is right.

use std::path::{Path, PathBuf};
use std::sync::{Arc, mpsc};

use cluster_config::SsdIo;
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_store::generate::{GenSpec, generate};
use engram_store::resident::ExpectedTable;
use engram_sync::Mutex;
use io_uring::{IoUring, squeue};

use super::uring::{MAX_RESETS, Ring, RingFactory};
use super::*;

const SEED: u64 = 31;
const ROWS: u64 = 15 * 700 + 4;

fn table(dir: &Path) -> (PathBuf, TableDigest) {
    let path = dir.join("t.etab");
    let spec = GenSpec {
        layer: 1,
        rows: ROWS,
        seed: SEED,
        hash_preset: None,
        hash_base: None,
        threads: 1,
    };
    let meta = generate(&path, &spec, None).expect("generate");
    (path, meta.digest)
}

fn pin(digest: TableDigest) -> Option<ExpectedTable> {
    Some(ExpectedTable {
        digest,
        layer: 1,
        rows: ROWS,
    })
}

/// What the faulty rings do; shared by every ring a factory makes.
#[derive(Debug, Default)]
struct Script {
    /// Waits that hand entries to the kernel, then report EINTR.
    interrupt_every: Option<u64>,
    /// Pushes that report a full queue (every Nth).
    full_every: Option<u64>,
    /// Every wait hands entries to the kernel, then fails with EIO, and no
    /// completion is ever handed back (a ring that stopped working).
    always_fail: bool,
    /// Each reap also yields a completion of an earlier batch.
    replay_stale: bool,
    /// The I/O priority field of every SQE pushed.
    ioprios: Vec<u16>,
    /// The first wait that finds it hands its reads to the kernel, then
    /// blocks until it is released (a batch held on a busy drive).
    gate: Option<mpsc::Receiver<()>>,
    /// Set once a wait is held at the gate.
    held: bool,
    waits: u64,
    pushes: u64,
    /// User data of the batch before the current one.
    earlier: Vec<u64>,
    current: Vec<u64>,
}

struct FaultyRing {
    ring: IoUring,
    script: Arc<Mutex<Script>>,
}

impl Ring for FaultyRing {
    unsafe fn push(&mut self, entry: &squeue::Entry) -> bool {
        let mut s = self.script.lock();
        s.pushes += 1;
        if s.full_every.is_some_and(|n| s.pushes.is_multiple_of(n)) {
            return false;
        }
        // SAFETY: forwarded from the caller.
        let ok = unsafe { self.ring.submission().push(entry) }.is_ok();
        let ud = entry.get_user_data();
        s.ioprios.push(sqe_ioprio(entry));
        if s.current.first().is_some_and(|&c| c >> 32 != ud >> 32) {
            s.earlier = std::mem::take(&mut s.current);
        }
        s.current.push(ud);
        ok
    }

    fn submit_and_wait(&mut self, want: usize) -> std::io::Result<usize> {
        let gate = self.script.lock().gate.take();
        if let Some(gate) = gate {
            self.ring.submit()?;
            self.script.lock().held = true;
            let _ = gate.recv();
        }
        let mut s = self.script.lock();
        s.waits += 1;
        let interrupted = s.interrupt_every.is_some_and(|n| s.waits.is_multiple_of(n));
        if s.always_fail || interrupted {
            // The reads really go to the kernel: they are in flight while
            // the caller sees the error.
            self.ring.submit()?;
            let errno = if s.always_fail {
                libc::EIO
            } else {
                libc::EINTR
            };
            return Err(std::io::Error::from_raw_os_error(errno));
        }
        self.ring.submit_and_wait(want)
    }

    fn reap(&mut self, into: &mut Vec<(u64, i32)>) {
        let s = self.script.lock();
        if s.always_fail {
            return;
        }
        if s.replay_stale
            && let Some(&old) = s.earlier.first()
        {
            // A full page's worth, as if an earlier read had just landed.
            into.push((old, pages::PAGE as i32));
        }
        into.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
    }
}

/// The `ioprio` field of an SQE: bytes 2..4 of the kernel's
/// `struct io_uring_sqe` (the io-uring crate keeps it private).
fn sqe_ioprio(entry: &squeue::Entry) -> u16 {
    const SQE: usize = 64;
    assert_eq!(size_of::<squeue::Entry>(), SQE);
    // SAFETY: `Entry` is `repr(C)` around the 64-byte kernel SQE; reading
    // its bytes reads initialized plain data.
    let bytes: &[u8; SQE] = unsafe { &*(entry as *const squeue::Entry).cast::<[u8; SQE]>() };
    u16::from_le_bytes([bytes[2], bytes[3]])
}

fn faulty(script: Script) -> (RingFactory, Arc<Mutex<Script>>) {
    let script = Arc::new(Mutex::new(script));
    (faulty_with(&script), script)
}

/// Rings that all follow `script`.
fn faulty_with(script: &Arc<Mutex<Script>>) -> RingFactory {
    let shared = Arc::clone(script);
    Box::new(move || {
        Ok(Box::new(FaultyRing {
            ring: IoUring::new(MAX_IN_FLIGHT as u32)?,
            script: Arc::clone(&shared),
        }) as Box<dyn Ring>)
    })
}

fn open(path: &Path, digest: TableDigest, io: SsdIo, rings: RingFactory) -> SsdReader {
    let opts = SsdOptions {
        io,
        ..SsdOptions::default()
    };
    SsdReader::open_with(path, pin(digest), false, opts, rings).expect("open")
}

fn random_rows(rng: &mut SplitMix64, n: usize) -> Vec<u64> {
    (0..n).map(|_| rng.below(ROWS)).collect()
}

/// Read `batches` random batches (one prefill-sized), checking every row.
fn read_and_check(r: &mut SsdReader, batches: usize) {
    let mut rng = SplitMix64::new(batches as u64);
    for b in 0..batches {
        let n = if b == 0 { 600 } else { 24 };
        let rows = random_rows(&mut rng, n);
        let mut out = vec![0u8; n * ROW_BYTES];
        r.read(&rows, &mut out).expect("read");
        assert_eq!(first_mismatch(SEED, 1, &rows, &out), None, "batch {b}");
    }
}

#[test]
fn interrupted_waits_and_a_full_queue_never_return_a_wrong_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = table(dir.path());
    let (rings, script) = faulty(Script {
        interrupt_every: Some(2),
        full_every: Some(7),
        ..Script::default()
    });
    let mut r = open(&path, digest, SsdIo::Uring, rings);
    read_and_check(&mut r, 300);
    let stats = r.ring_stats();
    assert!(stats.interrupted > 100, "{stats:?}");
    assert_eq!(stats.resets, 0, "EINTR and a full queue are retried");
    assert_eq!(r.engine(), SsdEngine::Uring);
    assert!(script.lock().pushes > 300 * 24);
}

#[test]
fn completions_of_an_earlier_batch_are_never_taken_for_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = table(dir.path());
    let (rings, _) = faulty(Script {
        replay_stale: true,
        ..Script::default()
    });
    let mut r = open(&path, digest, SsdIo::Uring, rings);
    read_and_check(&mut r, 200);
    assert!(r.ring_stats().stale > 100, "{:?}", r.ring_stats());
}

#[test]
fn a_ring_that_keeps_failing_is_given_up_and_the_next_batches_are_right() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = table(dir.path());
    let (rings, script) = faulty(Script {
        always_fail: true,
        ..Script::default()
    });
    let mut r = open(&path, digest, SsdIo::Uring, rings);
    let rows: Vec<u64> = (0..24).map(|i| i * 400).collect();
    let mut out = vec![0u8; rows.len() * ROW_BYTES];
    for i in 0..MAX_RESETS {
        out.fill(0);
        let e = r.read(&rows, &mut out).expect_err("the ring fails");
        assert!(matches!(e, SourceError::Failed(_)), "{e}");
        assert_eq!(r.ring_stats().resets, i + 1);
    }
    // Given up on: the pread pool reads from now on, and reads right.
    assert_eq!(r.engine(), SsdEngine::Pread);
    assert!(script.lock().waits >= u64::from(MAX_RESETS) * 3);
    read_and_check(&mut r, 100);
}

#[test]
fn a_page_flipped_on_disk_is_never_used_by_either_engine() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = table(dir.path());
    for io in [SsdIo::Uring, SsdIo::Pread] {
        let mut r = open(&path, digest, io, Box::new(uring::real_ring));
        assert!(r.checks_pages());
        let layout = TableFile::open(&path).expect("open").layout;
        // Row 15 * 40 + 3 lives in page 40; flip a byte of its neighbour row.
        let victim = 15 * 40 + 3;
        let (offset, in_page) = layout.row_page(victim + 1).expect("row");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open rw");
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, offset + in_page as u64 + 5)
            .expect("read");
        f.write_all_at(&[b[0] ^ 0x01], offset + in_page as u64 + 5)
            .expect("flip");
        f.sync_all().expect("sync");
        let rows = [7, victim, 15 * 90];
        let mut out = vec![0u8; rows.len() * ROW_BYTES];
        let e = r.read(&rows, &mut out).expect_err("corrupt page");
        assert!(matches!(e, SourceError::Corrupt(_)), "{io:?}: {e}");
        assert!(e.to_string().contains("page 40"), "{e}");
        assert_eq!(r.checksum_failures(), 1);
        // Rows of other pages still read right.
        let rows = [7, 15 * 90, 15 * 41];
        let mut out = vec![0u8; rows.len() * ROW_BYTES];
        r.read(&rows, &mut out).expect("other pages");
        assert_eq!(first_mismatch(SEED, 1, &rows, &out), None);
        f.write_all_at(&b, offset + in_page as u64 + 5)
            .expect("restore");
        f.sync_all().expect("sync");
    }
}

#[test]
fn a_copy_without_page_checksums_still_reads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = table(dir.path());
    engram_store::table_file::remove_page_sums(&path).expect("strip");
    let mut r = open(&path, digest, SsdIo::Auto, Box::new(uring::real_ring));
    assert!(!r.checks_pages());
    read_and_check(&mut r, 50);
}

#[test]
fn every_io_uring_read_carries_the_configured_priority() {
    use cluster_config::{IoClass, SsdIoprio};
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = table(dir.path());
    let rt = SsdIoprio::DEFAULT;
    let be = SsdIoprio {
        class: IoClass::BestEffort,
        level: 6,
    };
    // Real-time where this process may use it (root, CAP_SYS_NICE), else
    // the documented fall-back to best-effort at the same level.
    let rt_or_be = if ioprio::permitted(rt) {
        rt
    } else {
        SsdIoprio {
            class: IoClass::BestEffort,
            level: rt.level,
        }
    };
    for (wanted, got) in [(be, be), (rt, rt_or_be)] {
        let (rings, script) = faulty(Script::default());
        let opts = SsdOptions {
            io: SsdIo::Uring,
            ioprio: wanted,
            ..SsdOptions::default()
        };
        let mut r = SsdReader::open_with(&path, pin(digest), false, opts, rings).expect("open");
        assert_eq!(r.ioprio(), got);
        read_and_check(&mut r, 20);
        let seen = std::mem::take(&mut script.lock().ioprios);
        assert!(seen.len() >= 20 * 24);
        assert!(
            seen.iter().all(|&p| p == ioprio::value(got)),
            "{wanted}: SQE priorities {:?}",
            &seen[..4]
        );
    }
}

#[test]
fn every_pread_thread_has_the_configured_priority() {
    use cluster_config::{IoClass, SsdIoprio};
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = table(dir.path());
    for wanted in [
        SsdIoprio::DEFAULT,
        SsdIoprio {
            class: IoClass::Idle,
            level: 0,
        },
    ] {
        let opts = SsdOptions {
            io: SsdIo::Pread,
            pread_threads: 6,
            ioprio: wanted,
            ..SsdOptions::default()
        };
        let mut r = SsdReader::open(&path, pin(digest), false, opts).expect("open");
        let tids = r.pread_thread_ids();
        assert_eq!(tids.len(), 6);
        for tid in tids {
            let p = ioprio::of_thread(tid).expect("ioprio_get");
            assert_eq!(p, ioprio::value(r.ioprio()), "thread {tid} ({wanted})");
        }
        read_and_check(&mut r, 10);
    }
}

/// A source of [`READERS`] io_uring readers whose next batch a gate holds
/// mid-read (the script says when it is held) until `release` is sent.
fn gated_source(
    path: &Path,
    digest: TableDigest,
) -> (SsdSource, Arc<Mutex<Script>>, mpsc::Sender<()>) {
    let (release, gate) = mpsc::channel();
    let script = Arc::new(Mutex::new(Script {
        gate: Some(gate),
        ..Script::default()
    }));
    let readers = (0..READERS)
        .map(|_| {
            let opts = SsdOptions {
                io: SsdIo::Uring,
                ..SsdOptions::default()
            };
            SsdReader::open_with(path, pin(digest), false, opts, faulty_with(&script))
                .expect("open")
        })
        .collect();
    let src = SsdSource::with_readers(1, readers, Family::default()).expect("source");
    (src, script, release)
}

#[tokio::test]
async fn a_lookup_does_not_wait_for_a_batch_held_on_a_busy_drive() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = table(dir.path());
    let (src, script, release) = gated_source(&path, digest);
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    let (rows_a, rows_b) = ([1u64, 2, 3], [400u64, 500, 600]);
    let (out_a, out_b) = (vec![0u8; 3 * ROW_BYTES], vec![0u8; 3 * ROW_BYTES]);
    let mut a = Box::pin(src.fetch(1, &rows_a, out_a, deadline));
    // A is queued and taken by a reader, which the gate holds mid-batch.
    let short = std::time::Duration::from_millis(5);
    while !script.lock().held {
        assert!(
            tokio::time::timeout(short, &mut a).await.is_err(),
            "A ended"
        );
    }
    // B is read by another reader while A's batch is still held.
    let (res, out_b) = src.fetch(1, &rows_b, out_b, deadline).await;
    res.expect("B is not stuck behind A");
    assert_eq!(first_mismatch(SEED, 1, &rows_b, &out_b), None);
    release.send(()).expect("release A");
    let (res, out_a) = a.await;
    res.expect("A");
    assert_eq!(first_mismatch(SEED, 1, &rows_a, &out_a), None);
}

#[tokio::test]
async fn a_lookup_dropped_mid_read_leaves_the_next_ones_right() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = table(dir.path());
    let (src, script, release) = gated_source(&path, digest);
    let src = Arc::new(src);
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    let rows_a = [1u64, 2, 3];
    let mut a = Box::pin(src.fetch(1, &rows_a, vec![0u8; 3 * ROW_BYTES], deadline));
    let short = std::time::Duration::from_millis(5);
    while !script.lock().held {
        assert!(
            tokio::time::timeout(short, &mut a).await.is_err(),
            "A ended"
        );
    }
    // The caller gives up on A while its batch is held mid-read.
    drop(a);
    release.send(()).expect("release A");
    // Lookups after it, through the router's way in (completions reused),
    // each get exactly their own rows.
    let mut slot = crate::source::empty_slot();
    for k in 0..50u64 {
        let rows: Vec<u64> = (0..24).map(|i| (k * 97 + i * 13) % 1000).collect();
        let job = FetchJob {
            table: 1,
            rows: rows.clone(),
            buf: vec![0u8; 24 * ROW_BYTES],
            deadline,
        };
        Arc::clone(&src).fetch_job(job, &mut slot);
        let (res, job) = std::future::poll_fn(|cx| slot.poll(cx)).await;
        res.expect("fetch");
        assert_eq!(job.rows, rows);
        assert_eq!(first_mismatch(SEED, 1, &rows, &job.buf), None, "lookup {k}");
    }
}
