//! `engram-cluster pki init | issue` and the certificate half of
//! `engram-cluster check`, as an operator runs them.

use std::path::Path;
use std::process::{Command, Output};

const RACK: &str = r#"version = 1
[rack]
name = "lab"
[rack.tls]
operators = ["alice"]

[[table]]
id = 1
layer = 1
path = "tables/layer1.etab"
rows = 1000
digest = "1111111111111111111111111111111111111111111111111111111111111111"

[[donor]]
name = "donor-a"
listen = ["tls://0.0.0.0:7410", "quic://0.0.0.0:7410"]
advertise = ["tls://10.0.0.11:7410", "quic://10.0.0.11:7410"]
tables = [1]
ram_gib = 16.0

[[node]]
name = "gpu-1"
[[node.route]]
table = 1
sources = ["donor-a", "ssd"]
"#;

fn run(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = Command::new(env!("CARGO_BIN_EXE_engram-cluster"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run engram-cluster");
    (
        status.code().unwrap_or(-1),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

#[test]
fn init_issue_check() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("rack.toml"), RACK).expect("write");
    let config = ["--config", "rack.toml"];

    let (code, out, _) = run(d, &["check", "rack.toml"]);
    assert_eq!(code, 0, "no CA yet is no error: {out}");
    assert!(out.contains("pki: no CA yet at pki/ca.pem"), "{out}");

    let (code, out, err) = run(d, &[&["pki", "init"][..], &config].concat());
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("written rack.tls.ca (CA): pki/ca.pem"),
        "{out}"
    );
    let (code, _, err) = run(d, &[&["pki", "init"][..], &config].concat());
    assert_eq!(code, 1);
    assert!(err.contains("pki/ca.pem: exists; pass --force"), "{err}");

    let (code, _, err) = run(d, &["check", "rack.toml"]);
    assert_eq!(code, 2, "a CA without host certificates fails the check");
    assert!(
        err.contains("error: node[0] (gpu-1): pki/gpu-1.pem: missing, as is its key"),
        "{err}"
    );

    let (code, out, err) = run(d, &[&["pki", "issue"][..], &config].concat());
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "one line per host: {out}");
    assert!(
        lines[0].starts_with(
            "written donor[0] (donor-a): pki/donor-a.pem [dns:donor-a, ip:10.0.0.11], valid until "
        ),
        "{out}"
    );
    let (code, out, err) = run(d, &["check", "rack.toml"]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(
        out.contains("3 certificates: 0 errors, 0 warnings"),
        "{out}"
    );

    let (_, out, _) = run(d, &[&["pki", "issue"][..], &config].concat());
    assert!(out.lines().all(|l| l.starts_with("kept ")), "{out}");

    // Soon to expire: warned about, not failed.
    let (code, _, _) = run(
        d,
        &[&["pki", "issue", "--days", "10", "--force"][..], &config].concat(),
    );
    assert_eq!(code, 0);
    let (code, out, err) = run(d, &["check", "rack.toml"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("0 errors, 3 warnings"), "{out}");
    assert!(
        err.contains("warning: donor[0] (donor-a): pki/donor-a.pem: certificate expires on"),
        "{err}"
    );

    let (code, _, err) = run(d, &["pki", "issue", "--config", "rack.toml", "--days", "0"]);
    assert_eq!(code, 2, "clap refuses a zero validity: {err}");
}

#[test]
fn init_into_a_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (code, out, err) = run(dir.path(), &["pki", "init", "--dir", "ca"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("ca/ca.pem"), "{out}");
    assert!(dir.path().join("ca/ca.key").is_file());
    let (code, _, err) = run(
        dir.path(),
        &["pki", "init", "--dir", "ca", "--config", "rack.toml"],
    );
    assert_eq!(code, 2, "--dir and --config exclude each other: {err}");
}
