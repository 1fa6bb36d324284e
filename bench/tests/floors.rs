//! `engram-bench floor` and `engram-bench load` as a user runs them, on
//! small tables and short series: every series is measured (the floor that
//! gathers rows among them, its rows checked, and a bulk series), and a
//! load reports the `--copy-tables` starts beside the default's. They need the workspace's
//! binaries built in the same profile.

use std::process::Command;

fn bench(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_engram-bench"))
        .args(args)
        .output()
        .expect("engram-bench runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_slice(&out.stdout).expect("json")
}

/// A short `engram-bench floor --json` over `transports`, on small tables.
/// Exactly `count` ratios whose names contain one of `marks`, each a
/// finite positive p50.
fn assert_ratios(ratios: &[serde_json::Value], marks: &[&str], count: usize) {
    let p50s: Vec<f64> = ratios
        .iter()
        .filter(|r| {
            r["what"]
                .as_str()
                .is_some_and(|w| marks.iter().any(|m| w.contains(m)))
        })
        .map(|r| r["p50"].as_f64().expect("p50"))
        .collect();
    assert!(
        p50s.len() == count && p50s.iter().all(|r| r.is_finite() && *r > 0.0),
        "{marks:?}: {ratios:?}"
    );
}

fn short_floor(transports: &str) -> serde_json::Value {
    bench(&[
        "floor",
        "--json",
        "--transports",
        transports,
        "--restarts",
        "0",
        "--connects",
        "1",
        "--rounds",
        "1",
        "--lookups",
        "300",
        "--warmup",
        "30",
        "--rows-per-table",
        "30000",
    ])
}

#[test]
fn the_floor_run_has_a_floor_that_gathers_the_rows() {
    let v = short_floor("tcp");
    let series = v["series"].as_array().expect("series");
    let names: Vec<&str> = series
        .iter()
        .map(|s| s["series"].as_str().expect("name"))
        .collect();
    for rows in [24, 48] {
        for client in ["blocking", "polling"] {
            let want = format!("floor gathering rows, {client} client, {rows} rows");
            assert!(names.contains(&want.as_str()), "{names:?}");
        }
    }
    // Every series says where its lookups' time went: both ends did some
    // work for every lookup, and the parts fit in the wall time.
    for s in series {
        let split = &s["split"];
        let us = |k: &str| split[k].as_f64().unwrap_or_else(|| panic!("{k} in {s}"));
        assert!(
            us("client_cpu_us") > 0.0 && us("server_cpu_us") > 0.0,
            "{s}"
        );
        assert!(
            us("server_waiting_us") >= 0.0 && us("neither_us") >= 0.0,
            "{s}"
        );
        assert!(us("wall_us") + 1e-6 >= us("neither_us"), "{s}");
    }
    let ratios = v["ratios"].as_array().expect("ratios");
    let against: Vec<f64> = ratios
        .iter()
        .filter(|r| {
            r["what"]
                .as_str()
                .is_some_and(|w| w.ends_with("against the floor gathering rows"))
        })
        .map(|r| r["p50"].as_f64().expect("p50"))
        .collect();
    assert_eq!(against.len(), 4, "{ratios:?}");
    assert!(
        against.iter().all(|r| r.is_finite() && *r > 0.0),
        "{against:?}"
    );
    // The protocol's floor: the least protocol client against the least
    // server the protocol allows (its rows checked like every series'),
    // both ways of waiting, at both sizes, and the ratios that split the
    // donor's gap into the protocol's share and the donor's own.
    for rows in [24, 48] {
        for client in ["blocking", "polling"] {
            let want = format!("protocol's floor, least protocol client {client}, {rows} rows");
            assert!(names.contains(&want.as_str()), "{names:?}");
        }
    }
    assert_ratios(
        ratios,
        &[
            "(the protocol's own share)",
            "(what the donor adds to the protocol)",
        ],
        8,
    );
    // The least protocol client sleeping in the runtime's reactor, at both
    // sizes, and the ratios that split the sleeping client's gap into the
    // runtime's share and the project client's own.
    for rows in [24, 48] {
        let want = format!("donor, least protocol client sleeping in the runtime, {rows} rows");
        assert!(names.contains(&want.as_str()), "{names:?}");
    }
    assert_ratios(
        ratios,
        &[
            "(what waiting in the runtime's reactor costs)",
            "(the client's share beyond the runtime)",
            "(the least a client in the runtime gets)",
        ],
        6,
    );
    // The gathering floor with its client sleeping in the runtime too (the
    // like for like of the project's client not polling), and the least
    // protocol client's series a second time: the two identical series'
    // ratio is what the run resolves.
    for rows in [24, 48] {
        for want in [
            format!("floor gathering rows, client sleeping in the runtime, {rows} rows"),
            format!("donor, least protocol client sleeping in the runtime, again, {rows} rows"),
        ] {
            assert!(names.contains(&want.as_str()), "{names:?}");
        }
    }
    assert_ratios(
        ratios,
        &[
            "(what waiting in the runtime's reactor costs the floor)",
            "(the donor's share in the runtime)",
            "(like for like)",
            "(two identical series: what the run resolves)",
        ],
        8,
    );
    // The bulk series: a 16,384-row lookup against a raw ping-pong of the
    // same bytes and against a floor that gathers as many rows (its rows
    // checked), and their ratios.
    for name in [
        "floor, blocking client, 16384 rows (bulk)",
        "donor, project client, 16384 rows (bulk)",
        "floor gathering rows, blocking client, 16384 rows (bulk)",
    ] {
        let s = series
            .iter()
            .find(|s| s["series"] == name)
            .unwrap_or_else(|| panic!("{name} in {names:?}"));
        assert_eq!(s["rows"], 16384);
        assert!(s["answer_bytes"].as_u64().expect("bytes") > 16384 * 264);
    }
    let bulk: Vec<f64> = ratios
        .iter()
        .filter(|r| r["what"].as_str().is_some_and(|w| w.starts_with("bulk")))
        .map(|r| r["p50"].as_f64().expect("p50"))
        .collect();
    // Against the raw ping-pong (the target), the gather's own cost, and
    // the donor against the floor that gathers the same rows.
    assert!(
        bulk.len() == 3 && bulk.iter().all(|r| r.is_finite() && *r > 0.0),
        "{ratios:?}"
    );
}

#[test]
fn a_load_run_times_the_default_and_copy_starts_and_verify_against_the_same_floors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("t.etab");
    let v = bench(&[
        "load",
        "--json",
        "--rounds",
        "1",
        "--rows",
        "200000",
        "--file",
        file.to_str().expect("utf-8"),
        "--out",
        dir.path().to_str().expect("utf-8"),
    ]);
    let series = v["series"].as_array().expect("series");
    let names: Vec<&str> = series
        .iter()
        .map(|s| s["name"].as_str().expect("name"))
        .collect();
    for want in [
        "donor start (the file's pages, the default), verified, warm",
        "donor start, --copy-tables, verified, warm",
        "donor start, --copy-tables, --trust-digest, warm",
        "donor start, --copy-tables, verified, cold",
        "memory-donor verify, cold",
        "memory-donor verify --threads 1, cold",
        "donor restart from the fd store, --copy-tables",
    ] {
        assert!(names.contains(&want), "{names:?}");
    }
    for s in series {
        assert!(s["median_seconds"].as_f64().expect("seconds") > 0.0, "{s}");
    }
    let targets: Vec<&str> = v["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .map(|t| t["name"].as_str().expect("name"))
        .collect();
    assert_eq!(
        targets
            .iter()
            .filter(|t| t.starts_with("--copy-tables"))
            .count(),
        4,
        "{targets:?}"
    );
    let figures = v["figures"].as_array().expect("figures");
    assert_eq!(figures.len(), 2, "{figures:?}");
    for f in figures {
        let x = f["value"].as_f64().expect("value");
        assert!(x.is_finite() && x > 0.0, "{f}");
    }
}

/// With QUIC the run measures quinn alone moving the same bytes (the QUIC
/// floor), reports the donor over QUIC against it and that floor against
/// TCP's, and says what quinn's UDP layer uses on this kernel.
#[test]
fn the_floor_run_with_quic_measures_quinn_alone() {
    let v = short_floor("tcp,quic");
    let series = v["series"].as_array().expect("series");
    for rows in [24, 48] {
        let name = format!("QUIC floor (quinn), polling client, {rows} rows");
        let s = series
            .iter()
            .find(|s| s["series"] == name.as_str())
            .unwrap_or_else(|| panic!("no series {name:?}: {series:?}"));
        assert!(s["median"]["p50_us"].as_f64().expect("p50") > 0.0, "{s}");
    }
    let ratios = v["ratios"].as_array().expect("ratios");
    for what in [
        "QUIC floor (quinn alone) / polling TCP floor (the floor of quic / tcp)",
        "donor over quic / QUIC floor",
    ] {
        let n = ratios.iter().filter(|r| r["what"] == what).count();
        assert_eq!(n, 2, "{what} at both sizes: {ratios:?}");
    }
    assert!(
        v["quic_udp"]["gso_segments"].as_u64().expect("gso") >= 1,
        "{}",
        v["quic_udp"]
    );
}
