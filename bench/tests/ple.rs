//! `engram-bench ple` as a user runs it, at a small shape: both
//! projections timed, their bits the same (the command fails if not), the
//! gate and convolution timed, bad flags refused by name.

use std::process::Command;

#[test]
fn the_ple_run_times_both_projections_and_checks_their_bits() {
    let out = Command::new(env!("CARGO_BIN_EXE_engram-bench"))
        .args([
            "ple",
            "--hidden",
            "64",
            "--streams",
            "4",
            "--tokens",
            "9",
            "--repeats",
            "3",
            "--json",
        ])
        .output()
        .expect("engram-bench runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["identical"], true, "{v}");
    assert_eq!(
        (v["hidden"].as_u64(), v["tokens"].as_u64()),
        (Some(64), Some(9))
    );
    for k in [
        "baseline_project_ms",
        "prepared_project_ms",
        "speedup",
        "gate_and_conv_ms",
        "layer_ms_per_token",
    ] {
        let x = v[k].as_f64().expect(k);
        assert!(x.is_finite() && x > 0.0, "{k}: {v}");
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_engram-bench"))
        .args(["ple", "--tokens", "0"])
        .output()
        .expect("engram-bench runs");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--tokens"));
}
