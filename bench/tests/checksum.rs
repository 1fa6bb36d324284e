//! `engram-bench checksum` as a user runs it: every length summed both
//! ways (the command fails if they disagree), each with a pause and back
//! to back, after a pause that kept the wide units warm and after one
//! whose end woke them, with the way `payload_checksum` picks.

use std::process::Command;

#[test]
fn the_checksum_run_times_both_ways_at_every_length() {
    let out = Command::new(env!("CARGO_BIN_EXE_engram-bench"))
        .args(["checksum", "--calls", "30", "--json"])
        .output()
        .expect("engram-bench runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let points = v["points"].as_array().expect("points");
    // Six lengths, each after a pause, after a pause that kept the wide
    // units warm, after one whose end woke them, and back to back.
    assert_eq!(points.len(), 24, "{points:?}");
    for p in points {
        for k in [
            "sse2_ns",
            "wide_ns",
            "payload_checksum_ns",
            "chosen_vs_best",
        ] {
            let x = p[k].as_f64().expect(k);
            assert!(x.is_finite() && x > 0.0, "{k}: {p}");
        }
    }
    for (warm, woken) in [(false, false), (true, false), (false, true)] {
        assert!(
            points.iter().any(|p| p["what"] == "24 rows"
                && p["pause_us"] == 50
                && p["warm"] == warm
                && p["woken_ns"].is_u64() == woken),
            "{points:?}"
        );
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_engram-bench"))
        .args(["checksum", "--calls", "0"])
        .output()
        .expect("engram-bench runs");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--calls"));
}
