//! Heap allocations in the steady state (after a warm-up), counted by a
//! counting global allocator:
//! - per 24-row lookup through the node's router, from local RAM, from the
//!   SSD copy and from a donor process over TCP and over TLS (its records
//!   opened and sealed in place), on a runtime of one thread and on one of
//!   two workers; and on the donor's side, with the donor in this process;
//! - per step of the node's model loop, from each of those sources; over
//!   QUIC, against quinn alone moving the same bytes.
//!
//! Each must be zero (QUIC: no more than quinn's own), so the hot path does
//! not grow allocations unnoticed (docs/node.md, "Allocations per lookup"
//! and "Allocations per token").

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use cluster_config::Config;
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{ROW_BYTES, TableDigest};
use inference_node::memory::Routers;
use inference_node::metrics::NodeMetrics;
use rack_harness::rack_toml::{
    DonorEntry, LinkEntry, ModelSection, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
};
use rack_harness::{DonorProcess, gen_table};

/// Counts every allocation and reallocation, on any thread but those
/// marked [`UNCOUNTED`].
struct Counting;

fn count() {
    if !UNCOUNTED.with(std::cell::Cell::get) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The count is the process's: one test counts at a time.
static ONE_AT_A_TIME: engram_sync::Mutex<()> = engram_sync::Mutex::new(());

fn one_at_a_time() -> engram_sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock()
}

const ROWS: u64 = 30_000;
const SEED: u64 = 5;
const WARM: usize = 300;
const COUNTED: usize = 2_000;

