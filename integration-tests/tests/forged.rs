//! Strangers who forge a node's source address, against a real donor
//! process: QUIC Initials and TCP SYNs that claim to come from the node
//! (127.0.0.1, where the node dials from). Past its limits the donor
//! answers an unvalidated Initial with a stateless Retry, which only a
//! client that receives at the address can answer, and a TCP connection
//! exists only once its handshake came back from the address; so the node
//! dials and reads rows through any number of forged packets, and its live
//! session goes on untouched.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cluster_config::Transport;
use inference_node::client::DonorClient;
use rack_harness::forge::{self, Forged};
use rack_harness::secure::{SecureRack, lookup, threads};
use rack_harness::{runtime as rt, sample};

/// Forged packets per burst.
const FORGED: usize = 1000;
/// The node's address: where every node of the rack dials from.
const NODE: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// The donor's counters that tell what became of QUIC Initials.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Quic {
    /// Stateless Retries sent.
    retries: f64,
    /// Initials whose address a token proved.
    validated: f64,
    /// Initials refused outright, and handshakes evicted.
    refused: f64,
    evicted: f64,
}

impl Quic {
    fn of(rack: &SecureRack) -> Self {
        let m = rack.metrics();
        let refusal = |reason: &str| {
            let series =
                format!("engram_donor_refusals_total{{plane=\"data\",reason=\"{reason}\"}}");
            sample(&m, &series).unwrap_or(0.0)
        };
        Self {
            retries: refusal("quic_retry"),
            validated: sample(&m, "engram_donor_quic_validated_total").unwrap_or(0.0),
            refused: refusal("handshake_limit"),
            evicted: refusal("handshake_evicted"),
        }
    }

    fn since(self, before: Self) -> Self {
        Self {
            retries: self.retries - before.retries,
            validated: self.validated - before.validated,
            refused: self.refused - before.refused,
            evicted: self.evicted - before.evicted,
        }
    }
}

fn ca(rack: &SecureRack) -> PathBuf {
    rack.config.tls.as_ref().expect("pki").ca.clone()
}

/// `n-quic` dials the donor over QUIC and reads 20 lookups: the client
/// and how long its connect took.
async fn dial(rack: &SecureRack) -> (DonorClient, Duration) {
    let t0 = Instant::now();
    let c = DonorClient::connect(
        rack.addr(Transport::Quic),
        &rack.opts("n-quic", Transport::Quic, None),
    )
    .await
    .unwrap_or_else(|e| panic!("n-quic could not dial over QUIC: {e}"));
    let took = t0.elapsed();
    for i in 0..20 {
        lookup(&c, i).await;
    }
    (c, took)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn how(f: Forged) -> &'static str {
    if f.raw {
        "raw socket"
    } else {
        "sockets bound to the node's address (no raw socket)"
    }
}

/// The node process: `inference-node canary` as `n-quic`, 50 tokens; its
/// summary line.
fn canary(rack: &SecureRack) -> String {
    let out = std::process::Command::new(rack_harness::bin("inference-node"))
        .args(["canary", "--config"])
        .arg(&rack.config.path)
        .args([
            "--name",
            "n-quic",
            "--tokens",
            "50",
            "--tokens-per-second",
            "400",
        ])
        .output()
        .expect("canary runs");
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{text}");
    text.lines().last().expect("summary").to_string()
}

