//! The monitoring files in `systemd/monitoring/`: the rules pass their
//! `promtool test rules` cases, and a real Prometheus scraping a running
//! rack (two donors over TLS, a node running `inference-node canary`)
//! answers every query of the dashboard, before and while a donor is
//! down, and fires the donor-down alert when one is killed and clears it
//! once it serves again.
//!
//! Both need Debian's `prometheus` package (`/usr/bin/prometheus`,
//! `/usr/bin/promtool`); without it they skip unless
//! `ENGRAM_REQUIRE_PROMETHEUS=1` (CI).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rack_harness::prometheus::{
    PROMETHEUS, PROMTOOL, Prometheus, dashboard_queries, monitoring_dir,
};
use rack_harness::rack_toml::{
    DonorEntry, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
};
use rack_harness::{DonorProcess, Process, bin, free_port, gen_table, rack_pki};

/// `tool` if installed; otherwise `None` after saying why the test skips
/// (a failure under `ENGRAM_REQUIRE_PROMETHEUS`).
fn installed(tool: &str) -> Option<PathBuf> {
    let path = PathBuf::from(tool);
    if path.is_file() {
        return Some(path);
    }
    assert!(
        std::env::var_os("ENGRAM_REQUIRE_PROMETHEUS").is_none(),
        "{tool} is required (apt-get install prometheus)"
    );
    eprintln!("skipped: {tool} not installed (apt-get install prometheus)");
    None
}

#[test]
fn rules_pass_their_promtool_tests() {
    let Some(promtool) = installed(PROMTOOL) else {
        return;
    };
    let dir = monitoring_dir();
    for args in [
        vec!["check", "rules", "engram-rack.rules.yml"],
        vec!["test", "rules", "engram-rack.rules.test.yml"],
    ] {
        let out = Command::new(&promtool)
            .args(&args)
            .current_dir(&dir)
            .output()
            .expect("promtool runs");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "promtool {args:?}:\n{said}");
        assert!(said.contains("SUCCESS"), "promtool {args:?}:\n{said}");
    }
}

/// Rows of each table.
const ROWS: u64 = 20_000;

