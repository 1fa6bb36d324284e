//! A node routing tables of other encodings than V4.1's (docs/models.md):
//! under `[model] family = "qwen4exp"` its routers read an FP8 table and an
//! NVFP4 table from a donor over TCP (protocol version 2), from a
//! host-local donor's shared memfd, from the node's SSD copy and from its
//! local copy, every row as the generator made it; a copy whose rows are
//! of another encoding than the config says is refused at start.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster_config::Config;
use engram_protocol::TableDigest;
use engram_protocol::encoding::RowEncoding;
use engram_protocol::synthetic::{SplitMix64, synthetic_encoded_row};
use engram_store::table_file::{TableFile, TableWriter};
use inference_node::memory::{MemoryError, Routers};
use inference_node::metrics::NodeMetrics;
use rack_harness::rack_toml::{
    DonorEntry, ModelSection, NodeEntry, RackToml, RouteEntry, TableEntry,
};
use rack_harness::{DonorProcess, free_port, gen_encoded_table, runtime as rt};

const ROWS: u64 = 20_000;
const FP8: RowEncoding = RowEncoding::Fp8PerTensor { values: 160 };
const NVFP4: RowEncoding = RowEncoding::Nvfp4 { values: 160 };
/// (table id = layer, encoding, seed).
const TABLES: [(u32, RowEncoding, u64); 2] = [(1, FP8, 7), (2, NVFP4, 8)];

/// The rows `ids` of table `(layer, encoding, seed)` as generated.
fn expected(layer: u32, encoding: RowEncoding, seed: u64, ids: &[u64]) -> Vec<u8> {
    let size = encoding.row_bytes();
    let mut out = vec![0u8; ids.len() * size];
    for (&r, row) in ids.iter().zip(out.chunks_exact_mut(size)) {
        assert!(synthetic_encoded_row(encoding, seed, layer, r, row));
    }
    out
}

/// Both tables; donor `d` on loopback TCP, donor `h` on TCP and a host
/// socket; one node per source, each routing both tables to it alone.
fn rack(dir: &Path) -> (Config, Vec<(u32, TableDigest)>) {
    let mut toml = RackToml::new("q");
    let mut digests = Vec::new();
    for (id, encoding, seed) in TABLES {
        let name = format!("t{id}.etab");
        let (path, digest) = gen_encoded_table(dir, &name, id, encoding, ROWS, seed).expect("gen");
        digests.push((id, digest));
        toml.table.push(TableEntry {
            encoding: Some(encoding.name()),
            ..TableEntry::new(id, path, ROWS, digest)
        });
    }
    let port = || format!("127.0.0.1:{}", free_port().expect("port"));
    let socket = format!("unix://{}", dir.join("h.sock").display());
    toml.donor = vec![
        DonorEntry::new("d", [port()], [1, 2]),
        DonorEntry::new("h", [port(), socket], [1, 2]),
    ];
    toml.node = ["d", "h", "ssd", "local"]
        .into_iter()
        .map(|src| NodeEntry {
            tokens_per_second: Some(1.0),
            probe_interval_ms: Some(100),
            lookup_timeout_ms: Some(2000),
            ..NodeEntry::new(
                format!("via-{src}"),
                vec![
                    RouteEntry::new(1, [src]).hedge("off"),
                    RouteEntry::new(2, [src]).hedge("off"),
                ],
            )
        })
        .collect();
    toml.model = Some(ModelSection {
        family: Some("qwen4exp".into()),
        eos_token: Some(248_044),
        ..ModelSection::default()
    });
    let path = dir.join("rack.toml");
    toml.write(&path).expect("config");
    (Config::load(&path).expect("valid config"), digests)
}

