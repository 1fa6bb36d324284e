//! `engram-bench ssd --contention` and `paced --contention` as a user runs
//! them, on a small table and short series: every series is measured, the
//! JSON carries the verdicts, bad settings are refused. They need the
//! workspace's binaries built in the same profile.

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_engram-bench"))
        .args(args)
        .output()
        .expect("engram-bench runs")
}

#[test]
fn ssd_contention_measures_every_load_and_priority() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("t.etab");
    let file = file.to_str().expect("utf-8");
    let out = bench(&[
        "ssd",
        "--contention",
        "--json",
        "--seconds",
        "0.5",
        "--rows",
        "1000000",
        "--file",
        file,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let series = v["series"].as_array().expect("series");
    // Idle, then reader and writer at each of three priorities.
    assert_eq!(series.len(), 7, "{v}");
    let loads: Vec<&str> = series
        .iter()
        .map(|s| s["load"].as_str().expect("load"))
        .collect();
    assert_eq!(loads[0], "none");
    assert_eq!(loads[1..4], ["reader"; 3]);
    assert_eq!(loads[4..], ["writer"; 3]);
    for s in series {
        assert!(s["batches"].as_u64().expect("batches") >= 1, "{s}");
        assert!(s["batch"]["p99_us"].as_f64().expect("p99") > 0.0, "{s}");
    }
    // The reader streams all along; the writer may spend a whole short
    // series in one fsync, so only its figure's presence is checked.
    for s in &series[1..4] {
        assert!(s["load_mib_s"].as_f64().expect("bandwidth") > 0.0, "{s}");
    }
    for s in &series[4..] {
        assert!(s["load_mib_s"].as_f64().expect("bandwidth") >= 0.0, "{s}");
    }
    for k in ["sequential_reader", "writer"] {
        assert!(v[k]["met"].is_boolean(), "{k}: {v}");
    }

    let out = bench(&["ssd", "--contention", "--seconds", "0", "--file", file]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--seconds must be"));
}

#[test]
fn paced_contention_runs_every_series_at_every_rate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = bench(&[
        "paced",
        "--contention",
        "--rates",
        "100",
        "--seconds-per-point",
        "1",
        "--hash-base",
        "1000",
        "--out",
        dir.path().to_str().expect("utf-8"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = std::fs::read(dir.path().join("paced-contention.json")).expect("json");
    let points: Vec<serde_json::Value> = serde_json::from_slice(&json).expect("points");
    let series: Vec<&str> = points
        .iter()
        .map(|p| p["series"].as_str().expect("series"))
        .collect();
    assert_eq!(
        series,
        [
            "idle drive, realtime",
            "reader, realtime",
            "reader, best-effort",
            "reader, idle class"
        ]
    );
    for p in &points {
        assert!(p["tokens"].as_u64().expect("tokens") >= 1, "{p}");
        assert!(
            p["predicted_tokens_per_second"]
                .as_f64()
                .expect("predicted")
                > 0.0,
            "{p}"
        );
    }
    assert!(points[1]["load_mib_s"].as_f64().expect("bandwidth") > 0.0);
    assert!(text.contains("reader MiB/s"), "{text}");
}
