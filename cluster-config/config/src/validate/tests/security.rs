//! Rules of `[rack.tls]`, transports, `rack.plaintext`, donor `clients`
//! and `[[node.link]]`.

use super::*;
use crate::{Link, Plaintext};

const TLS: &str = "tls = { operators = [\"alice\"] }";
const LISTEN_A: &str = "listen = [\"0.0.0.0:7410\"]\nadvertise = [\"10.1.0.5:7410\"]";

/// The good config without `[rack.tls]`, `extra` in its place (line 5).
fn without_tls(extra: &str) -> String {
    good().replacen(TLS, extra, 1)
}

/// The good config with donor-a's listen and advertise lines (22, 23) replaced.
fn donor_a(listen: &str, advertise: &str) -> String {
    good().replacen(
        LISTEN_A,
        &format!("listen = [{listen}]\nadvertise = [{advertise}]"),
        1,
    )
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("addr")
}

#[test]
fn plaintext_beyond_loopback_needs_rack_plaintext_allow() {
    let tcp = donor_a("\"tcp://0.0.0.0:7410\"", "\"tcp://10.1.0.5:7410\"");
    expect_in(
        &tcp,
        22,
        "donor[0].listen",
        "plaintext on a non-loopback address",
    );
    let allowed = tcp.replacen(
        "name = \"demo\"",
        "name = \"demo\"\nplaintext = \"allow\"",
        1,
    );
    let c = parse(&allowed).expect("allowed");
    assert_eq!(c.plaintext, Plaintext::Allow);
    let a = c.donor("donor-a").expect("donor-a");
    assert_eq!(
        a.listen,
        [Endpoint::new(Transport::Tcp, addr("0.0.0.0:7410"))]
    );
    // Without [rack.tls] a bare address is plaintext, and so is the control plane.
    let plain = without_tls("").replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\ncontrol = \"10.1.0.5:7411\"",
        1,
    );
    expect_in(
        &plain,
        22,
        "donor[0].listen",
        "tcp://0.0.0.0:7410 is plaintext",
    );
    expect_in(
        &plain,
        26,
        "donor[0].control",
        "plaintext and unauthenticated",
    );
    let loopback = without_tls("").replacen(
        LISTEN_A,
        "listen = [\"127.0.0.1:7410\"]\nadvertise = [\"127.0.0.1:7410\"]",
        1,
    );
    let c = parse(&loopback).expect("plaintext on loopback is fine");
    assert_eq!(
        (c.tls.as_ref(), c.plaintext),
        (None, Plaintext::LoopbackOnly)
    );
    expect(
        "name = \"demo\"",
        "name = \"demo\"\nplaintext = \"sometimes\"",
        5,
        "rack.plaintext",
        "not one of",
    );
}

#[test]
fn every_plaintext_address_a_daemon_binds_or_advertises_keeps_the_loopback_rule() {
    let plain = without_tls("");
    // A loopback listener that tells nodes to dial plaintext elsewhere.
    let advertised = plain.replacen(
        LISTEN_A,
        "listen = [\"127.0.0.1:7410\"]\nadvertise = [\"tcp://10.1.0.5:7410\"]",
        1,
    );
    expect_in(
        &advertised,
        23,
        "donor[0].advertise",
        "dial plaintext on a non-loopback address",
    );
    // /metrics (plaintext HTTP) on a donor and on a node, and the node API,
    // with the rack's PKI or without: none of them has TLS.
    for base in [good(), plain.clone()] {
        let t = base
            .replacen(
                "ram_gib = 251.0",
                "ram_gib = 251.0\nmetrics = \"0.0.0.0:9410\"",
                1,
            )
            .replacen(
                "name = \"gpu-1\"",
                "name = \"gpu-1\"\napi = \"10.1.0.9:7420\"\nmetrics = \"10.1.0.9:9101\"",
                1,
            );
        let d = diags(&t);
        for (key, msg) in [
            (
                "donor[0].metrics",
                "/metrics at 0.0.0.0:9410 is plaintext HTTP",
            ),
            (
                "node[0].api",
                "the node API at 10.1.0.9:7420 is plaintext gRPC",
            ),
            (
                "node[0].metrics",
                "/metrics at 10.1.0.9:9101 is plaintext HTTP",
            ),
        ] {
            assert!(
                d.iter().any(|x| x.key == key && x.message.contains(msg)),
                "{key}: {d:?}"
            );
        }
        let allowed = t.replacen(
            "name = \"demo\"",
            "name = \"demo\"\nplaintext = \"allow\"",
            1,
        );
        if let Err(e) = parse(&allowed) {
            panic!("rack.plaintext = \"allow\" accepts them: {e}");
        }
    }
    // The same rule for the daemons' command-line overrides.
    let c = parse(&good()).expect("valid");
    assert!(
        c.plaintext_bind("--metrics", addr("127.0.0.1:9101"))
            .is_ok()
    );
    let e = c
        .plaintext_bind("--metrics", addr("10.1.0.9:9101"))
        .expect_err("refused");
    assert!(
        e.contains("non-loopback") && e.contains("plaintext = \"allow\""),
        "{e}"
    );
}