#[test]
fn a_qwen4exp_node_reads_fp8_and_nvfp4_rows_from_every_source() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, _) = rack(dir.path());
    let path = config.path.display().to_string();
    let _d = DonorProcess::start(&["--config", &path, "--name", "d"]).expect("donor d");
    let h = DonorProcess::start(&["--config", &path, "--name", "h"]).expect("donor h");
    rt().block_on(async {
        for source in ["d", "h", "ssd", "local"] {
            let metrics = Arc::new(NodeMetrics::new());
            let node = format!("via-{source}");
            let mem = Routers::from_config(&config, &node, &metrics)
                .await
                .unwrap_or_else(|e| panic!("{node}: {e}"));
            for (id, encoding, seed) in TABLES {
                let router = mem.router(id).expect("router");
                assert_eq!(router.settings().encoding, encoding);
                for (i, n) in [1usize, 16, 48, 500].into_iter().enumerate() {
                    let mut g = SplitMix64::new(u64::from(id) * 100 + i as u64);
                    let rows: Vec<u64> = (0..n).map(|_| g.below(ROWS)).collect();
                    let mut out = vec![0u8; n * encoding.row_bytes()];
                    // A host-local donor's mapping may come after the first lookups.
                    let t0 = Instant::now();
                    let f = loop {
                        match router.fetch(&rows, &mut out).await {
                            Ok(f) => break f,
                            Err(e) if t0.elapsed() > Duration::from_secs(10) => {
                                panic!("{node}, table {id}, {n} rows: {e}")
                            }
                            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                        }
                    };
                    assert_eq!(f.source.as_deref(), Some(source), "{node} table {id}");
                    assert!(
                        out == expected(id, encoding, seed, &rows),
                        "{node}, table {id} ({}), {n} rows: not the generator's rows",
                        encoding.name()
                    );
                }
            }
        }
    });
    // `inference-node canary` on the same node: 16 rows a token (Qwen4Exp's
    // family) from both tables, every lookup answered by the donor.
    rt().block_on(async {
        let spec = inference_node::canary::CanarySpec {
            tokens: Some(50),
            tokens_per_second: Some(1000.0),
            seed: 3,
        };
        let metrics = Arc::new(NodeMetrics::new());
        let reports = inference_node::canary::run(
            &config,
            "via-d",
            &spec,
            metrics,
            |_| (),
            std::future::pending(),
        )
        .await
        .expect("canary");
        assert_eq!(reports.len(), 2);
        for (table, r) in reports {
            assert_eq!(r.lookups, 50, "table {table}");
            assert_eq!(r.by_source.get("d"), Some(&50), "table {table}: {r:?}");
            assert_eq!(r.failed + r.zeros, 0, "table {table}");
        }
    });
    // The host-local donor handed its tables over: it answered no lookup.
    let log = h.log();
    assert!(
        !log.contains("not shared"),
        "the encoded tables are shared: {log}"
    );
    // Its host socket's messages as PROTOCOL.md 5 writes them: packed rows
    // with the encoding and row size named, a sealed memfd of exactly the
    // rows (in whole pages) and its 4 KiB record, the record at version 3.
    let socket = dir.path().join("h.sock");
    let sock = daemon_runtime::hostsock::connect(&socket).expect("connect");
    let mut buf = vec![0u8; daemon_runtime::hostsock::MAX_MESSAGE + 1];
    let mut seen = BTreeMap::new();
    for _ in 0..8 {
        let (n, fd) =
            daemon_runtime::hostsock::recv(std::os::fd::AsRawFd::as_raw_fd(&sock), &mut buf)
                .expect("recv");
        let msg: serde_json::Value = serde_json::from_slice(&buf[..n]).expect("json");
        if let Some(f) = fd {
            seen.insert(msg["table"].as_u64().expect("table"), (msg, f));
        }
        if seen.len() == 2 {
            break;
        }
    }
    for (id, encoding, _) in TABLES {
        let (msg, file) = &seen[&u64::from(id)];
        assert_eq!(msg["layout"], "packed", "{msg}");
        assert_eq!(msg["encoding"], encoding.name().as_str(), "{msg}");
        assert_eq!(msg["row_bytes"], encoding.row_bytes(), "{msg}");
        let len = file.metadata().expect("meta").len();
        assert_eq!(msg["bytes"], len, "{msg}");
        // The rows, rounded up to whole pages, then the record's page.
        let rows_len = (ROWS * encoding.row_bytes() as u64).div_ceil(4096) * 4096;
        assert_eq!(len, rows_len + 4096, "{msg}");
        assert!(engram_store::kept::is_sealed_read_only(file));
        let mut version = [0u8; 4];
        std::os::unix::fs::FileExt::read_exact_at(file, &mut version, len - 4096 + 8)
            .expect("record");
        assert_eq!(u32::from_le_bytes(version), 3, "record version 3");
    }
}

