//! The node's memory against real donor processes and real SSD copies:
//! failover to the SSD copy when a donor is killed, re-admission when it
//! comes back, a donor at the wrong version never used, both SSD engines
//! reading exactly the generator's rows, and copies that are not what the
//! config pins refused at startup.

use std::path::Path;
use std::time::{Duration, Instant};

use cluster_config::{Config, SsdIo};
use engram_protocol::synthetic::first_mismatch;
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_store::resident::ExpectedTable;
use inference_node::memory::{MemoryError, Routers};
use inference_node::metrics::NodeMetrics;
use inference_node::router::Router;
use inference_node::source::ssd::{SsdEngine, SsdOptions, SsdReader};
use rack_harness::rack_toml::{DonorEntry, NodeEntry, RackToml, RouteEntry, TableEntry};
use rack_harness::runtime as rt;
use rack_harness::{DonorProcess, gen_table};

const ROWS: u64 = 30_000;
const SEED: u64 = 5;

/// Two ports free on 127.0.0.1 now (so a restarted donor can bind them again).
fn ports() -> (u16, u16) {
    let port = || rack_harness::free_port().expect("free port");
    (port(), port())
}

/// A config with one table, donor `d` on 127.0.0.1 (data plane `ports.0`,
/// control plane `ports.1`) and node `n`. The node runs at 1 token/s, so
/// table 1's window is 25 ms: on a loaded machine a slow lookup is not
/// handed to the SSD copy at the deadline. These tests check who serves and
/// what, not how fast (the router's timing is tested under paused time).
fn write_config(
    dir: &Path,
    table: &Path,
    digest: TableDigest,
    ports: (u16, u16),
    sources: &[&str],
) -> Config {
    write_rack(dir, &rack_config(table, digest, ports, sources))
}

/// The rack [`write_config`] writes.
fn rack_config(table: &Path, digest: TableDigest, ports: (u16, u16), sources: &[&str]) -> RackToml {
    let (port, control) = ports;
    let mut rack = RackToml::new("t");
    rack.table = vec![TableEntry::new(1, table, ROWS, digest)];
    rack.donor = vec![DonorEntry {
        control: Some(format!("127.0.0.1:{control}")),
        ..DonorEntry::new("d", [format!("127.0.0.1:{port}")], [1])
    }];
    rack.node = vec![NodeEntry {
        probe_interval_ms: Some(100),
        lookup_timeout_ms: Some(2000),
        tokens_per_second: Some(1.0),
        ..NodeEntry::new(
            "n",
            vec![RouteEntry::new(1, sources.iter().copied()).hedge("off")],
        )
    }];
    rack
}

/// `rack` written to `dir/rack.toml`, loaded.
fn write_rack(dir: &Path, rack: &RackToml) -> Config {
    let path = dir.join("rack.toml");
    rack.write(&path).expect("config");
    Config::load(&path).expect("valid config")
}

fn donor(config: &Config) -> DonorProcess {
    DonorProcess::serving(&config.path, "d").expect("donor starts")
}

/// Fetch 24 random rows, check them, and say who served them.
async fn fetch_one(router: &Router, i: u64) -> String {
    let rows = random_rows(i);
    let mut out = vec![0u8; 24 * ROW_BYTES];
    let f = router.fetch(&rows, &mut out).await.expect("fetch");
    assert_eq!(first_mismatch(SEED, 1, &rows, &out), None, "wrong rows");
    f.source.expect("rows, not zeros").to_string()
}

fn random_rows(seed: u64) -> Vec<u64> {
    let mut s = engram_protocol::synthetic::SplitMix64::new(seed);
    (0..24).map(|_| s.below(ROWS)).collect()
}