#[test]
fn secure_transports_need_rack_tls() {
    let text = without_tls("plaintext = \"allow\"").replacen(
        "listen = [\"127.0.0.2:7410\"]",
        "listen = [\"tls://127.0.0.2:7410\"]",
        1,
    );
    expect_in(&text, 29, "donor[1].listen", "needs the rack's PKI");
    let text = without_tls("plaintext = \"allow\"").replacen(
        "ram_gib = 125.5",
        "ram_gib = 125.5\ntls_cert = \"b.pem\"",
        1,
    );
    expect_in(&text, 32, "donor[1].tls_cert", "need [rack.tls]");
    let text = without_tls("plaintext = \"allow\"").replacen(
        "lookup_timeout_ms = 40",
        "lookup_timeout_ms = 40\ntls_key = \"gpu.key\"",
        1,
    );
    expect_in(&text, 39, "node[0].tls_key", "needs [rack.tls]");
    expect(
        "listen = [\"127.0.0.2:7410\"]",
        "listen = [\"udp://127.0.0.2:7410\"]",
        29,
        "donor[1].listen[0]",
        "not a transport",
    );
    expect(
        "advertise = [\"10.1.0.5:7410\"]",
        "advertise = [\"quic://10.1.0.5:7410\"]",
        23,
        "donor[0].advertise[0]",
        "listens on no quic address",
    );
    // TLS and QUIC may share a port: one is TCP, the other UDP.
    let both = donor_a(
        "\"tls://0.0.0.0:7410\", \"quic://0.0.0.0:7410\"",
        "\"tls://10.1.0.5:7410\", \"quic://10.1.0.5:7410\"",
    );
    assert!(parse(&both).is_ok());
    let text = donor_a(
        "\"tls://0.0.0.0:7410\", \"tcp://10.1.0.5:7410\"",
        "\"tls://10.1.0.5:7410\"",
    );
    expect_in(
        &text,
        22,
        "donor[0].listen[1]",
        "collides with tls://0.0.0.0:7410",
    );
}

#[test]
fn tls_settings_and_certificate_files() {
    let c = parse(&good()).expect("valid");
    let tls = c.tls.as_ref().expect("tls");
    assert_eq!(tls.dir, PathBuf::from("/etc/engram-rack/pki"));
    assert_eq!(tls.ca, PathBuf::from("/etc/engram-rack/pki/ca.pem"));
    assert!(c.is_operator("alice") && !c.is_operator("gpu-1"));
    let files = c.tls_files("donor-a").expect("files");
    assert_eq!(
        (files.cert, files.key),
        (
            PathBuf::from("/etc/engram-rack/pki/donor-a.pem"),
            PathBuf::from("/etc/engram-rack/pki/donor-a.key")
        )
    );
    let text = good()
        .replacen(TLS, "tls = { dir = \"/srv/pki\", ca = \"ca/root.pem\" }", 1)
        .replacen(
            "ram_gib = 125.5",
            "ram_gib = 125.5\ntls_cert = \"certs/b.pem\"\ntls_key = \"/secret/b.key\"",
            1,
        );
    let c = parse(&text).expect("valid");
    let tls = c.tls.as_ref().expect("tls");
    assert_eq!(tls.ca, PathBuf::from("/etc/engram-rack/ca/root.pem"));
    assert!(!c.is_operator("alice"));
    let files = c.tls_files("donor-b").expect("files");
    assert_eq!(files.cert, PathBuf::from("/etc/engram-rack/certs/b.pem"));
    assert_eq!(files.key, PathBuf::from("/secret/b.key"));
    assert_eq!(
        c.tls_files("gpu-1").map(|f| f.cert),
        Some(PathBuf::from("/srv/pki/gpu-1.pem"))
    );
    let c = parse(&without_tls("plaintext = \"allow\"")).expect("valid");
    assert_eq!(c.tls_files("donor-a"), None, "no PKI, no files");
}

