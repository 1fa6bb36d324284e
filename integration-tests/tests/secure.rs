//! The secure data plane against a real donor process: rows over TLS and
//! QUIC equal the table's bytes; intruders (another CA, an expired
//! certificate, a name the donor does not allow, plaintext on a TLS port,
//! TLS on a plaintext port) are turned away clearly, logged and counted,
//! while a live node keeps being served; and SIGHUP rotates certificates
//! without dropping live connections, refusing bad ones.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster_config::{Config, Transport};
use engram_protocol::ROW_BYTES;
use engram_protocol::synthetic::first_mismatch;
use inference_node::client::{ClientError, DonorClient, Request};
use inference_node::memory::Routers;
use inference_node::metrics::NodeMetrics;
use inference_node::router::Router;
use rack_harness::secure::{SEED, SecureRack, lookup, random_rows, threads};
use rack_harness::{DonorProcess, rack_pki, runtime as rt, sample};

/// One checked lookup through a router; who served it.
async fn fetch(router: &Router, i: u64) -> String {
    let rows = random_rows(i);
    let mut out = vec![0u8; rows.len() * ROW_BYTES];
    let f = router.fetch(&rows, &mut out).await.expect("fetch");
    assert_eq!(first_mismatch(SEED, 1, &rows, &out), None, "wrong rows");
    f.source.expect("rows").to_string()
}

#[test]
fn rows_over_tls_quic_and_tcp_equal_the_table() {
    let rack = SecureRack::start();
    rt().block_on(async {
        let metrics = Arc::new(NodeMetrics::new());
        for node in ["n-tls", "n-quic", "n-tcp"] {
            let mem = Routers::from_config(&rack.config, node, &metrics)
                .await
                .expect("memory");
            let router = mem.router(1).expect("router");
            for i in 0..500 {
                assert_eq!(fetch(router, i).await, "d", "{node}: served by the donor");
            }
        }
    });
    let log = rack.donor.log();
    assert!(log.contains("tls://127.0.0.1:"), "{log}");
    assert!(log.contains("quic://127.0.0.1:"), "{log}");
}

#[test]
fn intruders_are_refused_clearly_and_counted_while_a_node_is_served() {
    let rack = SecureRack::start();
    let tls = rack.addr(Transport::Tls);
    rt().block_on(async {
        let live = DonorClient::connect(tls, &rack.opts("n-tls", Transport::Tls, None))
            .await
            .expect("the live node connects");
        let mut i = 0;
        let mut keep_going = async || {
            for _ in 0..20 {
                i += 1;
                lookup(&live, i).await;
            }
        };
        keep_going().await;

        // A node name the donor does not allow: a clear refusal inside TLS.
        let e = DonorClient::connect(tls, &rack.opts("n-out", Transport::Tls, None))
            .await
            .expect_err("n-out is not allowed");
        assert!(
            matches!(&e, ClientError::Refused { message, .. } if message.contains("n-out is not allowed on donor d")),
            "{e}"
        );
        let e = DonorClient::connect(rack.addr(Transport::Quic), &rack.opts("n-out", Transport::Quic, None))
            .await
            .expect_err("n-out is not allowed over QUIC either");
        assert!(e.to_string().contains("n-out is not allowed"), "{e}");
        keep_going().await;

        // A certificate from another CA: the handshake fails.
        let other = tempfile::tempdir().expect("tempdir");
        let other_cfg = other.path().join("rack.toml");
        std::fs::copy(&rack.config.path, &other_cfg).expect("copy config");
        rack_pki(&other_cfg).expect("another rack's PKI");
        let other_files = Config::load(&other_cfg)
            .expect("config")
            .tls_files("n-tls");
        let e = DonorClient::connect(tls, &rack.opts("n-tls", Transport::Tls, other_files.clone()))
            .await
            .expect_err("another CA");
        assert!(e.to_string().contains("TLS") || e.to_string().contains("certificate"), "{e}");
        let e = DonorClient::connect(rack.addr(Transport::Quic), &rack.opts("n-tls", Transport::Quic, other_files))
            .await
            .expect_err("another CA over QUIC");
        assert!(!e.to_string().is_empty());
        keep_going().await;

        // An expired certificate, signed by the rack's own CA.
        let expired = expired_files(&rack);
        let e = raw_tls_connect(tls, &expired, &rack.config).await;
        assert!(e.is_err(), "an expired certificate is refused");
        keep_going().await;

        // A plaintext client on the TLS port gets a TLS alert (fatal,
        // protocol_version), nothing in plaintext; a node reads it as such.
        let answer = plaintext_hello(tls);
        assert_eq!(answer, [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x46]);
        let e = DonorClient::connect(rack.addr(Transport::Tls), &rack.opts("n-tls", Transport::Tcp, None))
            .await
            .expect_err("plaintext on a TLS port");
        assert!(e.to_string().contains("tls:// port"), "{e}");
        keep_going().await;

        // A TLS client on the plaintext port is told what it probably did.
        let e = DonorClient::connect(rack.addr(Transport::Tcp), &rack.opts("n-tls", Transport::Tls, None))
            .await
            .expect_err("TLS on a plaintext port");
        assert!(e.to_string().contains("plaintext tcp:// port"), "{e}");
        keep_going().await;
    });
    // Every refusal is counted, by reason.
    assert!(
        rack.refusals("client_not_allowed") >= 2.0,
        "{}",
        rack.metrics()
    );
    assert!(
        rack.refusals("handshake_failed") >= 3.0,
        "{}",
        rack.metrics()
    );
    assert_eq!(rack.refusals("plaintext_on_tls_port"), 2.0);
    assert_eq!(rack.refusals("tls_on_plaintext_port"), 1.0);
    // And logged, with the identity where there is one.
    let log = rack.donor.log();
    assert!(log.contains("identity=n-out"), "{log}");
    assert!(log.contains("TLS handshake failed"), "{log}");
}

