//! A donor serving tables of other row encodings than V4.1's beside a
//! V4.1 table (docs/models.md): a version-2 client sees each table's
//! encoding in the Welcome and gets its rows at their own size, both
//! tables in one Lookup; a version-1 client sees and gets the V4.1 table
//! only; an answer's rows stay within `max_rows` x 264 bytes.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::Path;

use engram_protocol::encoding::RowEncoding;
use engram_protocol::etab::TableMeta;
use engram_protocol::messages::{LookupSection, encode_lookup};
use engram_protocol::synthetic::SplitMix64;
use engram_protocol::{
    ErrorCode, Frame, Limits, PROTOCOL_VERSION, PROTOCOL_VERSION_V1, ROW_BYTES, TableDigest,
    TableInfo, decode,
};
use engram_store::table_file::{TableFile, TableWriter};
use rack_harness::{DonorProcess, gen_table, hello_stream_at};

/// A table of `rows` random rows of `encoding` (no NaN codes), layer
/// `layer`, with a table scale where the encoding has one.
fn encoded_table(dir: &Path, layer: u32, e: RowEncoding, rows: u64) -> (TableMeta, Vec<u8>) {
    let path = dir.join(format!("layer{layer}.etab"));
    let mut data = vec![0u8; rows as usize * e.row_bytes()];
    let mut g = SplitMix64::new(u64::from(layer));
    for b in data.chunks_mut(8) {
        b.copy_from_slice(&g.next_u64().to_le_bytes()[..b.len()]);
    }
    data.iter_mut().for_each(|b| *b &= 0xFE);
    let meta = TableMeta {
        layer,
        rows,
        digest: TableDigest([0; 32]),
        hash_preset: None,
        hash_base: None,
        source: "test rows".into(),
        encoding: e,
        tensor_scale: e.has_tensor_scale().then(|| 0.0123f32.to_bits()),
    };
    let mut w = TableWriter::create(&path, meta).expect("create");
    w.write_rows(&data).expect("rows");
    (w.finish().expect("finish"), data)
}

/// Say Hello at `version`, send `frames`, half-close, and read every
/// frame the donor sends until it closes.
fn exchange(addr: SocketAddr, version: u16, frames: &[u8]) -> Vec<u8> {
    let mut s = hello_stream_at(addr, "enc", version);
    s.write_all(frames).expect("write");
    s.shutdown(std::net::Shutdown::Write).expect("half close");
    let mut all = Vec::new();
    s.read_to_end(&mut all).expect("read");
    all
}

fn lookup(sections: &[(u32, TableDigest, &[u64])]) -> Vec<u8> {
    let s: Vec<LookupSection<'_>> = sections
        .iter()
        .map(|&(table_id, d, rows)| LookupSection {
            table_id,
            digest_prefix: d.prefix(),
            rows,
        })
        .collect();
    let mut out = Vec::new();
    encode_lookup(&mut out, 7, &s).expect("lookup");
    out
}

/// The Welcome's tables and the frames after it.
fn welcome_then(answer: &[u8], version: u16) -> (Vec<TableInfo>, &[u8]) {
    let limits = Limits::default();
    let w = decode(answer, &limits).expect("valid").expect("a frame");
    let Frame::Welcome(welcome) = w.frame else {
        panic!("expected Welcome, got {:?}", w.frame);
    };
    assert_eq!(
        welcome.version, version,
        "the Welcome speaks the client's version"
    );
    (welcome.tables().collect(), &answer[w.len..])
}

