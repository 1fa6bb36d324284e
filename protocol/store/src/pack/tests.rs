//! Tests of `pack`.

use super::*;
use crate::table_file::TableFile;
use safetensors::tensor::TensorView;

fn rows_data(rows: usize) -> (Vec<u8>, Vec<u8>) {
    let mut table = vec![0u8; rows * ROW_BYTES];
    engram_protocol::synthetic::synthetic_rows(2, 1, 0, &mut table);
    let w = table
        .chunks_exact(ROW_BYTES)
        .flat_map(|r| r[..ROW_VALUES].to_vec())
        .collect();
    let s = table
        .chunks_exact(ROW_BYTES)
        .flat_map(|r| r[ROW_VALUES..].to_vec())
        .collect();
    (w, s)
}

fn write_st(path: &Path, tensors: Vec<(&str, Dtype, Vec<usize>, &[u8])>) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .into_iter()
        .map(|(n, d, shape, data)| {
            (
                n.to_string(),
                TensorView::new(d, shape, data).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("write checkpoint");
}

fn packed_rows(path: &Path) -> Vec<u8> {
    let t = TableFile::open(path).expect("open");
    t.verify(None).expect("verify");
    let mut out = Vec::new();
    t.for_each_chunk(true, None, |_, r| {
        out.extend_from_slice(r);
        Ok(())
    })
    .expect("stream");
    out
}

#[test]
fn packs_a_single_file_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = 20_000;
    let (w, s) = rows_data(rows);
    let (wn, sn) = tensor_names(1);
    let other = [0u8; 4];
    let ck = dir.path().join("model.safetensors");
    write_st(
        &ck,
        vec![
            (&wn, Dtype::F8_E4M3, vec![rows, 256], &w),
            (&sn, Dtype::F8_E8M0, vec![rows, 8], &s),
            ("layers.0.attn.wq", Dtype::U8, vec![4], &other),
        ],
    );
    let out = dir.path().join("l1.etab");
    let meta = pack(dir.path(), 1, &out, &PackSpec::default(), |_| None).expect("pack");
    assert_eq!(meta.rows, rows as u64);
    assert_eq!(meta.hash_preset, None);
    let mut want = vec![0u8; rows * ROW_BYTES];
    engram_protocol::synthetic::synthetic_rows(2, 1, 0, &mut want);
    assert_eq!(packed_rows(&out), want);
    // The file itself works as well as its directory.
    let out2 = dir.path().join("l1b.etab");
    assert_eq!(
        pack(&ck, 1, &out2, &PackSpec::default(), |_| None)
            .expect("pack")
            .digest,
        meta.digest
    );
    // A layer the checkpoint lacks is a clear error.
    let err = pack(&ck, 14, &out2, &PackSpec::default(), |_| None).expect_err("no layer 14");
    assert!(
        err.to_string().contains("layers.14.engram.embed.weight"),
        "{err}"
    );
}

#[test]
fn packs_a_sharded_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = 1000;
    let (w, s) = rows_data(rows);
    let (wn, sn) = tensor_names(14);
    write_st(
        &dir.path().join("model-00001-of-00002.safetensors"),
        vec![(&wn, Dtype::F8_E4M3, vec![rows, 256], &w)],
    );
    write_st(
        &dir.path().join("model-00002-of-00002.safetensors"),
        vec![(&sn, Dtype::F8_E8M0, vec![rows, 8], &s)],
    );
    let index = format!(
        r#"{{"metadata":{{"total_size":1}},"weight_map":{{"{wn}":"model-00001-of-00002.safetensors","{sn}":"model-00002-of-00002.safetensors"}}}}"#
    );
    std::fs::write(dir.path().join("model.safetensors.index.json"), index).expect("index");
    let out = dir.path().join("l14.etab");
    let meta = pack(
        dir.path(),
        14,
        &out,
        &PackSpec {
            hash_preset: Some("custom".into()),
            hash_base: Some(123),
            config_json: None,
        },
        |_| None,
    )
    .expect("pack");
    assert_eq!(meta.layer, 14);
    assert_eq!(meta.hash_base, Some(123));
    let mut want = vec![0u8; rows * ROW_BYTES];
    engram_protocol::synthetic::synthetic_rows(2, 1, 0, &mut want);
    assert_eq!(packed_rows(&out), want);
}