#[test]
fn a_killed_donor_fails_over_to_ssd_and_is_readmitted_when_it_returns() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let config = write_config(dir.path(), &table, digest, ports(), &["d", "ssd"]);
    let mut d = donor(&config);
    rt().block_on(async {
        let metrics = std::sync::Arc::new(NodeMetrics::new());
        let mem = Routers::from_config(&config, "n", &metrics)
            .await
            .expect("memory");
        let (http, _server) = inference_node::memory::serve_metrics(
            "127.0.0.1:0".parse().expect("addr"),
            metrics.clone(),
        )
        .await
        .expect("metrics server");
        let router = mem.router(1).expect("router");
        let fetch = |i| fetch_one(router, i);
        for i in 0..20 {
            assert_eq!(fetch(i).await, "d");
        }
        d.signal(libc::SIGKILL);
        d.wait(Duration::from_secs(10)).expect("killed");
        for i in 20..40 {
            assert_eq!(
                fetch(i).await,
                "ssd",
                "every lookup is served, by the SSD copy"
            );
        }
        let text = rack_harness::scrape(http).expect("scrape");
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(
            text.contains("engram_node_breaker_state{source=\"d\"} 2"),
            "breaker open:\n{text}"
        );
        assert!(text.contains("engram_node_rows_served_total{table=\"1\",source=\"ssd\"} 480"));
        // The donor returns on the same address: probes re-admit it.
        let _d2 = donor(&config);
        let back = Instant::now();
        let mut i = 40;
        loop {
            if fetch(i).await == "d" {
                break;
            }
            i += 1;
            assert!(
                back.elapsed() < Duration::from_secs(20),
                "never re-admitted"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            metrics
                .render()
                .contains("engram_node_breaker_state{source=\"d\"} 0")
        );
    });
}

#[test]
fn a_donor_at_another_version_is_never_used() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let other = tempfile::tempdir().expect("tempdir");
    let (other_table, other_digest) =
        gen_table(other.path(), "l1.etab", 1, ROWS, SEED + 1).expect("gen");
    assert_ne!(digest, other_digest);
    let port = ports();
    // The donor serves the other version (its own config pins that one).
    let donor_cfg = write_config(other.path(), &other_table, other_digest, port, &["d"]);
    let _d = donor(&donor_cfg);
    let config = write_config(dir.path(), &table, digest, port, &["d", "ssd"]);
    rt().block_on(async {
        let metrics = NodeMetrics::new();
        let mem = Routers::from_config(&config, "n", &metrics)
            .await
            .expect("memory");
        let router = mem.router(1).expect("router");
        assert!(!router.sources()[0].admissible(1), "excluded at startup");
        for i in 0..10 {
            assert_eq!(fetch_one(router, i).await, "ssd");
        }
        // The copy's engine is in the metrics, as the reader reports it.
        let text = metrics.render();
        let line = text
            .lines()
            .find(|l| l.starts_with("engram_node_ssd_engine{") && l.ends_with(" 1"))
            .unwrap_or_else(|| panic!("no SSD engine in\n{text}"));
        assert!(line.contains("table=\"1\""), "{line}");
        assert!(line.contains("page_checksums=\"true\""), "{line}");
        assert!(
            line.contains("engine=\"io_uring\"") || line.contains("engine=\"pread\""),
            "{line}"
        );
    });
}

#[test]
fn both_ssd_engines_read_the_generators_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let pin = ExpectedTable {
        digest,
        layer: 1,
        rows: ROWS,
    };
    // What this machine allows, found out independently of the reader: an
    // aligned O_DIRECT read of the file, and an io_uring instance.
    let direct = direct_read_works(&table);
    let uring = SsdReader::open(
        &table,
        Some(pin),
        true,
        SsdOptions {
            io: SsdIo::Uring,
            ..SsdOptions::default()
        },
    )
    .is_ok();
    if std::env::var_os("ENGRAM_REQUIRE_DIRECT_IO").is_some() {
        assert!(direct, "O_DIRECT reads fail on {}", table.display());
        assert!(uring, "io_uring is unavailable");
    }
    for io in [SsdIo::Auto, SsdIo::Uring, SsdIo::Pread] {
        let opts = SsdOptions {
            io,
            ..SsdOptions::default()
        };
        if io == SsdIo::Uring && !uring {
            continue;
        }
        let mut r = SsdReader::open(&table, Some(pin), false, opts).expect("open");
        // The engine asked for (or, for auto, io_uring wherever it works)
        // really reads, with O_DIRECT wherever the file system allows it.
        let want = match io {
            SsdIo::Pread => SsdEngine::Pread,
            SsdIo::Uring => SsdEngine::Uring,
            SsdIo::Auto if uring => SsdEngine::Uring,
            SsdIo::Auto => SsdEngine::Pread,
        };
        assert_eq!(r.engine(), want, "{io:?}");
        assert_eq!(r.is_direct(), direct, "{io:?}");
        assert!(r.checks_pages(), "a generated table has page checksums");
        // A prefill-sized batch (more than one submit's worth) and many small ones.
        let mut s = engram_protocol::synthetic::SplitMix64::new(9);
        let big: Vec<u64> = (0..1000).map(|_| s.below(ROWS)).collect();
        let mut out = vec![0u8; big.len() * ROW_BYTES];
        r.read(&big, &mut out).expect("read");
        assert_eq!(
            first_mismatch(SEED, 1, &big, &out),
            None,
            "{}",
            r.engine_name()
        );
        for i in 0..200 {
            let rows = random_rows(i);
            let mut out = vec![0u8; 24 * ROW_BYTES];
            r.read(&rows, &mut out).expect("read");
            assert_eq!(first_mismatch(SEED, 1, &rows, &out), None);
        }
        let e = r
            .read(&[ROWS], &mut [0u8; ROW_BYTES])
            .expect_err("out of range");
        assert!(e.to_string().contains("out of range"), "{e}");
        assert_eq!(
            r.ring_stats(),
            Default::default(),
            "{io:?}: nothing went wrong"
        );
    }
}

