//! An interrupted benchmark leaves nothing behind: `engram-bench floor`
//! stopped with SIGTERM halfway through its series stops the donor and the
//! floor's server it started, removes its scratch directory (its tables),
//! and exits non-zero. Needs the workspace's binaries built in the same
//! profile.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Pids of the processes whose command line mentions `dir`.
fn processes_under(dir: &Path) -> Vec<u32> {
    let needle = dir.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if let Ok(c) = std::fs::read(e.path().join("cmdline"))
            && String::from_utf8_lossy(&c).contains(&needle)
        {
            found.push(pid);
        }
    }
    found
}

#[test]
fn an_interrupted_floor_run_stops_its_servers_and_removes_its_tables() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut bench = Command::new(env!("CARGO_BIN_EXE_engram-bench"))
        .args([
            "floor",
            "--transports",
            "tcp",
            "--restarts",
            "0",
            "--connects",
            "1",
            "--rounds",
            "1",
            "--lookups",
            "1000000",
            "--warmup",
            "30",
            "--rows-per-table",
            "30000",
        ])
        .env("TMPDIR", tmp.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("engram-bench starts");
    let stderr = bench.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // Measuring: the donor and the floor's server run, the tables exist.
    let mut log = Vec::new();
    let end = Instant::now() + Duration::from_secs(120);
    while !log.iter().any(|l: &String| l.starts_with("round 1")) {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => log.push(l),
            Err(_) => {
                let _ = bench.kill();
                panic!("no round started: {}", log.join("\n"));
            }
        }
    }
    let children = processes_under(tmp.path());
    assert!(
        children.len() >= 2,
        "the donor and the floor's server run from the scratch directory: {children:?}"
    );
    assert!(
        std::fs::read_dir(tmp.path()).expect("tmp").next().is_some(),
        "the scratch directory exists"
    );

    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(bench.id() as i32, libc::SIGTERM) };
    let end = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = bench.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > end {
            let _ = bench.kill();
            panic!("engram-bench still runs 60 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    log.extend(rx.try_iter());
    let left = processes_under(tmp.path());
    for &pid in &left {
        // SAFETY: kill(2) has no memory effects; these run from our own
        // scratch directory (the test's failure is reported below).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    assert!(left.is_empty(), "still running: {left:?}");
    assert!(!status.success(), "an interrupted run fails: {status:?}");
    assert!(
        log.iter().any(|l| l.contains("interrupted")),
        "{}",
        log.join("\n")
    );
    let files: Vec<_> = std::fs::read_dir(tmp.path())
        .expect("tmp")
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(files.is_empty(), "left behind: {files:?}");
}
