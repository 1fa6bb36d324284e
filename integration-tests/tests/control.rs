//! The donor's control plane (gRPC health, ListTables, Stats, Drain) and
//! its `/metrics`, against the real `memory-donor` process on loopback.

use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use engram_protocol::control::donor_control_client::DonorControlClient;
use engram_protocol::control::{
    DrainRequest, ListTablesRequest, LoadState, SERVICE_NAME, StatsRequest,
};
use engram_protocol::synthetic::first_mismatch;
use engram_protocol::{ErrorCode, ROW_BYTES, TableDigest};
use inference_node::{ClientError, ClientOptions, DonorClient, Request};
use rack_harness::runtime as rt;
use rack_harness::{DonorProcess, OpsAddrs, exchange, gen_table, sample, scrape};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

const SEED: u64 = 5;
const OPS: [&str; 4] = ["--control", "127.0.0.1:0", "--metrics", "127.0.0.1:0"];

async fn health(ops: &OpsAddrs) -> HealthClient<Channel> {
    let channel = Channel::from_shared(ops.control_uri())
        .expect("uri")
        .connect()
        .await
        .expect("health connects");
    HealthClient::new(channel)
}

async fn control(ops: &OpsAddrs) -> DonorControlClient<Channel> {
    DonorControlClient::connect(ops.control_uri())
        .await
        .expect("control connects")
}

async fn check(h: &mut HealthClient<Channel>, service: &str) -> ServingStatus {
    let r = h
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .expect("health check")
        .into_inner();
    ServingStatus::try_from(r.status).expect("known status")
}

/// Drop a file's pages from the page cache, so loading it reads the disk.
fn evict(path: &std::path::Path) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).expect("open");
    // SAFETY: fadvise only advises the kernel about this open descriptor.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// A table and a donor serving it with a control plane and metrics.
fn donor_with_ops(
    rows: u64,
    extra: &[&str],
) -> (tempfile::TempDir, TableDigest, DonorProcess, OpsAddrs) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "t.etab", 1, rows, SEED).expect("gen");
    let table = path.display().to_string();
    let mut args = vec!["--table", &table, "--listen", "127.0.0.1:0"];
    args.extend_from_slice(&OPS);
    args.extend_from_slice(extra);
    let donor = DonorProcess::start(&args).expect("donor starts");
    let ops = donor.ops().expect("ops line");
    (dir, digest, donor, ops)
}