#[test]
fn identities_must_be_dns_names_of_their_own() {
    expect(
        TLS,
        "tls = { operators = [\"al_ice\"] }",
        5,
        "rack.tls.operators[0]",
        "not a DNS name",
    );
    expect(
        TLS,
        "tls = { operators = [\"GPU-1\"] }",
        5,
        "rack.tls.operators[0]",
        "collides with node \"gpu-1\" (node[0].name)",
    );
    expect(
        TLS,
        "tls = { operators = [\"alice\", \"alice\"] }",
        5,
        "rack.tls.operators[1]",
        "listed twice",
    );
    expect(
        "name = \"donor-a\"",
        "name = \"donor_a\"",
        21,
        "donor[0].name",
        "not a DNS name",
    );
    expect(
        "name = \"gpu-1\"",
        "name = \"gpu_1\"",
        37,
        "node[0].name",
        "not a DNS name",
    );
}

#[test]
fn donors_nodes_and_operators_share_one_case_blind_namespace() {
    // A node named as a donor (both units default to the host name).
    expect(
        "name = \"gpu-1\"",
        "name = \"donor-a\"",
        37,
        "node[0].name",
        "collides with donor \"donor-a\" (donor[0].name)",
    );
    // Names that differ only in case are one name to a certificate check.
    expect(
        "name = \"gpu-1\"",
        "name = \"Donor-A\"",
        37,
        "node[0].name",
        "compared without case",
    );
    expect(
        "name = \"donor-b\"",
        "name = \"DONOR-A\"",
        28,
        "donor[1].name",
        "collides with donor \"donor-a\"",
    );
    // Plaintext racks too: a name is the host's identity in every plane.
    let plain =
        without_tls("plaintext = \"allow\"").replacen("name = \"gpu-1\"", "name = \"donor-b\"", 1);
    expect_in(&plain, 37, "node[0].name", "one namespace of names");
}

#[test]
fn donor_clients_are_nodes() {
    let text = good().replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nclients = [\"gpu-1\"]",
        1,
    );
    let c = parse(&text).expect("valid");
    assert_eq!(c.donor("donor-a").expect("donor-a").clients, ["gpu-1"]);
    assert!(c.donor("donor-b").expect("donor-b").clients.is_empty());
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nclients = [\"gpu-1\", \"gpu-9\"]",
        26,
        "donor[0].clients[1]",
        "\"gpu-9\" is not a node of this rack",
    );
    expect(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nclients = []",
        26,
        "donor[0].clients",
        "an empty list would admit no node",
    );
}

/// The good config with `link` (TOML lines) as gpu-1's `[[node.link]]`,
/// starting on line 39.
fn with_link(link: &str) -> String {
    good().replacen(
        "lookup_timeout_ms = 40",
        &format!("lookup_timeout_ms = 40\n[[node.link]]\n{link}"),
        1,
    )
}

