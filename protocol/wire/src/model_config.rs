//! The checkpoint's `config.json` (Hugging Face's model config): the
//! Engram and fusion parameters the model was trained with, compared with
//! what this build computes, so that a model revision that changes one is
//! refused by name instead of giving wrong rows.
//!
//! What it is: parsing (the fields at the top level, or under
//! `text_config`, which a multimodal config nests them in; the top level
//! wins, as the engines merge them) and the comparisons. What it is not:
//! reading the file (the caller does the IO, bounded by
//! [`MAX_CONFIG_BYTES`]), or the fusion weights.

use serde_json::Value;
use thiserror::Error;

use crate::hashing::{COLUMNS, ENGRAM_LAYERS, HEADS, HashParams, MAX_NGRAM};
use crate::row::ROW_VALUES;

/// Largest `config.json` read.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The Engram and fusion fields of a `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `engram_layer_ids`: the layers that run Engram.
    pub layer_ids: Vec<u64>,
    /// `engram_num_embeddings`: each Engram layer's table rows.
    pub num_embeddings: Vec<u64>,
    /// `engram_max_ngram_size`.
    pub max_ngram: u64,
    /// `engram_n_heads`.
    pub heads: u64,
    /// `engram_head_dim`: values a row holds.
    pub head_dim: u64,
    /// `engram_vocab_size`: the hashing's base size (primes above it - 1).
    pub base: u64,
    /// `engram_compressed_vocab_size`: the token map's size, from which
    /// the multipliers are drawn.
    pub compressed_vocab: u64,
    /// `engram_pad_token_id`: the raw pad token.
    pub pad_token: u64,
    /// `hidden_size`.
    pub hidden: u64,
    /// `hc_mult`: the residual streams.
    pub hc_mult: u64,
    /// `rms_norm_eps`: the fusion's normalization epsilon.
    pub rms_norm_eps: f64,
}

/// Why a `config.json` is refused.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ModelConfigError {
    /// Not JSON, or not an object.
    #[error("config.json is not a JSON object: {0}")]
    Json(String),
    /// A field is missing or of the wrong kind.
    #[error("config.json: `{field}` is missing or not {what}")]
    Field {
        /// The field.
        field: &'static str,
        /// What it must be.
        what: &'static str,
    },
    /// A field differs from what this build or the rack config uses.
    #[error(
        "config.json: `{field}` is {config}, but {what} is {ours}: \
         rows would be addressed or fused differently from the model's, so this is refused"
    )]
    Mismatch {
        /// The field.
        field: &'static str,
        /// Its value in config.json.
        config: String,
        /// The value used here.
        ours: String,
        /// Where that value comes from.
        what: String,
    },
}

/// A field's value (the top level first, then `text_config`).
fn field<'a>(top: &'a Value, name: &str) -> Option<&'a Value> {
    top.get(name)
        .or_else(|| top.get("text_config").and_then(|t| t.get(name)))
}

fn uint(top: &Value, name: &'static str) -> Result<u64, ModelConfigError> {
    field(top, name)
        .and_then(Value::as_u64)
        .ok_or(ModelConfigError::Field {
            field: name,
            what: "a whole number",
        })
}

fn uints(top: &Value, name: &'static str) -> Result<Vec<u64>, ModelConfigError> {
    let bad = ModelConfigError::Field {
        field: name,
        what: "a list of at most 64 whole numbers",
    };
    let list = field(top, name)
        .and_then(Value::as_array)
        .ok_or(bad.clone())?;
    if list.len() > 64 {
        return Err(bad);
    }
    list.iter().map(|v| v.as_u64().ok_or(bad.clone())).collect()
}

/// Refuse `config` unless it equals `ours`, naming the field and `what`
/// `ours` is.
pub fn expect<T: PartialEq + std::fmt::Debug>(
    field: &'static str,
    config: T,
    ours: T,
    what: impl Into<String>,
) -> Result<(), ModelConfigError> {
    if config == ours {
        return Ok(());
    }
    Err(ModelConfigError::Mismatch {
        field,
        config: format!("{config:?}"),
        ours: format!("{ours:?}"),
        what: what.into(),
    })
}

impl ModelConfig {
    /// Parse a `config.json`'s bytes (at most [`MAX_CONFIG_BYTES`]).
    pub fn parse(bytes: &[u8]) -> Result<Self, ModelConfigError> {
        if bytes.len() as u64 > MAX_CONFIG_BYTES {
            return Err(ModelConfigError::Json(format!(
                "{} bytes, more than the {MAX_CONFIG_BYTES} accepted",
                bytes.len()
            )));
        }
        let top: Value =
            serde_json::from_slice(bytes).map_err(|e| ModelConfigError::Json(e.to_string()))?;
        if !top.is_object() {
            return Err(ModelConfigError::Json("not an object".into()));
        }
        Ok(Self {
            layer_ids: uints(&top, "engram_layer_ids")?,
            num_embeddings: uints(&top, "engram_num_embeddings")?,
            max_ngram: uint(&top, "engram_max_ngram_size")?,
            heads: uint(&top, "engram_n_heads")?,
            head_dim: uint(&top, "engram_head_dim")?,
            base: uint(&top, "engram_vocab_size")?,
            compressed_vocab: uint(&top, "engram_compressed_vocab_size")?,
            pad_token: uint(&top, "engram_pad_token_id")?,
            hidden: uint(&top, "hidden_size")?,
            hc_mult: uint(&top, "hc_mult")?,
            rms_norm_eps: field(&top, "rms_norm_eps").and_then(Value::as_f64).ok_or(
                ModelConfigError::Field {
                    field: "rms_norm_eps",
                    what: "a number",
                },
            )?,
        })
    }