#[test]
fn initials_forged_from_a_nodes_address_never_lock_it_out() {
    let rack = SecureRack::start();
    let (quic, ca) = (rack.addr(Transport::Quic), ca(&rack));
    let rt = rt();
    // The node's usual connect time: the median of three dials, no flood.
    let mut usual: Vec<Duration> = (0..3).map(|_| rt.block_on(dial(&rack)).1).collect();
    usual.sort();
    let (before, drops) = (Quic::of(&rack), snmp("Udp", "RcvbufErrors"));
    let forged = forge::forge_quic_initials(NODE, None, quic, &ca, FORGED);
    assert!(forged.sent >= FORGED * 9 / 10, "only {forged:?}");
    // The donor holds its first few forged handshakes for its hello
    // timeout (2 s): the node dials while they are in progress.
    let (c, took) = rt.block_on(dial(&rack));
    drop(c);
    // Then the node process, through another burst.
    let again = forge::forge_quic_initials(NODE, None, quic, &ca, FORGED);
    let summary = canary(&rack);
    let (q, drops) = (
        Quic::of(&rack).since(before),
        snmp("Udp", "RcvbufErrors") - drops,
    );
    println!(
        "{} + {} QUIC Initials forged from {NODE} ({}; {drops} datagrams dropped host-wide by \
         full socket buffers): the node dialed in {:.1} ms (usually {:.1} ms, fastest {:.1}) and \
         read 20 lookups; its canary process: {summary}; donor: {} Retries sent, {} tokens \
         validated, {} refused, {} evicted",
        forged.sent,
        again.sent,
        how(forged),
        ms(took),
        ms(usual[1]),
        ms(usual[0]),
        q.retries,
        q.validated,
        q.refused,
        q.evicted
    );
    assert!(summary.contains("failed 0 [d=50]"), "{summary}");
    // Past the first few the forged Initials got Retries (some never
    // reached the donor: a burst overflows its socket's buffer); the node
    // and its canary came back with their tokens and were never refused.
    assert!(
        q.retries + drops as f64 >= (forged.sent + again.sent) as f64 * 0.9,
        "{q:?}, {drops} dropped"
    );
    assert!(q.validated >= 2.0 && q.refused == 0.0, "{q:?}");
}

#[test]
fn initials_forged_from_a_connected_nodes_address_leave_its_session_alone() {
    let rack = SecureRack::start();
    let (quic, ca) = (rack.addr(Transport::Quic), ca(&rack));
    let accepted =
        || sample(&rack.metrics(), "engram_donor_connections_accepted_total").unwrap_or(-1.0);
    rt().block_on(async {
        let (c, _) = dial(&rack).await;
        // The node's own address and port: the donor's answers to the
        // forged Initials (Retries, handshake packets) reach its socket.
        let port = c.quic_local_addr().expect("a QUIC connection").port();
        let (before, sessions) = (Quic::of(&rack), accepted());
        let drops = snmp("Udp", "RcvbufErrors");
        let forger = std::thread::spawn({
            let ca = ca.clone();
            move || forge::forge_quic_initials(NODE, Some(port), quic, &ca, FORGED)
        });
        let mut lookups = 0u64;
        while !forger.is_finished() {
            lookup(&c, 1000 + lookups).await;
            lookups += 1;
        }
        let forged = forger.join().expect("forger");
        for _ in 0..100 {
            lookup(&c, 1000 + lookups).await;
            lookups += 1;
        }
        let (q, drops) = (
            Quic::of(&rack).since(before),
            snmp("Udp", "RcvbufErrors") - drops,
        );
        let m = rack.metrics();
        let from = if forged.raw {
            format!("{NODE}:{port}")
        } else {
            format!("{NODE}, other ports")
        };
        println!(
            "{} QUIC Initials forged from the node's own address {from} ({}; {drops} \
             datagrams dropped host-wide by full socket buffers) while it was connected: \
             {lookups} lookups on its session, all answered; donor: {} Retries sent, {} tokens \
             validated, {} refused, {} evicted; sessions accepted {sessions} before, {} after",
            forged.sent,
            how(forged),
            q.retries,
            q.validated,
            q.refused,
            q.evicted,
            accepted()
        );
        assert!(forged.sent >= FORGED * 9 / 10, "only {forged:?}");
        assert!(!c.is_closed(), "the node's session ended");
        assert_eq!(accepted(), sessions, "a session was opened or reopened");
        assert!(
            !m.contains("engram_donor_connection_errors_total{"),
            "the donor ended a session on an error:\n{m}"
        );
        assert!(q.retries > 0.0 && q.validated == 0.0, "{q:?}");
    });
}

