//! `inference-node run` against real donor processes: the trace and
//! summary, fused outputs identical to a run on local RAM (with a wide
//! prefill cut into several messages), a clear refusal to start when a
//! table has no usable source, and the warm-up's Pings before each step.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use rack_harness::{DonorProcess, bin, model_rack, model_rack_config};

/// Run the node; returns (exit ok, stdout, stderr).
fn run(config: &Path, name: &str, extra: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin("inference-node"))
        .arg("run")
        .arg("--config")
        .arg(config)
        .args(["--name", name, "--quiet"])
        .args(extra)
        .output()
        .expect("inference-node runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn trace(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .expect("trace")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn checksums(steps: &[serde_json::Value]) -> BTreeMap<(u64, u64), String> {
    steps
        .iter()
        .flat_map(|s| s["positions"].as_array().expect("positions").iter())
        .map(|p| {
            (
                (
                    p["seq"].as_u64().expect("seq"),
                    p["index"].as_u64().expect("index"),
                ),
                p["checksum"].as_str().expect("checksum").to_string(),
            )
        })
        .collect()
}

#[test]
fn a_paced_run_traces_every_step_and_fuses_what_local_ram_fuses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = model_rack(dir.path()).expect("rack");
    let _donor = DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts");
    let args = |t: &Path| {
        vec![
            "--tokens".to_string(),
            "120".into(),
            "--prefill".into(),
            "60".into(),
            "--json".into(),
            "--trace".into(),
            t.display().to_string(),
        ]
    };
    let t_node = dir.path().join("node.jsonl");
    let a = args(&t_node);
    let (ok, out, err) = run(
        &config,
        "n",
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert!(ok, "{err}");
    let summary: serde_json::Value = serde_json::from_str(&out).expect("summary JSON");
    assert_eq!(summary["tokens"], 120);
    assert_eq!(summary["prefill_positions"], 60);
    assert_eq!(summary["failed_steps"], 0);
    assert!(
        summary["predicted_tokens_per_second"]
            .as_f64()
            .expect("prediction")
            > 0.0
    );
    let steps = trace(&t_node);
    assert_eq!(steps.len(), 121, "one prefill step and 120 decode steps");
    assert_eq!(steps[0]["kind"], "prefill");
    let t0 = &steps[0]["tables"][0];
    assert!(
        t0["unique_rows"].as_u64().expect("rows") > 500 && t0["messages"].as_u64().expect("n") >= 2,
        "a wide prefill is cut at the donor's frame cap: {t0}"
    );
    for s in &steps[1..] {
        assert_eq!(s["kind"], "decode");
        assert_eq!(s["w_us"], 20_000.0);
        for t in s["tables"].as_array().expect("tables") {
            assert_eq!(t["rows"], 24);
            let src = t["source"].as_str().expect("served");
            assert!(src == "d" || src == "ssd", "{t}");
        }
    }
    let served_by_donor = steps[1..]
        .iter()
        .filter(|s| s["tables"][0]["source"] == "d")
        .count();
    assert!(served_by_donor > 100, "the donor serves: {served_by_donor}");

    // The same input on local RAM fuses bit-identical outputs.
    let t_ref = dir.path().join("ref.jsonl");
    let a = args(&t_ref);
    let (ok, _, err) = run(
        &config,
        "ref",
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert!(ok, "{err}");
    let reference = checksums(&trace(&t_ref));
    assert_eq!(reference.len(), 180);
    assert_eq!(checksums(&steps), reference);
}

#[test]
fn draft_prefetch_on_a_donor_fuses_what_local_ram_fuses_without_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = model_rack(dir.path()).expect("rack");
    let _donor = DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts");
    let go = |name: &str, file: &str, extra: &[&str]| {
        let t = dir.path().join(file);
        let mut a = vec!["--tokens", "60", "--speculate", "3", "--trace"];
        let path = t.display().to_string();
        a.push(&path);
        a.extend_from_slice(extra);
        let (ok, _, err) = run(&config, name, &a);
        assert!(ok, "{err}");
        trace(&t)
    };
    let reference = checksums(&go("ref", "ref.jsonl", &[]));
    assert_eq!(reference.len(), 60);
    let drafted = ["--draft-us", "300"];
    let off = go("n", "off.jsonl", &drafted);
    let on = go(
        "n",
        "on.jsonl",
        &[&drafted[..], &["--draft-prefetch"]].concat(),
    );
    for steps in [&off, &on] {
        assert_eq!(steps.len(), 15);
        assert!(
            steps
                .iter()
                .all(|s| s["kind"] == "verify" && s["draft_us"].as_f64() >= Some(900.0))
        );
    }
    // One message per table per step without prefetch; one per position
    // (less rows asked already) with it.
    assert!(off.iter().all(|s| s["tables"][0]["messages"] == 1));
    assert!(
        on.iter()
            .any(|s| s["tables"][0]["messages"].as_u64() > Some(1))
    );
    assert_eq!(checksums(&off), reference);
    assert_eq!(checksums(&on), reference);
}