    /// Compare the hashing: layers, orders, heads, row width, base size,
    /// each table's rows and the compressed vocabulary the multipliers
    /// come from, against what this build computes for `params`.
    pub fn check_hashing(&self, params: &HashParams) -> Result<(), ModelConfigError> {
        let layers: Vec<u64> = ENGRAM_LAYERS.iter().map(|&l| u64::from(l)).collect();
        expect(
            "engram_layer_ids",
            self.layer_ids.clone(),
            layers,
            "the layers this build runs",
        )?;
        expect(
            "engram_max_ngram_size",
            self.max_ngram,
            MAX_NGRAM as u64,
            "this build's largest order",
        )?;
        expect(
            "engram_n_heads",
            self.heads,
            HEADS as u64,
            "this build's heads per order",
        )?;
        expect(
            "engram_head_dim",
            self.head_dim,
            ROW_VALUES as u64,
            "the values a 264-byte row holds",
        )?;
        let what = format!("the base size of the hashing ({})", params.preset);
        expect("engram_vocab_size", self.base, params.preset.base(), what)?;
        let rows: Vec<u64> = params.layers.iter().map(|l| l.rows).collect();
        let what = format!(
            "the sums of each layer's {COLUMNS} primes above engram_vocab_size - 1 ({})",
            self.base.saturating_sub(1)
        );
        expect(
            "engram_num_embeddings",
            self.num_embeddings.clone(),
            rows,
            what,
        )?;
        expect(
            "engram_compressed_vocab_size",
            self.compressed_vocab,
            u64::from(params.vocab),
            "the vocabulary this build's multipliers are drawn for (V4.1's)",
        )
    }

    /// The rows `config.json` gives layer `layer`'s table, if it runs Engram.
    pub fn rows_of(&self, layer: u32) -> Option<u64> {
        let i = self.layer_ids.iter().position(|&l| l == u64::from(layer))?;
        self.num_embeddings.get(i).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::Preset;

    /// A V4.1 config.json's Engram and fusion fields, as the release has them.
    pub(crate) fn v41() -> Value {
        serde_json::json!({
            "architectures": ["DeepseekV41ForCausalLM"],
            "hidden_size": 5120,
            "hc_mult": 4,
            "rms_norm_eps": 1e-20,
            "engram_layer_ids": [1, 14],
            "engram_num_embeddings": [384_006_168u64, 384_016_682u64],
            "engram_max_ngram_size": 4,
            "engram_n_heads": 8,
            "engram_head_dim": 256,
            "engram_vocab_size": 16_000_000,
            "engram_compressed_vocab_size": 99_092,
            "engram_pad_token_id": 2
        })
    }

    fn parse(v: &Value) -> Result<ModelConfig, ModelConfigError> {
        ModelConfig::parse(v.to_string().as_bytes())
    }

    #[test]
    fn v41s_config_matches_the_hashing() {
        let c = parse(&v41()).expect("parses");
        c.check_hashing(&HashParams::v41()).expect("V4.1");
        assert_eq!(c.rows_of(14), Some(384_016_682));
        assert_eq!(c.rows_of(2), None);
        assert_eq!(c.rms_norm_eps, 1e-20);
        // Nested under text_config, as multimodal configs have it.
        let nested = serde_json::json!({"model_type": "deepseek_v41", "text_config": v41()});
        assert_eq!(parse(&nested).expect("nested"), c);
    }

    #[test]
    fn each_difference_is_refused_naming_its_field() {
        let params = HashParams::v41();
        for (field, value) in [
            ("engram_layer_ids", serde_json::json!([1, 15])),
            (
                "engram_num_embeddings",
                serde_json::json!([384_006_168u64, 1]),
            ),
            ("engram_max_ngram_size", serde_json::json!(3)),
            ("engram_n_heads", serde_json::json!(16)),
            ("engram_head_dim", serde_json::json!(128)),
            ("engram_vocab_size", serde_json::json!(16_000_001)),
            ("engram_compressed_vocab_size", serde_json::json!(99_091)),
        ] {
            let mut v = v41();
            v[field] = value;
            let e = parse(&v)
                .expect("parses")
                .check_hashing(&params)
                .expect_err(field);
            assert!(
                matches!(&e, ModelConfigError::Mismatch { field: f, .. } if *f == field),
                "{field}: {e}"
            );
            assert!(e.to_string().contains(field), "{e}");
        }
        let small = HashParams::new(Preset::Base(1000)).expect("base");
        let e = parse(&v41())
            .expect("parses")
            .check_hashing(&small)
            .expect_err("base");
        assert!(e.to_string().contains("engram_vocab_size"), "{e}");
    }

    #[test]
    fn missing_and_malformed_fields_are_named() {
        for (field, value) in [
            ("hidden_size", Value::Null),
            ("hc_mult", serde_json::json!(-4)),
            ("rms_norm_eps", serde_json::json!("small")),
            ("engram_layer_ids", serde_json::json!(1)),
            ("engram_num_embeddings", serde_json::json!(vec![1; 65])),
        ] {
            let mut v = v41();
            v[field] = value;
            let e = parse(&v).expect_err(field);
            assert!(
                matches!(&e, ModelConfigError::Field { field: f, .. } if *f == field),
                "{e}"
            );
        }
        assert!(matches!(
            ModelConfig::parse(b"[1]"),
            Err(ModelConfigError::Json(_))
        ));
        assert!(matches!(
            ModelConfig::parse(b"{"),
            Err(ModelConfigError::Json(_))
        ));
        let big = vec![b' '; MAX_CONFIG_BYTES as usize + 1];
        assert!(matches!(
            ModelConfig::parse(&big),
            Err(ModelConfigError::Json(_))
        ));
    }
}