#[test]
fn rows_of_every_encoding_are_served_at_their_own_size() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (v41_path, v41_digest) = gen_table(dir.path(), "l1.etab", 1, 5_000, 3).expect("gen");
    let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
    let bf16 = RowEncoding::Bf16 { values: 160 };
    let nvfp4 = RowEncoding::Nvfp4 { values: 160 };
    let (m3, rows3) = encoded_table(dir.path(), 3, fp8, 2_000);
    let (m4, rows4) = encoded_table(dir.path(), 4, bf16, 1_000);
    let (m5, rows5) = encoded_table(dir.path(), 5, nvfp4, 3_000);
    let paths: Vec<String> = [1, 3, 4, 5]
        .iter()
        .map(|l| {
            dir.path()
                .join(format!("layer{l}.etab"))
                .display()
                .to_string()
        })
        .collect();
    let v41 = v41_path.display().to_string();
    let donor = DonorProcess::start(&[
        "--table",
        &v41,
        "--table",
        &paths[1],
        "--table",
        &paths[2],
        "--table",
        &paths[3],
        "--listen",
        "127.0.0.1:0",
        "--max-rows",
        "48",
    ])
    .expect("donor starts");

    // Version 2: every table, with its encoding and scale.
    let ids: &[u64] = &[0, 7, 1_999];
    let answer = exchange(
        donor.addr,
        PROTOCOL_VERSION,
        &lookup(&[(3, m3.digest, ids), (1, v41_digest, &[4_999])]),
    );
    let (tables, rest) = welcome_then(&answer, PROTOCOL_VERSION);
    let by_id = |id: u32| tables.iter().find(|t| t.table_id == id).copied();
    assert_eq!(tables.len(), 4, "{tables:?}");
    let t3 = by_id(3).expect("table 3");
    assert_eq!((t3.encoding, t3.tensor_scale), (fp8, m3.tensor_scale));
    assert_eq!((t3.rows, t3.digest), (2_000, m3.digest));
    assert_eq!(by_id(4).expect("table 4").encoding, bf16);
    assert_eq!(by_id(5).expect("table 5").row_bytes(), 90);
    assert_eq!(by_id(1).expect("table 1").encoding, RowEncoding::V41);
    let limits = Limits::for_rows(48);
    let r = decode(rest, &limits).expect("valid").expect("rows");
    let Frame::Rows(rows) = r.frame else {
        panic!("expected Rows, got {:?}", r.frame);
    };
    let got: Vec<_> = rows.sections().collect();
    assert_eq!(got[0].0.row_size(), 160);
    for (k, &id) in ids.iter().enumerate() {
        let want = &rows3[id as usize * 160..][..160];
        assert_eq!(&got[0].1[k * 160..][..160], want, "fp8 row {id}");
    }
    assert_eq!(got[1].0.row_bytes, 0, "V4.1's rows say 0, as in version 1");
    let file = TableFile::open(&v41_path).expect("open");
    let mut want = Vec::new();
    file.for_each_chunk(false, None, |first, chunk| {
        if first <= 4_999 && 4_999 < first + (chunk.len() / ROW_BYTES) as u64 {
            let at = (4_999 - first) as usize * ROW_BYTES;
            want = chunk[at..at + ROW_BYTES].to_vec();
        }
        Ok(())
    })
    .expect("rows");
    assert_eq!(got[1].1, &want[..]);

    // BF16 and NVFP4 rows. 48 x 264 = 12,672 bytes hold 39 BF16 rows of
    // 320 and two NVFP4 rows of 90; 40 BF16 rows (12,800) exceed them.
    let fit: Vec<u64> = (0..39).collect();
    let over: Vec<u64> = (0..40).collect();
    let mut frames = lookup(&[(4, m4.digest, &fit), (5, m5.digest, &[2_999, 0])]);
    frames.extend(lookup(&[(4, m4.digest, &over)]));
    frames.extend(lookup(&[(5, m5.digest, &[1])]));
    let answer = exchange(donor.addr, PROTOCOL_VERSION, &frames);
    let (_, mut rest) = welcome_then(&answer, PROTOCOL_VERSION);
    let mut answers = Vec::new();
    while let Some(d) = decode(rest, &limits).expect("valid") {
        answers.push(d.frame);
        rest = &rest[d.len..];
    }
    assert_eq!(answers.len(), 3, "{answers:?}");
    let Frame::Rows(r) = answers[0] else {
        panic!("rows: {:?}", answers[0]);
    };
    let s: Vec<_> = r.sections().collect();
    assert_eq!(s[0].1, &rows4[..39 * 320]);
    assert_eq!(&s[1].1[..90], &rows5[2_999 * 90..]);
    assert_eq!(&s[1].1[90..], &rows5[..90]);
    match answers[1] {
        Frame::Error(e) => assert_eq!((e.code, e.detail), (ErrorCode::RequestTooLarge, 48)),
        ref other => panic!("expected request_too_large, got {other:?}"),
    }
    let Frame::Rows(r) = answers[2] else {
        panic!("the connection goes on: {:?}", answers[2]);
    };
    assert_eq!(r.sections().next().expect("one").1, &rows5[90..180]);

    // Version 1: the V4.1 table only; the others are unknown to it.
    let answer = exchange(
        donor.addr,
        PROTOCOL_VERSION_V1,
        &lookup(&[(3, m3.digest, &[0]), (1, v41_digest, &[0])]),
    );
    let (tables, rest) = welcome_then(&answer, PROTOCOL_VERSION_V1);
    assert_eq!(tables, [TableInfo::v41(1, 1, 5_000, v41_digest)]);
    let r = decode(rest, &Limits::default())
        .expect("valid")
        .expect("rows");
    let Frame::Rows(rows) = r.frame else {
        panic!("expected Rows, got {:?}", r.frame);
    };
    let s: Vec<_> = rows.sections().collect();
    assert_eq!(s[0].0.status, Some(ErrorCode::UnknownTable));
    assert!(s[1].0.status.is_none() && s[1].1.len() == ROW_BYTES);
    let log = donor.log();
    assert!(
        log.contains("held packed in a memfd"),
        "what it lacks is said: {log}"
    );
}

