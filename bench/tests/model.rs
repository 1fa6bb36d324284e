//! `engram-bench model` as a user runs it.

use std::process::{Command, Output};

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_engram-bench"))
        .args(args)
        .output()
        .expect("engram-bench runs")
}

#[test]
fn json_at_100_tokens_per_second() {
    let out = bench(&[
        "model",
        "--tokens-per-second",
        "100",
        "--f0-ms",
        "0.59",
        "--f1-ms",
        "0.59",
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"));
    assert!((f("tokens_per_second") - 96.71).abs() < 0.005, "{v}");
    assert!((f("slowdown") - 0.034).abs() < 1e-9, "{v}");
    assert_eq!(f("token_ms"), 10.0);
    assert_eq!(f("tokens_per_second_target"), 100.0);
    assert_eq!(v["windows_ms"], serde_json::json!([0.25, 3.25]));
    assert_eq!(v["fetch_ms"], serde_json::json!([0.59, 0.59]));
    assert!((f("extra_ms") - 0.34).abs() < 1e-9 && (f("time_ms") - 10.34).abs() < 1e-9);
}

#[test]
fn table_output() {
    let out = bench(&[
        "model",
        "--tokens-per-second",
        "100",
        "--f0-ms",
        "0.59",
        "--f1-ms",
        "0.59",
    ]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("96.71") && text.contains("3.4%"), "{text}");
}

#[test]
fn bad_input_names_the_flag() {
    for (args, flag) in [
        (["0", "0.5", "0.5"], "--tokens-per-second"),
        (["NaN", "0.5", "0.5"], "--tokens-per-second"),
        (["100", "-1", "0.5"], "--f0-ms"),
        (["100", "0.5", "NaN"], "--f1-ms"),
        (["100", "0.5", "inf"], "--f1-ms"),
    ] {
        let out = bench(&[
            "model",
            "--tokens-per-second",
            args[0],
            "--f0-ms",
            args[1],
            "--f1-ms",
            args[2],
        ]);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
    let out = bench(&[
        "model",
        "--tokens-per-second",
        "abc",
        "--f0-ms",
        "0",
        "--f1-ms",
        "0",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tokens-per-second"));
}