#[test]
fn a_table_with_no_usable_source_stops_the_node_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = model_rack(dir.path()).expect("rack");
    let (ok, _, err) = run(&config, "stranded", &["--tokens", "5"]);
    assert!(!ok);
    assert!(
        err.contains("has no usable source at start") && err.contains("gone"),
        "{err}"
    );
    // Bad flags are refused before anything starts.
    let (ok, _, err) = run(&config, "n", &["--batch", "0"]);
    assert!(!ok && err.contains("--batch"), "{err}");
    // Without a GPU (or without `--features cuda`) the GPU backbone is
    // refused with the reason; with one, it runs.
    let (ok, _, err) = run(&config, "ref", &["--tokens", "5", "--backbone", "gpu"]);
    assert!(ok || err.contains("GPU backbone:"), "{err}");
    let (ok, _, err) = run(&config, "nobody", &[]);
    assert!(!ok && err.contains("nobody"), "{err}");
}

/// The checkpoint's config.json (`[model] config`) that agrees with the
/// node lets it run; one that differs in a field stops it at start,
/// naming the field.
#[test]
fn a_config_json_that_differs_from_the_node_stops_it_naming_the_field() {
    use engram_protocol::hashing::{HashParams, Preset};
    let dir = tempfile::tempdir().expect("tempdir");
    let mut rack = model_rack_config(dir.path()).expect("rack");
    let json = dir.path().join("config.json");
    if let Some(m) = rack.model.as_mut() {
        m.config = Some(json.display().to_string());
    }
    let config = dir.path().join("rack.toml");
    rack.write(&config).expect("config");
    let p = HashParams::new(Preset::from_base(rack_harness::MODEL_BASE).expect("base"))
        .expect("params");
    let good = serde_json::json!({
        "hidden_size": 8, "hc_mult": 2, "rms_norm_eps": 1e-20,
        "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [p.layers[0].rows, p.layers[1].rows],
        "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_vocab_size": rack_harness::MODEL_BASE, "engram_compressed_vocab_size": 99_092,
        "engram_pad_token_id": 2
    });
    std::fs::write(&json, good.to_string()).expect("write");
    let (ok, _, err) = run(&config, "ref", &["--tokens", "3"]);
    assert!(ok, "{err}");
    for (field, value) in [
        ("hidden_size", serde_json::json!(16)),
        (
            "engram_num_embeddings",
            serde_json::json!([p.layers[0].rows + 1, p.layers[1].rows]),
        ),
        ("rms_norm_eps", serde_json::json!(1e-6)),
    ] {
        let mut bad = good.clone();
        bad[field] = value;
        std::fs::write(&json, bad.to_string()).expect("write");
        let (ok, _, err) = run(&config, "ref", &["--tokens", "3"]);
        assert!(
            !ok && err.contains(field) && err.contains("config.json"),
            "{field}: {err}"
        );
    }
}