/// A plaintext Hello on `addr`; what came back, as text.
fn plaintext_hello(addr: std::net::SocketAddr) -> Vec<u8> {
    use std::io::Read;
    let mut s = rack_harness::hello_stream(addr, "plain");
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    buf
}

/// Certificates for the config's hosts, signed by its CA, that expired a day ago.
fn expired_files(rack: &SecureRack) -> cluster_config::TlsFiles {
    let config = &rack.config;
    let tls = config.tls.as_ref().expect("tls");
    let dir = config.path.parent().expect("dir").join("expired");
    let mut toml = rack.toml.clone();
    let section = toml.rack.tls.as_mut().expect("[rack.tls]");
    section.dir = Some("expired".into());
    section.ca = Some(tls.ca.display().to_string());
    let path = config.path.parent().expect("dir").join("expired.toml");
    toml.write(&path).expect("write");
    let expired_cfg = Config::load(&path).expect("config");
    let past = std::time::SystemTime::now() - Duration::from_secs(3 * 86_400);
    cluster_config::pki::issue_at(&expired_cfg, past, 1, true).expect("issue expired");
    cluster_config::TlsFiles {
        ca: tls.ca.clone(),
        cert: dir.join("n-tls.pem"),
        key: dir.join("n-tls.key"),
    }
}

/// A TLS handshake (and a read) to the donor with the certificate in
/// `files`, bypassing the node's own checks of its material.
async fn raw_tls_connect(
    addr: std::net::SocketAddr,
    files: &cluster_config::TlsFiles,
    _config: &Config,
) -> std::io::Result<()> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let read = |p: &PathBuf| std::fs::read(p).expect("read");
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&read(&files.ca)) {
        roots.add(c.expect("ca")).expect("root");
    }
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read(&files.cert))
        .map(|c| c.expect("cert"))
        .collect();
    let key = PrivateKeyDer::from_pem_slice(&read(&files.key)).expect("key");
    let config = rustls::ClientConfig::builder_with_provider(cluster_config::tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .expect("client auth");
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = cluster_config::tls::server_name("d").expect("name");
    let mut s = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await?;
    // The donor's verdict on our certificate arrives after our Finished.
    s.write_all(b"x").await?;
    let mut buf = [0u8; 64];
    match s.read(&mut buf).await? {
        0 => Err(std::io::ErrorKind::UnexpectedEof.into()),
        _ => Ok(()),
    }
}

