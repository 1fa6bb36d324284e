//! `inference-node serve`, the node daemon, under a fake systemd: READY=1
//! once every source is open, sequences submitted over gRPC streamed back
//! step by step (fused outputs identical to `inference-node run`), each
//! table's sources and state, bad requests refused, SIGHUP applying a new
//! config live and refusing an invalid one, watchdog pings from the
//! serving path (and none once it is stalled), and SIGTERM draining; on a
//! Qwen4Exp rack, that family's loop behind the same API.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use engram_protocol::node_api::engram_node_client::EngramNodeClient;
use engram_protocol::node_api::{
    GenerateRequest, TablesRequest, TablesResponse, generate_event, generate_request,
};
use rack_harness::rack_toml::{NodeEntry, RackToml, RouteEntry};
use rack_harness::{
    DonorProcess, NotifySocket, QWEN_EOS, bin, free_port, model_rack, model_rack_config,
    qwen_rack_config,
};

const TEXT: &str = "The rack hums in the corner of the room. The node asks for the rows early, \
                    and the rows are ready before the block needs them.";

fn rt() -> tokio::runtime::Runtime {
    rack_harness::runtime()
}

/// Start the daemon for node `n` with the fake notify socket and `env`.
fn serve(config: &Path, notify: &NotifySocket, env: &[(&str, &str)]) -> DonorProcess {
    serve_with(config, notify, env, "5000")
}

fn serve_with(
    config: &Path,
    notify: &NotifySocket,
    env: &[(&str, &str)],
    drain_ms: &str,
) -> DonorProcess {
    let mut cmd = Command::new(bin("inference-node"));
    cmd.arg("serve")
        .arg("--config")
        .arg(config)
        .args([
            "--name",
            "n",
            "--listen",
            "127.0.0.1:0",
            "--drain-timeout-ms",
            drain_ms,
        ])
        .env("RUST_LOG", "info")
        .env("NOTIFY_SOCKET", &notify.path);
    for (k, v) in env {
        cmd.env(k, v);
    }
    DonorProcess::spawn(cmd).expect("the daemon starts")
}

async fn client(addr: std::net::SocketAddr) -> EngramNodeClient<tonic::transport::Channel> {
    EngramNodeClient::connect(format!("http://{addr}"))
        .await
        .expect("connects")
}

async fn tables(addr: std::net::SocketAddr) -> TablesResponse {
    client(addr)
        .await
        .tables(TablesRequest {})
        .await
        .expect("tables")
        .into_inner()
}

/// What a sequence's stream held.
#[derive(Debug, Default)]
struct Generated {
    /// Checksums of its positions, in order.
    sums: Vec<String>,
    /// Each step's tables' sources.
    sources: Vec<String>,
    /// Per step: table 1's rows in the (batch's) step, this sequence's
    /// positions in it, and table 1's messages.
    steps: Vec<(u32, usize, u32)>,
    /// Its summary's token count.
    tokens: u64,
}

/// Submit `req` and read its stream to the summary.
async fn generate(addr: std::net::SocketAddr, req: GenerateRequest) -> Generated {
    let mut stream = client(addr)
        .await
        .generate(req)
        .await
        .expect("accepted")
        .into_inner();
    let (mut g, mut done) = (Generated::default(), false);
    while let Some(ev) = stream.message().await.expect("stream") {
        match ev.event.expect("an event") {
            generate_event::Event::Step(s) => {
                assert!(s.positions.iter().all(|p| p.seq == 0));
                g.sums
                    .extend(s.positions.iter().map(|p| p.checksum.clone()));
                g.sources.extend(s.tables.iter().map(|t| t.source.clone()));
                g.steps
                    .push((s.tables[0].rows, s.positions.len(), s.tables[0].messages));
            }
            generate_event::Event::Summary(s) => {
                assert_eq!(s.failed_steps, 0);
                let json: serde_json::Value = serde_json::from_str(&s.json).expect("summary JSON");
                assert_eq!(json["tokens"], s.tokens);
                g.tokens = s.tokens;
                done = true;
            }
        }
    }
    assert!(done, "a summary ends the stream");
    g
}

