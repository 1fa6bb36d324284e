//! The authorized control plane on real processes: a donor of a rack with
//! a PKI serves its control plane over TLS and lets nodes read, operators
//! act, and nobody else in; `engram-cluster status|drain|swap` operate it;
//! SwapTable loads only files under the table directory with the expected
//! digest; the node's control probe uses its own certificate. On a rack
//! without a PKI, Drain works from loopback.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use cluster_config::Config;
use engram_protocol::TableDigest;
use engram_protocol::control::donor_control_client::DonorControlClient;
use engram_protocol::control::{DrainRequest, ListTablesRequest, StatsRequest, SwapTableRequest};
use inference_node::ClientOptions;
use inference_node::source::{ControlTls, DonorSource, RowSource};
use rack_harness::pki::TestPki;
use rack_harness::rack_toml::{
    DonorEntry, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
};
use rack_harness::runtime as rt;
use rack_harness::{DonorProcess, OpsAddrs, bin, free_port, gen_table, sample, scrape};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

const ROWS: u64 = 2_000;

/// A one-donor rack on loopback: tables under `tables/`, a second version
/// beside them, a copy of it outside; a PKI (CA, donor `d`, node `n`,
/// operator `ops-1`, and `stranger`, whom the CA signed but the config
/// does not name) when `tls`.
struct Rack {
    dir: tempfile::TempDir,
    config: PathBuf,
    control: std::net::SocketAddr,
    v1: TableDigest,
    v2: (PathBuf, TableDigest),
    outside: PathBuf,
    pki: Option<TestPki>,
}

