//! The donor under a fake systemd: a notification socket the test owns,
//! `WATCHDOG_USEC` set. READY=1 only once every table is loaded and
//! verified, STATUS lines with load progress before it, WATCHDOG=1 while
//! the serving path answers and none while it hangs, STOPPING=1 on SIGTERM.

use std::time::{Duration, Instant};

use engram_protocol::control::donor_control_client::DonorControlClient;
use engram_protocol::control::{ListTablesRequest, LoadState};
use rack_harness::{NotifySocket, OpsAddrs, Process, gen_table};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

async fn health(ops: &OpsAddrs) -> ServingStatus {
    let channel = tonic::transport::Channel::from_shared(ops.control_uri())
        .expect("uri")
        .connect()
        .await
        .expect("health connects");
    let mut h = HealthClient::new(channel);
    let r = h
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("check")
        .into_inner();
    ServingStatus::try_from(r.status).expect("status")
}

fn has_line(msg: &str, line: &str) -> bool {
    msg.lines().any(|l| l == line)
}

fn count(msgs: &[(Instant, String)], line: &str) -> usize {
    msgs.iter().filter(|(_, m)| has_line(m, line)).count()
}

#[test]
fn ready_after_loading_status_progress_watchdog_pings_and_stopping() {
    // 1,000,000 rows (264 MB): a load with many progress steps.
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = gen_table(dir.path(), "t.etab", 1, 1_000_000, 3).expect("gen");
    let notify = NotifySocket::bind(dir.path()).expect("notify socket");
    let table = path.display().to_string();
    let socket = notify.path.display().to_string();
    let mut donor = Process::launch_donor_with_env(
        &[
            "--table",
            &table,
            "--listen",
            "127.0.0.1:0",
            "--control",
            "127.0.0.1:0",
            "--mlock",
            "off",
            // One thread, and a copy (served from the file's pages, a
            // warm load takes about a hash): a load long enough for
            // several progress steps.
            "--load-threads",
            "1",
            "--copy-tables",
        ],
        &[("NOTIFY_SOCKET", &socket), ("WATCHDOG_USEC", "400000")],
    )
    .expect("launch");
    let ops = donor.ops().expect("ops line");
    let ready = notify
        .wait_line(Duration::from_secs(60), "READY=1")
        .expect("READY=1");
    let runtime = rt();
    // Whoever hears READY=1 finds the donor serving with every table ready.
    runtime.block_on(async {
        assert_eq!(health(&ops).await, ServingStatus::Serving);
        let mut c = DonorControlClient::connect(ops.control_uri())
            .await
            .expect("control");
        let list = c
            .list_tables(ListTablesRequest {})
            .await
            .expect("list")
            .into_inner();
        assert!(list.tables.iter().all(|t| t.state() == LoadState::Ready));
    });
    assert!(
        donor.log().contains("table resident"),
        "the table was loaded before READY=1"
    );
    let msgs = notify.messages();
    let before = &msgs[..ready];
    let progress: Vec<&str> = before
        .iter()
        .filter_map(|(_, m)| {
            m.lines()
                .find(|l| l.starts_with("STATUS=loading table 1: "))
        })
        .collect();
    assert!(
        progress.len() >= 5 && progress.last() == Some(&"STATUS=loading table 1: 100%"),
        "progress before READY: {progress:?}\n{}",
        donor.log()
    );
    assert!(
        before
            .iter()
            .any(|(_, m)| m.starts_with("EXTEND_TIMEOUT_USEC=")),
        "a progressing load extends the start timeout"
    );
    assert_eq!(count(before, "WATCHDOG=1"), 0, "no ping before READY=1");
    assert!(
        msgs[ready]
            .1
            .contains("STATUS=serving 1 tables, 0 connections"),
        "{}",
        msgs[ready].1
    );

    // Pings every 200 ms (half of WATCHDOG_USEC) while healthy.
    notify
        .wait(Duration::from_secs(10), |m| {
            count(&m[ready..], "WATCHDOG=1") >= 3
        })
        .expect("watchdog pings while healthy");

    donor.signal(libc::SIGTERM);
    notify
        .wait_line(Duration::from_secs(10), "STOPPING=1")
        .expect("STOPPING=1 on SIGTERM");
    let status = donor.wait(Duration::from_secs(10)).expect("exits");
    assert!(status.success(), "{status:?}\n{}", donor.log());
    // The log is read by another thread: wait for its last lines, not a snapshot.
    let drained = donor.wait_line(Duration::from_secs(5), |l| {
        l.contains("drained").then_some(())
    });
    assert!(drained.is_ok(), "{}", donor.log());
}

#[test]
fn watchdog_pings_stop_while_the_serving_path_hangs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = gen_table(dir.path(), "t.etab", 1, 20_000, 3).expect("gen");
    let notify = NotifySocket::bind(dir.path()).expect("notify socket");
    let table = path.display().to_string();
    let socket = notify.path.display().to_string();
    // 300 ms watchdog: probe and ping every 150 ms. 1.5 s after ready the
    // test-only stall takes the tables' lock for good.
    let donor = Process::launch_donor_with_env(
        &[
            "--table",
            &table,
            "--listen",
            "127.0.0.1:0",
            "--control",
            "127.0.0.1:0",
        ],
        &[
            ("NOTIFY_SOCKET", &socket),
            ("WATCHDOG_USEC", "300000"),
            ("ENGRAM_TEST_STALL_AFTER_MS", "1500"),
        ],
    )
    .expect("launch");
    let ops = donor.ops().expect("ops line");
    let ready = notify
        .wait_line(Duration::from_secs(30), "READY=1")
        .expect("READY=1");
    notify
        .wait(Duration::from_secs(10), |m| {
            count(&m[ready..], "WATCHDOG=1") >= 3
        })
        .expect("pings while healthy");
    donor
        .wait_line(Duration::from_secs(10), |l| {
            l.contains("ENGRAM_TEST_STALL_AFTER_MS").then_some(())
        })
        .expect("the stall starts");
    let stalled_at = Instant::now();
    // Observing an absence takes time: 2 s is more than 13 ping periods.
    std::thread::sleep(Duration::from_secs(2));
    let late: Vec<Duration> = notify
        .messages()
        .iter()
        .filter(|(at, m)| *at > stalled_at && has_line(m, "WATCHDOG=1"))
        .map(|(at, _)| *at - stalled_at)
        .collect();
    // A probe answered just before the lock was taken may still ping once.
    assert!(
        late.iter().all(|d| *d < Duration::from_millis(200)),
        "pings while the serving path hangs: {late:?}"
    );
    // The process, its runtime and its control plane are fine: a timer
    // would have gone on pinging. The probe's failure is in the log.
    assert_eq!(rt().block_on(health(&ops)), ServingStatus::Serving);
    donor
        .wait_line(Duration::from_secs(5), |l| {
            l.contains("did not answer its own probe").then_some(())
        })
        .expect("the failed probe is logged");
}