/// `inference-node run --config CONFIG --quiet ARGS`: each step's first
/// position's checksum, from its trace.
fn run_sums(config: &Path, args: &[&std::ffi::OsStr]) -> Vec<String> {
    let trace = config.with_file_name("run-trace.jsonl");
    let out = Command::new(bin("inference-node"))
        .arg("run")
        .arg("--config")
        .arg(config)
        .arg("--quiet")
        .args(args)
        .arg("--trace")
        .arg(&trace)
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(&trace)
        .expect("trace")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            v["positions"][0]["checksum"]
                .as_str()
                .expect("sum")
                .to_string()
        })
        .collect()
}

fn text_request(max_tokens: u64) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Text(TEXT.into())),
        max_tokens,
        prefill: 0,
        speculate: 0,
    }
}

#[test]
fn the_daemon_serves_sequences_reports_tables_reloads_and_drains() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut rack = model_rack_config(dir.path()).expect("rack");
    let config = dir.path().join("rack.toml");
    rack.write(&config).expect("config");
    let _donor = DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts");
    let notify = NotifySocket::bind(dir.path()).expect("notify socket");
    let mut node = serve(&config, &notify, &[("WATCHDOG_USEC", "1000000")]);
    notify
        .wait_line(Duration::from_secs(30), "READY=1")
        .expect("READY=1");
    let addr = node.addr;
    rt().block_on(async {
        let t = tables(addr).await;
        assert_eq!(t.tokens_per_second, 50.0);
        assert_eq!(t.fusion, "cpu");
        assert_eq!(t.tables.len(), 2);
        for (tab, (id, layer)) in t.tables.iter().zip([(1, 1), (14, 14)]) {
            assert_eq!((tab.table, tab.layer), (id, layer));
            let names: Vec<&str> = tab.sources.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(names, ["d", "ssd"]);
            assert!(
                tab.sources
                    .iter()
                    .all(|s| s.admissible && s.breaker == "closed")
            );
            assert_eq!(tab.policy, "fail");
        }

        // A sequence, streamed step by step.
        let Generated {
            sums,
            sources,
            tokens,
            ..
        } = generate(addr, text_request(40)).await;
        assert_eq!((sums.len(), tokens), (40, 40));
        assert!(
            sources.iter().filter(|s| *s == "d").count() > 60,
            "{sources:?}"
        );

        // `run` over the same text fuses the same outputs.
        let input = dir.path().join("text.txt");
        std::fs::write(&input, TEXT).expect("text");
        let reference = run_sums(
            &config,
            &[
                "--name".as_ref(),
                "ref".as_ref(),
                "--tokens".as_ref(),
                "40".as_ref(),
                "--input".as_ref(),
                input.as_os_str(),
            ],
        );
        assert_eq!(sums, reference);

        // Bad requests are refused with a reason.
        let mut c = client(addr).await;
        let e = c
            .generate(GenerateRequest {
                input: None,
                max_tokens: 1,
                prefill: 0,
                speculate: 0,
            })
            .await
            .expect_err("no input");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let e = c
            .generate(GenerateRequest {
                speculate: 1_000,
                ..text_request(1)
            })
            .await
            .expect_err("too many drafts");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    });

    // Idle, the daemon proves its serving path and pings the watchdog.
    notify
        .wait(Duration::from_secs(10), |m| {
            m.iter()
                .filter(|(_, s)| s.lines().any(|l| l == "WATCHDOG=1"))
                .count()
                >= 2
        })
        .expect("watchdog pings while healthy");

    // SIGHUP applies a new rate, policy and hedge live.
    let n = rack.node_mut("n").expect("node n");
    n.tokens_per_second = Some(25.0);
    n.route[0].policy = Some("zeros".into());
    n.route[0].hedge = Some("off".into());
    rack.write(&config).expect("write");
    node.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(15);
    rt().block_on(async {
        loop {
            let t = tables(addr).await;
            if t.tokens_per_second == 25.0 && t.tables[0].policy == "zeros" {
                assert_eq!(t.tables[0].hedge, "off");
                assert_eq!(t.tables[1].policy, "fail", "only table 1's route changed");
                assert!(
                    (t.tables[0].window_us - 1000.0).abs() < 1.0,
                    "W/40 at 25 tokens/s"
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the reload was not applied: {t:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    // systemd 253+ ends a reload only for RELOADING=1 with MONOTONIC_USEC,
    // then READY=1.
    notify
        .wait(Duration::from_secs(5), |m| {
            let reloading = m.iter().position(|(_, s)| {
                s.lines().any(|l| l == "RELOADING=1")
                    && s.lines().any(|l| l.starts_with("MONOTONIC_USEC="))
            });
            reloading.is_some_and(|i| {
                m[i + 1..]
                    .iter()
                    .any(|(_, s)| s.lines().any(|l| l == "READY=1"))
            })
        })
        .expect("RELOADING=1 with MONOTONIC_USEC, then READY=1");
    // An invalid config is refused and the old one kept.
    std::fs::write(&config, "version = 1\n[rack\n").expect("write");
    node.signal(libc::SIGHUP);
    node.wait_line(Duration::from_secs(10), |l| {
        l.contains("keeping the old one").then_some(())
    })
    .expect("refusal logged");
    rt().block_on(async {
        let t = tables(addr).await;
        assert_eq!(t.tokens_per_second, 25.0);
        let g = generate(addr, text_request(5)).await;
        assert_eq!(g.sums.len(), 5, "still serving");
    });

    // SIGTERM: STOPPING=1 and a clean exit.
    node.signal(libc::SIGTERM);
    let status = node.wait(Duration::from_secs(15)).expect("exits");
    assert!(status.success(), "{}", node.log());
    notify
        .wait_line(Duration::from_secs(1), "STOPPING=1")
        .expect("STOPPING=1");
}

#[test]
fn a_stalled_model_loop_misses_its_watchdog() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = model_rack(dir.path()).expect("rack");
    let _donor = DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts");
    let notify = NotifySocket::bind(dir.path()).expect("notify socket");
    let node = serve(
        &config,
        &notify,
        &[
            ("WATCHDOG_USEC", "400000"),
            (inference_node::daemon::TEST_STALL_ENV, "1500"),
        ],
    );
    notify
        .wait_line(Duration::from_secs(30), "READY=1")
        .expect("READY=1");
    let pings = |from: Instant| {
        notify
            .messages()
            .iter()
            .filter(|(t, m)| *t >= from && m.lines().any(|l| l == "WATCHDOG=1"))
            .count()
    };
    let start = Instant::now();
    notify
        .wait(Duration::from_secs(10), |m| {
            m.iter().any(|(_, s)| s.lines().any(|l| l == "WATCHDOG=1"))
        })
        .expect("pings while healthy");
    // The stall begins 1.5 s after start; give it a period to take hold.
    let log_seen = node.wait_line(Duration::from_secs(10), |l| {
        l.contains("stops here").then_some(())
    });
    assert!(log_seen.is_ok(), "{}", node.log());
    let quiet_from = Instant::now() + Duration::from_millis(300);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(pings(quiet_from), 0, "no ping while the loop is stalled");
    assert!(pings(start) >= 1);
    // The API still answers: it is the loop that is wedged, and only the watchdog can tell.
    rt().block_on(async {
        let t = tables(node.addr).await;
        assert_eq!(t.tables.len(), 2);
    });
}

/// The unit's own `ExecStart=` (binary and config paths swapped for the
/// test's, the name variable for the node's name) starts the daemon under a fake
/// systemd, and its stop is clean.
#[test]
fn the_units_command_line_starts_the_daemon() {
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd/inference-node.service"),
    )
    .expect("unit file");
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart=");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut rack = model_rack_config(dir.path()).expect("rack");
    let config = dir.path().join("rack.toml");
    rack.write(&config).expect("config");
    let _donor = DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts");
    // The unit serves the config's api address: give node `n` a free one.
    let port = free_port().expect("port");
    rack.node_mut("n").expect("node n").api = Some(format!("127.0.0.1:{port}"));
    rack.write(&config).expect("write");
    let mut words = exec.split_whitespace();
    assert_eq!(words.next(), Some("/usr/bin/inference-node"));
    let mut cmd = Command::new(bin("inference-node"));
    for w in words {
        match w {
            "/etc/engram-rack/rack.toml" => cmd.arg(&config),
            "${ENGRAM_NODE_NAME}" => cmd.arg("n"),
            other => cmd.arg(other),
        };
    }
    let notify = NotifySocket::bind(dir.path()).expect("notify socket");
    cmd.env("NOTIFY_SOCKET", &notify.path)
        .env("RUST_LOG", "info");
    let mut node = DonorProcess::spawn(cmd).expect("the unit's command starts the daemon");
    assert_eq!(node.addr.port(), port);
    notify
        .wait_line(Duration::from_secs(30), "READY=1")
        .expect("READY=1");
    // ExecReload is `kill -HUP $MAINPID`.
    assert!(unit.contains("ExecReload=/bin/kill -HUP $MAINPID"));
    node.signal(libc::SIGHUP);
    node.wait_line(Duration::from_secs(10), |l| {
        l.contains("config applied").then_some(())
    })
    .expect("reloaded");
    node.signal(libc::SIGTERM);
    let status = node.wait(Duration::from_secs(15)).expect("exits");
    assert!(status.success(), "{}", node.log());
}

#[test]
fn sigterm_lets_the_running_sequence_end_by_the_drain_deadline_and_refuses_new_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = model_rack(dir.path()).expect("rack");
    let _donor = DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts");
    let notify = NotifySocket::bind(dir.path()).expect("notify socket");
    let mut node = serve_with(&config, &notify, &[], "1000");
    notify
        .wait_line(Duration::from_secs(30), "READY=1")
        .expect("READY=1");
    let addr = node.addr;
    rt().block_on(async {
        // 1,000 tokens at 50 tokens/s would take 20 s.
        let mut stream = client(addr)
            .await
            .generate(text_request(1_000))
            .await
            .expect("accepted")
            .into_inner();
        let first = stream.message().await.expect("stream").expect("a step");
        assert!(matches!(first.event, Some(generate_event::Event::Step(_))));
        let sent = Instant::now();
        node.signal(libc::SIGTERM);
        notify
            .wait_line(Duration::from_secs(5), "STOPPING=1")
            .expect("STOPPING=1");
        let e = client(addr)
            .await
            .generate(text_request(5))
            .await
            .expect_err("refused while draining");
        assert_eq!(e.code(), tonic::Code::Unavailable);
        let mut steps = 1;
        let mut summary = None;
        while let Some(ev) = stream.message().await.expect("stream") {
            match ev.event.expect("event") {
                generate_event::Event::Step(_) => steps += 1,
                generate_event::Event::Summary(s) => summary = Some(s),
            }
        }
        let s = summary.expect("the stopped sequence still gets its summary");
        assert_eq!(s.tokens, steps);
        assert!(steps < 1_000, "stopped at the deadline, not run to the end");
        assert!(
            sent.elapsed() < Duration::from_secs(8),
            "{:?}",
            sent.elapsed()
        );
    });
    let status = node.wait(Duration::from_secs(15)).expect("exits");
    assert!(status.success(), "{}", node.log());
}

#[test]
fn concurrent_requests_share_steps_and_fuse_what_each_fuses_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut rack = model_rack_config(dir.path()).expect("rack");
    rack.node_mut("n").expect("node n").max_batch = Some(2);
    let config = dir.path().join("rack.toml");
    rack.write(&config).expect("config");
    let _donor = DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts");
    let notify = NotifySocket::bind(dir.path()).expect("notify socket");
    let mut cmd = Command::new(bin("inference-node"));
    cmd.arg("serve")
        .arg("--config")
        .arg(&config)
        .args([
            "--name",
            "n",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "info")
        .env("NOTIFY_SOCKET", &notify.path);
    let node = DonorProcess::spawn(cmd).expect("the daemon starts");
    let metrics: std::net::SocketAddr = node
        .log()
        .split_whitespace()
        .find_map(|w| w.strip_prefix("metrics="))
        .expect("metrics address")
        .parse()
        .expect("addr");
    let addr = node.addr;
    let requests = [
        text_request(30),
        GenerateRequest {
            input: Some(generate_request::Input::Ids(
                engram_protocol::node_api::TokenIds {
                    ids: (0..40u32).map(|i| (i * 37 + 11) % 500).collect(),
                },
            )),
            max_tokens: 20,
            prefill: 6,
            speculate: 0,
        },
        GenerateRequest {
            speculate: 2,
            ..text_request(24)
        },
    ];
    rt().block_on(async {
        let mut alone = Vec::new();
        for r in &requests {
            alone.push(generate(addr, r.clone()).await);
        }
        assert_eq!(
            alone.iter().map(|g| g.sums.len()).collect::<Vec<_>>(),
            [30, 26, 24]
        );
        let (a, b, c) = tokio::join!(
            generate(addr, requests[0].clone()),
            generate(addr, requests[1].clone()),
            generate(addr, requests[2].clone()),
        );
        // The same outputs as alone, each in order.
        assert_eq!(a.sums, alone[0].sums);
        assert_eq!(b.sums, alone[1].sums);
        assert_eq!(c.sums, alone[2].sums);
        // One message per table per step, and steps were shared: a step's
        // message held another request's rows.
        let steps = || [&a, &b, &c].into_iter().flat_map(|g| g.steps.iter());
        assert!(steps().all(|&(_, _, messages)| messages == 1));
        let shared = steps()
            .filter(|&&(rows, own, _)| rows as usize > own * 24)
            .count();
        assert!(shared > 10, "{shared} shared steps");
    });
    let text = rack_harness::scrape(metrics).expect("scrape");
    let sample = |s: &str| rack_harness::sample(&text, s).unwrap_or_else(|| panic!("{s}:\n{text}"));
    assert_eq!(sample("engram_node_queue_seconds_count"), 6.0);
    let steps = sample("engram_node_batch_size_count");
    assert!(
        sample("engram_node_batch_size_bucket{le=\"1.0\"}") < steps,
        "some steps had two"
    );
    assert_eq!(
        sample("engram_node_batch_size_bucket{le=\"2.0\"}"),
        steps,
        "never more than max_batch = 2"
    );
}

/// [`qwen_rack_config`] with node `n` reading the donor (the SSD copy
/// behind) and node `ref` its local RAM copy, written to `dir/rack.toml`.
fn qwen_rack(dir: &Path) -> (std::path::PathBuf, RackToml) {
    let mut toml = qwen_rack_config(dir).expect("rack");
    let node = |name: &str, sources: &[&str]| NodeEntry {
        probe_interval_ms: Some(100),
        tokens_per_second: Some(200.0),
        max_batch: Some(2),
        prefill_budget: Some(8),
        ..NodeEntry::new(
            name,
            vec![RouteEntry::new(1, sources.iter().copied()).hedge("off")],
        )
    };
    toml.node = vec![node("n", &["d", "ssd"]), node("ref", &["local"])];
    let config = dir.join("rack.toml");
    toml.write(&config).expect("config");
    (config, toml)
}

fn ids_request(ids: Vec<u32>, max_tokens: u64, prefill: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Ids(
            engram_protocol::node_api::TokenIds { ids },
        )),
        max_tokens,
        prefill,
        speculate: 0,
    }
}