fn write_config(dir: &Path, table: &Path, digest: TableDigest, ports: [u16; 2]) -> Config {
    let [tcp, tls] = ports;
    let node = |name: &str, source: &str, link: Option<&str>| NodeEntry {
        lookup_timeout_ms: Some(2000),
        tokens_per_second: Some(1.0),
        link: link.map(|t| LinkEntry::new("d", t)).into_iter().collect(),
        ..NodeEntry::new(name, vec![RouteEntry::new(1, [source]).hedge("off")])
    };
    let mut rack = RackToml::new("t");
    rack.rack.tls = Some(TlsSection::default());
    rack.table = vec![TableEntry::new(1, table, ROWS, digest)];
    let listen = [
        format!("tcp://127.0.0.1:{tcp}"),
        format!("tls://127.0.0.1:{tls}"),
    ];
    rack.donor = vec![DonorEntry {
        clients: Some(vec!["donor".into(), "tls".into()]),
        ..DonorEntry::new("d", listen, [1])
    }];
    rack.node = vec![
        node("donor", "d", Some("tcp")),
        node("tls", "d", Some("tls")),
        node("ssd", "ssd", None),
        node("local", "local", None),
    ];
    let path = dir.join("rack.toml");
    rack.write(&path).expect("config");
    rack_harness::rack_pki(&path).expect("rack PKI");
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
        let mem = Routers::from_config(config, node, &metrics)
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
    let port = || rack_harness::free_port().expect("port");
    let config = write_config(dir.path(), &table, digest, [port(), port()]);
    let _d = donor_d(&config);
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
    let spec = memory_donor::spec::ServeSpec::from_config(config, "d").expect("spec");
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
            rack_harness::free_port().expect("port"),
            rack_harness::free_port().expect("port"),
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

/// Donor `d` of `config`, in a process of its own.
fn donor_d(config: &Config) -> DonorProcess {
    DonorProcess::serving(&config.path, "d").expect("donor starts")
}

/// Steps of the model loop before counting, and counted.
const LOOP_WARM: u64 = 200;
const LOOP_COUNTED: u64 = 600;
/// The loop's rate: fast, so the test is short, and slow enough that a
/// step's rows are in before its block on a loaded machine.
const LOOP_RATE: f64 = 1000.0;

/// Two tables (layers 1 and 14) sized for the `[model]` hashing, a donor
/// serving both over TCP and TLS, and a node per source: `donor` (TCP),
/// `tls`, `ssd` and `local`, each with the default hedging.
fn write_model_config(dir: &Path) -> Config {
    use rack_harness::{MODEL_BASE, MODEL_SEED, free_port, gen_hashed_table};
    let params = engram_protocol::hashing::HashParams::new(
        engram_protocol::hashing::Preset::from_base(MODEL_BASE).expect("preset"),
    )
    .expect("params");
    let (l1, d1) = gen_hashed_table(dir, "l1.etab", 1, MODEL_BASE, MODEL_SEED).expect("gen");
    let (l14, d14) = gen_hashed_table(dir, "l14.etab", 14, MODEL_BASE, MODEL_SEED).expect("gen");
    let [r1, r14] = [params.layers[0].rows, params.layers[1].rows];
    let node = |name: &str, source: &str, link: Option<&str>| NodeEntry {
        lookup_timeout_ms: Some(2000),
        tokens_per_second: Some(50.0),
        link: link.map(|t| LinkEntry::new("d", t)).into_iter().collect(),
        ..NodeEntry::new(
            name,
            vec![
                RouteEntry::new(1, [source]).ssd_path(&l1),
                RouteEntry::new(14, [source]).ssd_path(&l14),
            ],
        )
    };
    let mut rack = RackToml::new("t");
    rack.rack.tls = Some(TlsSection::default());
    rack.table = vec![
        TableEntry::new(1, &l1, r1, d1),
        TableEntry::new(14, &l14, r14, d14),
    ];
    let port = || free_port().expect("port");
    let listen = [
        format!("tcp://127.0.0.1:{}", port()),
        format!("tls://127.0.0.1:{}", port()),
        format!("quic://127.0.0.1:{}", port()),
    ];
    rack.donor = vec![DonorEntry {
        clients: Some(vec!["donor".into(), "tls".into(), "quic".into()]),
        ..DonorEntry::new("d", listen, [1, 14])
    }];
    rack.node = vec![
        node("donor", "d", Some("tcp")),
        node("tls", "d", Some("tls")),
        node("quic", "d", Some("quic")),
        node("ssd", "ssd", None),
        node("local", "local", None),
    ];
    rack.model = Some(ModelSection::synthetic(MODEL_BASE, 3, 8, 2));
    let path = dir.join("rack.toml");
    rack.write(&path).expect("config");
    rack_harness::rack_pki(&path).expect("rack PKI");
    Config::load(&path).expect("valid config")
}

/// Allocations in [`LOOP_COUNTED`] steps of node `node`'s model loop (as
/// `inference-node run` runs it: its fetches on a runtime of two worker
/// threads, the warm-up before each step on), after [`LOOP_WARM`] steps:
/// the loop's thread, the runtime's and the SSD copy's readers all count.
/// Every step must have been served by `source`. `warm`: the loop's
/// warm-up before each step (a Ping to each table's first donor) on, as by
/// default.
fn loop_allocations(config: &Config, node: &str, source: &str, warm: bool) -> u64 {
    use inference_node::model::node::{Backbone, InputChoice, NodeModel};
    use inference_node::model::{LoopSpec, StepRecord};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let metrics = NodeMetrics::new();
    let mut nm = rt
        .block_on(NodeModel::from_config(
            config,
            node,
            Some(LOOP_RATE),
            &metrics,
        ))
        .expect("node");
    // The background tasks' first timers (see `allocations`).
    std::thread::sleep(std::time::Duration::from_millis(200));
    let steps = LOOP_WARM + LOOP_COUNTED;
    let tokens = nm
        .tokens(&InputChoice::Builtin, steps as usize)
        .expect("tokens");
    let spec = LoopSpec {
        tokens_per_second: LOOP_RATE,
        max_tokens: Some(steps),
        warm_lead: if warm {
            inference_node::model::DEFAULT_WARM_LEAD
        } else {
            std::time::Duration::ZERO
        },
        ..LoopSpec::default()
    };
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (mut seen, mut from, mut counted) = (0, 0, None);
    let mut on_step = |rec: &StepRecord| {
        seen += 1;
        if seen == LOOP_WARM {
            from = ALLOCS.load(Ordering::Relaxed);
        }
        if seen == steps {
            counted = Some(ALLOCS.load(Ordering::Relaxed) - from);
        }
        for t in &rec.tables {
            assert_eq!(
                t.source.as_deref(),
                Some(source),
                "step {} of node {node}: {t:?}",
                rec.step
            );
        }
        Ok(())
    };
    let summary = nm
        .run(
            rt.handle().clone(),
            &tokens,
            &spec,
            Backbone::Cpu,
            &stop,
            &mut on_step,
        )
        .expect("run");
    assert_eq!(summary.failed_steps, 0, "{}", summary.render());
    counted.expect("every step ran")
}

#[test]
fn the_model_loop_allocates_nothing_per_token() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write_model_config(dir.path());
    let _d = donor_d(&config);
    let counts: Vec<(&str, u64)> = [
        ("local RAM", "local", "local"),
        ("the SSD copy", "ssd", "ssd"),
        ("a donor over TCP", "donor", "d"),
        ("a donor over TLS", "tls", "d"),
    ]
    .into_iter()
    .map(|(name, node, source)| (name, loop_allocations(&config, node, source, true)))
    .collect();
    let shown: Vec<String> = counts
        .iter()
        .map(|(name, n)| format!("{name} {n} in {LOOP_COUNTED} steps"))
        .collect();
    eprintln!("allocations of the model loop: {}", shown.join(", "));
    // QUIC: quinn allocates per datagram; the loop over QUIC is held to
    // quinn alone moving the same bytes (two 24-row lookups a step, the
    // warm-up's Pings off so that each step is exactly those).
    let quic = loop_allocations(&config, "quic", "d", true);
    let quic_lookups = loop_allocations(&config, "quic", "d", false);
    let floor_trips = 2_000;
    let floor = quinn_allocations(
        engram_protocol::HEADER_LEN + 16 + 24 * 8,
        engram_protocol::HEADER_LEN + 8 + 24 * ROW_BYTES,
        floor_trips,
    );
    let per_lookup = quic_lookups as f64 / (2 * LOOP_COUNTED) as f64;
    let per_trip = floor as f64 / floor_trips as f64;
    eprintln!(
        "over QUIC: {quic} allocations in {LOOP_COUNTED} steps with the warm-up, \
         {quic_lookups} without ({per_lookup:.2} per lookup); quinn alone: {per_trip:.2} per round trip of the same bytes"
    );
    // What quinn allocates per datagram varies with its acknowledgements'
    // timing: a quarter's margin.
    assert!(
        per_lookup <= per_trip * 1.25,
        "a lookup over QUIC allocates {per_lookup:.2} times, quinn alone {per_trip:.2} per round trip: \
         the loop's own share must be nothing"
    );
    for (name, n) in counts {
        assert_eq!(
            n, 0,
            "{n} allocations in {LOOP_COUNTED} steps of the model loop from {name}: a step in the steady state allocates nothing"
        );
    }
}

