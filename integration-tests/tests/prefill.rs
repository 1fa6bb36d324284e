//! A wide sweep (a prefill) against two real donor processes that hold the
//! same table, over TCP, TLS and QUIC in turn: striped across both, every
//! row the generator's, and one of them killed with SIGKILL, or hung with
//! SIGSTOP, mid-sweep without failing the sweep (its chunks are hedged to
//! the other replica once they miss their share of the hard timeout).

use std::path::Path;
use std::time::{Duration, Instant};

use cluster_config::{Config, Transport};
use engram_protocol::TableDigest;
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use inference_node::memory::Routers;
use inference_node::metrics::NodeMetrics;
use inference_node::model::fetch::fetch_rows;
use rack_harness::rack_toml::{
    DonorEntry, LinkEntry, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
};
use rack_harness::runtime as rt;
use rack_harness::{DonorProcess, gen_table, sample};

const ROWS: u64 = 600_000;
const SWEEP: usize = 400_000;
const SEED: u64 = 9;

/// Donors `a` and `b` on TCP, TLS and QUIC (loopback), both serving the
/// table; nodes `n-tcp`, `n-tls` and `n-quic` route to both, each over the
/// transport its name says. The rack has its PKI.
fn write_config(dir: &Path, table: &Path, digest: TableDigest) -> Config {
    let mut rack = RackToml::new("t");
    rack.rack.tls = Some(TlsSection::default());
    rack.table = vec![TableEntry::new(1, table, ROWS, digest)];
    for name in ["a", "b"] {
        let (tcp, tls, quic) = (port(), port(), port());
        let listen = [
            format!("tcp://127.0.0.1:{tcp}"),
            format!("tls://127.0.0.1:{tls}"),
            format!("quic://127.0.0.1:{quic}"),
        ];
        rack.donor.push(DonorEntry::new(name, listen, [1]));
    }
    for t in TRANSPORTS {
        rack.node.push(NodeEntry {
            probe_interval_ms: Some(100),
            lookup_timeout_ms: Some(2000),
            link: vec![LinkEntry::new("a", t), LinkEntry::new("b", t)],
            ..NodeEntry::new(format!("n-{t}"), vec![RouteEntry::new(1, ["a", "b"])])
        });
    }
    let path = dir.join("rack.toml");
    rack.write(&path).expect("config");
    rack_harness::rack_pki(&path).expect("rack PKI");
    Config::load(&path).expect("valid config")
}

const TRANSPORTS: [Transport; 3] = [Transport::Tcp, Transport::Tls, Transport::Quic];

fn port() -> u16 {
    rack_harness::free_port().expect("free port")
}

fn donor(config: &Config, name: &str) -> DonorProcess {
    let path = config.path.display().to_string();
    DonorProcess::start(&["--config", &path, "--name", name, "--trust-digest"])
        .expect("donor starts")
}

fn sweep_rows() -> Vec<u64> {
    let mut rng = SplitMix64::new(77);
    let mut v: Vec<u64> = (0..SWEEP).map(|_| rng.below(ROWS)).collect();
    v.sort_unstable();
    v.dedup();
    v
}

#[test]
fn a_sweep_is_striped_over_replicas_and_survives_one_killed_mid_sweep_on_every_transport() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let config = write_config(dir.path(), &table, digest);
    let rows = sweep_rows();
    // Over QUIC a killed donor sends no reset (UDP): its chunks in flight
    // are hedged to the other replica at half the hard timeout.
    for t in TRANSPORTS {
        sweep_and_kill(&config, &rows, t, Some(libc::SIGKILL));
    }
}

/// A replica hung mid-sweep (SIGSTOP: its sockets open, nothing answered)
/// costs the sweep a delay, not the sweep: its chunks are hedged to the
/// other replica.
#[test]
fn a_sweep_survives_a_replica_hung_mid_sweep() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let config = write_config(dir.path(), &table, digest);
    sweep_and_kill(&config, &sweep_rows(), Transport::Tls, Some(libc::SIGSTOP));
}

/// Both donors fresh; a sweep over `transport` striped across them, then
/// (`signal`) one killed or stopped mid-sweep, then a sweep over the other
/// alone.
fn sweep_and_kill(config: &Config, rows: &[u64], transport: Transport, signal: Option<i32>) {
    let _a = donor(config, "a");
    let mut b = donor(config, "b");
    let rows = rows.to_vec();
    let node = format!("n-{transport}");
    rt().block_on(async {
        let metrics = std::sync::Arc::new(NodeMetrics::new());
        let mem = Routers::from_config(config, &node, &metrics)
            .await
            .expect("memory");
        let router = mem.router(1).expect("router").clone();
        let cap = engram_protocol::frame::DEFAULT_MAX_ROWS as usize;
        let served = |source: &str| {
            let series =
                format!("engram_node_rows_served_total{{table=\"1\",source=\"{source}\"}}");
            sample(&metrics.render(), &series).unwrap_or(0.0)
        };

        // Both healthy: the sweep is shared between them.
        let f = fetch_rows(&router, &rows, cap).await;
        assert_eq!(f.error, None, "{transport}");
        assert_eq!(
            first_mismatch(SEED, 1, &rows, &f.bytes),
            None,
            "{transport}: wrong rows"
        );
        assert_eq!((f.hedges, f.failovers), (0, 0));
        assert!(f.messages > 4, "{} messages", f.messages);
        let (a0, b0) = (served("a"), served("b"));
        assert_eq!(a0 + b0, rows.len() as f64);
        assert!(
            a0 >= rows.len() as f64 / 4.0 && b0 >= rows.len() as f64 / 4.0,
            "{transport}: striped: a served {a0}, b {b0}"
        );

        let Some(signal) = signal else {
            return;
        };
        // b dies once it has served part of the next sweep.
        let sweep = {
            let (router, rows) = (router.clone(), rows.clone());
            tokio::spawn(async move { fetch_rows(&router, &rows, cap).await })
        };
        let t0 = Instant::now();
        while served("b") == b0 {
            assert!(t0.elapsed() < Duration::from_secs(20), "b never served");
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        b.signal(signal);
        let hit = Instant::now();
        assert!(
            !sweep.is_finished(),
            "the sweep ended before b was signalled"
        );
        let f = sweep.await.expect("sweep task");
        println!(
            "{transport}, signal {signal}: the sweep ended {:?} after b's signal, {} hedges, \
             {} failovers",
            hit.elapsed(),
            f.hedges,
            f.failovers
        );
        assert_eq!(f.error, None, "{transport}: the sweep survives a replica");
        assert_eq!(
            first_mismatch(SEED, 1, &rows, &f.bytes),
            None,
            "{transport}: wrong rows"
        );
        assert!(
            f.failovers + f.hedges >= 1,
            "b's chunks went elsewhere: {} failovers, {} hedges",
            f.failovers,
            f.hedges
        );
        assert_eq!(f.sources.len(), 2, "{:?}", f.sources);

        // And the next sweep goes to a alone.
        let f = fetch_rows(&router, &rows, cap).await;
        assert_eq!(f.error, None);
        assert_eq!(f.sources, vec![std::sync::Arc::<str>::from("a")]);
        assert_eq!(
            first_mismatch(SEED, 1, &rows, &f.bytes),
            None,
            "{transport}: wrong rows"
        );
    });
    match signal {
        Some(libc::SIGKILL) => {
            b.wait(Duration::from_secs(10)).expect("b was killed");
        }
        Some(_) => b.signal(libc::SIGKILL),
        None => {}
    }
}
