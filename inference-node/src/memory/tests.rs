//! Reloads against real SSD copies (generated here) and a donor that is
//! down: what may change live is applied to the next lookup and keeps the
//! sources it can; what may not is refused with nothing changed.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cluster_config::{Config, Hedge, Policy};
use engram_protocol::synthetic::first_mismatch;
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_store::generate::{GenSpec, generate};

use super::{MemoryError, Routers};
use crate::metrics::NodeMetrics;
use crate::router::{Fetched, Router, RouterError};

const ROWS: u64 = 2_000;
const SEED: u64 = 11;

/// Tables 1 and 14 generated in a temporary directory, and a donor
/// address where nothing listens.
struct Rack {
    dir: tempfile::TempDir,
    digests: [TableDigest; 2],
    port: u16,
}

fn gen_table(dir: &Path, name: &str, layer: u32) -> TableDigest {
    let spec = GenSpec {
        layer,
        rows: ROWS,
        seed: SEED,
        hash_preset: None,
        hash_base: None,
        threads: 1,
    };
    generate(&dir.join(name), &spec, None)
        .expect("generate")
        .digest
}

fn rack() -> Rack {
    let dir = tempfile::tempdir().expect("tempdir");
    let digests = [
        gen_table(dir.path(), "l1.etab", 1),
        gen_table(dir.path(), "l14.etab", 14),
    ];
    // Bound then released: connecting there is refused at once.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    Rack { dir, digests, port }
}

/// A `[[node.route]]` entry.
fn route(table: u32, sources: &str, extra: &str) -> String {
    format!("[[node.route]]\ntable = {table}\nsources = [{sources}]\n{extra}\n")
}

impl Rack {
    /// The rack's config text: node `n` with these keys and routes.
    fn text(&self, node: &str, routes: &str) -> String {
        let [d1, d14] = self.digests;
        format!(
            "version = 1\n[rack]\nname = \"t\"\n\
             [[table]]\nid = 1\nlayer = 1\npath = \"l1.etab\"\nrows = {ROWS}\ndigest = \"{d1}\"\n\
             [[table]]\nid = 14\nlayer = 14\npath = \"l14.etab\"\nrows = {ROWS}\ndigest = \"{d14}\"\n\
             [[donor]]\nname = \"d\"\nlisten = [\"127.0.0.1:{}\"]\ntables = [1, 14]\nram_gib = 1.0\n\
             [[node]]\nname = \"n\"\n{node}\n{routes}",
            self.port
        )
    }

    fn parse(&self, text: &str) -> Config {
        Config::parse(text, &self.dir.path().join("rack.toml")).expect("valid config")
    }

    fn config(&self, node: &str, routes: &str) -> Config {
        self.parse(&self.text(node, routes))
    }
}

/// Fetch 24 rows of `table` (layer = id here); rows served are checked.
async fn fetch(router: &Router) -> Result<Fetched, RouterError> {
    let rows: Vec<u64> = (0..24).map(|i| i * 83 % ROWS).collect();
    let mut out = vec![0u8; rows.len() * ROW_BYTES];
    let f = router.fetch(&rows, &mut out).await?;
    if !f.is_zeros() {
        let layer = router.table();
        assert_eq!(first_mismatch(SEED, layer, &rows, &out), None, "wrong rows");
    }
    Ok(f)
}

fn names(router: &Router) -> Vec<String> {
    router
        .sources()
        .iter()
        .map(|h| h.source.name().to_string())
        .collect()
}

