//! Packing a Qwen4Exp n-gram table from row shards, as vLLM's loader lays
//! them out: every encoding, sharded checkpoints, and bad layouts refused.

use super::*;
use crate::table_file::TableFile;
use engram_protocol::DigestBuilder;
use engram_protocol::synthetic::SplitMix64;
use safetensors::tensor::TensorView;

/// A tensor to write: name, dtype, shape, bytes.
type T = (String, Dtype, Vec<usize>, Vec<u8>);

fn write_st(path: &Path, tensors: &[T]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("write safetensors");
}

/// Rows of `e` (random, no NaN codes), `rows` of them, row-major in the
/// table's layout.
fn table(e: RowEncoding, rows: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    (0..rows * e.row_bytes())
        .map(|_| {
            let b = rng.next_u64() as u8;
            if b & 0x7F == 0x7F { 0x11 } else { b }
        })
        .collect()
}

/// A checkpoint of `rows` rows of `e` in `parts` shards under `prefix`,
/// shards `[0, split)` in one file and the rest in another, with an index.
fn checkpoint(
    dir: &Path,
    e: RowEncoding,
    rows: usize,
    parts: usize,
    prefix: &str,
    split: usize,
    scale: f32,
) -> Vec<u8> {
    let data = table(e, rows, 7);
    let rb = e.row_bytes();
    let sw = if matches!(e, RowEncoding::Nvfp4 { .. }) {
        e.values() / 16
    } else {
        0
    };
    let vw = rb - sw;
    let per = rows.div_ceil(parts);
    let (dtype, width) = match e {
        RowEncoding::Bf16 { values } => (Dtype::BF16, values as usize),
        RowEncoding::Nvfp4 { values } => (Dtype::U8, values as usize / 2),
        _ => (Dtype::F8_E4M3, vw),
    };
    let mut files: [Vec<T>; 2] = [Vec::new(), Vec::new()];
    for i in 0..parts {
        let (lo, hi) = ((i * per).min(rows), ((i + 1) * per).min(rows));
        let n = hi - lo;
        if n == 0 {
            continue;
        }
        let rows_of = &data[lo * rb..hi * rb];
        let values: Vec<u8> = rows_of
            .chunks_exact(rb)
            .flat_map(|r| r[..vw].to_vec())
            .collect();
        let f = &mut files[usize::from(i >= split)];
        f.push((
            format!("{prefix}ngram_embedding.shard_{i}.weight"),
            dtype,
            vec![n, width],
            values,
        ));
        if sw > 0 {
            let scales: Vec<u8> = rows_of
                .chunks_exact(rb)
                .flat_map(|r| r[vw..].to_vec())
                .collect();
            f.push((
                format!("{prefix}ngram_embedding.shard_{i}.weight_scale"),
                Dtype::F8_E4M3,
                vec![n, sw],
                scales,
            ));
        }
    }
    let leaf = match e {
        RowEncoding::Nvfp4 { .. } => Some("weight_scale_2"),
        RowEncoding::Fp8PerTensor { .. } => Some("weight_scale"),
        _ => None,
    };
    if let Some(leaf) = leaf {
        files[0].push((
            format!("{prefix}ngram_embedding.{leaf}"),
            Dtype::F32,
            vec![],
            scale.to_le_bytes().to_vec(),
        ));
    }
    files[0].push(("model.norm.weight".into(), Dtype::BF16, vec![4], vec![0; 8]));
    let mut map = serde_json::Map::new();
    for (k, f) in files.iter().enumerate() {
        let name = format!("model-{k}.safetensors");
        write_st(&dir.join(&name), f);
        for (n, ..) in f {
            map.insert(n.clone(), serde_json::Value::String(name.clone()));
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
    data
}

fn spec(layer: u32, parts: u64) -> NgramPackSpec {
    NgramPackSpec {
        layer,
        parts: Some(parts),
        ..NgramPackSpec::default()
    }
}

/// The packed file's rows, read through its header's page geometry.
fn rows_of(path: &Path) -> (TableMeta, Vec<u8>) {
    let (m, layout) = TableFile::read_meta(path).expect("header");
    let bytes = std::fs::read(path).expect("read");
    let rb = layout.row_bytes as usize;
    let mut out = Vec::with_capacity(m.rows as usize * rb);
    for r in 0..m.rows {
        let at = layout.row_offset(r).expect("in range") as usize;
        out.extend_from_slice(&bytes[at..at + rb]);
    }
    (m, out)
}

#[test]
fn every_encoding_packs_row_for_row_with_its_global_scale() {
    for (e, scale) in [
        (RowEncoding::Fp8PerTensor { values: 160 }, Some(0.0123f32)),
        (RowEncoding::Bf16 { values: 160 }, None),
        (RowEncoding::Nvfp4 { values: 160 }, Some(2.5f32)),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let prefix = "model.layers.2.ple.ple_embedding.";
        // 1,000 rows in 7 shards of 143 (the last 142), over two files.
        let want = checkpoint(dir.path(), e, 1000, 7, prefix, 3, scale.unwrap_or(1.0));
        let out = dir.path().join("ple.etab");
        let meta = pack_ngram(dir.path(), &out, &spec(3, 7), |_, _| None).expect("packs");
        assert_eq!(
            (meta.rows, meta.layer, meta.encoding),
            (1000, 3, e),
            "{}",
            e.name()
        );
        assert_eq!(meta.tensor_scale, scale.map(f32::to_bits));
        let (m, got) = rows_of(&out);
        assert_eq!(m, meta);
        assert_eq!(got, want, "{}: rows as the shards hold them", e.name());
        let mut d = DigestBuilder::new();
        d.update(&want);
        assert_eq!(meta.digest, d.finish(), "the digest of the rows in order");
    }
}

#[test]
fn the_config_gives_the_shard_count_and_checks_the_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let e = RowEncoding::Fp8PerTensor { values: 16 };
    // A small Qwen4Exp-shaped config: 2 orders x 2 heads of primes above
    // 100, padded to 8: the table's rows.
    let cfg = |layer_ids: &[u64]| {
        serde_json::json!({"text_config": {
        "ngram_size": 3, "heads_per_ngram": 2, "vocab_size": 1000,
        "ngram_vocab_size_base": 100, "make_ngram_vocab_size_divisible_by": 8,
        "eos_token_id": 5, "ple_layer_ids": layer_ids, "split_ngram_parts": 3}})
    };
    let h = Qwen4ExpHashing::new(Qwen4ExpConfig {
        ngram_size: 3,
        heads_per_ngram: 2,
        vocab: 1000,
        base: 100,
        seed: engram_protocol::qwen4exp::DEFAULT_SEED,
        eos: 5,
        divisible_by: 8,
        layer_index: 0,
    })
    .expect("hashing");
    let rows = h.padded_rows as usize;
    checkpoint(dir.path(), e, rows, 3, "m.", 1, 0.5);
    std::fs::write(dir.path().join("config.json"), cfg(&[4]).to_string()).expect("config");
    let out = dir.path().join("t.etab");
    let s = NgramPackSpec {
        layer: 4,
        ..NgramPackSpec::default()
    };
    let meta = pack_ngram(dir.path(), &out, &s, |_, _| None).expect("packs");
    assert_eq!((meta.rows, meta.hash_base), (rows as u64, Some(100)));
    // Another layer's hashing addresses other primes: refused.
    std::fs::write(dir.path().join("config.json"), cfg(&[1, 4]).to_string()).expect("config");
    let e2 = pack_ngram(dir.path(), &out, &s, |_, _| None).expect_err("rows differ");
    assert!(e2.to_string().contains("addresses"), "{e2}");
    let s5 = NgramPackSpec {
        layer: 5,
        ..NgramPackSpec::default()
    };
    let e3 = pack_ngram(dir.path(), &out, &s5, |_, _| None).expect_err("no such layer");
    assert!(e3.to_string().contains("ple_layer_ids"), "{e3}");
}

#[test]
fn bad_checkpoints_are_refused_by_name_and_nothing_is_left_behind() {
    let e = RowEncoding::Fp8PerTensor { values: 160 };
    let run = |dir: &Path, s: &NgramPackSpec| {
        let out = dir.join("t.etab");
        let r = pack_ngram(dir, &out, s, |_, _| None);
        assert!(r.is_ok() || !out.exists(), "no file after an error");
        r.map(|_| ()).map_err(|e| e.to_string())
    };
    // The wrong shard count: shard sizes do not follow.
    let dir = tempfile::tempdir().expect("tempdir");
    checkpoint(dir.path(), e, 1000, 7, "a.", 3, 1.0);
    let err = run(dir.path(), &spec(1, 8)).expect_err("8 parts");
    assert!(err.contains("shard 0 of `a.` has 143 rows"), "{err}");
    let err = run(dir.path(), &spec(1, 5)).expect_err("5 parts");
    assert!(err.contains("split_ngram_parts is 5"), "{err}");
    // A missing shard.
    std::fs::remove_file(dir.path().join("model-1.safetensors")).expect("rm");
    let err = run(dir.path(), &spec(1, 7)).expect_err("missing file");
    assert!(err.contains("model-1.safetensors"), "{err}");
    // No global scale (FP8), and a scale that is vLLM's "missing" sentinel.
    let dir = tempfile::tempdir().expect("tempdir");
    checkpoint(dir.path(), e, 100, 2, "a.", 2, f32::MIN);
    let err = run(dir.path(), &spec(1, 2)).expect_err("sentinel");
    assert!(err.contains("missing its global scale"), "{err}");
    // Two tables and no prefix to choose one; the layer chooses.
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let mut two = Vec::new();
    for p in ["model.layers.0.", "model.layers.5."] {
        let sub = d.join(p.trim_end_matches('.'));
        std::fs::create_dir(&sub).expect("dir");
        checkpoint(&sub, e, 50, 1, p, 1, 1.0);
        let st = std::fs::read(sub.join("model-0.safetensors")).expect("read");
        let (_, md) = SafeTensors::read_metadata(&st).expect("meta");
        let stt = SafeTensors::deserialize(&st).expect("st");
        for (n, _) in md.tensors() {
            let t = stt.tensor(&n).expect("t");
            two.push((n.clone(), t.dtype(), t.shape().to_vec(), t.data().to_vec()));
        }
    }
    two.retain(|(n, ..)| n != "model.norm.weight");
    write_st(&d.join("model.safetensors"), &two);
    let err = run(d, &spec(3, 1)).expect_err("two tables");
    assert!(err.contains("--tensor-prefix"), "{err}");
    assert!(run(d, &spec(6, 1)).is_ok(), "layer 6 names model.layers.5.");
    let s = NgramPackSpec {
        tensor_prefix: Some("model.layers.0.".into()),
        ..spec(1, 1)
    };
    assert!(run(d, &s).is_ok());
    // A NaN code is refused naming its row.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut rows = vec![0x22u8; 20 * 160];
    rows[13 * 160 + 5] = 0x7F;
    write_st(
        &dir.path().join("model.safetensors"),
        &[
            (
                "x.ngram_embedding.shard_0.weight".into(),
                Dtype::F8_E4M3,
                vec![20, 160],
                rows,
            ),
            (
                "x.ngram_embedding.weight_scale".into(),
                Dtype::F32,
                vec![1],
                1f32.to_le_bytes().into(),
            ),
        ],
    );
    let err = run(dir.path(), &spec(1, 1)).expect_err("NaN");
    assert!(err.contains("row 13"), "{err}");
    // Rows of a dtype no encoding has.
    let dir = tempfile::tempdir().expect("tempdir");
    write_st(
        &dir.path().join("model.safetensors"),
        &[(
            "x.ngram_embedding.shard_0.weight".into(),
            Dtype::F32,
            vec![2, 4],
            vec![0; 32],
        )],
    );
    let err = run(dir.path(), &spec(1, 1)).expect_err("F32");
    assert!(err.contains("FP8 (F8_E4M3), BF16 or NVFP4"), "{err}");
}
