//! Qwen4Exp's n-gram row ids and row values against vLLM's own code:
//! `data/qwen4exp-ids.json` holds cases and the ids vLLM's
//! `Qwen4ExpNGramEmbedding` computed for them, and rows of each encoding
//! with the bf16 values vLLM's table methods give them (written by
//! `python/qwen4exp_reference.py write`, which the engine suite runs again
//! with `check` against vLLM's and SGLang's code). Every layout constant,
//! every id and every value must equal ours.

use std::path::Path;

use engram_protocol::encoding::RowEncoding;
use engram_protocol::qwen4exp::{Qwen4ExpConfig, Qwen4ExpHashing};
use serde_json::Value;

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("a list")
        .iter()
        .map(|x| x.as_u64().expect("an unsigned integer"))
        .collect()
}

fn i64s(v: &Value) -> Vec<i64> {
    v.as_array()
        .expect("a list")
        .iter()
        .map(|x| x.as_i64().expect("an integer"))
        .collect()
}

fn reference() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/qwen4exp-ids.json");
    serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json")
}

#[test]
fn every_row_of_every_encoding_dequantizes_to_vllms_values() {
    let doc = reference();
    let rows = doc["rows"].as_array().expect("rows");
    let mut kinds = std::collections::BTreeSet::new();
    for (i, r) in rows.iter().enumerate() {
        let enc = RowEncoding::parse(r["encoding"].as_str().expect("name")).expect("encoding");
        let hex = r["row"].as_str().expect("row");
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|k| u8::from_str_radix(&hex[k..k + 2], 16).expect("hex"))
            .collect();
        let mut out = vec![0u16; enc.values()];
        enc.dequantize_bf16(&bytes, r["scale"].as_f64().expect("scale") as f32, &mut out)
            .expect("row");
        let want: Vec<u16> = u64s(&r["bf16"]).iter().map(|&b| b as u16).collect();
        assert_eq!(out, want, "row {i} ({})", enc.name());
        kinds.insert(enc.name());
    }
    assert_eq!(kinds.len(), 3, "{kinds:?}");
}

#[test]
fn every_case_gives_vllms_rows() {
    let doc = reference();
    let c = &doc["config"];
    let n = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("config {k}"));
    let config = |layer_index| Qwen4ExpConfig {
        ngram_size: n("ngram_size") as usize,
        heads_per_ngram: n("heads_per_ngram") as usize,
        vocab: n("vocab_size"),
        base: n("ngram_vocab_size_base"),
        seed: n("seed"),
        eos: n("eos_token_id"),
        divisible_by: n("make_ngram_vocab_size_divisible_by"),
        layer_index,
    };
    for (layer, want) in doc["layouts"].as_object().expect("layouts") {
        let h = Qwen4ExpHashing::new(config(layer.parse().expect("index"))).expect("params");
        let mult: Vec<u64> = h.multipliers.iter().map(|&m| m as u64).collect();
        assert_eq!(mult, u64s(&want["multipliers"]), "layer {layer}");
        assert_eq!(h.sizes, u64s(&want["sizes"]), "layer {layer}");
        assert_eq!(h.offsets, u64s(&want["offsets"]), "layer {layer}");
        assert_eq!(
            h.rows,
            want["rows"].as_u64().expect("rows"),
            "layer {layer}"
        );
    }
    let cases = doc["cases"].as_array().expect("cases");
    let mut tokens_checked = 0;
    for (i, case) in cases.iter().enumerate() {
        let h = Qwen4ExpHashing::new(config(case["layer_index"].as_u64().expect("layer")))
            .expect("params");
        let mut got = Vec::new();
        for r in case["batch"].as_array().expect("batch") {
            let ids = h
                .ids(&i64s(&r["context"]), &i64s(&r["tokens"]))
                .expect("ids");
            got.extend(ids.chunks(h.heads()).map(<[u64]>::to_vec));
        }
        let want: Vec<Vec<u64>> = case["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(u64s)
            .collect();
        assert_eq!(got, want, "case {i}");
        tokens_checked += got.len();
    }
    assert!(
        cases.len() >= 10 && tokens_checked > 100,
        "{tokens_checked}"
    );
}