/// A batch step asks each table's rows in one message however many
/// sequences it holds, up to the donor's frame cap: 256 sequences, over
/// 2,048 distinct rows per table, one message each.
#[test]
fn a_wide_batch_step_is_one_message_per_table_up_to_the_frame_cap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut rack = model_rack_config(dir.path()).expect("rack");
    rack.donor_mut("d").expect("donor d").max_rows = Some(8192);
    let config = dir.path().join("rack.toml");
    rack.write(&config).expect("config");
    let _donor = DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor starts");
    let t = dir.path().join("batch.jsonl");
    let path = t.display().to_string();
    let (ok, _, err) = run(
        &config,
        "n",
        &["--batch", "256", "--tokens", "768", "--trace", &path],
    );
    assert!(ok, "{err}");
    let steps = trace(&t);
    assert_eq!(steps.len(), 3);
    for s in &steps {
        for table in s["tables"].as_array().expect("tables") {
            let unique = table["unique_rows"].as_u64().expect("unique rows");
            assert!(unique > 2048, "{table}");
            assert_eq!(table["messages"], 1, "{table}");
        }
    }
}

/// Donor `d` of `config` with its metrics served, and a count of the
/// Pings it has answered so far.
fn donor_counting_pings(config: &Path) -> (DonorProcess, impl Fn() -> f64) {
    let donor = DonorProcess::start(&[
        "--config",
        &config.display().to_string(),
        "--name",
        "d",
        "--metrics",
        "127.0.0.1:0",
    ])
    .expect("donor starts");
    let metrics = donor
        .ops()
        .expect("ops line")
        .metrics
        .expect("metrics address");
    let pings = move || {
        let text = rack_harness::scrape(metrics).expect("scrape");
        rack_harness::sample(&text, "engram_donor_pings_total").expect("pings series")
    };
    (donor, pings)
}

/// The node's warm-up pings each table's first donor once before every
/// step (`--warm-us`, on by default: both tables route to the one donor
/// here, whose one connection gets one Ping a step), and not at all with
/// `--warm-us 0`.
#[test]
fn a_paced_node_pings_its_donor_before_each_step_unless_told_not_to() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = model_rack(dir.path()).expect("rack");
    let (_donor, pings) = donor_counting_pings(&config);
    let before = pings();
    let (ok, _, err) = run(&config, "n", &["--tokens", "40"]);
    assert!(ok, "{err}");
    let warm = pings() - before;
    // 40 steps; a Ping still out when the next warm-up comes is not
    // doubled, the last step's may not leave before the node exits, and a
    // probe may add one.
    assert!((30.0..=44.0).contains(&warm), "{warm} Pings for 40 steps");
    let before = pings();
    let (ok, _, err) = run(&config, "n", &["--tokens", "40", "--warm-us", "0"]);
    assert!(ok, "{err}");
    let cold = pings() - before;
    assert!(cold <= 4.0, "{cold} Pings with the warm-up off");
}

/// The embedded memory warms the path as the node's loop does: each
/// `warm` pings the table's first source (one donor for both tables
/// here, so one Ping a call), and the prefetch after it is served.
#[test]
fn the_embedded_memory_warms_its_donor_when_asked() {
    use inference_node::embed::{EmbeddedNode, Segment};
    let dir = tempfile::tempdir().expect("tempdir");
    let config = model_rack(dir.path()).expect("rack");
    let (_donor, pings) = donor_counting_pings(&config);
    let mem = EmbeddedNode::open(&config, "n").expect("open");
    let step = |i: i64, warm: bool| {
        if warm {
            mem.warm(std::time::Duration::from_micros(300))
                .expect("warm");
            std::thread::sleep(std::time::Duration::from_micros(300));
        }
        let t = mem
            .prefetch(&[i], &[Segment::after(1, &[1, 2, 3])])
            .expect("prefetch");
        for layer in mem.layers() {
            let mut out = vec![0u8; t.bytes()];
            t.wait(layer, &mut out, Some(std::time::Duration::from_secs(10)))
                .expect("served");
        }
    };
    // The connection up first (its probe and Hello are not Pings).
    step(0, false);
    let before = pings();
    for i in 1..=20 {
        step(i, true);
    }
    let warm = pings() - before;
    // (A probe may add a few.)
    assert!(
        (18.0..=28.0).contains(&warm),
        "{warm} Pings for 20 warm-ups"
    );
    let before = pings();
    for i in 21..=40 {
        step(i, false);
    }
    let cold = pings() - before;
    assert!(cold <= 4.0, "{cold} Pings with no warm-up");
    mem.close(std::time::Duration::from_secs(2));
}
