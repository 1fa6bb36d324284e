//! Heap allocations per 24-row lookup through the node's router, counted
//! by a counting global allocator, in the steady state (after a warm-up):
//! from local RAM, from the SSD copy and from a donor process over TCP
//! and over TLS (its records opened and sealed in place), on a runtime of one thread and on one of two workers. Each must be
//! zero, so the hot path does not grow allocations unnoticed (docs/node.md,
//! "Allocations per lookup").

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use cluster_config::Config;
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{ROW_BYTES, TableDigest};
use inference_node::memory::Memory;
use inference_node::metrics::NodeMetrics;
use integration_tests::{DonorProcess, gen_table};

/// Counts every allocation and reallocation, on any thread.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The count is the process's: one test counts at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

const ROWS: u64 = 30_000;
const SEED: u64 = 5;
const WARM: usize = 300;
const COUNTED: usize = 2_000;

fn write_config(dir: &Path, table: &Path, digest: TableDigest, ports: [u16; 2]) -> Config {
    let [tcp, tls] = ports;
    let text = format!(
        "version = 1\n[rack]\nname = \"t\"\n[rack.tls]\n\
         [[table]]\nid = 1\nlayer = 1\npath = \"{}\"\nrows = {ROWS}\ndigest = \"{digest}\"\n\
         [[donor]]\nname = \"d\"\nlisten = [\"tcp://127.0.0.1:{tcp}\", \"tls://127.0.0.1:{tls}\"]\n\
         tables = [1]\nram_gib = 1.0\nclients = [\"donor\", \"tls\"]\n\
         [[node]]\nname = \"donor\"\nlookup_timeout_ms = 2000\ntokens_per_second = 1\n\
         [[node.route]]\ntable = 1\nsources = [\"d\"]\nhedge = \"off\"\n\
         [[node.link]]\ndonor = \"d\"\ntransport = \"tcp\"\n\
         [[node]]\nname = \"tls\"\nlookup_timeout_ms = 2000\ntokens_per_second = 1\n\
         [[node.route]]\ntable = 1\nsources = [\"d\"]\nhedge = \"off\"\n\
         [[node.link]]\ndonor = \"d\"\ntransport = \"tls\"\n\
         [[node]]\nname = \"ssd\"\nlookup_timeout_ms = 2000\ntokens_per_second = 1\n\
         [[node.route]]\ntable = 1\nsources = [\"ssd\"]\nhedge = \"off\"\n\
         [[node]]\nname = \"local\"\nlookup_timeout_ms = 2000\ntokens_per_second = 1\n\
         [[node.route]]\ntable = 1\nsources = [\"local\"]\nhedge = \"off\"\n",
        table.display()
    );
    let path = dir.join("rack.toml");
    std::fs::write(&path, text).expect("config");
    integration_tests::rack_pki(&path).expect("rack PKI");
    Config::load(&path).expect("valid config")
}

/// Allocations in `counted` lookups of node `node`'s router, in the steady state, on
/// a runtime of one thread (`workers` 0) or of `workers` threads (as the
/// node runs). The SSD copy's reader threads and the timer thread count
/// too (they are part of a lookup's cost).
fn allocations(config: &Config, node: &str, workers: usize, counted: usize) -> u64 {
    let rt = match workers {
        0 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
    }
    .enable_all()
    .build()
    .expect("runtime");
    rt.block_on(async {
        let metrics = NodeMetrics::new();
        let mem = Memory::from_config(config, node, &metrics)
            .await
            .expect("memory");
        let router = mem.router(1).expect("router");
        // The node's background tasks (each source's probe and tend
        // loops) allocate their timers when they first run, which on a
        // loaded machine can be late: let them start before counting.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let mut rng = SplitMix64::new(3);
        let lookups: Vec<Vec<u64>> = (0..WARM + counted)
            .map(|_| (0..24).map(|_| rng.below(ROWS)).collect())
            .collect();
        // Every other lookup copies into a slice (`fetch`); the others take
        // the source's buffer itself (`fetch_vec`).
        let mut out = vec![0u8; 24 * ROW_BYTES];
        let mut taken = Vec::new();
        let mut counted = 0;
        for (i, rows) in lookups.iter().enumerate() {
            if i == WARM {
                counted = ALLOCS.load(Ordering::Relaxed);
            }
            let f = if i % 2 == 0 {
                router.fetch(rows, &mut out).await
            } else {
                router.fetch_vec(rows, &mut taken).await
            };
            assert!(!f.expect("fetch").is_zeros());
        }
        let n = ALLOCS.load(Ordering::Relaxed) - counted;
        let n_all = lookups.len();
        for (rows, bytes) in [(&lookups[n_all - 2], &out), (&lookups[n_all - 1], &taken)] {
            assert_eq!(first_mismatch(SEED, 1, rows, bytes), None, "wrong rows");
        }
        n
    })
}