#[test]
fn a_copy_of_another_encoding_than_the_config_says_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, _) = rack(dir.path());
    // The same 160-byte rows, said to be BF16 (80 values): the same digest
    // and rows, so only the encoding tells them apart.
    let fp8 = config.table(1).expect("table 1").path.clone();
    let src = TableFile::open_any(&fp8).expect("open");
    let mut meta = src.meta.clone();
    meta.encoding = RowEncoding::Bf16 { values: 80 };
    meta.tensor_scale = None;
    let other = dir.path().join("bf16.etab");
    let mut w = TableWriter::create(&other, meta).expect("create");
    let all: Vec<u64> = (0..ROWS).collect();
    w.write_rows(&expected(1, FP8, 7, &all)).expect("write");
    let written = w.finish().expect("finish");
    assert_eq!(
        written.digest, src.meta.digest,
        "the digest covers the rows"
    );
    let text = std::fs::read_to_string(&config.path).expect("read");
    let edited = text.replace(&fp8.display().to_string(), &other.display().to_string());
    std::fs::write(&config.path, edited).expect("write");
    let config = Config::load(&config.path).expect("valid config");
    rt().block_on(async {
        for node in ["via-ssd", "via-local"] {
            let metrics = Arc::new(NodeMetrics::new());
            let e = Routers::from_config(&config, node, &metrics)
                .await
                .expect_err("refused");
            assert!(
                matches!(e, MemoryError::Encoding { table: 1, .. }),
                "{node}: {e}"
            );
            let msg = e.to_string();
            assert!(
                msg.contains("bf16x80") && msg.contains("fp8_per_tensorx160"),
                "{msg}"
            );
        }
    });
}

/// V4.1's model loop and the libraries run V4.1's model: a Qwen4Exp
/// rack's node refuses to build V4.1's, naming the family and the command
/// that runs its own, instead of hashing its tokens as V4.1's.
#[test]
fn the_v41_model_loop_refuses_a_qwen4exp_rack_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, _) = rack(dir.path());
    let metrics = NodeMetrics::new();
    let built = rt().block_on(inference_node::model::node::NodeModel::from_config(
        &config, "via-ssd", None, &metrics,
    ));
    let Err(e) = built else {
        panic!("a qwen4exp rack's node built V4.1's model loop");
    };
    let msg = e.to_string();
    assert!(
        msg.contains("family = \"qwen4exp\"") && msg.contains("inference-node run"),
        "{msg}"
    );
}

