//! The command-line tools as a user runs them: gen, inspect, verify, fetch,
//! engram-cluster check, and the table file as other software reads it.

use std::process::{Command, Output};

use engram_protocol::ROW_BYTES;
use engram_protocol::synthetic::first_mismatch;
use rack_harness::rack_toml::{DonorEntry, RackToml, TableEntry};
use rack_harness::{DonorProcess, bin, gen_table, python_has};

fn run(name: &str, args: &[&str]) -> Output {
    Command::new(bin(name)).args(args).output().expect("runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn inspect_shows_a_table_of_any_encoding_and_says_which_this_build_serves() {
    use engram_protocol::encoding::RowEncoding;
    use engram_protocol::etab::{self, TableMeta};
    let dir = tempfile::tempdir().expect("tempdir");
    // A Qwen4Exp-shaped table: FP8 rows of 160 values, one table scale.
    let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
    let meta = TableMeta {
        layer: 1,
        rows: 1000,
        digest: engram_protocol::TableDigest([7; 32]),
        hash_preset: None,
        hash_base: None,
        source: "test".into(),
        encoding: fp8,
        tensor_scale: Some(0.5f32.to_bits()),
    };
    let mut bytes = etab::encode_header(&meta, false).expect("header");
    bytes.resize(bytes.len() + 40 * 4096, 0); // 25 rows a page
    let path = dir.path().join("qwen.etab");
    std::fs::write(&path, &bytes).expect("write");
    let p = path.display().to_string();
    let out = run("memory-donor", &["inspect", &p, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["encoding"], "fp8_per_tensorx160");
    assert_eq!(v["row_bytes"], 160);
    assert_eq!(v["rows_per_page"], 25);
    assert_eq!(v["pages"], 40);
    assert_eq!(v["tensor_scale"], 0.5);
    assert_eq!(
        (&v["served"], &v["node_reads"]),
        (&serde_json::json!(true), &serde_json::json!(false))
    );
    let out = run("memory-donor", &["inspect", &p]);
    let shown = text(&out.stdout);
    assert!(
        shown.contains("served:      by donors") && shown.contains("160 bytes each"),
        "{shown}"
    );
    // verify reads its rows (all zero here), and finds they are not the
    // header's version.
    let out = run("memory-donor", &["verify", &p]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("rows hash to"),
        "{}",
        text(&out.stderr)
    );
    // V4.1's tables: served, 264-byte rows, 15 a page.
    let (v41, _) = gen_table(dir.path(), "t.etab", 14, 100, 5).expect("gen");
    let out = run(
        "memory-donor",
        &["inspect", &v41.display().to_string(), "--json"],
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        (
            &v["served"],
            &v["row_bytes"],
            &v["rows_per_page"],
            &v["tensor_scale"]
        ),
        (
            &serde_json::json!(true),
            &serde_json::json!(264),
            &serde_json::json!(15),
            &serde_json::Value::Null
        )
    );
}

/// A safetensors file of `tensors` (name, dtype, shape, bytes), written
/// as its format says: a little-endian header length, the JSON header,
/// then the bytes.
fn write_safetensors(path: &std::path::Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let at = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, data.len()]}),
        );
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    std::fs::write(path, out).expect("write safetensors");
}

