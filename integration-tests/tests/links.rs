//! A donor given a dedicated link: it runs in a network namespace reached
//! from the node over two links, an "Ethernet" veth pair and a
//! "Thunderbolt" one, each its own /30, and listens on both addresses (TLS
//! and QUIC, with the rack PKI). A node tied to the Thunderbolt link by
//! `[[node.link]] interface` (SO_BINDTODEVICE; the donor advertises only
//! its Ethernet address) or `bind` (its source address there; the donor's
//! Thunderbolt address advertised first) sends its lookups over that link
//! only: the interfaces' byte counters say so. With the link down its route falls over to the
//! SSD copy with no failed lookup; with the link up again the donor is
//! re-admitted and serves over it.
//!
//! Needs root and iproute2: skipped otherwise, unless
//! `ENGRAM_REQUIRE_NETNS=1` (CI), where it fails instead.

use std::path::Path;
use std::time::{Duration, Instant};

use cluster_config::{Config, Transport};
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_protocol::{ROW_BYTES, TableDigest};
use inference_node::memory::Routers;
use inference_node::metrics::NodeMetrics;
use inference_node::router::Router;
use rack_harness::netns::{NetNs, Veth};
use rack_harness::rack_toml::{
    DonorEntry, LinkEntry, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
};
use rack_harness::{DonorProcess, bin, gen_table, rack_pki, runtime};

const ROWS: u64 = 20_000;
const SEED: u64 = 17;
/// Lookups measured on the link, and rows in each.
const LOOKUPS: u64 = 500;
const ROWS_PER_LOOKUP: usize = 24;
/// Lookups made while the Thunderbolt link is down.
const LOOKUPS_DOWN: u64 = 50;
/// The donor's data-plane port (TLS on TCP, QUIC on UDP), on both links.
const PORT: u16 = 7410;

/// How the node is tied to the Thunderbolt link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tie {
    /// `interface = "<the link's interface>"` (SO_BINDTODEVICE).
    Interface,
    /// `bind = "<the node's address on the link>"`.
    Bind,
}

/// True when namespaces can be built; a skip message otherwise, a failure
/// when `ENGRAM_REQUIRE_NETNS=1`.
fn usable() -> bool {
    let Err(why) = NetNs::check() else {
        return true;
    };
    let required = std::env::var("ENGRAM_REQUIRE_NETNS").as_deref() == Ok("1");
    assert!(
        !required,
        "network namespaces are required (ENGRAM_REQUIRE_NETNS=1): {why}"
    );
    eprintln!("skipped: {why}");
    false
}

/// A donor in a namespace of its own with two links to this one; the node
/// `n` routes table 1 to `["d", "ssd"]` and reaches `d` over `transport`,
/// tied to the Thunderbolt link.
struct TwoLinks {
    // Declared first: the donor ends before its namespace is deleted.
    donor: DonorProcess,
    _ns: NetNs,
    tb: Veth,
    eth: Veth,
    config: Config,
    _dir: tempfile::TempDir,
}

impl TwoLinks {
    fn start(tie: Tie, transport: Transport) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (table, digest) = gen_table(dir.path(), "l1.etab", 1, ROWS, SEED).expect("gen");
        let mut ns = NetNs::create("links").expect("namespace");
        let eth = ns.link();
        let tb = ns.add_link().expect("a second link");
        let config = write_config(dir.path(), &table, digest, tb, eth, tie, transport);
        let mut cmd = ns.command(bin("memory-donor"));
        cmd.arg("serve")
            .arg("--config")
            .arg(&config.path)
            .args(["--name", "d"])
            .env("RUST_LOG", "info");
        let donor = DonorProcess::spawn(cmd).expect("the donor starts");
        Self {
            donor,
            _ns: ns,
            tb,
            eth,
            config,
            _dir: dir,
        }
    }

    /// Bytes sent and received so far on the root-namespace ends of the
    /// Thunderbolt and the Ethernet link.
    fn bytes(&self) -> (u64, u64) {
        (if_bytes(&self.tb.host_if()), if_bytes(&self.eth.host_if()))
    }
}

/// `tx_bytes + rx_bytes` of interface `name`.
fn if_bytes(name: &str) -> u64 {
    ["tx_bytes", "rx_bytes"]
        .iter()
        .map(|f| {
            let path = format!("/sys/class/net/{name}/statistics/{f}");
            let text = std::fs::read_to_string(&path).expect("interface counter");
            text.trim().parse::<u64>().expect("a byte count")
        })
        .sum()
}

