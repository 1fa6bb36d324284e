//! The files in `systemd/`: both units pass `systemd-analyze verify` (with
//! their ExecStart pointed at the binaries just built, and the RDMA drop-in), carry the settings
//! the operations design asks for, and the example rack config plans.
//!
//! `systemd-analyze verify` runs offline, without systemd as PID 1, given
//! `--man=no --generators=no`; an unknown key is only a warning (exit code
//! 0), so any output fails the test too. Without `systemd-analyze` the
//! verify test is skipped unless `ENGRAM_REQUIRE_SYSTEMD_ANALYZE=1` (CI).

use std::path::{Path, PathBuf};
use std::process::Command;

use rack_harness::bin;

fn systemd_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd")
}

const UNITS: [&str; 3] = [
    "memory-donor.service",
    "inference-node.service",
    "engram-engines.service",
];

fn settings(unit: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(systemd_dir().join(unit)).expect("unit file");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

fn secs(v: &str) -> u64 {
    if let Some(m) = v.strip_suffix("min") {
        m.parse::<u64>().expect("minutes") * 60
    } else {
        v.trim_end_matches('s').parse().expect("seconds")
    }
}

#[test]
fn units_carry_the_operations_settings() {
    for unit in UNITS {
        let s = settings(unit);
        let get = |k: &str| {
            s.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
                .unwrap_or_else(|| panic!("{unit}: {k}= missing"))
        };
        for (k, v) in [
            ("Type", "notify"),
            ("NotifyAccess", "main"),
            ("Restart", "on-failure"),
            ("LimitMEMLOCK", "infinity"),
            ("User", "engram-rack"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "yes"),
            ("NoNewPrivileges", "yes"),
            ("PrivateTmp", "yes"),
        ] {
            assert_eq!(get(k), v, "{unit}: {k}");
        }
        // The engine client applies a new config by restarting (its
        // engines see their rings' deadlines meanwhile): no reload.
        if unit == "engram-engines.service" {
            assert!(s.iter().all(|(k, _)| k != "ExecReload"), "{unit}");
        } else {
            assert_eq!(get("ExecReload"), "/bin/kill -HUP $MAINPID", "{unit}");
        }
        // No capability, but for the node CAP_SYS_NICE (its SSD copy's
        // reads at real-time I/O priority).
        let caps = if unit.starts_with("inference-node") || unit.starts_with("engram-engines") {
            "CAP_SYS_NICE"
        } else {
            ""
        };
        for k in ["CapabilityBoundingSet", "AmbientCapabilities"] {
            assert_eq!(get(k), caps, "{unit}: {k}");
        }
        // The name: the host's unless the unit's environment file says.
        let var = if unit.starts_with("memory-donor") {
            "ENGRAM_DONOR_NAME"
        } else {
            "ENGRAM_NODE_NAME"
        };
        let verb = if unit.starts_with("engram-engines") {
            "engines"
        } else {
            "serve"
        };
        assert!(get("ExecStart").contains(&format!(
            " {verb} --config /etc/engram-rack/rack.toml --name ${{{var}}}"
        )));
        assert_eq!(get("Environment"), format!("{var}=%H"), "{unit}");
        assert_eq!(
            get("EnvironmentFile"),
            format!(
                "-/etc/engram-rack/{}.env",
                unit.trim_end_matches(".service")
            ),
            "{unit}"
        );
        assert!(get("ReadOnlyPaths").starts_with("/var/lib/engram-rack/"));
        assert!(secs(get("WatchdogSec")) >= 10);
        if unit.starts_with("memory-donor") {
            // Room for every table twice (a swap keeps both for a moment).
            let max: u32 = get("FileDescriptorStoreMax").parse().expect("a number");
            assert!(max >= 16, "{unit}: FileDescriptorStoreMax");
        }
        // Above the default drain timeout (5 s) with room for the last answers.
        assert!(
            secs(get("TimeoutStopSec")) >= 5 + 10,
            "{unit}: TimeoutStopSec"
        );
    }
}

/// Whether a `DeviceAllow=` specifier lets in a character device of
/// group `group` (as /proc/devices names it) or the node at `path`.
fn allows(spec: &str, group: &str, path: &str) -> bool {
    let spec = spec.split_whitespace().next().unwrap_or_default();
    match spec.strip_prefix("char-") {
        // systemd matches groups as globs; the units use a trailing `*`.
        Some(g) => match g.strip_suffix('*') {
            Some(prefix) => group.starts_with(prefix),
            None => g == group,
        },
        None => spec == path,
    }
}

/// The device nodes each unit needs reach it, on every systemd: the
/// units' `ProtectClock=yes` implies `DeviceAllow=char-rtc r`, which
/// before systemd 252 closes a unit to every device it does not list.
/// The node lists the GPU's groups; with the RDMA drop-in both daemons
/// list the verbs' nodes (and the drop-in turns `PrivateDevices=` off).
#[test]
fn units_let_in_the_device_nodes_they_need() {
    let effective = |unit: &str, drop_in: bool| {
        let mut s = settings(unit);
        if drop_in {
            s.extend(settings("rdma.conf"));
        }
        s
    };
    let device_allow = |s: &[(String, String)]| -> Vec<String> {
        s.iter()
            .filter(|(k, _)| k == "DeviceAllow")
            .map(|(_, v)| v.clone())
            .collect()
    };
    let last = |s: &[(String, String)], key: &str| {
        s.iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    let needs = |unit: &str, allow: &[String], group: &str, path: &str| {
        assert!(
            allow
                .iter()
                .any(|a| allows(a, group, path) && a.ends_with("rw")),
            "{unit} does not let in {path} (group {group}): DeviceAllow {allow:?}"
        );
    };
    for unit in UNITS {
        let plain = effective(unit, false);
        assert_eq!(
            last(&plain, "ProtectClock").as_deref(),
            Some("yes"),
            "{unit}"
        );
        let with_rdma = effective(unit, true);
        assert_eq!(
            last(&with_rdma, "PrivateDevices").as_deref(),
            Some("no"),
            "{unit}"
        );
        let allow = device_allow(&with_rdma);
        needs(unit, &allow, "infiniband_verbs", "/dev/infiniband/uverbs0");
        needs(unit, &allow, "infiniband_mad", "/dev/infiniband/umad0");
        needs(unit, &allow, "misc", "/dev/infiniband/rdma_cm");
    }
    let node = effective("inference-node.service", false);
    assert_ne!(last(&node, "PrivateDevices").as_deref(), Some("yes"));
    let allow = device_allow(&node);
    for (group, path) in [
        ("nvidia-frontend", "/dev/nvidia0"),
        ("nvidia", "/dev/nvidiactl"),
        ("nvidia-uvm", "/dev/nvidia-uvm"),
        ("nvidia-caps", "/dev/nvidia-caps/nvidia-cap1"),
        ("nvidia-nvlink", "/dev/nvidia-nvlink"),
        ("nvidia-nvswitch", "/dev/nvidia-nvswitch0"),
    ] {
        needs("inference-node.service", &allow, group, path);
    }
    // And nothing beyond them: the donor without the drop-in has no
    // device of its own.
    assert!(device_allow(&settings("memory-donor.service")).is_empty());
    assert!(!allows("char-nvidia* rw", "infiniband_verbs", "/dev/null"));
}

#[test]
fn units_pass_systemd_analyze_verify() {
    let analyze = ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file());
    let Some(analyze) = analyze else {
        assert!(
            std::env::var_os("ENGRAM_REQUIRE_SYSTEMD_ANALYZE").is_none(),
            "systemd-analyze is required (apt-get install systemd)"
        );
        eprintln!("skipped: systemd-analyze not installed");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let built = bin("memory-donor");
    let bin_dir = built.parent().expect("bin dir").display().to_string();
    let mut paths = Vec::new();
    for unit in UNITS {
        let text = std::fs::read_to_string(systemd_dir().join(unit)).expect("unit");
        assert!(text.contains("/usr/bin/"), "{unit}");
        let path = dir.path().join(unit);
        std::fs::write(&path, text.replace("/usr/bin/", &format!("{bin_dir}/"))).expect("copy");
        paths.push(path);
        // The RDMA drop-in, where docs/rdma.md installs it: verified with
        // the unit (a key it gets wrong is a complaint below).
        let drop_in = dir.path().join(format!("{unit}.d"));
        std::fs::create_dir_all(&drop_in).expect("drop-in dir");
        std::fs::copy(systemd_dir().join("rdma.conf"), drop_in.join("rdma.conf")).expect("drop-in");
    }
    // Make sure the other binary is there too (verify checks ExecStart).
    bin("inference-node");
    let out = Command::new(analyze)
        .args(["verify", "--man=no", "--generators=no"])
        .args(&paths)
        .env("SYSTEMD_LOG_LEVEL", "warning")
        .output()
        .expect("runs systemd-analyze");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{said}");
    let complaints: Vec<&str> = said
        .lines()
        .filter(|l| !l.trim().is_empty())
        // A container may not let it read PID 1's environment; not about our units.
        .filter(|l| !l.contains("$container of PID 1"))
        .collect();
    assert!(
        complaints.is_empty(),
        "systemd-analyze verify: {complaints:#?}"
    );
}

#[test]
fn the_sysusers_and_tmpfiles_snippets_name_the_user_and_directories() {
    let users =
        std::fs::read_to_string(systemd_dir().join("sysusers.d/engram-rack.conf")).expect("file");
    assert!(users.lines().any(|l| l.starts_with("u engram-rack ")));
    let dirs =
        std::fs::read_to_string(systemd_dir().join("tmpfiles.d/engram-rack.conf")).expect("file");
    assert!(
        dirs.lines().any(
            |l| l.starts_with("w /sys/kernel/mm/transparent_hugepage/shmem_enabled ")
                && l.ends_with(" advise")
        ),
        "shared memory huge pages for kept tables"
    );
    for d in [
        "/etc/engram-rack",
        "/var/lib/engram-rack/tables",
        "/var/lib/engram-rack/ssd",
    ] {
        assert!(
            dirs.lines()
                .any(|l| l.starts_with("d ") && l.split_whitespace().nth(1) == Some(d)),
            "{d}"
        );
    }
}

#[test]
fn the_example_rack_config_plans() {
    let out = Command::new(bin("engram-cluster"))
        .arg("plan")
        .arg(systemd_dir().join("rack.toml"))
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("donor-a") && text.contains("node gpu-1"),
        "{text}"
    );
    assert!(text.contains("100.0 tokens/s"), "{text}");
    let json = Command::new(bin("engram-cluster"))
        .arg("plan")
        .arg(systemd_dir().join("rack.toml"))
        .args(["--json", "--latency-us", "donor-a=340"])
        .output()
        .expect("runs");
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    let tps = v["nodes"][0]["predicted_tokens_per_second"]
        .as_f64()
        .expect("tokens/s");
    assert!((tps - 1000.0 / 10.09).abs() < 1e-6, "{tps}");
    assert_eq!(v["donors"][0]["fits"], serde_json::Value::Bool(true));
}

#[test]
fn plan_fails_when_a_donor_is_short_of_ram() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = std::fs::read_to_string(systemd_dir().join("rack.toml")).expect("rack.toml");
    let short = text.replacen("ram_gib = 128.0", "ram_gib = 96.0", 1);
    assert_ne!(short, text);
    let path = dir.path().join("rack.toml");
    std::fs::write(&path, short).expect("write");
    let out = Command::new(bin("engram-cluster"))
        .arg("plan")
        .arg(&path)
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("donor donor-a") && err.contains("ram_gib is 96.00"),
        "{err}"
    );
}