#[test]
fn sighup_rotates_certificates_and_a_new_ca_cuts_sessions_of_the_old_one() {
    let rack = SecureRack::start();
    let tls = rack.addr(Transport::Tls);
    let dir = rack.config.path.parent().expect("dir").to_path_buf();
    rt().block_on(async {
        let live = DonorClient::connect(tls, &rack.opts("n-tls", Transport::Tls, None))
            .await
            .expect("connects");
        lookup(&live, 1).await;
        // Keep the old CA's material for a client made later.
        let old = dir.join("old-pki");
        copy_dir(&dir.join("pki"), &old);
        let old_files = cluster_config::TlsFiles {
            ca: old.join("ca.pem"),
            cert: old.join("n-tls.pem"),
            key: old.join("n-tls.key"),
        };
        // A new CA and new certificates for everyone, then SIGHUP.
        force_pki(&rack.config.path);
        rack.donor.signal(libc::SIGHUP);
        wait_log(&rack.donor, "reload: TLS certificate and key loaded", 1);
        // The live connection was made with the old CA's certificate: the
        // new CA cuts it (at once on SIGHUP; at most a second later).
        wait_log(&rack.donor, "TLS session cut", 1);
        assert!(
            live.lookup(
                &[Request {
                    table: 1,
                    rows: &random_rows(2),
                }],
                &mut vec![0u8; 24 * ROW_BYTES],
            )
            .await
            .is_err(),
            "a session of the old CA still serves"
        );
        assert!(rack.refusals("revoked") >= 1.0, "{}", rack.metrics());
        // New connections get the new certificate: a client that trusts only
        // the old CA is refused, one with the new material is welcomed.
        let e = DonorClient::connect(tls, &rack.opts("n-tls", Transport::Tls, Some(old_files)))
            .await
            .expect_err("the donor now shows the new CA's certificate");
        assert!(e.to_string().contains("TLS"), "{e}");
        let fresh = DonorClient::connect(tls, &rack.opts("n-tls", Transport::Tls, None))
            .await
            .expect("new material connects");
        lookup(&fresh, 60).await;
        let quic = DonorClient::connect(
            rack.addr(Transport::Quic),
            &rack.opts("n-quic", Transport::Quic, None),
        )
        .await
        .expect("QUIC takes the new certificate too");
        lookup(&quic, 61).await;

        // A broken certificate is refused on SIGHUP and the good one kept.
        let cert = dir.join("pki/d.pem");
        std::fs::write(&cert, "not a certificate").expect("break");
        rack.donor.signal(libc::SIGHUP);
        wait_log(
            &rack.donor,
            "the new TLS certificate or key was refused; the old ones stay",
            1,
        );
        let again = DonorClient::connect(tls, &rack.opts("n-tls", Transport::Tls, None))
            .await
            .expect("still serving with the kept certificate");
        lookup(&again, 70).await;
    });
}

/// A node taken out of the donor's `clients` loses its open sessions on
/// SIGHUP, over TLS and QUIC alike, while the others keep theirs.
#[test]
fn sighup_cuts_the_live_sessions_of_a_client_no_longer_allowed() {
    let rack = SecureRack::start();
    rt().block_on(async {
        let tls = DonorClient::connect(
            rack.addr(Transport::Tls),
            &rack.opts("n-tls", Transport::Tls, None),
        )
        .await
        .expect("tls");
        let quic = DonorClient::connect(
            rack.addr(Transport::Quic),
            &rack.opts("n-quic", Transport::Quic, None),
        )
        .await
        .expect("quic");
        lookup(&tls, 1).await;
        lookup(&quic, 2).await;
        rack.rewrite_clients(&["n-quic", "n-tcp"]);
        rack.donor.signal(libc::SIGHUP);
        wait_log(&rack.donor, "TLS session cut", 1);
        let mut out = vec![0u8; 24 * ROW_BYTES];
        let rows = random_rows(3);
        let req = [Request {
            table: 1,
            rows: &rows,
        }];
        assert!(
            tls.lookup(&req, &mut out).await.is_err(),
            "n-tls still served"
        );
        // n-quic is still allowed: its session goes on.
        lookup(&quic, 4).await;
        rack.rewrite_clients(&["n-tcp"]);
        rack.donor.signal(libc::SIGHUP);
        wait_log(&rack.donor, "QUIC session cut", 1);
        assert!(
            quic.lookup(&req, &mut out).await.is_err(),
            "n-quic still served"
        );
        assert!(rack.refusals("revoked") >= 2.0, "{}", rack.metrics());
    });
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
}

/// A new CA and new certificates for every host.
fn force_pki(config: &Path) {
    for step in ["init", "issue"] {
        rack_harness::pki_step(config, step, true).expect("engram-cluster pki");
    }
}