#[test]
fn node_link_rules() {
    expect_in(
        &with_link("donor = \"donor-z\""),
        40,
        "node[0].link[0].donor",
        "\"donor-z\" is not a donor of this rack",
    );
    expect_in(
        &with_link("donor = \"donor-a\"\ntransport = \"quic\""),
        41,
        "node[0].link[0].transport",
        "advertises no quic address (it advertises tls://10.1.0.5:7410)",
    );
    expect_in(
        &with_link("donor = \"donor-a\"\ntransport = \"udp\""),
        41,
        "node[0].link[0].transport",
        "not one of",
    );
    expect_in(
        &with_link("donor = \"donor-a\"\ninterface = \"tb/0\""),
        41,
        "node[0].link[0].interface",
        "not a network interface name",
    );
    expect_in(
        &with_link("donor = \"donor-a\"\ninterface = \"thunderbolt-bridge0\""),
        41,
        "node[0].link[0].interface",
        "not a network interface name",
    );
    expect_in(
        &with_link("donor = \"donor-a\"\nbind = \"10.0.0.300\""),
        41,
        "node[0].link[0].bind",
        "not an IP address",
    );
    expect_in(
        &with_link("donor = \"donor-a\"\n[[node.link]]\ndonor = \"donor-a\""),
        42,
        "node[0].link[1].donor",
        "has two links",
    );
}

#[test]
fn links_and_endpoints_prefer_tls_then_quic_then_tcp() {
    let all = donor_a(
        "\"tcp://0.0.0.0:7400\", \"quic://0.0.0.0:7410\", \"tls://0.0.0.0:7410\"",
        "\"tcp://10.1.0.5:7400\", \"quic://10.1.0.5:7410\", \"tls://10.1.0.5:7410\"",
    )
    .replacen(
        "name = \"demo\"",
        "name = \"demo\"\nplaintext = \"allow\"",
        1,
    );
    let text = all.replacen(
        "lookup_timeout_ms = 40",
        "lookup_timeout_ms = 40\n[[node.link]]\ndonor = \"donor-a\"\ntransport = \"tcp\"\n\
         bind = \"10.1.0.9\"\ninterface = \"thunderbolt0\"",
        1,
    );
    let c = parse(&text).expect("valid");
    let a = c.donor("donor-a").expect("donor-a");
    let n = c.node("gpu-1").expect("gpu-1");
    let at = |t, s| vec![Endpoint::new(t, addr(s))];
    assert_eq!(a.endpoints(None), at(Transport::Tls, "10.1.0.5:7410"));
    assert_eq!(
        a.endpoints(Some(Transport::Quic)),
        at(Transport::Quic, "10.1.0.5:7410")
    );
    let link = n.link("donor-a");
    assert_eq!(
        link,
        Link {
            transport: Some(Transport::Tcp),
            bind: Some("10.1.0.9".parse().expect("ip")),
            interface: Some("thunderbolt0".into()),
        }
    );
    assert_eq!(
        a.endpoints(link.transport),
        at(Transport::Tcp, "10.1.0.5:7400")
    );
    let b = c.donor("donor-b").expect("donor-b");
    assert_eq!(n.link("donor-b"), Link::default(), "no link: defaults");
    assert_eq!(b.endpoints(n.link("donor-b").transport), b.advertise);

    // Without TLS, QUIC comes first; with neither, TCP.
    let quic_tcp = donor_a(
        "\"tcp://0.0.0.0:7400\", \"quic://0.0.0.0:7410\"",
        "\"tcp://10.1.0.5:7400\", \"quic://10.1.0.5:7410\"",
    )
    .replacen(
        "name = \"demo\"",
        "name = \"demo\"\nplaintext = \"allow\"",
        1,
    );
    let c = parse(&quic_tcp).expect("valid");
    let a = c.donor("donor-a").expect("donor-a");
    assert_eq!(a.endpoints(None), at(Transport::Quic, "10.1.0.5:7410"));
    let tcp = donor_a("\"tcp://0.0.0.0:7400\"", "\"tcp://10.1.0.5:7400\"").replacen(
        "name = \"demo\"",
        "name = \"demo\"\nplaintext = \"allow\"",
        1,
    );
    let c = parse(&tcp).expect("valid");
    let a = c.donor("donor-a").expect("donor-a");
    assert_eq!(a.endpoints(None), at(Transport::Tcp, "10.1.0.5:7400"));
}

