//! The checkpoint's `config.json` at the node's start: every Engram hash
//! and fusion parameter the model was trained with, compared with what the
//! node computes (its hashing, its fusion's epsilon) and with what `[model]`
//! says (compressed vocabulary, pad token, hidden size, streams) and the
//! token map has; a difference is refused, naming the field. The parsing
//! and the hashing's comparison live in `engram_protocol::model_config`,
//! with `pack`'s.

use cluster_config::model::{ConfigJson, Model};
use engram_protocol::hashing::HashParams;
use engram_protocol::model_config::{ModelConfig, ModelConfigError, expect};

use crate::engram::TokenMap;
use crate::engram::fusion::NORM_EPS;

/// Check `model`'s `config.json` (none named, none beside the weights:
/// nothing to check, `Ok(None)`); returns the file checked, or the first
/// difference, naming the file (a configuration error to the caller).
pub(crate) fn check(
    model: &Model,
    params: &HashParams,
    map: Option<&TokenMap>,
) -> Result<Option<std::path::PathBuf>, String> {
    let path = match &model.config_json {
        None => return Ok(None),
        Some(ConfigJson::Beside(p)) if !p.is_file() => return Ok(None),
        Some(c) => c.path().to_path_buf(),
    };
    let err = |e: String| format!("{}: {e}", path.display());
    let config =
        engram_store::checkpoint::read_model_config(&path).map_err(|e| err(e.to_string()))?;
    compare(&config, model, params, map).map_err(|e| err(e.to_string()))?;
    tracing::info!(config = %path.display(), "the checkpoint's config.json agrees with the node's hashing, fusion and [model]");
    Ok(Some(path))
}

/// Every comparison, the first difference being the error.
fn compare(
    c: &ModelConfig,
    model: &Model,
    params: &HashParams,
    map: Option<&TokenMap>,
) -> Result<(), ModelConfigError> {
    c.check_hashing(params)?;
    if let Some(n) = model.compressed_vocab {
        expect(
            "engram_compressed_vocab_size",
            c.compressed_vocab,
            u64::from(n),
            "[model] compressed_vocab",
        )?;
    }
    if let Some(m) = map {
        let what = "the compressed ids of the token map";
        expect(
            "engram_compressed_vocab_size",
            c.compressed_vocab,
            u64::from(m.compressed_len()),
            what,
        )?;
    }
    expect(
        "engram_pad_token_id",
        c.pad_token,
        u64::from(model.pad_token),
        "[model] pad_token",
    )?;
    expect(
        "hidden_size",
        c.hidden,
        u64::from(model.hidden),
        "[model] hidden",
    )?;
    expect(
        "hc_mult",
        c.hc_mult,
        u64::from(model.streams),
        "[model] streams",
    )?;
    expect(
        "rms_norm_eps",
        c.rms_norm_eps,
        NORM_EPS,
        "the fusion's epsilon in this build",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use cluster_config::model::{FusionBackend, TokenMapSource};
    use engram_protocol::hashing::Preset;

    fn v41_json() -> serde_json::Value {
        serde_json::json!({
            "hidden_size": 5120, "hc_mult": 4, "rms_norm_eps": 1e-20,
            "engram_layer_ids": [1, 14],
            "engram_num_embeddings": [384_006_168u64, 384_016_682u64],
            "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
            "engram_vocab_size": 16_000_000, "engram_compressed_vocab_size": 99_092,
            "engram_pad_token_id": 2
        })
    }

    fn model(config_json: Option<ConfigJson>) -> Model {
        Model {
            family: cluster_config::model::Family::DeepseekV41,
            eos_token: None,
            hashing: Preset::V41,
            token_map: TokenMapSource::None,
            compressed_vocab: Some(99_092),
            pad_token: 2,
            hidden: 5120,
            streams: 4,
            weights: None,
            fusion: FusionBackend::Cpu,
            config_json,
        }
    }

    #[test]
    fn config_json_is_checked_against_the_node_and_model() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("config.json");
        let params = HashParams::v41();
        let named = || Some(ConfigJson::Named(path.clone()));
        // Named and missing: refused; beside the weights and missing: nothing to check.
        assert!(check(&model(named()), &params, None).is_err());
        let beside = Some(ConfigJson::Beside(path.clone()));
        assert_eq!(
            check(&model(beside.clone()), &params, None).expect("none"),
            None
        );
        std::fs::write(&path, v41_json().to_string()).expect("write");
        assert_eq!(
            check(&model(beside), &params, None).expect("ok"),
            Some(path.clone())
        );
        for (field, value) in [
            ("hidden_size", serde_json::json!(7168)),
            ("hc_mult", serde_json::json!(2)),
            ("rms_norm_eps", serde_json::json!(1e-6)),
            ("engram_pad_token_id", serde_json::json!(1)),
            ("engram_compressed_vocab_size", serde_json::json!(129_280)),
            ("engram_num_embeddings", serde_json::json!([1, 2])),
        ] {
            let mut v = v41_json();
            v[field] = value;
            std::fs::write(&path, v.to_string()).expect("write");
            let e = check(&model(named()), &params, None)
                .expect_err(field)
                .to_string();
            assert!(
                e.contains(field) && e.contains("config.json"),
                "{field}: {e}"
            );
        }
        // [model] values that contradict the model are refused too.
        std::fs::write(&path, v41_json().to_string()).expect("write");
        for m in [
            Model {
                pad_token: 0,
                ..model(named())
            },
            Model {
                hidden: 64,
                ..model(named())
            },
            Model {
                streams: 1,
                ..model(named())
            },
        ] {
            assert!(check(&m, &params, None).is_err(), "{m:?}");
        }
        let map = TokenMap::from_ids((0..16).collect()).expect("map");
        let e = check(&model(named()), &params, Some(&map))
            .expect_err("map")
            .to_string();
        assert!(e.contains("token map"), "{e}");
    }
}