/// Wait (at most 10 s) until `needle` has appeared `n` times in the log.
fn wait_log(p: &DonorProcess, needle: &str, n: usize) {
    let start = Instant::now();
    while p.log().matches(needle).count() < n {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no {needle:?} in:\n{}",
            p.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_node_reload_takes_new_certificates_and_keeps_serving() {
    let rack = SecureRack::start();
    rt().block_on(async {
        let metrics = Arc::new(NodeMetrics::new());
        let mem = Routers::from_config(&rack.config, "n-tls", &metrics)
            .await
            .expect("memory");
        let router = mem.router(1).expect("router");
        for i in 0..20 {
            assert_eq!(fetch(router, i).await, "d");
        }
        // New certificates from the same CA for every host: the node takes
        // its own on reload and keeps being served.
        rack_harness::pki_step(&rack.config.path, "issue", true).expect("issue --force");
        let report = mem
            .reload(&rack.config, "n-tls", &metrics)
            .await
            .expect("reload");
        assert!(
            report
                .to_string()
                .contains("TLS certificate reloaded (n-tls)"),
            "{report}"
        );
        for i in 20..40 {
            assert_eq!(fetch(router, i).await, "d");
        }
        // A broken certificate is refused; the node keeps the one it has.
        let files = rack.config.tls_files("n-tls").expect("files");
        std::fs::write(&files.cert, "broken").expect("break");
        let report = mem
            .reload(&rack.config, "n-tls", &metrics)
            .await
            .expect("the rest of the reload applies");
        assert!(
            !report.to_string().contains("TLS certificate reloaded"),
            "{report}"
        );
        for i in 40..60 {
            assert_eq!(fetch(router, i).await, "d");
        }
    });
}

/// A TCP connection to `to` from `from` (any 127.0.0.0/8 address), which
/// sends `bytes` and then says nothing.
fn half_open(
    from: std::net::Ipv4Addr,
    to: std::net::SocketAddr,
    bytes: &[u8],
) -> Option<std::net::TcpStream> {
    use std::io::Write;
    let mut s = rack_harness::connect_from(from, to)?;
    s.write_all(bytes).ok()?;
    Some(s)
}

/// Strangers who connect and never authenticate hold no place a node
/// needs: 1,000 half-open TLS and plain TCP connections from 40 source
/// addresses (the node's among them) and 1,000 QUIC Initials from 40
/// others cost the donor at most its pre-auth budget in threads and none
/// of its connection slots, while nodes connect and read rows over TLS,
/// TCP and QUIC.
#[test]
fn floods_of_strangers_never_take_a_nodes_place() {
    let rack = SecureRack::start();
    let (tls, tcp, quic) = (
        rack.addr(Transport::Tls),
        rack.addr(Transport::Tcp),
        rack.addr(Transport::Quic),
    );
    let before = threads(rack.donor.id());
    let mut held = Vec::new();
    // Half a ClientHello's worth of record header, then silence; a partial
    // Hello on plain TCP.
    for i in 0..1000u32 {
        let from = std::net::Ipv4Addr::new(127, 0, 2, 1 + (i % 40) as u8);
        let from = if i % 40 == 0 {
            std::net::Ipv4Addr::LOCALHOST
        } else {
            from
        };
        let (to, bytes): (_, &[u8]) = if i % 2 == 0 {
            (tls, &[0x16, 0x03, 0x01])
        } else {
            (tcp, &[13, 0, 0])
        };
        if let Some(s) = half_open(from, to, bytes) {
            held.push(s);
        }
    }
    assert!(held.len() >= 900, "only {} connections opened", held.len());
    let ca = &rack.config.tls.as_ref().expect("pki").ca;
    let initials = rack_harness::forge::quic_initials(quic, ca, [127, 0, 3], 40, 25);
    assert!(initials >= 900, "only {initials} QUIC Initials sent");
    std::thread::sleep(Duration::from_millis(200));
    let during = threads(rack.donor.id());
    assert!(
        during <= before + server_preauth_total() + 8,
        "{during} threads during the flood, {before} before"
    );
    rt().block_on(async {
        for (node, transport) in [
            ("n-tls", Transport::Tls),
            ("n-tcp", Transport::Tcp),
            ("n-quic", Transport::Quic),
        ] {
            let addr = rack.addr(transport);
            let t0 = Instant::now();
            let c = DonorClient::connect(addr, &rack.opts(node, transport, None))
                .await
                .unwrap_or_else(|e| panic!("{node} during the flood: {e}"));
            for i in 0..20 {
                lookup(&c, i).await;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{node} took {:?}",
                t0.elapsed()
            );
        }
    });
    println!(
        "{} half-open connections and {initials} QUIC Initials: donor threads {before} before, \
         {during} during; {} evicted unauthenticated, {} QUIC Retries, {} Retry tokens \
         validated, {} handshake limits",
        held.len(),
        rack.refusals("preauth_evicted"),
        rack.refusals("quic_retry"),
        sample(&rack.metrics(), "engram_donor_quic_validated_total").unwrap_or(0.0),
        rack.refusals("handshake_limit")
    );
    assert!(rack.refusals("preauth_evicted") > 0.0, "{}", rack.metrics());
    assert!(rack.refusals("quic_retry") > 0.0, "{}", rack.metrics());
    // Strangers held no served slot.
    let open = sample(&rack.metrics(), "engram_donor_connections_open").unwrap_or(-1.0);
    assert!(open <= 3.0, "{open} served connections during the flood");
    drop(held);
}

/// The donor's pre-auth budget ([`memory_donor::server::PREAUTH_TOTAL`]).
fn server_preauth_total() -> usize {
    memory_donor::server::PREAUTH_TOTAL
}