#[test]
fn rdma_addresses_and_their_device() {
    let rdma = donor_a(
        "\"tls://0.0.0.0:7410\", \"rdma://10.1.0.5:7420\"",
        "\"tls://10.1.0.5:7410\", \"rdma://10.1.0.5:7420\"",
    );
    let c = parse(&rdma).expect("valid");
    let a = c.donor("donor-a").expect("donor-a");
    assert_eq!(
        a.rdma_endpoint(),
        Some(Endpoint::new(Transport::Rdma, addr("10.1.0.5:7420")))
    );
    assert_eq!(a.rdma, Some(crate::RdmaDevice::default()));
    assert!(
        !a.map_files,
        "RDMA registers a copy: no file pages by default"
    );
    // The stream transport a node dials is still TLS.
    assert_eq!(a.endpoints(None)[0].transport, Transport::Tls);
    // The device section, with its checks.
    let with_dev = rdma.replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nrdma = { device = \"mlx5_0\" }",
        1,
    );
    let c = parse(&with_dev).expect("valid");
    let dev = c.donor("donor-a").and_then(|d| d.rdma.clone());
    assert_eq!(
        dev,
        Some(crate::RdmaDevice {
            device: Some("mlx5_0".into()),
            ..crate::RdmaDevice::default()
        })
    );
    let bad = rdma.replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nrdma = { device = \"mlx5 0\", port = 2, gid_index = 3 }",
        1,
    );
    expect_in(
        &bad,
        26,
        "donor[0].rdma.device",
        "is not an RDMA device name",
    );
    // The fabric settings, and their bounds.
    let fabric = rdma.replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nrdma = { ack_timeout_ms = 4, retry_count = 3, traffic_class = 106 }",
        1,
    );
    let dev = parse(&fabric)
        .expect("valid")
        .donor("donor-a")
        .and_then(|d| d.rdma.clone());
    assert_eq!(
        dev,
        Some(crate::RdmaDevice {
            ack_timeout: Duration::from_millis(4),
            retry_count: 3,
            traffic_class: Some(106),
            ..crate::RdmaDevice::default()
        })
    );
    let out = rdma.replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nrdma = { ack_timeout_ms = 0, retry_count = 8, traffic_class = 256 }",
        1,
    );
    expect_in(
        &out,
        26,
        "donor[0].rdma.ack_timeout_ms",
        "0 is out of range 1..=10000",
    );
    expect_in(
        &out,
        26,
        "donor[0].rdma.retry_count",
        "8 is out of range 0..=7",
    );
    expect_in(
        &out,
        26,
        "donor[0].rdma.traffic_class",
        "256 is out of range 0..=255",
    );
    // Port and GID come from the address: a choice is refused, not ignored.
    expect_in(
        &bad,
        26,
        "donor[0].rdma.port",
        "is not supported: the connection manager takes the device's port from the rdma:// address",
    );
    expect_in(
        &bad,
        26,
        "donor[0].rdma.gid_index",
        "is not supported: the connection manager takes the device's GID",
    );
    // A device section without an rdma:// address.
    let orphan = good().replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nrdma = { device = \"mlx5_0\" }",
        1,
    );
    expect_in(
        &orphan,
        26,
        "donor[0].rdma",
        "without an rdma:// listen address",
    );
    // RDMA alone: no authenticated channel to learn regions over.
    let alone = donor_a("\"rdma://10.1.0.5:7420\"", "\"rdma://10.1.0.5:7420\"");
    expect_in(
        &alone,
        22,
        "donor[0].listen",
        "needs a tls:// or quic:// address",
    );
    // Without the rack's PKI.
    let no_pki = without_tls("plaintext = \"allow\"").replacen(
        LISTEN_A,
        "listen = [\"tcp://0.0.0.0:7410\", \"rdma://10.1.0.5:7420\"]\n\
         advertise = [\"tcp://10.1.0.5:7410\", \"rdma://10.1.0.5:7420\"]",
        1,
    );
    expect_in(
        &no_pki,
        22,
        "donor[0].listen",
        "rdma://10.1.0.5:7420 needs the rack's PKI",
    );
    // One RDMA address a donor; its port space is its own.
    let two = donor_a(
        "\"tls://0.0.0.0:7410\", \"rdma://10.1.0.5:7410\", \"rdma://10.1.0.6:7420\"",
        "\"tls://10.1.0.5:7410\"",
    );
    expect_in(&two, 22, "donor[0].listen[2]", "one RDMA address");
    // A node link may ask for it, where the donor advertises it.
    let link = rdma.clone() + "\n[[node.link]]\ndonor = \"donor-a\"\ntransport = \"rdma\"\n";
    let c = parse(&link).expect("valid");
    assert_eq!(c.nodes[0].links[0].1.transport, Some(Transport::Rdma));
    let link_b = good() + "\n[[node.link]]\ndonor = \"donor-a\"\ntransport = \"rdma\"\n";
    let d = diags(&link_b);
    assert!(
        d.iter()
            .any(|d| d.message.contains("advertises no rdma address")),
        "{d:?}"
    );
}