thread_local! {
    /// Set on threads whose allocations are not counted (a peer in this
    /// process standing for another host).
    static UNCOUNTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// quinn alone, the floor under a lookup over QUIC: heap allocations of
/// one side in `counted` round trips on one bidirectional stream (a
/// `req`-byte request, a `resp`-byte answer; quinn's defaults, a runtime of
/// two worker threads as the node's), after a warm-up; the echoing side
/// runs on a thread whose allocations are not counted.
fn quinn_allocations(req: usize, resp: usize, counted: usize) -> u64 {
    use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    let provider = || std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = rcgen::CertificateParams::new(vec!["floor".to_string()])
        .expect("params")
        .self_signed(&key)
        .expect("cert");
    let der = CertificateDer::from(cert.der().to_vec());
    let tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls 1.3")
        .with_no_client_auth()
        .with_single_cert(
            vec![der.clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .expect("server tls");
    let server = quinn::ServerConfig::with_crypto(std::sync::Arc::new(
        QuicServerConfig::try_from(std::sync::Arc::new(tls)).expect("quic server"),
    ));
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let addr = socket.local_addr().expect("addr");
    std::thread::spawn(move || {
        UNCOUNTED.with(|u| u.set(true));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let endpoint = quinn::Endpoint::new(
                quinn::EndpointConfig::default(),
                Some(server),
                socket,
                std::sync::Arc::new(quinn::TokioRuntime),
            )
            .expect("endpoint");
            let Some(incoming) = endpoint.accept().await else {
                return;
            };
            let Ok(conn) = incoming.await else { return };
            let Ok((mut send, mut recv)) = conn.accept_bi().await else {
                return;
            };
            let (mut buf, answer) = (vec![0u8; req], vec![0x5Au8; resp]);
            while recv.read_exact(&mut buf).await.is_ok() {
                if send.write_all(&answer).await.is_err() {
                    return;
                }
            }
        });
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).expect("root");
        let tls = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("tls 1.3")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let client = quinn::ClientConfig::new(std::sync::Arc::new(
            QuicClientConfig::try_from(std::sync::Arc::new(tls)).expect("quic client"),
        ));
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let endpoint = quinn::Endpoint::new(
            quinn::EndpointConfig::default(),
            None,
            socket,
            std::sync::Arc::new(quinn::TokioRuntime),
        )
        .expect("endpoint");
        let conn = endpoint
            .connect_with(client, addr, "floor")
            .expect("connect")
            .await
            .expect("handshake");
        let (mut send, mut recv) = conn.open_bi().await.expect("stream");
        let (request, mut answer) = (vec![0xA5u8; req], vec![0u8; resp]);
        let mut from = 0;
        for i in 0..WARM + counted {
            if i == WARM {
                from = ALLOCS.load(Ordering::Relaxed);
            }
            send.write_all(&request).await.expect("write");
            recv.read_exact(&mut answer).await.expect("read");
        }
        ALLOCS.load(Ordering::Relaxed) - from
    })
}