/// True when an aligned O_DIRECT read of `path`'s second page works here.
fn direct_read_works(path: &Path) -> bool {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    else {
        return false;
    };
    let layout = std::alloc::Layout::from_size_align(4096, 4096).expect("layout");
    // SAFETY: a non-zero size; freed below with the same layout.
    let ptr = unsafe { std::alloc::alloc(layout) };
    assert!(!ptr.is_null());
    // SAFETY: 4096 bytes just allocated, only used here.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, 4096) };
    let ok = f.read_at(buf, 4096).is_ok();
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(ptr, layout) };
    ok
}

#[test]
fn copies_that_are_not_what_the_config_pins_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let wrong = ExpectedTable {
        digest: TableDigest([9; 32]),
        layer: 1,
        rows: ROWS,
    };
    let e = SsdReader::open(&table, Some(wrong), false, SsdOptions::default())
        .expect_err("another version");
    assert!(e.to_string().contains("pins"), "{e}");
    // Same header, one row byte changed: verifying the copy at open catches
    // it (its page checksum first, the digest where a file has none).
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&table)
            .expect("open");
        f.write_at(&[0x11], 8192 + 3).expect("write");
    }
    let pin = ExpectedTable {
        digest,
        layer: 1,
        rows: ROWS,
    };
    let e =
        SsdReader::open(&table, Some(pin), false, SsdOptions::default()).expect_err("corrupt copy");
    assert!(e.to_string().contains("page 1 hashes to"), "{e}");
    // A node whose only source is that copy does not start.
    let config = write_config(dir.path(), &table, digest, ports(), &["ssd"]);
    rt().block_on(async {
        let e = Routers::from_config(&config, "n", &NodeMetrics::new())
            .await
            .expect_err("refused");
        assert!(matches!(e, MemoryError::Ssd { table: 1, .. }), "{e}");
    });
}

#[test]
fn a_node_with_a_local_copy_serves_itself() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let config = write_config(dir.path(), &table, digest, ports(), &["local"]);
    rt().block_on(async {
        let mem = Routers::from_config(&config, "n", &NodeMetrics::new())
            .await
            .expect("memory");
        let router = mem.router(1).expect("router");
        assert_eq!(fetch_one(router, 1).await, "local");
    });
}

