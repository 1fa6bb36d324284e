//! `inference-node addresses` and `memory-donor gen --hash-base` as a user
//! runs them: the pinned JSON, token maps, clear errors, and rows addressed
//! by hashing fetched from a real donor serving a table sized by the preset.

use std::process::{Command, Output};

use engram_protocol::hashing::{HashParams, Preset, hash_sequence};
use rack_harness::{DonorProcess, bin};

fn run(name: &str, args: &[&str]) -> Output {
    Command::new(bin(name))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .expect("runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("json")
}

/// The rows of one layer of one position, from the JSON.
fn layer_rows(v: &serde_json::Value, position: usize, layer: &str) -> Vec<u64> {
    v["positions"][position]["rows"][layer]
        .as_array()
        .expect("24 rows")
        .iter()
        .map(|r| r.as_u64().expect("row id"))
        .collect()
}

#[test]
fn addresses_prints_the_pinned_json() {
    let out = run(
        "inference-node",
        &[
            "addresses",
            "--preset",
            "v41",
            "--compressed-ids",
            "5,17,-1,99091",
            "--json",
        ],
    );
    let v = json(&out);
    let p = HashParams::v41();
    let want = hash_sequence(&p, 2, &[5, 17, -1, 99_091]).expect("hash");
    assert_eq!(v["layers"], serde_json::json!([1, 14]));
    let positions = v["positions"].as_array().expect("positions");
    assert_eq!(positions.len(), 4);
    for (i, (pos, w)) in positions.iter().zip(&want).enumerate() {
        assert_eq!(
            pos.as_object().map(|o| o.len()),
            Some(2),
            "id and rows only"
        );
        match w {
            None => assert_eq!(pos["rows"], serde_json::Value::Null),
            Some(w) => {
                assert_eq!(layer_rows(&v, i, "1"), w[0].to_vec());
                assert_eq!(layer_rows(&v, i, "14"), w[1].to_vec());
                // Row ids index the whole table: column c lies inside its prime's range.
                for (l, rows) in p.layers.iter().zip(w) {
                    for (c, r) in rows.iter().enumerate() {
                        assert!(*r >= l.offsets[c] && *r < l.offsets[c] + l.primes[c]);
                    }
                }
            }
        }
    }
    assert_eq!(positions[0]["id"], 5);
    assert_eq!(positions[2]["id"], -1);
    let line = text(&out.stdout);
    assert!(
        line.starts_with(r#"{"layers":[1,14],"positions":[{"id":5,"rows":{"1":["#),
        "{line}"
    );
    // Without --json: a table for people.
    let out = run("inference-node", &["addresses", "--compressed-ids", "5,-1"]);
    assert!(out.status.success());
    let t = text(&out.stdout);
    assert!(t.contains("preset v41") && t.contains("DEAD"), "{t}");
}

#[test]
fn token_ids_go_through_a_token_map_and_bad_input_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let map = dir.path().join("map.txt");
    // Raw ids 0..6 -> compressed 0 1 2 1 3 0 4.
    std::fs::write(&map, "0\n1\n2\n1\n3\n0\n4\n").expect("write");
    let m = map.display().to_string();
    let v = json(&run(
        "inference-node",
        &[
            "addresses",
            "--hash-base",
            "1000",
            "--token-map",
            &m,
            "--token-ids",
            "3,4,-1,6",
            "--json",
        ],
    ));
    let ids: Vec<i64> = v["positions"]
        .as_array()
        .expect("positions")
        .iter()
        .map(|p| p["id"].as_i64().expect("id"))
        .collect();
    assert_eq!(ids, [1, 3, -1, 4]);
    let p = HashParams::new(Preset::Base(1000)).expect("preset");
    // The pad is the map's compressed id of raw token 2: 2.
    let want = hash_sequence(&p, 2, &[1, 3, -1, 4]).expect("hash");
    assert_eq!(layer_rows(&v, 3, "14"), want[3].expect("live")[1].to_vec());

    for (args, msg) in [
        (
            vec!["--compressed-ids", "5,99092"],
            "position 1: compressed id 99092 is out of range",
        ),
        (
            vec!["--compressed-ids", "5,x"],
            "position 1: \"x\" is not an integer id",
        ),
        (
            vec!["--compressed-ids", "5", "--pad-id", "-3"],
            "pad id -3 is out of range",
        ),
        (
            vec!["--preset", "v40", "--compressed-ids", "1"],
            "the known preset is v41",
        ),
        (
            vec!["--hash-base", "1", "--compressed-ids", "1"],
            "not a hashing preset",
        ),
        (vec!["--token-ids", "1"], "--token-ids needs"),
        (
            vec!["--token-map", &m, "--token-ids", "7"],
            "but the model expects 99092",
        ),
        (
            vec!["--hash-base", "1000", "--token-map", &m, "--token-ids", "7"],
            "position 0: raw token id 7 is not in the token map (7 ids)",
        ),
    ] {
        let mut a = vec!["addresses"];
        a.extend(args.iter().copied());
        let out = run("inference-node", &a);
        assert!(!out.status.success(), "{a:?} succeeded");
        assert!(
            text(&out.stderr).contains(msg),
            "{a:?}: {}",
            text(&out.stderr)
        );
    }
    let out = run(
        "inference-node",
        &[
            "addresses",
            "--token-map",
            &m,
            "--token-ids",
            "1",
            "--compressed-vocab",
            "5",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn hashed_rows_come_from_a_table_sized_by_the_preset() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("l14.etab");
    let p = path.display().to_string();
    let out = run(
        "memory-donor",
        &[
            "gen",
            "--layer",
            "14",
            "--hash-base",
            "1000",
            "--seed",
            "3",
            "--out",
            &p,
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows = HashParams::new(Preset::Base(1000)).expect("preset").layers[1].rows;
    assert!(text(&out.stdout).contains(&format!("rows {rows}")));
    let v = json(&run("memory-donor", &["inspect", &p, "--json"]));
    assert_eq!(v["hash_base"], 1000);

    let addr = json(&run(
        "inference-node",
        &[
            "addresses",
            "--hash-base",
            "1000",
            "--compressed-ids",
            "7,8,9",
            "--json",
        ],
    ));
    let ids: Vec<String> = (0..3)
        .flat_map(|i| layer_rows(&addr, i, "14"))
        .map(|r| r.to_string())
        .collect();
    let donor = DonorProcess::start(&["--table", &p, "--listen", "127.0.0.1:0"]).expect("donor");
    let a = donor.addr.to_string();
    let list = ids.join(",");
    let out = run(
        "inference-node",
        &[
            "fetch",
            "--donor",
            &a,
            "--table",
            &p,
            "--table-id",
            "14",
            "--rows",
            &list,
            "--verify",
            "--hex",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).lines().count(), 72);
}
