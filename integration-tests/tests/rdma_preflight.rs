//! `scripts/rdma-check.sh --preflight IP`: what would keep RDMA from being
//! used on a host, each with its fix, exit 1 when something blocks. Run
//! against fake device trees (`RDMA_CHECK_SYSFS`) shaped as the kernel's
//! `/sys/class/infiniband`, for 127.0.0.1 (on `lo`), with a registration
//! small enough for any `ulimit -l` (`FLOOR_ROWS`).

use std::path::Path;
use std::process::Command;

/// A device `mlx5_0` whose port 1 is in `state`, carrying `netdev`.
fn fake_device(root: &Path, state: &str, netdev: &str, gid: &str) {
    let port = root.join("mlx5_0/ports/1");
    for d in ["gids", "gid_attrs/ndevs"] {
        std::fs::create_dir_all(port.join(d)).expect("dirs");
    }
    std::fs::write(port.join("state"), format!("{state}\n")).expect("state");
    std::fs::write(port.join("link_layer"), "Ethernet\n").expect("layer");
    std::fs::write(port.join("gids/0"), format!("{gid}\n")).expect("gid");
    std::fs::write(port.join("gid_attrs/ndevs/0"), format!("{netdev}\n")).expect("ndev");
}

/// Run the preflight against `sysfs`; its exit success and its output.
fn preflight(sysfs: &Path) -> (bool, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/rdma-check.sh");
    let out = Command::new("bash")
        .arg(script)
        .args(["--preflight", "127.0.0.1"])
        .env("RDMA_CHECK_SYSFS", sysfs)
        .env("FLOOR_ROWS", "1000")
        .output()
        .expect("runs bash");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn the_preflight_says_what_blocks_rdma_and_how_to_fix_it() {
    let has_lo = Command::new("ip")
        .args(["-o", "addr", "show", "lo"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("127.0.0.1"));
    if !has_lo {
        eprintln!("skipped: no `ip` here to find 127.0.0.1 on lo");
        return;
    }
    let gid = "fe80:0000:0000:0000:0000:0000:0000:0001";

    // Nothing blocks: an active port carrying lo, with a GID.
    let dir = tempfile::tempdir().expect("tempdir");
    fake_device(dir.path(), "4: ACTIVE", "lo", gid);
    let (ok, said) = preflight(dir.path());
    assert!(ok, "{said}");
    assert!(
        said.contains("mlx5_0 port 1: state 4: ACTIVE, link layer Ethernet, 1 GIDs, on lo"),
        "{said}"
    );
    assert!(
        said.contains("preflight: nothing blocks RDMA here"),
        "{said}"
    );

    // No device at all.
    let empty = tempfile::tempdir().expect("tempdir");
    let (ok, said) = preflight(empty.path());
    assert!(!ok, "{said}");
    assert!(said.contains("BLOCKS: no RDMA device"), "{said}");
    assert!(said.contains("fix: load the NIC's driver"), "{said}");

    // The IP's port is down; and has no GID.
    let down = tempfile::tempdir().expect("tempdir");
    fake_device(
        down.path(),
        "1: DOWN",
        "lo",
        "0000:0000:0000:0000:0000:0000:0000:0000",
    );
    let (ok, said) = preflight(down.path());
    assert!(!ok, "{said}");
    assert!(
        said.contains("BLOCKS: mlx5_0 port 1 (the one 127.0.0.1 is on) is 1: DOWN, not ACTIVE"),
        "{said}"
    );
    assert!(said.contains("BLOCKS: mlx5_0 port 1 has no GID"), "{said}");
    assert!(said.contains("2 thing(s) block RDMA here"), "{said}");

    // A device, but not on the IP's interface.
    let elsewhere = tempfile::tempdir().expect("tempdir");
    fake_device(elsewhere.path(), "4: ACTIVE", "eth9", gid);
    let (ok, said) = preflight(elsewhere.path());
    assert!(!ok, "{said}");
    assert!(
        said.contains("BLOCKS: 127.0.0.1 is on lo, which no RDMA device's port carries"),
        "{said}"
    );
}