/// `inference-node run` on a Qwen4Exp rack: the token loop hashes the
/// built-in text's ids, reads the FP8 table through a real donor and fuses
/// with the PLE layer; a run prefilling its first 20 positions and a batch
/// of 2 give, position for position, the outputs of the same sequences
/// decoded token by token from the node's local RAM copy.
#[test]
fn the_qwen4exp_loop_runs_on_a_real_rack_as_on_local_ram() {
    use rack_harness::drill::NodeRun;
    use rack_harness::drill::report::checksums;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut toml = rack_harness::qwen_rack_config(dir.path()).expect("rack");
    let node = |name: &str, sources: &[&str]| NodeEntry {
        probe_interval_ms: Some(100),
        ..NodeEntry::new(
            name,
            vec![RouteEntry::new(1, sources.iter().copied()).hedge("off")],
        )
    };
    toml.node = vec![node("rack", &["d", "ssd"]), node("ref", &["local"])];
    let config = dir.path().join("rack.toml");
    toml.write(&config).expect("config");
    let path = config.display().to_string();
    let _d = DonorProcess::start(&["--config", &path, "--name", "d"]).expect("donor");
    let run = |node: &str, stem: &str, extra: &[&str]| {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        NodeRun::start_with(&config, node, 200, 1000.0, &dir.path().join(stem), &extra)
            .expect("node")
            .finish(Duration::from_secs(120))
            .expect("finish")
    };
    let reference = run("ref", "ref", &[]);
    assert!(reference.success, "{}", reference.log);
    assert!(reference.log.contains("Qwen4Exp PLE"), "{}", reference.log);
    let want = checksums(&reference.steps);
    assert_eq!(want.len(), 200);
    let prefilled = run("rack", "prefill", &["--prefill", "20"]);
    assert!(prefilled.success, "{}", prefilled.log);
    let got = checksums(&prefilled.steps);
    // 20 prefilled, then 200 decoded: the first 200 are the reference's.
    for (k, v) in &want {
        assert_eq!(got.get(k), Some(v), "position {k:?}");
    }
    let sources: BTreeSet<String> = prefilled
        .steps
        .iter()
        .filter_map(|s| s.tables[0].source.clone())
        .collect();
    assert!(sources.contains("d"), "{sources:?}");
    assert!(
        prefilled.steps.iter().all(|s| s.tables[0].rows % 16 == 0),
        "16 rows a position"
    );
    // A batch of 2: each sequence decoded alone gives the same outputs.
    let batch = run("rack", "batch", &["--batch", "2"]);
    assert!(batch.success, "{}", batch.log);
    let got = checksums(&batch.steps);
    let first = got
        .iter()
        .filter(|((seq, _), _)| *seq == 0)
        .collect::<Vec<_>>();
    assert_eq!(first.len(), 100);
    for ((_, index), v) in first {
        assert_eq!(want.get(&(0, *index)), Some(v), "sequence 0 at {index}");
    }
}

/// The rack with both donors started, and options that open a node
/// without a /metrics listener.
fn started_rack(
    dir: &Path,
) -> (
    Config,
    [DonorProcess; 2],
    inference_node::embed::OpenOptions,
) {
    let (config, _) = rack(dir);
    let path = config.path.display().to_string();
    let start = |name: &str| {
        DonorProcess::start(&["--config", &path, "--name", name]).expect("donor starts")
    };
    let donors = [start("d"), start("h")];
    let opts = inference_node::embed::OpenOptions {
        metrics: inference_node::embed::MetricsAt::Off,
    };
    (config, donors, opts)
}

/// The library an engine of any family opens (`inference_node::embed::
/// NodeTables`): on the Qwen4Exp rack it names each table's encoding, row
/// size and rows; it looks rows up by id at their own size through a donor
/// over TCP (repeats and the order asked kept); a host-local donor's table
/// maps here as that donor's memory, rows back to back, each the
/// generator's; wrong calls are refused by name.
#[test]
fn node_tables_give_an_engine_the_rows_of_any_encoding() {
    use inference_node::embed::{EmbedError, NodeTables, RowLayout};
    let dir = tempfile::tempdir().expect("tempdir");
    let (config, _donors, opts) = started_rack(dir.path());
    let via_d = NodeTables::open(&config.path, "via-d", &opts).expect("open via-d");
    let info = via_d.tables().expect("tables");
    assert_eq!(info.len(), 2);
    for ((id, encoding, seed), t) in TABLES.into_iter().zip(&info) {
        assert_eq!((t.table, t.layer, t.rows), (id, id, ROWS));
        assert_eq!((t.encoding, t.row_bytes), (encoding, encoding.row_bytes()));
        let rows = [5, ROWS - 1, 5, 0, 77];
        let mut out = vec![0u8; rows.len() * t.row_bytes];
        let served = via_d
            .lookup(id, &rows, &mut out, Some(Duration::from_secs(5)))
            .expect("lookup");
        assert_eq!(served.sources, ["d"]);
        assert_eq!(served.rows, 4, "a repeated id is fetched once");
        assert!(out == expected(id, encoding, seed, &rows), "table {id}");
        // Bad calls: the table's row size, its row count, a routed table.
        let e = via_d
            .lookup(id, &rows, &mut out[1..], None)
            .expect_err("short");
        assert!(matches!(e, EmbedError::BadInput(_)), "{e}");
        let e = via_d
            .lookup(id, &[ROWS], &mut out[..t.row_bytes], None)
            .expect_err("past the end");
        assert!(e.to_string().contains("past table"), "{e}");
    }
    let e = via_d
        .lookup(9, &[1], &mut [0; 160], None)
        .expect_err("unrouted");
    assert!(e.to_string().contains("not routed"), "{e}");
    let e = via_d
        .table_view(1, Duration::ZERO)
        .expect_err("no host-local donor");
    assert!(matches!(e, EmbedError::NoSource(_)), "{e}");
    via_d.close(Duration::from_secs(1));
    assert!(matches!(via_d.tables(), Err(EmbedError::Closed)));

    let via_h = NodeTables::open(&config.path, "via-h", &opts).expect("open via-h");
    for (id, encoding, seed) in TABLES {
        let view = via_h
            .table_view(id, Duration::from_secs(10))
            .expect("the host-local donor's table");
        assert!(view.shared());
        assert_eq!(view.encoding(), encoding);
        assert_eq!(view.row_bytes(), encoding.row_bytes());
        assert_eq!(
            view.layout(),
            RowLayout::Encoded {
                row_bytes: encoding.row_bytes()
            }
        );
        let all: Vec<u64> = (0..ROWS).collect();
        let n = ROWS as usize * encoding.row_bytes();
        assert!(
            view.bytes()[..n] == expected(id, encoding, seed, &all)[..],
            "table {id}: the donor's memory is the table's rows back to back"
        );
    }
}