#[test]
fn refuses_bad_checkpoints() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = 30;
    let (mut w, s) = rows_data(rows);
    let (wn, sn) = tensor_names(1);
    let out = dir.path().join("o.etab");
    let ck = dir.path().join("a.safetensors");
    // Wrong dtype.
    write_st(
        &ck,
        vec![
            (&wn, Dtype::U8, vec![rows, 256], &w),
            (&sn, Dtype::F8_E8M0, vec![rows, 8], &s),
        ],
    );
    assert!(
        pack(&ck, 1, &out, &PackSpec::default(), |_| None)
            .expect_err("dtype")
            .to_string()
            .contains("expected F8_E4M3")
    );
    // Row counts that differ.
    write_st(
        &ck,
        vec![
            (&wn, Dtype::F8_E4M3, vec![rows, 256], &w),
            (&sn, Dtype::F8_E8M0, vec![rows - 1, 8], &s[..(rows - 1) * 8]),
        ],
    );
    assert!(pack(&ck, 1, &out, &PackSpec::default(), |_| None).is_err());
    // A NaN code names its row.
    w[7 * 256 + 3] = 0x7F;
    write_st(
        &ck,
        vec![
            (&wn, Dtype::F8_E4M3, vec![rows, 256], &w),
            (&sn, Dtype::F8_E8M0, vec![rows, 8], &s),
        ],
    );
    match pack(&ck, 1, &out, &PackSpec::default(), |_| None) {
        Err(PackError::CorruptRow { row: 7, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(!out.exists(), "a failed pack leaves no table behind");
    // An index that points outside the checkpoint.
    let index = format!(r#"{{"weight_map":{{"{wn}":"../x.safetensors","{sn}":"a.safetensors"}}}}"#);
    let idx = dir.path().join("model.safetensors.index.json");
    std::fs::write(&idx, index).expect("index");
    assert!(
        pack(&idx, 1, &out, &PackSpec::default(), |_| None)
            .expect_err("traversal")
            .to_string()
            .contains("leaves")
    );
    // Not a safetensors file at all.
    std::fs::write(&ck, b"garbage").expect("write");
    assert!(pack(&ck, 1, &out, &PackSpec::default(), |_| None).is_err());
}

/// A V4.1-shaped `config.json` for hashing base `base`.
fn config_json(base: u64) -> serde_json::Value {
    let p = HashParams::new(Preset::from_base(base).expect("base")).expect("params");
    serde_json::json!({
        "hidden_size": 5120, "hc_mult": 4, "rms_norm_eps": 1e-20,
        "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [p.layers[0].rows, p.layers[1].rows],
        "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_vocab_size": base, "engram_compressed_vocab_size": 99_092,
        "engram_pad_token_id": 2
    })
}

/// A safetensors file whose first tensor (`filler`, `U8`, a hole of
/// `filler` bytes) puts layer 1's table tensors `filler` bytes in.
fn write_far(path: &Path, filler: u64, w: &[u8], s: &[u8], rows: usize) {
    use std::os::unix::fs::FileExt;
    let (wn, sn) = tensor_names(1);
    let (w0, s0) = (filler, filler + w.len() as u64);
    let end = s0 + s.len() as u64;
    let mut header = serde_json::json!({
        "filler": {"dtype": "U8", "shape": [filler], "data_offsets": [0, filler]},
        wn: {"dtype": "F8_E4M3", "shape": [rows, 256], "data_offsets": [w0, s0]},
        sn: {"dtype": "F8_E8M0", "shape": [rows, 8], "data_offsets": [s0, end]},
    })
    .to_string()
    .into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    let f = File::create(path).expect("create");
    let start = 8 + header.len() as u64;
    f.set_len(start + end).expect("sparse length");
    f.write_all_at(&(header.len() as u64).to_le_bytes(), 0)
        .expect("write");
    f.write_all_at(&header, 8).expect("write");
    f.write_all_at(w, start + w0).expect("write");
    f.write_all_at(s, start + s0).expect("write");
}

#[test]
fn a_table_tensor_past_4_and_64_gib_in_its_shard_packs_and_matches_config_json() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = HashParams::new(Preset::Base(1000)).expect("params").layers[0].rows as usize;
    let (w, s) = rows_data(rows);
    let mut want = vec![0u8; rows * ROW_BYTES];
    engram_protocol::synthetic::synthetic_rows(2, 1, 0, &mut want);
    for filler in [(4u64 << 30) + 4096, (64u64 << 30) + 123 * 8] {
        let ck = dir.path().join("model.safetensors");
        write_far(&ck, filler, &w, &s, rows);
        std::fs::write(
            dir.path().join("config.json"),
            config_json(1000).to_string(),
        )
        .expect("config");
        let out = dir.path().join("l1.etab");
        let meta = pack(&ck, 1, &out, &PackSpec::default(), |_| None).expect("pack");
        assert_eq!(
            (meta.rows, meta.hash_base),
            (rows as u64, Some(1000)),
            "from config.json"
        );
        assert_eq!(packed_rows(&out), want, "filler {filler}");
        std::fs::remove_file(&out).expect("rm");
    }
}

#[test]
fn config_json_differences_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = HashParams::new(Preset::Base(1000)).expect("params").layers[0].rows as usize;
    let (w, s) = rows_data(rows);
    let ck = dir.path().join("model.safetensors");
    write_far(&ck, 8, &w, &s, rows);
    let out = dir.path().join("l1.etab");
    let cfg = dir.path().join("config.json");
    for (field, value) in [
        (
            "engram_num_embeddings",
            serde_json::json!([rows + 1, 30_058]),
        ),
        ("engram_vocab_size", serde_json::json!(2000)),
        ("engram_compressed_vocab_size", serde_json::json!(99_000)),
        ("engram_layer_ids", serde_json::json!([2, 14])),
        ("engram_head_dim", serde_json::json!(128)),
    ] {
        let mut c = config_json(1000);
        c[field] = value;
        std::fs::write(&cfg, c.to_string()).expect("config");
        let e = pack(&ck, 1, &out, &PackSpec::default(), |_| None).expect_err(field);
        assert!(e.to_string().contains(field), "{field}: {e}");
        assert!(!out.exists());
    }
    std::fs::write(&cfg, config_json(1000).to_string()).expect("config");
    let spec = PackSpec {
        hash_base: Some(2000),
        ..PackSpec::default()
    };
    let e = pack(&ck, 1, &out, &spec, |_| None).expect_err("contradicts");
    assert!(e.to_string().contains("--hash-base"), "{e}");
    // Named explicitly, a missing config.json is an error, not skipped.
    let spec = PackSpec {
        config_json: Some(dir.path().join("missing.json")),
        ..PackSpec::default()
    };
    assert!(pack(&ck, 1, &out, &spec, |_| None).is_err());
    std::fs::remove_file(&cfg).expect("rm");
    assert!(
        pack(&ck, 1, &out, &PackSpec::default(), |_| None).is_ok(),
        "none beside: not checked"
    );
}