/// The rack: table 1, donor `d` listening on TLS and QUIC on both links,
/// node `n` tied to the Thunderbolt link. Its PKI is made as an operator
/// would.
fn write_config(
    dir: &Path,
    table: &Path,
    digest: TableDigest,
    tb: Veth,
    eth: Veth,
    tie: Tie,
    transport: Transport,
) -> Config {
    let (t, e) = (tb.addr(), eth.addr());
    let addr = |scheme: &str, ip| format!("{scheme}://{ip}:{PORT}");
    let listen = vec![
        addr("tls", t),
        addr("tls", e),
        addr("quic", t),
        addr("quic", e),
    ];
    let link = LinkEntry::new("d", transport);
    // With `interface` the node's connections leave through the link
    // whatever address they dial: the donor advertises its Ethernet address
    // alone, the one every node knows it by. With `bind` the route to the
    // dialled address decides: the Thunderbolt address comes first.
    let (link, advertise) = match tie {
        Tie::Interface => (
            LinkEntry {
                interface: Some(tb.host_if()),
                ..link
            },
            vec![addr("tls", e), addr("quic", e)],
        ),
        Tie::Bind => (
            LinkEntry {
                bind: Some(tb.host_addr().to_string()),
                ..link
            },
            listen.clone(),
        ),
    };
    let mut rack = RackToml::new("t");
    rack.rack.tls = Some(TlsSection::with_operators(["op"]));
    rack.table = vec![TableEntry::new(1, table, ROWS, digest)];
    rack.donor = vec![DonorEntry {
        advertise: Some(advertise),
        ..DonorEntry::new("d", listen, [1])
    }];
    // Each lookup waits for the donor up to the window (W/40 = 50 ms at 0.5
    // tokens/s) before the SSD copy is asked too: a loaded
    // machine's hiccup does not make the copy win a lookup the link served.
    rack.node = vec![NodeEntry {
        tokens_per_second: Some(0.5),
        probe_interval_ms: Some(100),
        connect_timeout_ms: Some(300),
        lookup_timeout_ms: Some(500),
        link: vec![link],
        ..NodeEntry::new(
            "n",
            vec![
                RouteEntry::new(1, ["d", "ssd"])
                    .ssd_path(table)
                    .hedge("off"),
            ],
        )
    }];
    let path = dir.join("rack.toml");
    rack.write(&path).expect("config");
    let config = Config::load(&path).expect("valid config");
    rack_pki(&path).expect("rack PKI");
    config
}

fn random_rows(seed: u64) -> Vec<u64> {
    let mut s = SplitMix64::new(seed);
    (0..ROWS_PER_LOOKUP).map(|_| s.below(ROWS)).collect()
}

/// One lookup, its rows checked against the table; who served it.
async fn fetch(router: &Router, i: u64) -> String {
    let rows = random_rows(i);
    let mut out = vec![0u8; rows.len() * ROW_BYTES];
    let f = router
        .fetch(&rows, &mut out)
        .await
        .expect("no failed lookup");
    assert_eq!(first_mismatch(SEED, 1, &rows, &out), None, "wrong rows");
    f.source.expect("rows, not zeros").to_string()
}

/// The whole story on one rack: lookups over the Thunderbolt link only,
/// the SSD copy while it is down, the donor again once it is up.
fn dedicated_link(tie: Tie, transport: Transport) {
    if !usable() {
        return;
    }
    let rack = TwoLinks::start(tie, transport);
    let what = format!("{transport} tied by {tie:?}");
    runtime().block_on(async {
        let metrics = NodeMetrics::new();
        let memory = Routers::from_config(&rack.config, "n", &metrics)
            .await
            .expect("memory");
        let router = memory.router(1).expect("router");
        assert_eq!(fetch(router, 0).await, "d", "{what}: the donor serves");

        let (tb0, eth0) = rack.bytes();
        for i in 1..=LOOKUPS {
            assert_eq!(fetch(router, i).await, "d", "{what}: lookup {i}");
        }
        let (tb1, eth1) = rack.bytes();
        let (tb, eth) = (tb1 - tb0, eth1 - eth0);
        let rows_bytes = LOOKUPS * (ROWS_PER_LOOKUP * ROW_BYTES) as u64;
        println!(
            "{what}: {LOOKUPS} lookups of {ROWS_PER_LOOKUP} rows ({rows_bytes} bytes of rows): \
             Thunderbolt link {} {tb} bytes, Ethernet link {} {eth} bytes",
            rack.tb.host_if(),
            rack.eth.host_if()
        );
        assert!(
            tb >= rows_bytes,
            "{what}: the Thunderbolt link carried {tb} bytes, less than the rows' {rows_bytes}"
        );
        assert!(
            eth * 100 <= tb,
            "{what}: the Ethernet link carried {eth} bytes beside the Thunderbolt link's {tb}"
        );

        // The cable is pulled: the root namespace's end goes down.
        rack.tb.set_host_up(false).expect("link down");
        let down = Instant::now();
        for i in 0..LOOKUPS_DOWN {
            let by = fetch(router, 10_000 + i).await;
            assert_eq!(by, "ssd", "{what}: lookup {i} with the link down");
        }
        let (tb2, _) = rack.bytes();
        println!(
            "{what}: link down: {LOOKUPS_DOWN} lookups served by the SSD copy in {:.0} ms, none failed",
            down.elapsed().as_secs_f64() * 1e3
        );

        // Plugged back: the probes find the donor and it serves again.
        rack.tb.set_host_up(true).expect("link up");
        let up = Instant::now();
        let mut i = 20_000;
        while fetch(router, i).await != "d" {
            assert!(
                up.elapsed() < Duration::from_secs(15),
                "{what}: the donor was not re-admitted within 15 s of the link coming up"
            );
            i += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!(
            "{what}: link up: the donor serves again after {:.0} ms",
            up.elapsed().as_secs_f64() * 1e3
        );
        for j in 1..=20 {
            assert_eq!(fetch(router, i + j).await, "d", "{what}: after re-admission");
        }
        let (tb3, _) = rack.bytes();
        assert!(
            tb3 - tb2 >= 20 * (ROWS_PER_LOOKUP * ROW_BYTES) as u64,
            "{what}: after re-admission the rows did not come over the Thunderbolt link"
        );
    });
    let log = rack.donor.log();
    assert!(
        log.contains(&format!("{}://{}:{PORT}", transport, rack.tb.addr())),
        "{log}"
    );
}

#[test]
fn tls_over_the_interface_named_by_the_link() {
    dedicated_link(Tie::Interface, Transport::Tls);
}

#[test]
fn tls_from_the_address_named_by_the_link() {
    dedicated_link(Tie::Bind, Transport::Tls);
}

#[test]
fn quic_over_the_interface_named_by_the_link() {
    dedicated_link(Tie::Interface, Transport::Quic);
}