#[test]
fn a_host_socket_is_an_absolute_path_beside_a_network_address() {
    let host = donor_a(
        "\"tls://0.0.0.0:7410\", \"unix:///run/engram-rack/donor.sock\"",
        "\"tls://10.1.0.5:7410\"",
    )
    .replacen(
        "ram_gib = 251.0",
        "ram_gib = 251.0\nhost_uids = [1000]\nhost_gids = [998, 999]",
        1,
    );
    let c = parse(&host).expect("valid");
    let a = c.donor("donor-a").expect("donor-a");
    assert_eq!(
        a.host_socket.as_deref(),
        Some(Path::new("/run/engram-rack/donor.sock"))
    );
    assert!(
        !a.map_files,
        "a host socket hands out a sealed copy: no file pages by default"
    );
    assert_eq!(
        (a.host_uids.as_slice(), a.host_gids.as_slice()),
        (&[1000][..], &[998, 999][..])
    );
    assert_eq!(
        a.listen,
        [Endpoint::new(Transport::Tls, addr("0.0.0.0:7410"))]
    );
    // The other donor has none.
    assert!(c.donor("donor-b").is_some_and(|b| b.host_socket.is_none()));

    let relative = donor_a(
        "\"tls://0.0.0.0:7410\", \"unix://donor.sock\"",
        "\"tls://10.1.0.5:7410\"",
    );
    expect_in(&relative, 22, "donor[0].listen[1]", "is not a socket path");
    let long = format!("/{}", "x".repeat(120));
    let too_long = donor_a(
        &format!("\"tls://0.0.0.0:7410\", \"unix://{long}\""),
        "\"tls://10.1.0.5:7410\"",
    );
    expect_in(&too_long, 22, "donor[0].listen[1]", "at most 107 bytes");
    let two = donor_a(
        "\"tls://0.0.0.0:7410\", \"unix:///run/a.sock\", \"unix:///run/b.sock\"",
        "\"tls://10.1.0.5:7410\"",
    );
    expect_in(&two, 22, "donor[0].listen[2]", "one host socket");
    let alone = donor_a("\"unix:///run/a.sock\"", "\"tls://10.1.0.5:7410\"");
    expect_in(
        &alone,
        22,
        "donor[0].listen",
        "list a network address beside it",
    );
    let ids_without = good().replacen("ram_gib = 251.0", "ram_gib = 251.0\nhost_uids = [1]", 1);
    expect_in(
        &ids_without,
        26,
        "donor[0].host_uids",
        "only beside a unix:// listen address",
    );
    let bad_id = host.replacen("host_uids = [1000]", "host_uids = [-1]", 1);
    expect_in(&bad_id, 26, "donor[0].host_uids[0]", "out of range");
}

#[test]
fn a_donor_binds_its_tables_to_a_numa_node() {
    assert_eq!(parse(&good()).expect("valid").donors[0].numa_node, None);
    let bound = good().replacen("ram_gib = 251.0", "ram_gib = 251.0\nnuma_node = 1", 1);
    let c = parse(&bound).expect("valid");
    assert_eq!(c.donor("donor-a").and_then(|d| d.numa_node), Some(1));
    let far = bound.replacen("numa_node = 1", "numa_node = 1024", 1);
    expect_in(&far, 26, "donor[0].numa_node", "out of range");
    assert!(
        !c.donor("donor-a").expect("donor-a").map_files,
        "numa_node binds a copy: no file pages by default"
    );
    let mapped = bound.replacen("numa_node = 1", "numa_node = 1\nmap_files = true", 1);
    expect_in(&mapped, 26, "donor[0].numa_node", "page cache");
}
