//! `engram-bench plot-sample` as a user runs it.

use std::process::Command;

#[test]
fn plot_sample_writes_svg_and_png() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_engram-bench"))
        .args(["plot-sample", "--out"])
        .arg(dir.path())
        .output()
        .expect("engram-bench runs");
    assert!(out.status.success(), "{out:?}");
    for f in ["sample-heatmap", "sample-timeline"] {
        let png = std::fs::read(dir.path().join(format!("{f}.png"))).expect("png");
        assert_eq!(&png[1..4], b"PNG");
        let svg = std::fs::read_to_string(dir.path().join(format!("{f}.svg"))).expect("svg");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