fn addr(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

/// Two donors `d1` and `d2` serving tables 1 and 14 over TLS, node `n`
/// routing table 1 to `d1`, `d2`, then its SSD copy and table 14 to `d1`,
/// then its SSD copy; everyone's `/metrics` on a port of its own.
fn rack(dir: &Path) -> RackToml {
    let (l1, d1) = gen_table(dir, "l1.etab", 1, ROWS, 1).expect("gen");
    let (l14, d14) = gen_table(dir, "l14.etab", 14, ROWS, 2).expect("gen");
    let port = || free_port().expect("free port");
    let mut rack = RackToml::new("t");
    rack.rack.tls = Some(TlsSection::with_operators(["op"]));
    rack.table = vec![
        TableEntry::new(1, &l1, ROWS, d1),
        TableEntry::new(14, &l14, ROWS, d14),
    ];
    for name in ["d1", "d2"] {
        rack.donor.push(DonorEntry {
            metrics: Some(addr(port())),
            ..DonorEntry::new(name, [format!("tls://{}", addr(port()))], [1, 14])
        });
    }
    rack.node.push(NodeEntry {
        tokens_per_second: Some(50.0),
        probe_interval_ms: Some(200),
        metrics: Some(addr(port())),
        ..NodeEntry::new(
            "n",
            vec![
                RouteEntry::new(1, ["d1", "d2", "ssd"]).ssd_path(&l1),
                RouteEntry::new(14, ["d1", "ssd"]).ssd_path(&l14),
            ],
        )
    });
    rack
}

/// The shipped rules with their `for:` shortened to 2 s, so the test
/// sees an alert fire within seconds: the expressions are the shipped ones.
fn rules_fast() -> String {
    let text =
        std::fs::read_to_string(monitoring_dir().join("engram-rack.rules.yml")).expect("rules");
    text.lines()
        .map(|l| match l.split_once("for: ") {
            Some((indent, _)) if indent.trim().is_empty() => format!("{indent}for: 2s"),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Wait (at most 60 s) until every dashboard query answers at least one
/// series; print each query's first answer.
fn every_dashboard_query_answers(prometheus: &Prometheus, when: &str) {
    let queries = dashboard_queries().expect("dashboard");
    assert!(queries.len() >= 10, "{queries:?}");
    let mut empty = Vec::new();
    let all = prometheus.wait_for(Duration::from_secs(60), "every dashboard query", |p| {
        empty.clear();
        for (_, expr) in &queries {
            if p.query(expr)?.is_empty() {
                empty.push(expr.clone());
            }
        }
        Ok(empty.is_empty())
    });
    assert!(all.is_ok(), "{when}: no data for {empty:#?}");
    for (title, expr) in &queries {
        let result = prometheus.query(expr).expect("query");
        let first = &result[0];
        eprintln!(
            "{when}: {title}: {expr} -> {} series, e.g. {} = {}",
            result.len(),
            first["metric"],
            first["value"][1]
        );
    }
}

fn donor_down(prometheus: &Prometheus, metrics: SocketAddr) -> bool {
    let instance = metrics.to_string();
    prometheus
        .firing("EngramDonorDown")
        .expect("alerts")
        .iter()
        .any(|labels| labels["instance"] == instance.as_str())
}

#[test]
fn a_real_prometheus_answers_the_dashboard_and_alerts_on_a_donor_down() {
    let Some(_) = installed(PROMETHEUS) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let toml = rack(dir.path());
    let config = dir.path().join("rack.toml");
    toml.write(&config).expect("config");
    rack_pki(&config).expect("rack PKI");
    let metrics = |i: usize| -> SocketAddr {
        toml.donor[i]
            .metrics
            .as_deref()
            .expect("metrics")
            .parse()
            .expect("addr")
    };
    let node_metrics: SocketAddr = toml.node[0]
        .metrics
        .as_deref()
        .expect("metrics")
        .parse()
        .expect("addr");
    let mut d1 = DonorProcess::serving(&config, "d1").expect("d1 starts");
    let _d2 = DonorProcess::serving(&config, "d2").expect("d2 starts");
    let mut canary = Command::new(bin("inference-node"));
    canary
        .args(["canary", "--config"])
        .arg(&config)
        .args(["--name", "n"]);
    let _canary = Process::spawn(canary).expect("canary starts");

    let data = dir.path().join("prometheus");
    std::fs::create_dir_all(&data).expect("dir");
    let jobs = [
        ("engram-donor", vec![metrics(0), metrics(1)]),
        ("engram-node", vec![node_metrics]),
    ];
    let prometheus = Prometheus::start(&data, &jobs, &rules_fast()).expect("Prometheus starts");
    every_dashboard_query_answers(&prometheus, "rack up");
    // Both daemons show their certificate and the CA's: two donors, one node.
    for (job, series) in [("engram-donor", 4), ("engram-node", 2)] {
        let q = format!(
            "{{__name__=~\"engram_(donor|node)_certificate_expiry_timestamp_seconds\", job=\"{job}\"}}"
        );
        assert_eq!(prometheus.query(&q).expect("query").len(), series, "{q}");
    }

    let killed = std::time::Instant::now();
    d1.signal(libc::SIGKILL);
    assert!(d1.wait(Duration::from_secs(10)).is_some(), "d1 exits");
    let fired = prometheus.wait_for(Duration::from_secs(30), "EngramDonorDown", |p| {
        Ok(donor_down(p, metrics(0)))
    });
    assert!(fired.is_ok(), "{fired:?}");
    eprintln!(
        "EngramDonorDown fired {:?} after the kill",
        killed.elapsed()
    );
    assert!(!donor_down(&prometheus, metrics(1)), "only d1 is down");
    every_dashboard_query_answers(&prometheus, "d1 down");

    let _d1 = DonorProcess::serving(&config, "d1").expect("d1 starts again");
    let restarted = std::time::Instant::now();
    let cleared = prometheus.wait_for(Duration::from_secs(30), "EngramDonorDown to clear", |p| {
        Ok(!donor_down(p, metrics(0)))
    });
    assert!(cleared.is_ok(), "{cleared:?}");
    eprintln!(
        "EngramDonorDown cleared {:?} after d1 was ready again",
        restarted.elapsed()
    );
}