#[test]
fn health_is_not_serving_while_loading_and_list_tables_shows_progress() {
    // 2,000,000 rows (528 MB) read from disk and hashed: a load long enough
    // that the checks below land inside it with a wide margin.
    const ROWS: u64 = 2_000_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "big.etab", 14, ROWS, SEED).expect("gen");
    evict(&path);
    let table = format!("3={}", path.display());
    let mut args = vec![
        "--table",
        &table,
        "--listen",
        "127.0.0.1:0",
        "--mlock",
        "off",
    ];
    args.extend_from_slice(&OPS);
    let process = DonorProcess::launch(&args).expect("launch");
    let ops = process.ops().expect("ops line before loading");
    assert!(ops.control.is_some() && ops.metrics.is_some(), "{ops:?}");
    let runtime = rt();
    let watched = runtime.block_on(async {
        let mut h = health(&ops).await;
        // A watch sees every change from here on: NOT_SERVING first.
        let mut watch = h
            .watch(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .expect("watch")
            .into_inner();
        let first = watch.message().await.expect("watch").expect("a status");
        assert_eq!(check(&mut h, "").await, ServingStatus::NotServing);
        assert_eq!(check(&mut h, SERVICE_NAME).await, ServingStatus::NotServing);
        let mut c = control(&ops).await;
        let list = c
            .list_tables(ListTablesRequest {})
            .await
            .expect("list")
            .into_inner();
        let t = &list.tables[0];
        assert!(
            matches!(t.state(), LoadState::Loading | LoadState::Verifying),
            "{t:?}"
        );
        assert!(t.verify && t.bytes_done <= t.bytes_total, "{t:?}");
        if !t.digest.is_empty() {
            assert_eq!((t.id, t.layer, t.rows), (3, 14, ROWS));
            assert_eq!(t.bytes_total, ROWS * ROW_BYTES as u64);
            assert_eq!(t.digest, digest.to_hex());
        }
        let page = scrape(ops.metrics.expect("metrics")).expect("scrape");
        assert!(page.starts_with("HTTP/1.1 200 OK\r\n"), "{page}");
        assert_eq!(
            sample(
                &page,
                "engram_donor_table_state{table=\"3\",layer=\"14\",state=\"ready\"}"
            )
            .unwrap_or(0.0),
            0.0
        );
        // Then SERVING once the table is resident and verified.
        let mut seen: Vec<HealthCheckResponse> = vec![first];
        while seen.last().map(|r| r.status) != Some(ServingStatus::Serving as i32) {
            let next = tokio::time::timeout(Duration::from_secs(60), watch.message())
                .await
                .expect("serving within a minute")
                .expect("watch")
                .expect("a status");
            seen.push(next);
        }
        seen
    });
    assert_eq!(
        watched.first().map(|r| r.status),
        Some(ServingStatus::NotServing as i32),
        "{watched:?}"
    );
    let donor = process.ready().expect("ready");
    runtime.block_on(async {
        let mut h = health(&ops).await;
        assert_eq!(check(&mut h, "").await, ServingStatus::Serving);
        assert_eq!(check(&mut h, SERVICE_NAME).await, ServingStatus::Serving);
        let list = control(&ops)
            .await
            .list_tables(ListTablesRequest {})
            .await
            .expect("list")
            .into_inner();
        assert_eq!(list.donor, "memory-donor");
        assert!(!list.draining);
        let t = &list.tables[0];
        assert_eq!(t.state(), LoadState::Ready);
        assert_eq!((t.id, t.layer, t.rows), (3, 14, ROWS));
        assert_eq!(t.digest, digest.to_hex());
        assert_eq!((t.bytes_done, t.bytes_total), (t.bytes_total, ROWS * 264));
        assert_eq!(t.path, path.display().to_string());
    });
    let page = scrape(ops.metrics.expect("metrics")).expect("scrape");
    assert_eq!(
        sample(
            &page,
            "engram_donor_table_state{table=\"3\",layer=\"14\",state=\"ready\"}"
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        sample(&page, "engram_donor_table_rows{table=\"3\",layer=\"14\"}"),
        Some(ROWS as f64)
    );
    drop(donor);
}

#[test]
fn stats_and_metrics_count_lookups_and_survive_garbage() {
    const ROWS: u64 = 50_000;
    let (_dir, digest, donor, ops) = donor_with_ops(ROWS, &[]);
    let metrics = ops.metrics.expect("metrics");
    let runtime = rt();
    let client = runtime.block_on(async {
        let c = DonorClient::connect(donor.addr, &ClientOptions::new("n", vec![(1, digest)]))
            .await
            .expect("connects");
        let mut out = vec![0u8; 24 * ROW_BYTES];
        for i in 0..10u64 {
            let rows: Vec<u64> = (0..24).map(|k| (i * 977 + k * 31) % ROWS).collect();
            let req = [Request {
                table: 1,
                rows: &rows,
            }];
            c.lookup(&req, &mut out).await.expect("lookup");
            assert!(first_mismatch(SEED, 1, &rows, &out).is_none());
        }
        let e = c
            .lookup(
                &[Request {
                    table: 1,
                    rows: &[ROWS],
                }],
                &mut out[..ROW_BYTES],
            )
            .await
            .expect_err("out of range");
        assert!(matches!(e, ClientError::Section { .. }), "{e:?}");
        let s = control(&ops)
            .await
            .stats(StatsRequest {})
            .await
            .expect("stats")
            .into_inner();
        assert_eq!((s.lookups, s.rows), (11, 240));
        assert!(s.bytes > 240 * ROW_BYTES as u64, "{}", s.bytes);
        let errors: Vec<_> = s
            .errors
            .iter()
            .map(|e| (e.name.as_str(), e.count))
            .collect();
        assert_eq!(errors, vec![("row_out_of_range", 1)]);
        assert_eq!(
            s.errors[0].code,
            u32::from(ErrorCode::RowOutOfRange.to_u16())
        );
        let conns = s.connections.expect("connections");
        assert_eq!((conns.open, conns.accepted, conns.refused), (1, 1, 0));
        let t = s.service_time.expect("service time");
        assert_eq!(t.count, 11);
        assert!(
            t.p50_us > 0.0 && t.p50_us <= t.p99_us && t.p99_us <= t.max_us,
            "{t:?}"
        );
        assert!(s.uptime_seconds > 0.0);
        c
    });
    // The operator's view of the same numbers: `engram-cluster status` by
    // the donor's control address (no config: plaintext).
    let addr = ops.control.expect("control").to_string();
    let status = |args: &[&str]| {
        let out = std::process::Command::new(rack_harness::bin("engram-cluster"))
            .arg("status")
            .args(args)
            .output()
            .expect("engram-cluster runs");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, text, err) = status(&[&addr, "--detail"]);
    assert_eq!(code, Some(0), "{text}{err}");
    let head = format!("{addr}  {addr}  SERVING");
    assert!(
        text.lines().nth(1).is_some_and(|l| l.starts_with(&head)),
        "{text}"
    );
    assert!(
        text.contains(&format!("{addr} ({addr}): SERVING")),
        "{text}"
    );
    assert!(text.contains("  lookups 11 rows 240"), "{text}");
    assert!(text.contains("  errors row_out_of_range (3): 1"), "{text}");
    assert!(
        text.contains(&format!(
            "  table 1 layer 1 rows {ROWS} digest {} ready 100.0%",
            digest.to_hex()
        )),
        "{text}"
    );
    // Without a config, donors are named by address, and there is no "all".
    let (code, _, err) = status(&[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("name the donors to ask"), "{err}");
    let (code, _, err) = status(&["not-an-address"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("is not a control address (HOST:PORT)"),
        "{err}"
    );
    let page = scrape(metrics).expect("scrape");
    let (head, body) = page.split_once("\r\n\r\n").expect("a head");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    // Header names are case-insensitive (hyper writes them in lower case).
    let fields = head.to_ascii_lowercase();
    assert!(
        fields.contains("content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"),
        "{head}"
    );
    assert!(
        fields.contains(&format!("content-length: {}", body.len())),
        "{head}"
    );
    for (series, want) in [
        ("engram_donor_lookups_total", 11.0),
        ("engram_donor_rows_total", 240.0),
        ("engram_donor_errors_total{code=\"row_out_of_range\"}", 1.0),
        ("engram_donor_service_time_seconds_count", 11.0),
        (
            "engram_donor_service_time_seconds_bucket{le=\"+Inf\"}",
            11.0,
        ),
        ("engram_donor_connections_open", 1.0),
        ("engram_donor_connections_accepted_total", 1.0),
        ("engram_donor_connections_refused_total", 0.0),
        (
            "engram_donor_table_state{table=\"1\",layer=\"1\",state=\"ready\"}",
            1.0,
        ),
        (
            "engram_donor_table_state{table=\"1\",layer=\"1\",state=\"loading\"}",
            0.0,
        ),
        ("engram_donor_draining", 0.0),
    ] {
        assert_eq!(sample(body, series), Some(want), "{series} in:\n{body}");
    }
    assert!(body.ends_with("# EOF\n"));

    // Garbage, wrong methods and paths, and an oversized head: typed
    // answers or a close, and the donor goes on serving both planes.
    let mut junk = vec![0u8; 3000];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in junk.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let answer = exchange(metrics, &junk).expect("junk");
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 4"),
        "{answer}"
    );
    let answer = exchange(metrics, b"GET\r\n\r\n").expect("no target");
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    let answer = exchange(metrics, b"DELETE /metrics HTTP/1.1\r\n\r\n").expect("delete");
    assert!(answer.starts_with("HTTP/1.1 405 "), "{answer}");
    let answer = exchange(metrics, b"GET /debug HTTP/1.1\r\n\r\n").expect("404");
    assert!(answer.starts_with("HTTP/1.1 404 "), "{answer}");
    let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    huge.resize(64 << 10, b'a');
    let answer = exchange(metrics, &huge).expect("huge");
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 431 "),
        "{answer}"
    );
    let again = scrape(metrics).expect("scrape");
    assert!(again.starts_with("HTTP/1.1 200 OK"), "{again}");
    runtime.block_on(async {
        let rows: Vec<u64> = (0..24).collect();
        let mut out = vec![0u8; 24 * ROW_BYTES];
        client
            .lookup(
                &[Request {
                    table: 1,
                    rows: &rows,
                }],
                &mut out,
            )
            .await
            .expect("still serving");
        let s = control(&ops)
            .await
            .stats(StatsRequest {})
            .await
            .expect("stats")
            .into_inner();
        assert_eq!(s.lookups, 12);
    });
}

/// A data-plane connection that says Hello and then never closes, to hold a
/// drain open until its deadline.
fn stubborn_connection(addr: std::net::SocketAddr) -> TcpStream {
    let mut s = rack_harness::hello_stream(addr, "stubborn");
    let mut first = [0u8; 16];
    s.read_exact(&mut first).expect("welcome");
    s
}

#[test]
fn drain_over_grpc_sends_goodbye_and_the_donor_exits_cleanly() {
    let (_dir, digest, mut donor, ops) = donor_with_ops(10_000, &["--drain-timeout-ms", "3000"]);
    let _stubborn = stubborn_connection(donor.addr);
    rt().block_on(async {
        let c = DonorClient::connect(donor.addr, &ClientOptions::new("n", vec![(1, digest)]))
            .await
            .expect("connects");
        let mut h = health(&ops).await;
        assert_eq!(check(&mut h, "").await, ServingStatus::Serving);
        let mut ctl = control(&ops).await;
        let d = ctl
            .drain(DrainRequest {})
            .await
            .expect("drain")
            .into_inner();
        assert!(d.started);
        assert_eq!(d.grace_ms, 3000);
        // The stubborn connection holds the drain open: meanwhile the donor
        // says NOT_SERVING and reports draining.
        assert_eq!(check(&mut h, "").await, ServingStatus::NotServing);
        let list = ctl
            .list_tables(ListTablesRequest {})
            .await
            .expect("list")
            .into_inner();
        assert!(list.draining);
        let again = ctl
            .drain(DrainRequest {})
            .await
            .expect("drain")
            .into_inner();
        assert!(!again.started, "a second Drain is a no-op");
        // The client notices Goodbye on its next request; lookups sent before
        // the Goodbye reached it are still answered.
        let end = Instant::now() + Duration::from_secs(5);
        let rows: Vec<u64> = (0..24).collect();
        let mut out = vec![0u8; 24 * ROW_BYTES];
        while Instant::now() < end {
            let req = [Request {
                table: 1,
                rows: &rows,
            }];
            match c.lookup(&req, &mut out).await {
                Ok(()) => tokio::time::sleep(Duration::from_millis(5)).await,
                Err(ClientError::Draining) => break,
                Err(e) => panic!("lookup during the drain: {e:?}"),
            }
        }
        assert!(c.is_draining(), "the client saw Goodbye");
    });
    let status = donor.wait(Duration::from_secs(15)).expect("donor exits");
    assert!(status.success(), "{status:?}\n{}", donor.log());
    let log = donor.log();
    assert!(
        log.contains("drain requested over the control plane"),
        "{log}"
    );
    assert!(log.contains("drained"), "{log}");
}

#[test]
fn drain_while_loading_exits_cleanly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = gen_table(dir.path(), "t.etab", 1, 1_000_000, SEED).expect("gen");
    evict(&path);
    let table = path.display().to_string();
    let mut args = vec![
        "--table",
        &table,
        "--listen",
        "127.0.0.1:0",
        "--mlock",
        "off",
    ];
    args.extend_from_slice(&OPS[..2]);
    let mut process = DonorProcess::launch(&args).expect("launch");
    let ops = process.ops().expect("ops line");
    assert_eq!(ops.metrics, None);
    let d = rt().block_on(async {
        control(&ops)
            .await
            .drain(DrainRequest {})
            .await
            .expect("drain answered")
            .into_inner()
    });
    assert!(d.started);
    let status = process.wait(Duration::from_secs(30)).expect("exits");
    assert!(status.success(), "{status:?}\n{}", process.log());
}