#[test]
fn lookups_allocate_nothing_in_the_steady_state() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port()
    };
    let config = write_config(dir.path(), &table, digest, [port(), port()]);
    let _d = DonorProcess::start(&[
        "--config",
        &config.path.display().to_string(),
        "--name",
        "d",
    ])
    .expect("donor starts");
    for (workers, runtime) in [(0, "one thread"), (2, "two worker threads")] {
        let counts: Vec<(&str, u64)> = [
            ("local RAM", "local"),
            ("the SSD copy", "ssd"),
            ("a donor", "donor"),
            ("a donor over TLS", "tls"),
        ]
        .into_iter()
        .map(|(name, node)| (name, allocations(&config, node, workers, COUNTED)))
        .collect();
        let shown: Vec<String> = counts
            .iter()
            .map(|(name, n)| {
                format!(
                    "{name} {:.4} ({n} in {COUNTED})",
                    *n as f64 / COUNTED as f64
                )
            })
            .collect();
        eprintln!(
            "allocations per 24-row lookup, runtime of {runtime}: {}",
            shown.join(", ")
        );
        for (name, n) in counts {
            assert_eq!(
                n, 0,
                "{n} allocations in {COUNTED} lookups from {name} (runtime of {runtime}): the steady state allocates nothing"
            );
        }
    }
}

/// The donor's serving stack in this process, on a runtime of its own (its
/// connections run on threads of their own either way).
fn in_process_donor(config: &Config, table: &Path) -> (tokio::runtime::Runtime, impl Drop) {
    use memory_donor::server::{self, Shared};
    use memory_donor::tls::{Access, DonorTls};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let spec = memory_donor::serve::ServeSpec::from_config(config, "d").expect("spec");
    let (t, _) = engram_store::resident::ResidentTable::load(
        1,
        table,
        None,
        true,
        engram_store::resident::MlockMode::Off,
        |_| None,
    )
    .expect("table");
    let shared = Shared::new(spec.server.clone(), vec![t]);
    let (files, _) = spec.tls.as_ref().expect("the rack has a PKI");
    shared.set_tls(DonorTls::load(files, Access::from_config(config, "d")).expect("tls"));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    rt.block_on(async {
        let mut listeners = Vec::new();
        for e in &spec.listen {
            let l = tokio::net::TcpListener::bind(e.addr).await.expect("bind");
            listeners.push(match e.transport {
                cluster_config::Transport::Tls => server::Listener::Tls(l),
                _ => server::Listener::Tcp(l),
            });
        }
        tokio::spawn(server::run(listeners, shared, async move {
            let _ = rx.await;
        }));
    });
    struct Stop(Option<tokio::sync::oneshot::Sender<()>>);
    impl Drop for Stop {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }
    (rt, Stop(Some(tx)))
}

/// The donor's side of a lookup allocates nothing either: with the donor
/// in this process, every allocation of the lookup's both ends is counted.
/// The donor re-checks its TLS sessions once a second (a background sweep
/// that allocates), so a count is taken over a window much shorter than
/// that, up to five times; an allocation per lookup would show in every
/// one.
#[test]
fn a_donor_answers_lookups_over_tcp_and_tls_without_allocating() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let config = write_config(
        dir.path(),
        &table,
        digest,
        [
            integration_tests::free_port().expect("port"),
            integration_tests::free_port().expect("port"),
        ],
    );
    let (_rt, _stop) = in_process_donor(&config, &table);
    for (name, node) in [("TCP", "donor"), ("TLS", "tls")] {
        let counts: Vec<u64> = (0..5)
            .map(|_| allocations(&config, node, 2, 500))
            .take_while(|&n| n > 0)
            .collect();
        eprintln!(
            "allocations in 500 lookups over {name}, both ends in one process: {counts:?} (then 0)"
        );
        assert!(
            counts.len() < 5,
            "the node and the donor allocate in every window of 500 lookups over {name}: {counts:?}"
        );
    }
}