/// A host-wide counter of /proc/net/snmp: `PROTO: NAME` (`Tcp`, `Udp`).
fn snmp(proto: &str, name: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/net/snmp").unwrap_or_default();
    let head = format!("{proto}:");
    let mut lines = text.lines().filter(|l| l.starts_with(&head));
    let (Some(names), Some(values)) = (lines.next(), lines.next()) else {
        return 0;
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == name)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

/// Resets the host sent since `before` (`Tcp: OutRsts`), once at least
/// `n` (at most 5 s: each SYN-ACK to a forged port is reset as it arrives).
fn resets_since(before: u64, n: u64) -> u64 {
    let start = Instant::now();
    loop {
        let now = snmp("Tcp", "OutRsts") - before;
        if now >= n || start.elapsed() > Duration::from_secs(5) {
            return now;
        }
        std::thread::yield_now();
    }
}

/// Established TCP connections (/proc/net/tcp) to local port `port` from
/// remote ports in `from`.
fn established(port: u16, from: std::ops::Range<u16>) -> usize {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let hex_port = |a: &str| {
        a.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    text.lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3
                && f[3] == "01"
                && hex_port(f[1]) == Some(port)
                && hex_port(f[2]).is_some_and(|p| from.contains(&p))
        })
        .count()
}

/// A TCP handshake validates the address: SYNs forged from the node's
/// address reach the donor's data plane (TLS and TCP), its control plane
/// and `/metrics`; the SYN-ACKs go to the forged address, whose host
/// resets them, and none becomes a connection, so none holds a pre-auth
/// place.
#[test]
fn syns_forged_from_a_nodes_address_never_become_connections() {
    let Some(raw) = forge::raw_socket_or_skip() else {
        return;
    };
    let rack = SecureRack::start();
    let targets = [
        ("data tls", rack.addr(Transport::Tls)),
        ("data tcp", rack.addr(Transport::Tcp)),
        ("control", rack.control()),
        ("metrics", rack.metrics_addr()),
    ];
    let (threads_before, resets_before) = (threads(rack.donor.id()), snmp("Tcp", "OutRsts"));
    let ports = 10_000..10_000 + FORGED as u16;
    let mut sent = 0;
    for (_, to) in targets {
        let SocketAddr::V4(to) = to else {
            panic!("not IPv4")
        };
        for (i, p) in ports.clone().enumerate() {
            let seq = 0x5EED_0000 ^ i as u32;
            sent += usize::from(raw.syn(SocketAddrV4::new(NODE, p), to, seq).is_ok());
        }
    }
    let resets = resets_since(resets_before, sent as u64);
    let held: usize = targets
        .iter()
        .map(|(_, to)| established(to.port(), ports.clone()))
        .sum();
    let threads_after = threads(rack.donor.id());
    rt().block_on(async {
        for (node, t) in [("n-tls", Transport::Tls), ("n-tcp", Transport::Tcp)] {
            let c = DonorClient::connect(rack.addr(t), &rack.opts(node, t, None))
                .await
                .unwrap_or_else(|e| panic!("{node}: {e}"));
            lookup(&c, 7).await;
        }
    });
    let status = std::process::Command::new(rack_harness::bin("engram-cluster"))
        .args(["status", "--config"])
        .arg(&rack.config.path)
        .output()
        .expect("engram-cluster status");
    let m = rack.metrics();
    let evicted = |plane: &str| {
        let s =
            format!("engram_donor_refusals_total{{plane=\"{plane}\",reason=\"preauth_evicted\"}}");
        sample(&m, &s).unwrap_or(0.0)
    };
    println!(
        "{sent} SYNs forged from {NODE} at the donor's TLS, TCP, control and metrics ports: \
         {resets} resets sent host-wide (the SYN-ACKs' answer at the forged ports), {held} connections established from the forged ports; \
         donor threads {threads_before} before, {threads_after} after; pre-auth evictions: \
         data {}, control {}; the nodes read rows over TLS and TCP, the operator's status {}",
        evicted("data"),
        evicted("control"),
        if status.status.success() {
            "answered"
        } else {
            "FAILED"
        }
    );
    assert_eq!(sent, 4 * FORGED);
    assert!(
        resets >= sent as u64,
        "the donor's SYN-ACKs did not reach the forged address"
    );
    assert_eq!(held, 0, "a forged SYN became a connection");
    assert_eq!((evicted("data"), evicted("control")), (0.0, 0.0), "{m}");
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
}
