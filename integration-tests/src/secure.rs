//! A secure rack for the end-to-end tests of the TLS and QUIC planes: one
//! real donor process `d` with the rack PKI, listening on `tcp://`,
//! `tls://` and `quic://` loopback addresses, with `/metrics` and a
//! control plane; nodes `n-tls`, `n-quic` and `n-tcp` (admitted, each
//! reaching `d` over the transport its name says) and `n-out` (not
//! admitted). The tests drive the node's client library against it.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use cluster_config::{Config, Transport};
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{ROW_BYTES, TableDigest};
use inference_node::client::{ClientOptions, DonorClient, Request, TlsClient};
use inference_node::tls::NodeTls;

use crate::rack_toml::{
    DonorEntry, LinkEntry, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
};
use crate::{DonorProcess, gen_table, rack_pki, sample, scrape};

/// Rows of the rack's table 1.
pub const ROWS: u64 = 20_000;
/// The seed its rows are generated from.
pub const SEED: u64 = 9;

fn free_port() -> u16 {
    crate::free_port().expect("free port")
}

/// The rack's config: table 1 in `table` at `digest`.
fn rack_config(table: &Path, digest: TableDigest) -> RackToml {
    let [tcp, tls, quic, metrics, control] = [(); 5].map(|()| free_port());
    let mut rack = RackToml::new("t");
    rack.rack.tls = Some(TlsSection::with_operators(["op"]));
    rack.table = vec![TableEntry::new(1, table, ROWS, digest)];
    let listen = [
        format!("tcp://127.0.0.1:{tcp}"),
        format!("tls://127.0.0.1:{tls}"),
        format!("quic://127.0.0.1:{quic}"),
    ];
    rack.donor = vec![DonorEntry {
        metrics: Some(format!("127.0.0.1:{metrics}")),
        control: Some(format!("127.0.0.1:{control}")),
        hello_timeout_ms: Some(2000),
        clients: Some(vec!["n-tls".into(), "n-quic".into(), "n-tcp".into()]),
        ..DonorEntry::new("d", listen, [1])
    }];
    for (node, transport) in [
        ("n-tls", "tls"),
        ("n-quic", "quic"),
        ("n-tcp", "tcp"),
        ("n-out", "tls"),
    ] {
        rack.node.push(NodeEntry {
            probe_interval_ms: Some(100),
            lookup_timeout_ms: Some(2000),
            tokens_per_second: Some(1.0),
            link: vec![LinkEntry::new("d", transport)],
            ..NodeEntry::new(node, vec![RouteEntry::new(1, ["d", "ssd"]).hedge("off")])
        });
    }
    rack
}

/// The rack, running.
#[derive(Debug)]
pub struct SecureRack {
    /// Its directory: table, config, PKI.
    pub dir: tempfile::TempDir,
    /// The config as written.
    pub toml: RackToml,
    /// The config as loaded.
    pub config: Config,
    /// Table 1's digest.
    pub digest: TableDigest,
    /// Donor `d`.
    pub donor: DonorProcess,
}

impl SecureRack {
    /// Generate the table, write the config and the PKI, start `d` and
    /// wait until it is ready.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
        let toml = rack_config(&table, digest);
        let path = dir.path().join("rack.toml");
        toml.write(&path).expect("config");
        let config = Config::load(&path).expect("valid config");
        rack_pki(&path).expect("rack PKI");
        let donor = DonorProcess::start(&["--config", &path.display().to_string(), "--name", "d"])
            .expect("donor starts");
        Self {
            dir,
            toml,
            config,
            digest,
            donor,
        }
    }

    /// Where `d` listens on `t`.
    pub fn addr(&self, t: Transport) -> SocketAddr {
        self.donor.endpoint(t).expect("listens on it")
    }

    /// `d`'s control plane address.
    pub fn control(&self) -> SocketAddr {
        self.config
            .donor("d")
            .and_then(|d| d.control)
            .expect("control")
    }

    /// `d`'s `/metrics` address.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.config
            .donor("d")
            .and_then(|d| d.metrics)
            .expect("metrics")
    }

    /// Rewrite the config file with donor `d` admitting only `clients`.
    pub fn rewrite_clients(&self, clients: &[&str]) {
        let mut toml = self.toml.clone();
        let d = toml.donor_mut("d").expect("donor d");
        d.clients = Some(clients.iter().map(|c| c.to_string()).collect());
        toml.write(&self.config.path).expect("write");
    }

    /// `d`'s Prometheus text now.
    pub fn metrics(&self) -> String {
        scrape(self.metrics_addr()).expect("scrape")
    }

    /// `engram_donor_refusals_total{plane="data",reason=REASON}` now.
    pub fn refusals(&self, reason: &str) -> f64 {
        let series = format!("engram_donor_refusals_total{{plane=\"data\",reason=\"{reason}\"}}");
        sample(&self.metrics(), &series).unwrap_or(0.0)
    }

    /// Client options of node `node` (its own certificate files unless `files`).
    pub fn opts(
        &self,
        node: &str,
        transport: Transport,
        files: Option<cluster_config::TlsFiles>,
    ) -> ClientOptions {
        let mut o = ClientOptions::new(node, vec![(1, self.digest)]);
        o.transport = transport;
        o.connect_timeout = Duration::from_secs(5);
        let files = files
            .or_else(|| self.config.tls_files(node))
            .expect("tls files");
        o.tls = Some(TlsClient {
            tls: NodeTls::load(&files).expect("node material"),
            server_name: cluster_config::tls::server_name("d").expect("name"),
        });
        o
    }
}

/// 24 random rows of table 1, from `seed`.
pub fn random_rows(seed: u64) -> Vec<u64> {
    let mut s = SplitMix64::new(seed);
    (0..24).map(|_| s.below(ROWS)).collect()
}

/// One lookup of 24 random rows (from `seed`) straight through a client,
/// checked against the table.
pub async fn lookup(c: &DonorClient, seed: u64) {
    let rows = random_rows(seed);
    let mut out = vec![0u8; rows.len() * ROW_BYTES];
    c.lookup(
        &[Request {
            table: 1,
            rows: &rows,
        }],
        &mut out,
    )
    .await
    .expect("lookup");
    assert_eq!(first_mismatch(SEED, 1, &rows, &out), None, "wrong rows");
}

/// Threads of process `pid` now.
pub fn threads(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("Threads:")
}
