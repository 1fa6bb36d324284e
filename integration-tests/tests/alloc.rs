//! Heap allocations per 24-row lookup through the node's router, counted
//! by a counting global allocator, in the steady state (after a warm-up):
//! from local RAM, from the SSD copy and from a donor process over TCP.
//! Each count is held to its ceiling, so the hot path does not grow
//! allocations unnoticed (docs/node.md, "Allocations per lookup").

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

const ROWS: u64 = 30_000;
const SEED: u64 = 5;
const WARM: usize = 300;
const COUNTED: usize = 2_000;

fn write_config(dir: &Path, table: &Path, digest: TableDigest, port: u16) -> Config {
    let text = format!(
        "version = 1\n[rack]\nname = \"t\"\n\
         [[table]]\nid = 1\nlayer = 1\npath = \"{}\"\nrows = {ROWS}\ndigest = \"{digest}\"\n\
         [[donor]]\nname = \"d\"\nlisten = [\"127.0.0.1:{port}\"]\ntables = [1]\nram_gib = 1.0\n\
         [[node]]\nname = \"donor\"\nlookup_timeout_ms = 2000\ntokens_per_second = 1\n\
         [[node.route]]\ntable = 1\nsources = [\"d\"]\nhedge = \"off\"\n\
         [[node]]\nname = \"ssd\"\nlookup_timeout_ms = 2000\ntokens_per_second = 1\n\
         [[node.route]]\ntable = 1\nsources = [\"ssd\"]\nhedge = \"off\"\n\
         [[node]]\nname = \"local\"\nlookup_timeout_ms = 2000\ntokens_per_second = 1\n\
         [[node.route]]\ntable = 1\nsources = [\"local\"]\nhedge = \"off\"\n",
        table.display()
    );
    let path = dir.join("rack.toml");
    std::fs::write(&path, text).expect("config");
    Config::load(&path).expect("valid config")
}

/// Allocations per lookup of node `node`'s router, in the steady state.
fn per_lookup(config: &Config, node: &str) -> f64 {
    // One thread runs every task; the SSD copy's reader threads and the
    // timer thread count too (they are part of a lookup's cost).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let metrics = NodeMetrics::new();
        let mem = Memory::from_config(config, node, &metrics)
            .await
            .expect("memory");
        let router = mem.router(1).expect("router");
        let mut rng = SplitMix64::new(3);
        let lookups: Vec<Vec<u64>> = (0..WARM + COUNTED)
            .map(|_| (0..24).map(|_| rng.below(ROWS)).collect())
            .collect();
        let mut out = vec![0u8; 24 * ROW_BYTES];
        let mut counted = 0;
        for (i, rows) in lookups.iter().enumerate() {
            if i == WARM {
                counted = ALLOCS.load(Ordering::Relaxed);
            }
            let f = router.fetch(rows, &mut out).await.expect("fetch");
            assert!(!f.is_zeros());
        }
        let n = ALLOCS.load(Ordering::Relaxed) - counted;
        let last = lookups.last().expect("lookups");
        assert_eq!(first_mismatch(SEED, 1, last, &out), None, "wrong rows");
        n as f64 / COUNTED as f64
    })
}

#[test]
fn allocations_per_lookup_stay_within_their_measured_ceilings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let config = write_config(dir.path(), &table, digest, port);
    let _d = DonorProcess::start(&[
        "--config",
        &config.path.display().to_string(),
        "--name",
        "d",
    ])
    .expect("donor starts");
    let local = per_lookup(&config, "local");
    let ssd = per_lookup(&config, "ssd");
    let donor = per_lookup(&config, "donor");
    eprintln!("allocations per 24-row lookup: local {local:.2}, ssd {ssd:.2}, donor {donor:.2}");
    for (name, got, ceiling) in [
        ("local RAM", local, CEILINGS[0]),
        ("the SSD copy", ssd, CEILINGS[1]),
        ("a donor", donor, CEILINGS[2]),
    ] {
        assert!(
            got <= ceiling,
            "{got:.2} allocations per lookup from {name}, over its ceiling of {ceiling}"
        );
    }
}

/// The ceilings (local RAM, SSD copy, donor), allocations per lookup: what
/// is left is the source's boxed future (every source), the answer's
/// one-shot channel (SSD copy, donor) and a block of the SSD job queue
/// every 31 jobs; a little room for the runtime's own (2,000 lookups).
/// Before the router kept its attempts inline and sources handed buffers
/// back: 9, 12.03 and 11.
const CEILINGS: [f64; 3] = [1.05, 2.1, 2.05];