/// The node's donor client, saying version 2, reads rows of any encoding
/// at their size, mixed with V4.1's in one lookup, through the frame
/// buffer (small answers) and straight into the caller's buffer (large
/// ones); saying version 1 it is refused a table of another encoding as
/// missing. `inference-node fetch` fetches and verifies such rows.
#[test]
fn the_node_client_and_fetch_read_rows_of_any_encoding() {
    use inference_node::{ClientError, ClientOptions, DonorClient, Request};
    let dir = tempfile::tempdir().expect("tempdir");
    let (v41_path, v41_digest) = gen_table(dir.path(), "l1.etab", 1, 5_000, 3).expect("gen");
    let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
    let (m3, rows3) = encoded_table(dir.path(), 3, fp8, 20_000);
    let fp8_path = dir.path().join("layer3.etab").display().to_string();
    let v41 = v41_path.display().to_string();
    let donor = DonorProcess::start(&[
        "--table",
        &v41,
        "--table",
        &fp8_path,
        "--listen",
        "127.0.0.1:0",
    ])
    .expect("donor starts");
    let v41_file = TableFile::open(&v41_path).expect("open");
    let v41_row = |r: u64| {
        let mut b = vec![0u8; ROW_BYTES];
        let off = v41_file.layout.row_offset(r).expect("row");
        std::os::unix::fs::FileExt::read_exact_at(v41_file.handle(), &mut b, off).expect("read");
        b
    };
    rack_harness::runtime().block_on(async {
        let mut opts = ClientOptions::new("enc-node", vec![(1, v41_digest), (3, m3.digest)]);
        opts.version = PROTOCOL_VERSION;
        let c = DonorClient::connect(donor.addr, &opts)
            .await
            .expect("connects");
        assert_eq!((c.row_bytes(3), c.row_bytes(1)), (160, ROW_BYTES));
        for (n3, n1) in [(3usize, 2usize), (600, 300)] {
            // 3 + 2 rows: through the frame buffer; 600 + 300 (175 KB):
            // straight into `out`.
            let ids3: Vec<u64> = (0..n3 as u64).map(|i| (i * 7_919) % 20_000).collect();
            let ids1: Vec<u64> = (0..n1 as u64).map(|i| (i * 13) % 5_000).collect();
            let mut out = vec![0u8; n3 * 160 + n1 * ROW_BYTES];
            let req = [
                Request {
                    table: 3,
                    rows: &ids3,
                },
                Request {
                    table: 1,
                    rows: &ids1,
                },
            ];
            c.lookup(&req, &mut out).await.expect("lookup");
            for (k, &r) in ids3.iter().enumerate() {
                assert_eq!(
                    &out[k * 160..][..160],
                    &rows3[r as usize * 160..][..160],
                    "row {r}"
                );
            }
            let v41_rows = &out[n3 * 160..];
            for (k, &r) in ids1.iter().enumerate() {
                assert_eq!(
                    &v41_rows[k * ROW_BYTES..][..ROW_BYTES],
                    &v41_row(r)[..],
                    "row {r}"
                );
            }
            let mut short = vec![0u8; out.len() - 1];
            assert!(matches!(
                c.lookup(&req, &mut short).await,
                Err(ClientError::BadRequest(_))
            ));
        }
        let v1 = ClientOptions::new("enc-node", vec![(3, m3.digest)]);
        let e = DonorClient::connect(donor.addr, &v1).await.expect_err("v1");
        assert!(
            matches!(e, ClientError::TableMissing { table: 3, .. }),
            "{e:?}"
        );
    });
    let out = std::process::Command::new(rack_harness::bin("inference-node"))
        .args([
            "fetch",
            "--donor",
            &donor.addr.to_string(),
            "--table",
            &fp8_path,
            "--table-id",
            "3",
            "--rows",
            "0-99,19999",
            "--verify",
        ])
        .output()
        .expect("fetch runs");
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{se}");
    assert!(se.contains("verified 101 rows"), "{se}");
    assert!(
        so.contains("row 19999: [") && so.contains("fp8_per_tensorx160"),
        "{so}"
    );
}