/// The engine ring at a table's own row size (PROTOCOL.md 6.1, version 2):
/// a CPU stand-in for an engine's kernels publishes Qwen4Exp-shaped
/// requests (16 ids a position) into rings of FP8's 160-byte and NVFP4's
/// 90-byte rows, served from `NodeTables` through a donor over TCP and
/// through a host-local donor's memfd; every live position's rows are the
/// generator's, DEAD ones zeros, a -1 beside live ids zeros that row alone
/// (an ETP rank's shard), an id past the table zeros its position with
/// status "bad ids"; a ring of another row size, of a layer the node
/// does not route, or of two tables of two row sizes is refused by name.
#[test]
fn engine_rings_carry_rows_of_any_encoding_from_node_tables() {
    use engram_protocol::ring::NO_ROW;
    use inference_node::embed::{NodeMemory, NodeTables};
    use inference_node::ring::{RingHub, RingMemory, RingOptions, Shape, Status};
    use rack_harness::ring_engine::CpuEngine;

    let dir = tempfile::tempdir().expect("tempdir");
    let (config, _donors, opts) = started_rack(dir.path());
    const COLUMNS: usize = 16;
    let shape = |layer: u32, row_bytes: usize| Shape {
        slots: 4,
        layers: 1,
        columns: COLUMNS as u32,
        positions: 32,
        first_column: 0,
        layer_ids: [layer, 0],
        gpu_deadline_ns: 5_000_000_000,
        row_bytes: row_bytes as u32,
    };
    for node in ["via-d", "via-h"] {
        let tables = Arc::new(NodeTables::open(&config.path, node, &opts).expect("open"));
        let hub = RingHub::start(
            NodeMemory::Tables(Arc::clone(&tables)),
            RingOptions::default(),
        )
        .expect("hub");
        let mut rng = SplitMix64::new(11);
        for (id, encoding, seed) in TABLES {
            let size = encoding.row_bytes();
            let ring = Arc::new(RingMemory::create(&shape(id, size)).expect("ring"));
            assert_eq!(ring.shape().row_bytes as usize, size);
            let handle = hub.add(Arc::clone(&ring)).expect("served");
            let mut eng = CpuEngine::new(ring);
            for round in 0..20 {
                let n = 1 + rng.below(32) as usize;
                let dead = rng.below(n as u64) as usize;
                let past = (round % 5 == 4).then(|| (dead + 1) % n);
                let ids: Vec<Vec<Vec<i64>>> = (0..n)
                    .map(|p| {
                        let mut v: Vec<i64> = if p == dead && n > 1 {
                            vec![NO_ROW; COLUMNS]
                        } else {
                            (0..COLUMNS).map(|_| rng.below(ROWS) as i64).collect()
                        };
                        if past == Some(p) && p != dead {
                            v[3] = ROWS as i64;
                        } else if p != dead && p % 3 == 1 {
                            // A rank's shard: some of the position's rows.
                            v[5] = NO_ROW;
                        }
                        vec![v]
                    })
                    .collect();
                let seq = eng.publish(1, &ids);
                let a = eng.wait(seq, 0, n as u32);
                let bad = past.is_some_and(|p| p != dead || n == 1);
                let want = if bad { Status::BadIds } else { Status::Ok };
                assert_eq!(
                    a.status,
                    Some(want as u32),
                    "{node}, table {id}, round {round}"
                );
                for (p, pos) in ids.iter().enumerate() {
                    let got = &a.rows[p * COLUMNS * size..(p + 1) * COLUMNS * size];
                    let zero = pos[0][0] == NO_ROW || pos[0].contains(&(ROWS as i64));
                    if zero {
                        assert!(
                            got.iter().all(|&b| b == 0),
                            "{node}, table {id}: position {p}"
                        );
                    } else {
                        for (c, &r) in pos[0].iter().enumerate() {
                            let row = &got[c * size..(c + 1) * size];
                            let want = if r == NO_ROW {
                                vec![0; size]
                            } else {
                                expected(id, encoding, seed, &[r as u64])
                            };
                            assert!(row == want, "{node}, table {id}, round {round}, {p}/{c}");
                        }
                    }
                }
            }
            let c = handle.counters();
            assert_eq!(c.requests.load(std::sync::atomic::Ordering::Relaxed), 20);
        }
        // Refused by name: V4.1's row size on an FP8 table, a layer not
        // routed, two sections of two row sizes.
        let refuse = |s: Shape| {
            let ring = Arc::new(RingMemory::create(&s).expect("ring"));
            hub.add(ring).expect_err("refused").to_string()
        };
        let e = refuse(shape(1, 264));
        assert!(
            e.contains("264 bytes") && e.contains("fp8_per_tensorx160"),
            "{e}"
        );
        let e = refuse(shape(7, 160));
        assert!(
            e.contains("layer 7") && e.contains("table 1 (layer 1)"),
            "{e}"
        );
        let e = refuse(Shape {
            layers: 2,
            layer_ids: [1, 2],
            ..shape(1, 160)
        });
        assert!(e.contains("table 2") && e.contains("90"), "{e}");
        drop(hub);
        tables.close(Duration::from_secs(1));
    }
}