#[tokio::test]
async fn a_reload_applies_route_settings_and_the_token_rate() {
    let rack = rack();
    let routes = route(1, "\"ssd\"", "hedge = \"off\"") + &route(14, "\"ssd\"", "");
    let metrics = NodeMetrics::new();
    let before = rack.config("tokens_per_second = 1", &routes);
    let mem = Routers::from_config(&before, "n", &metrics)
        .await
        .expect("memory");
    let r1 = mem.router(1).expect("router");
    let old = r1.settings();
    assert_eq!(
        (old.window, old.hedge, old.policy),
        (Duration::from_millis(25), Hedge::Off, Policy::Fail)
    );
    let ssd = r1.sources()[0].clone();

    let routes = route(
        1,
        "\"ssd\"",
        "hedge = \"250us\"\npolicy = \"zeros\"\ngrace_us = 300\nhard_timeout_ms = 40",
    ) + &route(14, "\"ssd\"", "");
    let after = rack.config("tokens_per_second = 2", &routes);
    let report = mem.reload(&after, "n", &metrics).await.expect("reloaded");
    let s = r1.settings();
    assert_eq!(s.window, Duration::from_micros(12_500));
    assert_eq!(s.hedge, Hedge::Fixed(Duration::from_micros(250)));
    assert_eq!(s.policy, Policy::Zeros);
    assert_eq!(s.grace, Duration::from_micros(300));
    assert_eq!(s.hard_timeout, Duration::from_millis(40));
    assert!(s.precise_timers);
    let text = report.to_string();
    for want in [
        "table 1: window 25ms -> 12.5ms",
        "hedge off -> 250us",
        "policy fail -> zeros",
        "grace 100µs -> 300µs",
        "table 14: window 325ms -> 162.5ms",
    ] {
        assert!(text.contains(want), "{want:?} not in {text}");
    }
    assert!(Arc::ptr_eq(&r1.sources()[0], &ssd), "the SSD copy is kept");
    assert_eq!(fetch(r1).await.expect("ok").source.as_deref(), Some("ssd"));
    // The same config again changes nothing.
    let again = mem.reload(&after, "n", &metrics).await.expect("reloaded");
    assert!(again.is_empty(), "{again}");
}

#[tokio::test]
async fn a_new_policy_decides_the_next_lookup() {
    let rack = rack();
    let metrics = NodeMetrics::new();
    // The donor is down (excluded at startup): every lookup fails.
    let config = rack.config("", &route(1, "\"d\"", ""));
    let mem = Routers::from_config(&config, "n", &metrics)
        .await
        .expect("memory");
    let r1 = mem.router(1).expect("router");
    let e = fetch(r1).await.expect_err("policy fail");
    assert!(matches!(e, RouterError::AllFailed { .. }), "{e}");
    let config = rack.config("", &route(1, "\"d\"", "policy = \"zeros\""));
    mem.reload(&config, "n", &metrics).await.expect("reloaded");
    assert!(fetch(r1).await.expect("zeros").is_zeros());
}