/// The daemon on a Qwen4Exp rack serves Qwen4Exp's loop: raw token ids in,
/// 16 rows a position from the donor, each sequence's PLE state carried
/// across its steps (and across the batch it shares with another), the
/// outputs those of `inference-node run` on the node's local copy; what
/// the family cannot do (text without its tokenizer, speculation, ids past
/// the vocabulary) is refused by name; reload, the self-check's watchdog
/// pings and SIGTERM as on a V4.1 rack.
#[test]
fn the_daemon_serves_a_qwen4exp_rack() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, mut rack) = qwen_rack(dir.path());
    let _donor = DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts");
    let notify = NotifySocket::bind(dir.path()).expect("notify socket");
    let mut node = serve(&config, &notify, &[("WATCHDOG_USEC", "1000000")]);
    notify
        .wait_line(Duration::from_secs(30), "READY=1")
        .expect("READY=1");
    let addr = node.addr;
    // 50 ids of a small vocabulary (n-grams repeat), an EOS inside.
    let ids: Vec<u32> = (0..50u32)
        .map(|i| {
            if i == 21 {
                QWEN_EOS
            } else {
                100 + (i * 7) % 13
            }
        })
        .collect();
    let other: Vec<u32> = (0..40u32).map(|i| 3_000 + (i * 11) % 17).collect();
    let first = rt().block_on(async {
        let t = tables(addr).await;
        assert_eq!(t.tokens_per_second, 200.0);
        assert_eq!(t.fusion, "cpu (Qwen4Exp PLE)");
        assert_eq!(t.tables.len(), 1);
        assert_eq!((t.tables[0].table, t.tables[0].layer), (1, 1));
        let names: Vec<&str> = t.tables[0]
            .sources
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(names, ["d", "ssd"]);

        let alone = generate(addr, ids_request(ids.clone(), 40, 0)).await;
        assert_eq!((alone.sums.len(), alone.tokens), (40, 40));
        // From the donor (a step late for it may fail over to the SSD copy).
        let from_donor = alone.sources.iter().filter(|s| *s == "d").count();
        assert!(from_donor > 30, "{:?}", alone.sources);
        assert!(
            alone
                .steps
                .iter()
                .all(|&(rows, own, _)| rows == 16 && own == 1)
        );

        // `run` over the same ids from the local copy: the same outputs.
        let file = dir.path().join("ids.txt");
        let text: Vec<String> = ids.iter().map(u32::to_string).collect();
        std::fs::write(&file, text.join(" ")).expect("ids");
        let reference = run_sums(
            &config,
            &[
                "--name".as_ref(),
                "ref".as_ref(),
                "--tokens".as_ref(),
                "40".as_ref(),
                "--ids".as_ref(),
                file.as_os_str(),
            ],
        );
        assert_eq!(alone.sums, reference);

        // Two at once, one prefilling in chunks of the budget: each as alone.
        let other_alone = generate(addr, ids_request(other.clone(), 20, 12)).await;
        assert_eq!(other_alone.sums.len(), 32);
        // The second joins while the first decodes (40 steps of 5 ms).
        let (a, b) = tokio::join!(generate(addr, ids_request(ids.clone(), 40, 0)), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            generate(addr, ids_request(other.clone(), 20, 12)).await
        });
        assert_eq!(a.sums, alone.sums);
        assert_eq!(b.sums, other_alone.sums);
        let shared = [&a, &b]
            .into_iter()
            .flat_map(|g| g.steps.iter())
            .filter(|&&(rows, own, _)| rows as usize > own * 16)
            .count();
        assert!(shared > 10, "{shared} shared steps");
        assert!(
            b.steps.iter().all(|&(_, own, _)| own <= 8),
            "the prefill came in chunks of 8: {:?}",
            b.steps
        );

        // What Qwen4Exp's loop cannot do is refused by name.
        let mut c = client(addr).await;
        for (req, want) in [
            (text_request(5), "token ids"),
            (
                GenerateRequest {
                    speculate: 1,
                    ..ids_request(ids.clone(), 5, 0)
                },
                "V4.1",
            ),
        ] {
            let e = c.generate(req).await.expect_err("refused");
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains(want), "{}", e.message());
        }
        // An id past the vocabulary: the stream ends with the reason.
        let mut s = c
            .generate(ids_request(vec![1, 248_320], 2, 0))
            .await
            .expect("queued")
            .into_inner();
        let e = s.message().await.expect_err("refused at admission");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("vocabulary"), "{}", e.message());
        alone.sums
    });

    // Idle, the self-check runs Qwen4Exp's loop and pings the watchdog.
    notify
        .wait(Duration::from_secs(10), |m| {
            m.iter()
                .filter(|(_, s)| s.lines().any(|l| l == "WATCHDOG=1"))
                .count()
                >= 2
        })
        .expect("watchdog pings while healthy");

    // SIGHUP applies a new rate; a changed table scale needs a restart.
    rack.node_mut("n").expect("node n").tokens_per_second = Some(100.0);
    rack.write(&config).expect("write");
    node.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(15);
    rt().block_on(async {
        while tables(addr).await.tokens_per_second != 100.0 {
            assert!(Instant::now() < deadline, "the reload was not applied");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    rack.table[0].tensor_scale = Some(0.5);
    rack.write(&config).expect("write");
    node.signal(libc::SIGHUP);
    node.wait_line(Duration::from_secs(10), |l| {
        l.contains("restart the node").then_some(())
    })
    .expect("refusal logged");
    rt().block_on(async {
        let g = generate(addr, ids_request(ids.clone(), 5, 0)).await;
        assert_eq!(g.sums, first[..5], "still serving, as before");
    });

    node.signal(libc::SIGTERM);
    let status = node.wait(Duration::from_secs(15)).expect("exits");
    assert!(status.success(), "{}", node.log());
}

/// With `[model] tokenizer` a Qwen4Exp node takes text: the tokenizer's
/// raw ids, the same outputs as a request of those ids; `run --input`
/// reads text the same way.
#[test]
fn a_qwen4exp_node_with_its_tokenizer_takes_text() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, mut rack) = qwen_rack(dir.path());
    let tok = inference_node::model::input::word_tokenizer(TEXT).expect("tokenizer");
    let file = dir.path().join("tokenizer.json");
    tok.save(&file, false).expect("save");
    rack.model.as_mut().expect("model").tokenizer = Some(file.display().to_string());
    rack.write(&config).expect("write");
    let ids = tok.encode(TEXT, false).expect("encode").get_ids().to_vec();
    assert!(ids.len() > 20 && ids.iter().all(|&i| i < 1_000), "{ids:?}");
    let _donor = DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts");
    let notify = NotifySocket::bind(dir.path()).expect("notify socket");
    let mut node = serve(&config, &notify, &[]);
    notify
        .wait_line(Duration::from_secs(30), "READY=1")
        .expect("READY=1");
    let sums = rt().block_on(async {
        let text = generate(node.addr, text_request(20)).await;
        let by_ids = generate(node.addr, ids_request(ids.clone(), 20, 0)).await;
        assert_eq!(text.sums.len(), 20);
        assert_eq!(text.sums, by_ids.sums);
        text.sums
    });
    let input = dir.path().join("text.txt");
    std::fs::write(&input, TEXT).expect("text");
    let reference = run_sums(
        &config,
        &[
            "--name".as_ref(),
            "ref".as_ref(),
            "--tokens".as_ref(),
            "20".as_ref(),
            "--input".as_ref(),
            input.as_os_str(),
        ],
    );
    assert_eq!(sums, reference);
    node.signal(libc::SIGTERM);
    let status = node.wait(Duration::from_secs(15)).expect("exits");
    assert!(status.success(), "{}", node.log());
}