/// The client written from PROTOCOL.md alone (Python) reads an NVFP4
/// table's rows at version 2, and still V4.1's at version 1.
#[test]
fn the_python_client_from_protocol_md_reads_rows_of_any_encoding() {
    if !rack_harness::python_has("xxhash") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (v41_path, v41_digest) = gen_table(dir.path(), "l1.etab", 1, 3_000, 4).expect("gen");
    let nvfp4 = RowEncoding::Nvfp4 { values: 160 };
    let (m5, rows5) = encoded_table(dir.path(), 5, nvfp4, 3_000);
    let nv_path = dir.path().join("layer5.etab").display().to_string();
    let donor = DonorProcess::start(&[
        "--table",
        &v41_path.display().to_string(),
        "--table",
        &nv_path,
        "--listen",
        "127.0.0.1:0",
    ])
    .expect("donor");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/engram_client.py");
    let run = |table: &str, digest: TableDigest, version: &str| {
        let out = std::process::Command::new("python3")
            .args([
                script,
                &donor.addr.to_string(),
                table,
                &digest.to_hex(),
                "0,17,2999",
            ])
            .args(["--version", version])
            .output()
            .expect("python");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let shown = run("5", m5.digest, "2");
    let lines: Vec<&str> = shown.lines().collect();
    assert_eq!(lines.len(), 3, "{shown}");
    for (line, id) in lines.iter().zip([0usize, 17, 2999]) {
        let hex: String = rows5[id * 90..][..90]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(*line, format!("{id} {hex}"));
    }
    let v1 = run("1", v41_digest, "1");
    assert_eq!(v1.lines().count(), 3);
    assert!(v1.lines().all(|l| l.len() > 2 * ROW_BYTES), "{v1}");
}

/// A cluster config declares a table's encoding (and table scale): the
/// donor serves the FP8 table it names, and refuses to start on a file
/// whose rows are of another encoding, or whose table scale is another,
/// than the config says, before reading it.
#[test]
fn a_config_declares_each_tables_encoding_and_the_donor_holds_it_to_that() {
    use rack_harness::rack_toml::{DonorEntry, RackToml, TableEntry};
    let dir = tempfile::tempdir().expect("tempdir");
    let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
    let (m, rows) = encoded_table(dir.path(), 2, fp8, 4_000);
    let path = dir.path().join("layer2.etab");
    let config = |encoding: &str, scale: Option<f64>| {
        let mut rack = RackToml::new("q");
        rack.table = vec![TableEntry {
            encoding: Some(encoding.into()),
            tensor_scale: scale,
            ..TableEntry::new(2, &path, 4_000, m.digest)
        }];
        rack.donor = vec![DonorEntry::new("d", ["127.0.0.1:0".to_string()], [2])];
        let file = dir.path().join(format!("{encoding}-{scale:?}.toml"));
        rack.write(&file).expect("config");
        file.display().to_string()
    };
    let good = config("fp8_per_tensorx160", Some(0.0123));
    let donor = DonorProcess::start(&["--config", &good, "--name", "d"]).expect("donor");
    let answer = exchange(
        donor.addr,
        PROTOCOL_VERSION,
        &lookup(&[(2, m.digest, &[3_999])]),
    );
    let (tables, rest) = welcome_then(&answer, PROTOCOL_VERSION);
    assert_eq!(tables.len(), 1);
    assert_eq!((tables[0].encoding, tables[0].rows), (fp8, 4_000));
    let r = decode(rest, &Limits::default())
        .expect("valid")
        .expect("rows");
    let Frame::Rows(r) = r.frame else {
        panic!("expected Rows, got {:?}", r.frame);
    };
    assert_eq!(r.sections().next().expect("one").1, &rows[3_999 * 160..]);
    drop(donor);
    let refused = |config: String| {
        let out = std::process::Command::new(rack_harness::bin("memory-donor"))
            .args(["serve", "--config", &config, "--name", "d"])
            .output()
            .expect("runs");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{err}");
        err
    };
    let err = refused(config("bf16x80", None));
    assert!(
        err.contains("its rows are fp8_per_tensorx160 but the config says encoding = \"bf16x80\""),
        "{err}"
    );
    let err = refused(config("fp8_per_tensorx160", Some(0.5)));
    assert!(
        err.contains("its table scale is 0.0123 but the config says tensor_scale = 0.5"),
        "{err}"
    );
}

/// `memory-donor gen --encoding` writes a synthetic table of another
/// encoding (with its table scale) that `inspect` shows and `verify`
/// passes; a scale for an encoding without one, and a name that is not an
/// encoding, are refused.
#[test]
fn gen_writes_synthetic_tables_of_any_encoding() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("fp8.etab").display().to_string();
    let generate = |extra: &[&str]| {
        let mut args = vec![
            "gen", "--layer", "2", "--rows", "3000", "--seed", "4", "--out", &out,
        ];
        args.extend_from_slice(extra);
        std::process::Command::new(rack_harness::bin("memory-donor"))
            .args(&args)
            .output()
            .expect("runs")
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let o = generate(&["--encoding", "fp8_per_tensorx160", "--tensor-scale", "0.5"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let run = |args: &[&str]| {
        std::process::Command::new(rack_harness::bin("memory-donor"))
            .args(args)
            .output()
            .expect("runs")
    };
    let o = run(&["inspect", &out, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(
        (&v["encoding"], &v["tensor_scale"], &v["rows"]),
        (
            &serde_json::json!("fp8_per_tensorx160"),
            &serde_json::json!(0.5),
            &serde_json::json!(3000)
        )
    );
    let o = run(&["verify", &out]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let file = TableFile::open_any(Path::new(&out)).expect("open");
    let mut want = vec![0u8; 160];
    engram_protocol::synthetic::synthetic_encoded_row(
        RowEncoding::Fp8PerTensor { values: 160 },
        4,
        2,
        2_999,
        &mut want,
    );
    let mut got = vec![0u8; 160];
    let at = file.layout.row_offset(2_999).expect("row");
    std::os::unix::fs::FileExt::read_exact_at(file.handle(), &mut got, at).expect("read");
    assert_eq!(got, want);
    let o = generate(&["--encoding", "bf16x160", "--tensor-scale", "0.5"]);
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("bf16x160 has no table scale"),
        "{}",
        text(&o.stderr)
    );
    let o = generate(&["--encoding", "fp9x160"]);
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("is not a row encoding"),
        "{}",
        text(&o.stderr)
    );
}

/// Over TLS and QUIC (the rack's own certificates), the node's client at
/// version 2 reads FP8 rows beside V4.1's exactly as over TCP: the same
/// session bytes in another carrier.
#[test]
fn tls_and_quic_carry_rows_of_any_encoding() {
    use cluster_config::{Config, Transport};
    use inference_node::client::{ClientOptions, DonorClient, Request, TlsClient};
    use inference_node::tls::NodeTls;
    use rack_harness::rack_toml::{
        DonorEntry, NodeEntry, RackToml, RouteEntry, TableEntry, TlsSection,
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let (v41_path, v41_digest) = gen_table(dir.path(), "l1.etab", 1, 3_000, 6).expect("gen");
    let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
    let (m2, rows2) = encoded_table(dir.path(), 2, fp8, 6_000);
    let port = || rack_harness::free_port().expect("port");
    let mut rack = RackToml::new("q");
    rack.rack.tls = Some(TlsSection::default());
    rack.table = vec![
        TableEntry::new(1, &v41_path, 3_000, v41_digest),
        TableEntry {
            encoding: Some(fp8.name()),
            ..TableEntry::new(2, dir.path().join("layer2.etab"), 6_000, m2.digest)
        },
    ];
    let listen = [
        format!("tls://127.0.0.1:{}", port()),
        format!("quic://127.0.0.1:{}", port()),
    ];
    rack.donor = vec![DonorEntry {
        clients: Some(vec!["n".into()]),
        ..DonorEntry::new("d", listen, [1, 2])
    }];
    rack.node = vec![NodeEntry::new("n", vec![RouteEntry::new(1, ["d"])])];
    let path = dir.path().join("rack.toml");
    rack.write(&path).expect("config");
    rack_harness::rack_pki(&path).expect("pki");
    let config = Config::load(&path).expect("valid");
    let donor = DonorProcess::serving(&path, "d").expect("donor");
    let files = config.tls_files("n").expect("tls files");
    // 1,000 FP8 rows: an answer of 160 KB, more than one TLS buffer.
    let ids2: Vec<u64> = (0..1_000).map(|i| (i * 577) % 6_000).collect();
    let ids1: Vec<u64> = vec![0, 2_999];
    rack_harness::runtime().block_on(async {
        for t in [Transport::Tls, Transport::Quic] {
            let mut o = ClientOptions::new("n", vec![(1, v41_digest), (2, m2.digest)]);
            o.transport = t;
            o.version = PROTOCOL_VERSION;
            o.connect_timeout = std::time::Duration::from_secs(10);
            o.tls = Some(TlsClient {
                tls: NodeTls::load(&files).expect("node material"),
                server_name: cluster_config::tls::server_name("d").expect("name"),
            });
            let addr = donor.endpoint(t).expect("endpoint");
            let c = DonorClient::connect(addr, &o).await.expect("connects");
            let mut out = vec![0u8; ids2.len() * 160 + ids1.len() * ROW_BYTES];
            let req = [
                Request {
                    table: 2,
                    rows: &ids2,
                },
                Request {
                    table: 1,
                    rows: &ids1,
                },
            ];
            // Two lookups pipelined on the one connection.
            let mut again = out.clone();
            let (a, b) = tokio::join!(c.lookup(&req, &mut out), c.lookup(&req, &mut again));
            a.expect("lookup");
            b.expect("pipelined lookup");
            assert_eq!(out, again);
            for (k, &r) in ids2.iter().enumerate() {
                let want = &rows2[r as usize * 160..][..160];
                assert_eq!(&out[k * 160..][..160], want, "{t:?} row {r}");
            }
            let v41 = &out[ids2.len() * 160..];
            assert!(
                engram_protocol::synthetic::first_mismatch(6, 1, &ids1, v41).is_none(),
                "{t:?}"
            );
        }
    });
}