/// `[model] weights` on a Qwen4Exp rack: the PLE layer's tensors read from
/// a checkpoint under vLLM's names (`model.language_model.layers.{L-1}.ple.
/// key_proj.weight`, `value_proj`, the three norms, `conv1d`). A checkpoint
/// holding the weights `weights_seed = 3` draws fuses exactly as the seed
/// does; its `config.json` is checked against the node (a hidden size other
/// than `[model] hidden` is refused by name); a checkpoint without the
/// table's layer is refused naming the tensors looked for.
#[test]
fn the_qwen4exp_loop_reads_its_ple_weights_from_a_checkpoint() {
    use inference_node::engram::weights::PleWeights;
    use rack_harness::drill::NodeRun;
    use rack_harness::drill::report::checksums;
    use safetensors::tensor::TensorView;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut toml = rack_harness::qwen_rack_config(dir.path()).expect("rack");
    toml.node = vec![NodeEntry::new("ref", vec![RouteEntry::new(1, ["local"])])];
    let seeded = dir.path().join("seeded.toml");
    toml.write(&seeded).expect("config");
    // The checkpoint: [model] hidden 16, streams 4; 16 rows of 160 values.
    let (h, c, d, k) = (16usize, 64usize, 2560usize, 4usize);
    let w = PleWeights::from_seed(3, (h, 4), d, k).expect("weights");
    let bytes = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|b| b.to_le_bytes()).collect() };
    let p = "model.language_model.layers.0.ple";
    let tensors = [
        ("key_proj.weight", vec![c, d], bytes(&w.kv_proj[..c * d])),
        ("value_proj.weight", vec![h, d], bytes(&w.kv_proj[c * d..])),
        ("norm_key.weight", vec![c], bytes(&w.norm_key)),
        ("norm_query.weight", vec![c], bytes(&w.norm_query)),
        ("norm_conv.weight", vec![c], bytes(&w.norm_conv)),
        ("conv1d.weight", vec![c, 1, k], bytes(&w.conv)),
    ];
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir(&ckpt).expect("dir");
    let write = |prefix: &str| {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, shape, data)| {
                let v =
                    TensorView::new(safetensors::Dtype::BF16, shape.clone(), data).expect("view");
                (format!("{prefix}.{n}"), v)
            })
            .collect();
        let b = safetensors::serialize(views, None::<std::collections::HashMap<String, String>>)
            .expect("serialize");
        std::fs::write(ckpt.join("model.safetensors"), b).expect("write");
    };
    write(p);
    let model = toml.model.as_mut().expect("model");
    model.weights_seed = None;
    model.weights = Some(ckpt.display().to_string());
    let from_ckpt = dir.path().join("ckpt.toml");
    toml.write(&from_ckpt).expect("config");
    let run = |config: &Path, stem: &str| {
        NodeRun::start_with(config, "ref", 60, 1000.0, &dir.path().join(stem), &[])
            .expect("node")
            .finish(Duration::from_secs(120))
            .expect("finish")
    };
    let a = run(&seeded, "seeded");
    assert!(a.success, "{}", a.log);
    let want = checksums(&a.steps);
    assert_eq!(want.len(), 60);
    // Its config.json agrees (the fields it has are compared).
    let config_json = |hidden: u64| {
        let v = serde_json::json!({"text_config": {
            "hidden_size": hidden, "hc_count": 4, "ple_embed_dim": 2560,
            "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8,
            "vocab_size": 248_320, "ngram_vocab_size_base": 1_000,
            "eos_token_id": [rack_harness::QWEN_EOS, 248_046], "rms_norm_eps": 1e-6,
            "ple_layer_ids": [1, 9]}});
        std::fs::write(ckpt.join("config.json"), v.to_string()).expect("config.json");
    };
    config_json(16);
    let b = run(&from_ckpt, "ckpt");
    assert!(b.success, "{}", b.log);
    assert_eq!(
        checksums(&b.steps),
        want,
        "the checkpoint's weights fuse as the seed's"
    );
    assert!(b.log.contains("config.json agrees"), "{}", b.log);
    // Refusals at start: the run exits 1 saying why.
    let refused = || {
        let out = std::process::Command::new(rack_harness::bin("inference-node"))
            .arg("run")
            .arg("--config")
            .arg(&from_ckpt)
            .args(["--name", "ref", "--tokens", "1", "--quiet"])
            .output()
            .expect("run");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    config_json(32);
    let log = refused();
    assert!(log.contains("`hidden_size` is 32"), "{log}");
    // The table as the second PLE layer: its rows would hash as another
    // layer's.
    let second = serde_json::json!({"hidden_size": 16, "ple_layer_ids": [0, 1]});
    std::fs::write(ckpt.join("config.json"), second.to_string()).expect("config.json");
    let log = refused();
    assert!(
        log.contains("PLE layer 1 of `ple_layer_ids` [0, 1]"),
        "{log}"
    );
    config_json(16);
    write("model.language_model.layers.4.ple");
    let log = refused();
    assert!(
        log.contains("no PLE layer 1") && log.contains("model.layers.0.ple.key_proj.weight"),
        "{log}"
    );
    // The PLE fusion has no GPU path in the node: `fusion = "gpu"` is
    // refused rather than run on the CPU unsaid.
    write(p);
    toml.model.as_mut().expect("model").fusion = Some("gpu".into());
    toml.write(&from_ckpt).expect("config");
    let log = refused();
    assert!(log.contains("CPU only"), "{log}");
}