#[test]
fn pack_makes_a_qwen4exp_table_from_its_row_shards() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 100 FP8 rows of 160 values in 3 shards of 34, 34 and 32 rows.
    let rows: Vec<u8> = (0..100 * 160).map(|i| (i % 97) as u8).collect();
    let p = "model.layers.0.ple.ple_embedding.ngram_embedding";
    let mut tensors = vec![(
        format!("{p}.weight_scale"),
        "F32",
        vec![],
        0.25f32.to_le_bytes().to_vec(),
    )];
    for (i, (lo, hi)) in [(0, 34), (34, 68), (68, 100)].into_iter().enumerate() {
        tensors.push((
            format!("{p}.shard_{i}.weight"),
            "F8_E4M3",
            vec![hi - lo, 160],
            rows[lo * 160..hi * 160].to_vec(),
        ));
    }
    let named: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), b.clone()))
        .collect();
    write_safetensors(&dir.path().join("model.safetensors"), &named);
    let out = dir.path().join("ple.etab");
    let (ck, o) = (dir.path().display().to_string(), out.display().to_string());
    let args = [
        "pack",
        "--model",
        "qwen4exp",
        "--checkpoint",
        &ck,
        "--layer",
        "1",
        "--parts",
        "3",
        "--out",
        &o,
    ];
    let run_out = run("memory-donor", &args);
    assert!(run_out.status.success(), "{}", text(&run_out.stderr));
    assert!(
        text(&run_out.stdout).contains("rows 100 encoding fp8_per_tensorx160"),
        "{}",
        text(&run_out.stdout)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&run("memory-donor", &["inspect", &o, "--json"]).stdout)
            .expect("json");
    assert_eq!(
        (&v["rows"], &v["tensor_scale"], &v["hash_preset"]),
        (
            &serde_json::json!(100),
            &serde_json::json!(0.25),
            &serde_json::json!("qwen4exp")
        )
    );
    // Row 40 sits in page 1 (25 rows a page) at slot 15.
    let bytes = std::fs::read(&out).expect("read");
    let at = v["data_start"].as_u64().expect("start") as usize + 4096 + 15 * 160;
    assert_eq!(&bytes[at..at + 160], &rows[40 * 160..41 * 160]);
    // The wrong shard count is refused naming the shard, and no file is left.
    std::fs::remove_file(&out).expect("rm");
    let mut bad = args;
    bad[8] = "4";
    let r = run("memory-donor", &bad);
    assert!(!r.status.success() && !out.exists());
    assert!(text(&r.stderr).contains("shard 0"), "{}", text(&r.stderr));
    // V4.1's options are refused for qwen4exp, and the shard options for V4.1.
    let r = run("memory-donor", &[&args[..], &["--hash-base", "5"]].concat());
    assert!(
        text(&r.stderr).contains("--hash-base"),
        "{}",
        text(&r.stderr)
    );
    let r = run(
        "memory-donor",
        &[
            "pack",
            "--checkpoint",
            &ck,
            "--layer",
            "1",
            "--parts",
            "3",
            "--out",
            &o,
        ],
    );
    assert!(
        text(&r.stderr).contains("--model qwen4exp"),
        "{}",
        text(&r.stderr)
    );
}