#[test]
fn a_draining_donor_hands_over_without_a_failed_lookup() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let config = write_config(dir.path(), &table, digest, ports(), &["d", "ssd"]);
    let mut d = donor(&config);
    rt().block_on(async {
        let metrics = NodeMetrics::new();
        let mem = Routers::from_config(&config, "n", &metrics)
            .await
            .expect("memory");
        let router = mem.router(1).expect("router");
        for i in 0..10 {
            assert_eq!(fetch_one(router, i).await, "d");
        }
        d.signal(libc::SIGTERM);
        // Every lookup succeeds with the right rows (fetch_one checks both);
        // once the Goodbye is seen, the SSD copy serves.
        let start = Instant::now();
        let mut i = 10;
        while fetch_one(router, i).await == "d" {
            i += 1;
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "still on the draining donor"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        for j in 0..20 {
            assert_eq!(fetch_one(router, 1000 + j).await, "ssd");
        }
        let text = metrics.render();
        assert!(
            text.contains("engram_node_failed_lookups_total{table=\"1\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("engram_node_breaker_state{source=\"d\"} 0"),
            "a Goodbye is not a fault:\n{text}"
        );
    });
    // The node closed its side once drained: the donor exits cleanly.
    let status = d.wait(Duration::from_secs(10)).expect("donor exits");
    assert!(status.success(), "{status:?}\n{}", d.log());
}

#[test]
fn the_canary_runs_token_paced_lookups_and_reports_sources() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    let config = write_config(dir.path(), &table, digest, ports(), &["d", "ssd"]);
    let run = || {
        let out = std::process::Command::new(rack_harness::bin("inference-node"))
            .args(["canary", "--config"])
            .arg(&config.path)
            .args([
                "--name",
                "n",
                "--tokens",
                "200",
                "--tokens-per-second",
                "400",
            ])
            .args(["--metrics", "127.0.0.1:0"])
            .output()
            .expect("canary runs");
        let text = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{text}");
        assert!(text.contains("metrics listen=127.0.0.1:"), "{text}");
        text
    };
    let mut d = donor(&config);
    let text = run();
    let last = text.lines().last().expect("summary");
    assert!(last.starts_with("200 tokens"), "{last}");
    assert!(last.contains("failed 0 [d=200]"), "{last}");
    d.signal(libc::SIGKILL);
    d.wait(Duration::from_secs(10)).expect("killed");
    let text = run();
    let last = text.lines().last().expect("summary");
    assert!(last.contains("failed 0 [ssd=200]"), "{last}");
    let e = std::process::Command::new(rack_harness::bin("inference-node"))
        .args(["canary", "--config"])
        .arg(&config.path)
        .args(["--name", "nobody"])
        .output()
        .expect("runs");
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("node \"nobody\" is not in"));
}

#[test]
fn a_page_flipped_on_disk_under_a_running_node_is_never_used() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
    // The node's SSD copy is its own file; the donor serves from the table.
    let copy = dir.path().join("copy.etab");
    std::fs::copy(&table, &copy).expect("copy");
    let port = ports();
    let mut rack = rack_config(&table, digest, port, &["ssd", "d"]);
    rack.node[0].route[0].ssd_path = Some(copy.clone());
    let config = write_rack(dir.path(), &rack);
    let _d = donor(&config);
    rt().block_on(async {
        let metrics = NodeMetrics::new();
        let mem = Routers::from_config(&config, "n", &metrics)
            .await
            .expect("memory");
        let router = mem.router(1).expect("router");
        // The copy serves first while it reads right.
        assert_eq!(fetch_one(router, 1).await, "ssd");
        // One byte of page 100 flips on disk while the node runs.
        let layout = engram_store::table_file::TableFile::open(&copy)
            .expect("open")
            .layout;
        let victim = 100 * 15 + 4;
        let (offset, in_page) = layout.row_page(victim).expect("row");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&copy)
            .expect("open rw");
        let mut b = [0u8; 1];
        let at = offset + in_page as u64 + 17;
        f.read_exact_at(&mut b, at).expect("read");
        f.write_all_at(&[b[0] ^ 0x04], at).expect("flip");
        f.sync_all().expect("sync");
        for i in 0..20u64 {
            let mut rows = random_rows(100 + i);
            rows[(i % 24) as usize] = victim;
            let mut out = vec![0u8; 24 * ROW_BYTES];
            let got = router.fetch(&rows, &mut out).await.expect("fetch");
            assert_eq!(first_mismatch(SEED, 1, &rows, &out), None, "wrong rows");
            assert_eq!(got.source.as_deref(), Some("d"), "the donor serves instead");
        }
        let text = metrics.render();
        let failures = text
            .lines()
            .find(|l| l.starts_with("engram_node_checksum_failures") && l.contains("\"ssd\""))
            .unwrap_or_else(|| panic!("no SSD checksum failures in\n{text}"));
        assert!(!failures.ends_with(" 0"), "{failures}");
    });
}