#[tokio::test]
async fn a_reload_adds_reorders_and_removes_sources() {
    let rack = rack();
    let metrics = NodeMetrics::new();
    let config = rack.config("", &route(1, "\"ssd\"", ""));
    let mem = Routers::from_config(&config, "n", &metrics)
        .await
        .expect("memory");
    let r1 = mem.router(1).expect("router");
    let ssd = r1.sources()[0].clone();

    let config = rack.config("", &route(1, "\"d\", \"ssd\"", ""));
    let report = mem.reload(&config, "n", &metrics).await.expect("added");
    assert_eq!(names(r1), ["d", "ssd"]);
    assert!(report.to_string().contains("d: new donor"), "{report}");
    assert!(Arc::ptr_eq(&r1.sources()[1], &ssd));
    // The new donor is down: probed before use, so it starts excluded.
    assert!(!r1.sources()[0].admissible(1));
    assert_eq!(fetch(r1).await.expect("ok").source.as_deref(), Some("ssd"));
    let d = r1.sources()[0].clone();

    let config = rack.config("", &route(1, "\"ssd\", \"d\"", ""));
    let report = mem.reload(&config, "n", &metrics).await.expect("reordered");
    assert_eq!(names(r1), ["ssd", "d"]);
    assert!(
        report.to_string().contains("sources [d, ssd] -> [ssd, d]"),
        "{report}"
    );
    assert!(Arc::ptr_eq(&r1.sources()[0], &ssd) && Arc::ptr_eq(&r1.sources()[1], &d));

    // A donor whose connection settings change is reconnected.
    let config = rack.config("connect_timeout_ms = 300", &route(1, "\"ssd\", \"d\"", ""));
    let report = mem
        .reload(&config, "n", &metrics)
        .await
        .expect("reconnected");
    assert!(report.to_string().contains("d: reconnects"), "{report}");
    assert!(!Arc::ptr_eq(&r1.sources()[1], &d));

    // A copy at a new path is opened (and checked) and used.
    std::fs::copy(
        rack.dir.path().join("l1.etab"),
        rack.dir.path().join("l1b.etab"),
    )
    .expect("copy");
    let config = rack.config("", &route(1, "\"ssd\"", "ssd_path = \"l1b.etab\""));
    let report = mem.reload(&config, "n", &metrics).await.expect("removed");
    assert_eq!(names(r1), ["ssd"]);
    assert!(!Arc::ptr_eq(&r1.sources()[0], &ssd));
    assert!(report.to_string().contains("l1b.etab"), "{report}");
    assert_eq!(fetch(r1).await.expect("ok").source.as_deref(), Some("ssd"));
    // What no route uses is let go: the probe loops holding it end.
    drop(d);
    for _ in 0..100 {
        if Arc::strong_count(&ssd) == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(Arc::strong_count(&ssd), 1, "the old copy is still held");
}

#[tokio::test]
async fn a_reload_that_changes_the_tables_is_refused_and_nothing_changes() {
    let rack = rack();
    let metrics = NodeMetrics::new();
    let routes = route(1, "\"ssd\"", "hedge = \"off\"") + &route(14, "\"ssd\"", "");
    let mem = Routers::from_config(&rack.config("", &routes), "n", &metrics)
        .await
        .expect("memory");
    let r1 = mem.router(1).expect("router");
    let before = r1.settings();
    let ssd = r1.sources()[0].clone();

    // Another digest for table 1 (with a hedge change that must not apply).
    let routes = route(1, "\"d\", \"ssd\"", "hedge = \"p99\"") + &route(14, "\"ssd\"", "");
    let text = rack.text("", &routes);
    let [d1, d14] = rack.digests.map(|d| d.to_string());
    let e = mem
        .reload(&rack.parse(&text.replacen(&d1, &d14, 1)), "n", &metrics)
        .await
        .expect_err("refused");
    assert!(
        matches!(e, MemoryError::RestartNeeded { table: 1, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("restart the node"), "{e}");

    // Table 14 no longer routed.
    let config = rack.config("", &route(1, "\"ssd\"", "hedge = \"p99\""));
    let e = mem
        .reload(&config, "n", &metrics)
        .await
        .expect_err("refused");
    assert!(
        matches!(e, MemoryError::RestartNeeded { table: 14, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("no longer routed"), "{e}");

    let e = mem
        .reload(&rack.config("", &routes), "gpu-9", &metrics)
        .await
        .expect_err("refused");
    assert!(matches!(e, MemoryError::UnknownNode { .. }), "{e}");

    assert_eq!(r1.settings(), before);
    assert_eq!(names(r1), ["ssd"]);
    assert!(Arc::ptr_eq(&r1.sources()[0], &ssd));
}

#[tokio::test]
async fn a_new_copy_that_cannot_be_opened_is_refused_and_nothing_changes() {
    let rack = rack();
    let metrics = NodeMetrics::new();
    let config = rack.config("", &route(1, "\"ssd\"", "hedge = \"off\""));
    let mem = Routers::from_config(&config, "n", &metrics)
        .await
        .expect("memory");
    let r1 = mem.router(1).expect("router");
    let before = r1.settings();
    let ssd = r1.sources()[0].clone();

    let routes = route(
        1,
        "\"d\", \"ssd\"",
        "hedge = \"p99\"\nssd_path = \"missing.etab\"",
    );
    let e = mem
        .reload(&rack.config("", &routes), "n", &metrics)
        .await
        .expect_err("refused");
    assert!(matches!(e, MemoryError::Ssd { table: 1, .. }), "{e}");
    assert_eq!(r1.settings(), before);
    assert_eq!(names(r1), ["ssd"]);
    assert!(Arc::ptr_eq(&r1.sources()[0], &ssd));
    assert_eq!(fetch(r1).await.expect("ok").source.as_deref(), Some("ssd"));
}

#[test]
fn a_node_without_rdma_says_which_tables_read_over_what_instead() {
    let addr: std::net::SocketAddr = ([10, 0, 0, 11], 7420).into();
    let why = engram_rdma::verbs::VerbsError::NoDevice(String::new());
    assert_eq!(
        super::rdma_unused(addr, &why, "1, 14", cluster_config::Transport::Tls),
        "rdma://10.0.0.11:7420 is not used: no RDMA device found; tables 1, 14 read from this \
         donor over tls"
    );
}