#[test]
fn inspect_and_verify_report_the_table_and_catch_corruption() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "t.etab", 14, 1000, 5).expect("gen");
    let p = path.display().to_string();
    let out = run("memory-donor", &["inspect", &p, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["layer"], 14);
    assert_eq!(v["rows"], 1000);
    assert_eq!(v["pages"], 67);
    assert_eq!(v["digest"], digest.to_hex());
    assert_eq!(v["data_start"].as_u64().map(|d| d % 4096), Some(0));
    let out = run("memory-donor", &["inspect", &p]);
    assert!(text(&out.stdout).contains(&digest.to_hex()));

    assert_eq!(v["page_checksums"], "xxh3_64");
    let out = run("memory-donor", &["verify", &p]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("page checksums ok"));
    for threads in ["1", "3"] {
        let out = run("memory-donor", &["verify", "--threads", threads, &p]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(text(&out.stdout).contains(&digest.to_hex()));
    }
    let out = run("memory-donor", &["verify", "--threads", "0", &p]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--threads"),
        "{}",
        text(&out.stderr)
    );
    // Flip one value byte of row 500 to another valid code: its page's
    // checksum names the page.
    let off = v["data_start"].as_u64().expect("offset")
        + (500 / 15) * 4096
        + (500 % 15) * ROW_BYTES as u64;
    let mut bytes = std::fs::read(&path).expect("read");
    bytes[off as usize] ^= 0x01;
    std::fs::write(&path, &bytes).expect("write");
    let out = run("memory-donor", &["verify", &p]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("page 33 hashes to"),
        "{}",
        text(&out.stderr)
    );
    // The same file as written before page checksums existed: the digest
    // catches the flip, and adding checksums refuses to bless it.
    engram_store::table_file::remove_page_sums(&path).expect("strip");
    for args in [
        &["verify", &p][..],
        &["verify", "--write-page-checksums", &p],
    ] {
        let out = run("memory-donor", args);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            text(&out.stderr).contains("rows hash to"),
            "{}",
            text(&out.stderr)
        );
    }
    // Healed, it verifies without checksums (saying so), gains them, and
    // verifies with them.
    bytes[off as usize] ^= 0x01;
    std::fs::write(&path, &bytes).expect("write");
    engram_store::table_file::remove_page_sums(&path).expect("strip");
    let out = run("memory-donor", &["verify", &p]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("no page checksums (add them with --write-page-checksums)"));
    let out = run("memory-donor", &["inspect", &p]);
    assert!(
        text(&out.stdout).contains("none (add with"),
        "{}",
        text(&out.stdout)
    );
    let out = run("memory-donor", &["verify", "--write-page-checksums", &p]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("page checksums ok"));
    assert_eq!(
        std::fs::read(&path).expect("read"),
        bytes,
        "the file as gen wrote it"
    );
    // Not a table at all.
    std::fs::write(&path, b"not a table").expect("write");
    let out = run("memory-donor", &["inspect", &p]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("not a valid .etab"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn fetch_prints_writes_and_verifies_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "t.etab", 1, 5000, 8).expect("gen");
    let p = path.display().to_string();
    let donor = DonorProcess::start(&["--table", &p, "--listen", "127.0.0.1:0"]).expect("donor");
    let addr = donor.addr.to_string();
    let raw = dir.path().join("rows.bin");
    let fetch = |extra: &[&str]| {
        let mut args = vec![
            "fetch",
            "--donor",
            &addr,
            "--table",
            &p,
            "--table-id",
            "1",
            "--rows",
            "3,4990-4999",
        ];
        args.extend_from_slice(extra);
        run("inference-node", &args)
    };
    let out = fetch(&["--verify", "--out"]);
    assert!(!out.status.success(), "--out needs a value");
    let raw_path = raw.display().to_string();
    let out = fetch(&["--verify", "--out", &raw_path]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("verified 11 rows"));
    let data = std::fs::read(&raw).expect("rows");
    let ids: Vec<u64> = std::iter::once(3).chain(4990..5000).collect();
    assert_eq!(data.len(), ids.len() * ROW_BYTES);
    assert_eq!(first_mismatch(8, 1, &ids, &data), None);
    let hex = digest.to_hex();
    let by_digest = |digest: &str, rows: &str, extra: &[&str]| {
        let mut args = vec![
            "fetch",
            "--donor",
            &addr,
            "--digest",
            digest,
            "--table-id",
            "1",
            "--rows",
            rows,
        ];
        args.extend_from_slice(extra);
        run("inference-node", &args)
    };
    let out = by_digest(&hex, "7", &["--hex"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let line = text(&out.stdout);
    assert!(
        line.starts_with("7 ") && line.trim_end().len() == 2 + 2 * ROW_BYTES,
        "{line}"
    );
    let out = by_digest(&hex, "0-1", &[]);
    assert!(text(&out.stdout).lines().count() == 2 && text(&out.stdout).starts_with("row 0: ["));
    // A wrong digest and an out-of-range row fail with clear messages.
    let wrong = format!(
        "{}{}",
        &hex[..63],
        if hex.ends_with('0') { '1' } else { '0' }
    );
    let out = by_digest(&wrong, "1", &[]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("not the pinned"),
        "{}",
        text(&out.stderr)
    );
    let out = by_digest(&hex, "5000", &[]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("row_out_of_range"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn engram_cluster_checks_the_shipped_example_and_points_at_bad_lines() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../systemd/rack.toml");
    let out = run("engram-cluster", &["check", example]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("ok: rack \"rack-a\""));
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("rack.toml");
    let original = std::fs::read_to_string(example).expect("example");
    // The line of donor-a's `tables = [1]`, and the column of its `1`.
    let line = original
        .lines()
        .position(|l| l.starts_with("tables = [1]"))
        .expect("donor-a's tables")
        + 1;
    let body = original.replacen("tables = [1]", "tables = [7]", 1);
    std::fs::write(&bad, body).expect("write");
    let out = run("engram-cluster", &["check", &bad.display().to_string()]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("rack.toml:{line}:11:"))
            && err.contains("donor[0].tables[0]: table 7 is not defined"),
        "{err}"
    );
}

/// A client written in Python from PROTOCOL.md alone fetches rows from the real donor.
#[test]
fn a_python_client_written_from_protocol_md_fetches_rows() {
    if !python_has("xxhash") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "t.etab", 1, 3000, 4).expect("gen");
    let donor = DonorProcess::start(&[
        "--table",
        &path.display().to_string(),
        "--listen",
        "127.0.0.1:0",
    ])
    .expect("donor");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/engram_client.py");
    let out = Command::new("python3")
        .args([
            script,
            &donor.addr.to_string(),
            "1",
            &digest.to_hex(),
            "0,17,2999",
        ])
        .output()
        .expect("python");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3);
    for (line, id) in lines.iter().zip([0u64, 17, 2999]) {
        let mut want = [0u8; ROW_BYTES];
        engram_protocol::synthetic::synthetic_row(4, 1, id, &mut want);
        let hex: String = want.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(*line, format!("{id} {hex}"));
    }
}

/// A host-socket client written from PROTOCOL.md section 5 alone (Python,
/// standard library and `xxhash`) maps a donor's table and reads its rows.
#[test]
fn python_host_client_from_protocol_md_reads_mapped_rows() {
    if !python_has("xxhash") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "t.etab", 1, 3000, 4).expect("gen");
    let socket = dir.path().join("d.sock");
    let config = dir.path().join("rack.toml");
    let mut rack = RackToml::new("t");
    rack.table = vec![TableEntry::new(1, &path, 3000, digest)];
    let listen = [
        "127.0.0.1:0".to_string(),
        format!("unix://{}", socket.display()),
    ];
    rack.donor = vec![DonorEntry::new("d", listen, [1])];
    rack.write(&config).expect("config");
    let _donor = DonorProcess::start(&["--config", &config.display().to_string(), "--name", "d"])
        .expect("donor");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/engram_host_client.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(&socket)
        .args(["1", &digest.to_hex(), "0,17,2999"])
        .output()
        .expect("python");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{stdout}");
    for (line, id) in lines.iter().zip([0u64, 17, 2999]) {
        let mut want = [0u8; ROW_BYTES];
        engram_protocol::synthetic::synthetic_row(4, 1, id, &mut want);
        let hex: String = want.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(*line, format!("{id} {hex}"));
    }
    assert!(lines[3].starts_with("generation "), "{stdout}");
}

/// Python's `safetensors` opens a table file and sees the same rows, and
/// its page checksums are XXH3-64 of each page.
#[test]
fn python_safetensors_opens_a_table() {
    if !python_has("safetensors, numpy, xxhash") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = gen_table(dir.path(), "t.etab", 1, 40, 3).expect("gen");
    let script = r#"
import sys, hashlib, xxhash
from safetensors import safe_open
with safe_open(sys.argv[1], framework="numpy") as f:
    meta = f.metadata()
    pages = f.get_tensor("pages")
    sums = f.get_tensor("page_xxh3")
    rows = int(meta["rows"])
    flat = b"".join(bytes(pages[r // 15][(r % 15) * 264:(r % 15) * 264 + 264]) for r in range(rows))
    ok = all(xxhash.xxh3_64_intdigest(bytes(pages[p])) == int(sums[p]) for p in range(pages.shape[0]))
    print(meta["digest_blake3"], pages.shape[0], pages.shape[1], pages.dtype, flat[:264].hex(), flat[-264:].hex(), sums.dtype, ok)
"#;
    let out = Command::new("python3")
        .args(["-c", script, &path.display().to_string()])
        .output()
        .expect("python");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    let f: Vec<&str> = s.split_whitespace().collect();
    assert_eq!(f[0], digest.to_hex());
    assert_eq!((f[1], f[2], f[3]), ("3", "4096", "uint8"));
    let mut first = [0u8; ROW_BYTES];
    engram_protocol::synthetic::synthetic_row(3, 1, 0, &mut first);
    let mut last = [0u8; ROW_BYTES];
    engram_protocol::synthetic::synthetic_row(3, 1, 39, &mut last);
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    assert_eq!(f[4], hex(&first));
    assert_eq!(f[5], hex(&last));
    assert_eq!((f[6], f[7]), ("uint64", "True"), "page checksums");
}

/// `inference-node addresses --config` on a `qwen4exp` rack prints each
/// position's 16 row ids as Qwen4Exp's hashing gives them (an EOS inside
/// the ids restarts the window), never V4.1's; compressed ids are refused.
#[test]
fn addresses_of_a_qwen4exp_rack_are_its_own_hashings() {
    use engram_protocol::qwen4exp::{Qwen4ExpConfig, Qwen4ExpHashing};
    use rack_harness::rack_toml::ModelSection;
    let dir = tempfile::tempdir().expect("tempdir");
    let hashing = Qwen4ExpHashing::new(Qwen4ExpConfig {
        base: 1_000,
        ..Qwen4ExpConfig::qwen38_flash_next(7)
    })
    .expect("hashing");
    let mut rack = RackToml::new("q");
    rack.table = vec![TableEntry {
        encoding: Some("fp8_per_tensorx160".into()),
        ..TableEntry::new(
            1,
            dir.path().join("t.etab"),
            hashing.padded_rows,
            "00".repeat(32),
        )
    }];
    rack.donor = vec![DonorEntry::new("d", ["127.0.0.1:0".to_string()], [1])];
    rack.model = Some(ModelSection {
        family: Some("qwen4exp".into()),
        eos_token: Some(7),
        hash_base: Some(1_000),
        ..ModelSection::default()
    });
    let config = dir.path().join("rack.toml");
    rack.write(&config).expect("config");
    let c = config.display().to_string();
    let ids = [5i64, 9, 7, 11, 13, 5, 9];
    let list = "5,9,7,11,13,5,9";
    let out = run(
        "inference-node",
        &["addresses", "--config", &c, "--token-ids", list, "--json"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let want = hashing.ids(&[], &ids).expect("ids");
    let got: Vec<u64> = v["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .flat_map(|r| r.as_array().expect("a position's rows").clone())
        .map(|x| x.as_u64().expect("a row id"))
        .collect();
    assert_eq!(got, want);
    assert_eq!(v["rows"].as_array().map(Vec::len), Some(ids.len()));
    let out = run(
        "inference-node",
        &["addresses", "--config", &c, "--token-ids", list],
    );
    let t = text(&out.stdout);
    assert!(t.starts_with("qwen4exp: 16 rows a token"), "{t}");
    assert_eq!(t.lines().count(), 1 + ids.len(), "{t}");
    let out = run(
        "inference-node",
        &["addresses", "--config", &c, "--compressed-ids", list],
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("raw ids"),
        "{}",
        text(&out.stderr)
    );
}