impl Rack {
    fn new(tls: bool) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let tables = dir.path().join("tables");
        std::fs::create_dir_all(&tables).expect("mkdir");
        let (p1, v1) = gen_table(&tables, "v1.etab", 1, ROWS, 1).expect("gen v1");
        let (p2, d2) = gen_table(&tables, "v2.etab", 1, ROWS, 2).expect("gen v2");
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir_all(&elsewhere).expect("mkdir");
        let outside = elsewhere.join("v2.etab");
        std::fs::copy(&p2, &outside).expect("copy");
        let pki = tls.then(|| {
            let pki = TestPki::new(&dir.path().join("pki"), "rack CA").expect("CA");
            for host in ["d", "n", "ops-1", "stranger"] {
                pki.issue(host).expect("issue");
            }
            pki
        });
        let control = std::net::SocketAddr::from(([127, 0, 0, 1], free_port().expect("port")));
        let mut rack = RackToml::new("t");
        if tls {
            rack.rack.tls = Some(TlsSection::with_operators(["ops-1"]));
        }
        rack.table = vec![TableEntry::new(1, &p1, ROWS, v1)];
        let listen = format!("tcp://127.0.0.1:{}", free_port().expect("port"));
        rack.donor = vec![DonorEntry {
            headroom_gib: Some(0.1),
            control: Some(control.to_string()),
            metrics: Some("127.0.0.1:0".into()),
            ..DonorEntry::new("d", [listen], [1])
        }];
        rack.node = vec![NodeEntry::new("n", vec![RouteEntry::new(1, ["d"])])];
        let config = dir.path().join("rack.toml");
        rack.write(&config).expect("write config");
        Self {
            dir,
            config,
            control,
            v1,
            v2: (p2, d2),
            outside,
            pki,
        }
    }

    fn start(&self) -> (DonorProcess, OpsAddrs) {
        let config = self.config.display().to_string();
        let donor = DonorProcess::start(&["--config", &config, "--name", "d"]).expect("donor");
        let ops = donor.ops().expect("ops line");
        assert_eq!(ops.control, Some(self.control));
        (donor, ops)
    }

    fn pki(&self) -> &TestPki {
        self.pki.as_ref().expect("a rack with a PKI")
    }

    /// `engram-cluster ARGS --config RACK`.
    fn cluster(&self, args: &[&str]) -> Output {
        Command::new(bin("engram-cluster"))
            .args(args)
            .arg("--config")
            .arg(&self.config)
            .output()
            .expect("engram-cluster runs")
    }

    /// A control channel over TLS as `host` (its certificate and key), trusting `ca`.
    async fn channel_as(&self, host: &str, ca: &str, pems: (String, String)) -> Option<Channel> {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .identity(Identity::from_pem(pems.0, pems.1))
            .domain_name("d");
        let ep = Endpoint::from_shared(format!("https://{}", self.control))
            .expect("uri")
            .tls_config(tls)
            .expect("tls")
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(10));
        match ep.connect().await {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("{host}: connect failed: {e:?}");
                None
            }
        }
    }

    /// A control channel as `host`, whose certificate the rack CA signed.
    async fn channel(&self, host: &str) -> Channel {
        let pki = self.pki();
        self.channel_as(host, &pki.ca_pem, pki.pems(host).expect("pems"))
            .await
            .expect("connects")
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn swap_request(path: &Path, digest: &str) -> SwapTableRequest {
    SwapTableRequest {
        table_id: 1,
        path: path.display().to_string(),
        expected_digest: digest.to_string(),
        in_place: false,
    }
}

fn refusals(ops: &OpsAddrs, reason: &str) -> f64 {
    let page = scrape(ops.metrics.expect("metrics")).expect("scrape");
    sample(
        &page,
        &format!("engram_donor_refusals_total{{plane=\"control\",reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

async fn health(ch: Channel) -> Result<i32, tonic::Status> {
    HealthClient::new(ch)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(|r| r.into_inner().status)
}

#[test]
fn a_node_reads_but_may_not_drain_or_swap_and_strangers_get_nothing() {
    let rack = Rack::new(true);
    let (donor, ops) = rack.start();
    rt().block_on(async {
        // A node: health, ListTables and Stats.
        let ch = rack.channel("n").await;
        assert_eq!(health(ch.clone()).await.expect("health"), 1, "SERVING");
        let mut c = DonorControlClient::new(ch);
        let list = c
            .list_tables(ListTablesRequest {})
            .await
            .expect("a node lists tables")
            .into_inner();
        assert_eq!(list.tables[0].digest, rack.v1.to_hex());
        c.stats(StatsRequest {}).await.expect("a node reads stats");
        // ... but neither Drain nor SwapTable.
        let e = c.drain(DrainRequest {}).await.expect_err("a node drains");
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("n is a node"), "{e:?}");
        let e = c
            .swap_table(swap_request(&rack.v2.0, &rack.v2.1.to_hex()))
            .await
            .expect_err("a node swaps");
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");

        // A name the CA signed but the rack gives no role: not even health.
        let e = health(rack.channel("stranger").await)
            .await
            .expect_err("a stranger's health check");
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("stranger has no role"), "{e:?}");

        // A certificate from another CA (named as the operator): the handshake refuses it.
        let rogue = TestPki::new(&rack.dir.path().join("rogue"), "rogue CA").expect("CA");
        rogue.issue("ops-1").expect("issue");
        let pems = rogue.pems("ops-1").expect("pems");
        let refused = match rack.channel_as("rogue", &rack.pki().ca_pem, pems).await {
            None => true,
            Some(ch) => DonorControlClient::new(ch)
                .drain(DrainRequest {})
                .await
                .is_err(),
        };
        assert!(refused, "a certificate from another CA got through");

        // Plaintext against the TLS control plane: refused at the handshake too.
        let plain = Endpoint::from_shared(format!("http://{}", rack.control))
            .expect("uri")
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(5));
        if let Ok(ch) = plain.connect().await {
            health(ch)
                .await
                .expect_err("plaintext health on a TLS port");
        }
    });
    donor
        .wait_line(Duration::from_secs(10), |l| {
            (l.contains("control call refused")
                && l.contains("caller=n (127.0.0.1:")
                && l.contains("rpc=\"Drain\""))
            .then_some(())
        })
        .expect("the node's Drain is logged");
    // Logged after it is counted: two lines, two counts at least.
    let mut failed = 0;
    donor
        .wait_line(Duration::from_secs(10), |l| {
            failed += usize::from(l.contains("control plane: TLS handshake failed"));
            (failed >= 2).then_some(())
        })
        .expect("both failed handshakes are logged");
    assert_eq!(refusals(&ops, "not_operator"), 2.0, "{}", donor.log());
    assert_eq!(refusals(&ops, "no_role"), 1.0, "{}", donor.log());
    assert!(refusals(&ops, "handshake_failed") >= 2.0, "{}", donor.log());
    assert!(donor.log().contains("ready listen="), "still serving");
}

#[test]
fn the_node_probes_the_control_plane_with_its_certificate() {
    let rack = Rack::new(true);
    let (donor, _ops) = rack.start();
    let config = Config::load(&rack.config).expect("config");
    let files = config.tls_files("n").expect("node files");
    let tls = ControlTls(inference_node::tls::NodeTls::load(&files).expect("node material"));
    rt().block_on(async {
        let opts = || ClientOptions::new("n", vec![(1, rack.v1)]);
        let src = DonorSource::new("d", vec![donor.addr], opts())
            .with_control(Some(rack.control))
            .with_control_tls(Some(tls));
        let tables = src.probe().await.expect("probe over TLS");
        assert_eq!(tables, vec![(1, rack.v1)]);
        // Without its certificate the probe cannot get in.
        let plain =
            DonorSource::new("d", vec![donor.addr], opts()).with_control(Some(rack.control));
        plain
            .probe()
            .await
            .expect_err("a plaintext probe of a TLS control plane");
    });
}

#[test]
fn an_operator_drains_and_swaps_only_files_of_the_table_directory_with_their_digest() {
    let rack = Rack::new(true);
    let (mut donor, ops) = rack.start();
    let (v2, d2) = (&rack.v2.0, rack.v2.1);

    let out = rack.cluster(&["status"]);
    let shown = text(&out.stdout);
    assert!(out.status.success(), "{shown}{}", text(&out.stderr));
    let line = shown
        .lines()
        .find(|l| l.starts_with("d "))
        .expect("d's line");
    assert!(
        line.contains("SERVING") && line.contains(&format!("1:ready:{}", &rack.v1.to_hex()[..12])),
        "{shown}"
    );

    // Outside the table directory: directly, and through a symlink inside it.
    let swap = |file: &Path, digest: &str| {
        rack.cluster(&[
            "swap",
            "d",
            "--table",
            "1",
            "--file",
            &file.display().to_string(),
            "--digest",
            digest,
        ])
    };
    let out = swap(&rack.outside, &d2.to_hex());
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("d refused: ") && err.contains("outside the donor's table directories"),
        "{err}"
    );
    let link = v2.with_file_name("escape.etab");
    std::os::unix::fs::symlink(&rack.outside, &link).expect("symlink");
    let err = text(&swap(&link, &d2.to_hex()).stderr);
    assert!(
        err.contains("d refused: ") && err.contains("no symbolic link"),
        "{err}"
    );
    // Refused without saying where the link leads.
    assert!(!err.contains(&rack.outside.display().to_string()), "{err}");
    // A FIFO inside the table directory: refused at once, the donor unharmed.
    let fifo = v2.with_file_name("fifo.etab");
    let c = std::ffi::CString::new(fifo.display().to_string()).expect("path");
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    let t0 = std::time::Instant::now();
    let err = text(&swap(&fifo, &d2.to_hex()).stderr);
    assert!(err.contains("not a regular file"), "{err}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the FIFO held the swap"
    );
    let out = rack.cluster(&["status"]);
    assert!(
        out.status.success(),
        "status after the FIFO: {}",
        text(&out.stderr)
    );
    // The wrong digest: both named.
    let out = swap(v2, &rack.v1.to_hex());
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("FailedPrecondition")
            && err.contains(&format!("digest is {d2}, not the expected {}", rack.v1)),
        "{err}"
    );
    // A malformed digest never leaves the operator's machine.
    assert_eq!(swap(v2, "abc").status.code(), Some(2));
    rt().block_on(async {
        // No digest at all: INVALID_ARGUMENT.
        let mut c = DonorControlClient::new(rack.channel("ops-1").await);
        let e = c
            .swap_table(swap_request(v2, ""))
            .await
            .expect_err("no digest");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    });
    // The right file and digest: swapped.
    let out = swap(v2, &d2.to_hex());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("d: swapping table 1"));
    donor
        .wait_line(Duration::from_secs(30), |l| {
            l.contains("table swapped").then_some(())
        })
        .expect("swapped");
    assert_eq!(refusals(&ops, "swap_path"), 2.0, "{}", donor.log());
    assert_eq!(refusals(&ops, "swap_digest"), 2.0, "{}", donor.log());

    // A node's certificate may not drain; the operator's may.
    let out = rack.cluster(&["drain", "d", "--as", "n"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("d refused: n is a node"), "{err}");
    let out = rack.cluster(&["drain", "d"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("d: draining"));
    let status = donor
        .wait(Duration::from_secs(20))
        .expect("the donor exits");
    assert!(status.success(), "{status:?}");
}

#[test]
fn without_a_pki_drain_and_swap_work_from_loopback_only_within_the_table_directory() {
    let rack = Rack::new(false);
    let (mut donor, _ops) = rack.start();
    let out = rack.cluster(&["status", "d"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = rack.cluster(&[
        "swap",
        "d",
        "--table",
        "1",
        "--file",
        &rack.outside.display().to_string(),
        "--digest",
        &rack.v2.1.to_hex(),
    ]);
    let err = text(&out.stderr);
    assert!(
        err.starts_with("d refused: ") && err.contains("outside the donor's table directories"),
        "{err}"
    );
    let out = rack.cluster(&["drain", "d", "--as", "ops-1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--as is ignored"));
    assert!(text(&out.stdout).starts_with("d: draining"));
    let status = donor
        .wait(Duration::from_secs(20))
        .expect("the donor exits");
    assert!(status.success(), "{status:?}");
}

/// 200 silent connections to the control port (from 20 addresses, the
/// operator's among them) keep neither an operator nor a node's probe out:
/// they wait in a pre-auth budget of their own, whose oldest are evicted.
#[test]
fn silent_strangers_do_not_keep_operators_or_probes_out() {
    let rack = Rack::new(true);
    let (donor, ops) = rack.start();
    let mut silent = Vec::new();
    for i in 0..200u32 {
        let from = if i % 20 == 0 {
            std::net::Ipv4Addr::LOCALHOST
        } else {
            std::net::Ipv4Addr::new(127, 0, 4, (i % 20) as u8)
        };
        let s = rack_harness::connect_from(from, rack.control);
        silent.extend(s);
    }
    assert!(
        silent.len() >= 190,
        "only {} connections opened",
        silent.len()
    );
    let t0 = std::time::Instant::now();
    let out = rack.cluster(&["status"]);
    assert!(
        out.status.success(),
        "status during the flood: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "status took {:?}",
        t0.elapsed()
    );
    let config = Config::load(&rack.config).expect("config");
    let files = config.tls_files("n").expect("node files");
    let tls = ControlTls(inference_node::tls::NodeTls::load(&files).expect("node material"));
    rt().block_on(async {
        let opts = ClientOptions::new("n", vec![(1, rack.v1)]);
        let src = DonorSource::new("d", vec![donor.addr], opts)
            .with_control(Some(rack.control))
            .with_control_tls(Some(tls));
        assert_eq!(
            src.probe().await.expect("probe during the flood"),
            vec![(1, rack.v1)]
        );
    });
    let m = scrape(ops.metrics.expect("metrics")).expect("scrape");
    let evicted = sample(
        &m,
        "engram_donor_refusals_total{plane=\"control\",reason=\"preauth_evicted\"}",
    )
    .unwrap_or(0.0);
    println!(
        "200 silent control connections: {evicted} evicted; status in {:?}",
        t0.elapsed()
    );
    assert!(evicted > 0.0, "{m}");
    drop(silent);
}

/// An operator's open HTTP/2 session made with the old CA's certificate
/// gets nothing once a new CA is loaded: every call checks the caller's
/// certificate again.
#[test]
fn a_new_ca_cuts_an_open_control_session_of_the_old_one() {
    let rack = Rack::new(true);
    let (donor, _ops) = rack.start();
    rt().block_on(async {
        let mut c = DonorControlClient::new(rack.channel("ops-1").await);
        c.list_tables(ListTablesRequest {})
            .await
            .expect("allowed before");
        // A new CA, and new certificates from it for the donor and ops-1.
        let pki = rack.pki();
        let fresh = TestPki::new(&pki.dir, "new rack CA").expect("new CA");
        for host in ["d", "n", "ops-1"] {
            fresh.issue(host).expect("issue");
        }
        donor.signal(libc::SIGHUP);
        let t0 = std::time::Instant::now();
        let e = loop {
            match c.list_tables(ListTablesRequest {}).await {
                Err(e) => break e,
                Ok(_) if t0.elapsed() < Duration::from_secs(10) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(_) => panic!("the old CA's session is still served"),
            }
        };
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("no longer verifies"), "{e:?}");
    });
}
