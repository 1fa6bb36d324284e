//! Rules of the `[model]` table, each reported with line and key.

use std::path::Path;

use engram_protocol::hashing::{COLUMNS, Preset, V41_COMPRESSED_VOCAB};
use engram_protocol::row::ROW_VALUES;

use super::Ctx;
use crate::model::{
    ConfigJson, Family, FusionBackend, MAX_HIDDEN, MAX_RAW_VOCAB, MAX_STREAMS, MAX_WKV_BYTES,
    Model, TokenMapSource, WeightsSource,
};
use crate::raw::RawModel;
use toml::Spanned;

/// Validate `[model]`.
pub(super) fn model(cx: &mut Ctx<'_>, raw: &Spanned<RawModel>, base: &Path) -> Model {
    let m = raw.get_ref();
    let (family, eos_token) = family(cx, m);
    let hashing = hashing(cx, m);
    let token_map = token_map(cx, m, base);
    let compressed_vocab = compressed_vocab(cx, m, hashing);
    let (pad_token, hidden, streams) = shapes(cx, raw);
    let weights = weights(cx, m, base);
    let fusion = fusion(cx, m);
    let config_json = match (&m.config, &weights) {
        (Some(c), _) => Some(ConfigJson::Named(cx.path(c, "model.config", base))),
        (None, Some(WeightsSource::Checkpoint(w))) => Some(ConfigJson::Beside(
            if w.extension()
                .is_some_and(|e| e == "safetensors" || e == "json")
            {
                w.parent().unwrap_or(Path::new("/")).join("config.json")
            } else {
                w.join("config.json")
            },
        )),
        (None, _) => None,
    };
    Model {
        family,
        eos_token,
        hashing,
        token_map,
        compressed_vocab,
        pad_token,
        hidden,
        streams,
        weights,
        fusion,
        config_json,
    }
}

/// `family` (default `deepseek_v41`) and `eos_token`: required under
/// `qwen4exp` (its n-gram window restarts there), refused under V4.1,
/// whose hashing keys are refused under `qwen4exp` in turn (but
/// `hash_base`, there Qwen4Exp's `ngram_vocab_size_base`).
fn family(cx: &mut Ctx<'_>, m: &RawModel) -> (Family, Option<u32>) {
    let family = match &m.family {
        None => Family::default(),
        Some(f) => Family::parse(f.get_ref()).unwrap_or_else(|| {
            let known: Vec<_> = Family::ALL
                .iter()
                .map(|f| format!("{:?}", f.name()))
                .collect();
            cx.at(
                f.span(),
                "model.family",
                format!("{:?} is not one of {}", f.get_ref(), known.join(", ")),
            );
            Family::default()
        }),
    };
    let eos = super::opt_int(
        cx,
        &m.eos_token,
        "model.eos_token",
        0,
        i64::from(MAX_RAW_VOCAB) - 1,
    )
    .map(|v| v as u32);
    match family {
        Family::DeepseekV41 => {
            if let Some(e) = &m.eos_token {
                cx.at(
                    e.span(),
                    "model.eos_token",
                    "deepseek_v41 pads with pad_token; eos_token is for family = \"qwen4exp\"",
                );
            }
        }
        Family::Qwen4Exp => {
            let v41_only = [
                ("hash_preset", m.hash_preset.as_ref().map(|v| v.span())),
                ("token_map", m.token_map.as_ref().map(|v| v.span())),
                (
                    "compressed_vocab",
                    m.compressed_vocab.as_ref().map(|v| v.span()),
                ),
                ("pad_token", m.pad_token.as_ref().map(|v| v.span())),
            ];
            for (key, span) in v41_only {
                if let Some(span) = span {
                    cx.at(
                        span,
                        format!("model.{key}"),
                        format!("{key} is DeepSeek V4.1's; qwen4exp hashes raw ids with its own constants (docs/models.md)"),
                    );
                }
            }
            if eos.is_none() && m.eos_token.is_none() {
                let span = m.family.as_ref().map(|f| f.span()).unwrap_or_default();
                cx.at(
                    span,
                    "model.eos_token",
                    "family = \"qwen4exp\" needs eos_token (its config.json's eos_token_id): an n-gram window restarts at it",
                );
            }
        }
    }
    (family, eos)
}

/// Every node route's table must be of the encoding `family`'s tables
/// have (a V4.1 node reads 264-byte rows; a Qwen4Exp node its own).
pub(super) fn routes_fit_family(
    cx: &mut Ctx<'_>,
    raw: &[Spanned<crate::raw::RawNode>],
    tables: &[crate::Table],
    family: Family,
) {
    for (i, n) in raw.iter().enumerate() {
        for (j, r) in n.get_ref().routes.iter().enumerate() {
            let r = r.get_ref();
            let id = *r.table.get_ref();
            let Some(t) = tables.iter().find(|t| i64::from(t.id) == id) else {
                continue; // Reported by the route's own rules.
            };
            if !family.accepts(t.encoding) {
                cx.at(
                    r.table.span(),
                    format!("node[{i}].route[{j}].table"),
                    format!(
                        "table {id}'s rows are {}, but [model] family = {:?} reads {} (docs/models.md)",
                        t.encoding.name(),
                        family.name(),
                        family.encodings()
                    ),
                );
            }
        }
    }
}

/// `compressed_vocab`: at most V4.1's 99,092 (the multipliers of every
/// preset are drawn for it), and exactly that under `v41`, whose
/// multipliers are V4.1's (default: 99,092 under `v41`, none otherwise).
fn compressed_vocab(cx: &mut Ctx<'_>, m: &RawModel, hashing: Preset) -> Option<u32> {
    let vocab_max = i64::from(V41_COMPRESSED_VOCAB);
    let Some(v) = &m.compressed_vocab else {
        return (hashing == Preset::V41).then_some(V41_COMPRESSED_VOCAB);
    };
    let n = cx.int(v, "model.compressed_vocab", 1, vocab_max)? as u32;
    if hashing == Preset::V41 && n != V41_COMPRESSED_VOCAB {
        cx.at(
            v.span(),
            "model.compressed_vocab",
            format!(
                "{n} contradicts the v41 preset: its multipliers are drawn for V4.1's \
                 {V41_COMPRESSED_VOCAB} compressed ids, so a map of another size would hash \
                 differently from the model"
            ),
        );
    }
    Some(n)
}

/// The hashing: `hash_preset` or `hash_base` (V4.1 by default).
fn hashing(cx: &mut Ctx<'_>, m: &RawModel) -> Preset {
    match (&m.hash_preset, &m.hash_base) {
        (Some(p), Some(_)) => {
            cx.at(
                p.span(),
                "model.hash_preset",
                "give `hash_preset` or `hash_base`, not both",
            );
            Preset::V41
        }
        (Some(p), None) => match p.get_ref().as_str() {
            "v41" => Preset::V41,
            other => {
                cx.at(
                    p.span(),
                    "model.hash_preset",
                    format!("{other:?} is not a preset (known: \"v41\"; or set `hash_base`)"),
                );
                Preset::V41
            }
        },
        (None, Some(b)) => {
            let lo = engram_protocol::hashing::MIN_BASE as i64;
            let hi = engram_protocol::hashing::MAX_BASE as i64;
            match cx.int(b, "model.hash_base", lo, hi) {
                Some(b) => Preset::Base(b as u64),
                None => Preset::V41,
            }
        }
        (None, None) => Preset::V41,
    }
}

/// Where the token map comes from: `tokenizer`, `token_map` or neither.
fn token_map(cx: &mut Ctx<'_>, m: &RawModel, base: &Path) -> TokenMapSource {
    match (&m.tokenizer, &m.token_map) {
        (Some(t), Some(_)) => {
            cx.at(
                t.span(),
                "model.tokenizer",
                "give `tokenizer` or `token_map`, not both",
            );
            TokenMapSource::None
        }
        (Some(t), None) => TokenMapSource::Tokenizer(cx.path(t, "model.tokenizer", base)),
        (None, Some(t)) => TokenMapSource::Map(cx.path(t, "model.token_map", base)),
        (None, None) => TokenMapSource::None,
    }
}

/// The pad token, hidden size and streams; the fusion matrix they make
/// within its bound.
fn shapes(cx: &mut Ctx<'_>, raw: &Spanned<RawModel>) -> (u32, u32, u32) {
    let (span, m) = (raw.span(), raw.get_ref());
    let pad_token = super::opt_int(
        cx,
        &m.pad_token,
        "model.pad_token",
        0,
        i64::from(MAX_RAW_VOCAB) - 1,
    )
    .unwrap_or(2) as u32;
    let hidden = super::opt_int(cx, &m.hidden, "model.hidden", 1, i64::from(MAX_HIDDEN))
        .unwrap_or(5120) as u32;
    let streams = super::opt_int(cx, &m.streams, "model.streams", 1, i64::from(MAX_STREAMS))
        .unwrap_or(4) as u32;
    let wkv_bytes =
        (u64::from(streams) + 1) * u64::from(hidden) * (COLUMNS * ROW_VALUES) as u64 * 4;
    if wkv_bytes > MAX_WKV_BYTES {
        let at = m.hidden.as_ref().map_or(span.clone(), |h| h.span());
        cx.at(
            at,
            "model.hidden",
            format!(
                "a fusion matrix of ({streams} + 1) x {hidden} x {} f32 is {:.1} GiB, over the {} GiB accepted",
                COLUMNS * ROW_VALUES,
                wkv_bytes as f64 / f64::from(1u32 << 30),
                MAX_WKV_BYTES >> 30
            ),
        );
    }
    (pad_token, hidden, streams)
}

fn weights(cx: &mut Ctx<'_>, m: &RawModel, base: &Path) -> Option<WeightsSource> {
    match (&m.weights, &m.weights_seed) {
        (Some(w), Some(_)) => {
            cx.at(
                w.span(),
                "model.weights",
                "give `weights` or `weights_seed`, not both",
            );
            None
        }
        (Some(w), None) => Some(WeightsSource::Checkpoint(cx.path(w, "model.weights", base))),
        (None, Some(s)) => Some(WeightsSource::Seed(
            cx.int(s, "model.weights_seed", 0, i64::MAX).unwrap_or(0) as u64,
        )),
        // Only the model loop fuses; an engine embedding the memory has its own weights.
        (None, None) => None,
    }
}

fn fusion(cx: &mut Ctx<'_>, m: &RawModel) -> FusionBackend {
    match &m.fusion {
        None => FusionBackend::default(),
        Some(f) => FusionBackend::parse(f.get_ref()).unwrap_or_else(|| {
            cx.at(
                f.span(),
                "model.fusion",
                format!(
                    "{:?} is not one of \"cpu\", \"gpu\", \"gpu-or-cpu\"",
                    f.get_ref()
                ),
            );
            FusionBackend::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::{Config, ConfigError};

    const HEAD: &str = "version = 1\n[rack]\nname = \"r\"\n";

    fn parse(model: &str) -> Result<Config, ConfigError> {
        Config::parse(
            &format!("{HEAD}{model}"),
            Path::new("/etc/engram-rack/rack.toml"),
        )
    }

    /// Expect a diagnostic on `line` (of the whole file) for `key` containing `msg`.
    fn expect(model: &str, line: usize, key: &str, msg: &str) {
        let d = match parse(model) {
            Err(ConfigError::Invalid(d)) => d,
            other => panic!("expected diagnostics, got {other:?}"),
        };
        assert!(
            d.iter()
                .any(|d| d.line == line && d.key == key && d.message.contains(msg)),
            "no diagnostic at line {line} for {key} containing {msg:?}; got {d:?}"
        );
    }

    #[test]
    fn no_model_table_is_fine() {
        assert_eq!(parse("").expect("valid").model, None);
    }

    #[test]
    fn defaults_are_v41() {
        let m = parse("[model]\nweights_seed = 7\n")
            .expect("valid")
            .model
            .expect("model");
        assert_eq!(
            m,
            Model {
                family: Family::DeepseekV41,
                eos_token: None,
                hashing: Preset::V41,
                token_map: TokenMapSource::None,
                compressed_vocab: Some(99_092),
                pad_token: 2,
                hidden: 5120,
                streams: 4,
                weights: Some(WeightsSource::Seed(7)),
                fusion: FusionBackend::Cpu,
                config_json: None,
            }
        );
    }

    #[test]
    fn every_key_is_read_and_paths_resolve() {
        let m = parse(
            "[model]\nhash_base = 1000\ntoken_map = \"map.txt\"\ncompressed_vocab = 500\n\
             pad_token = 0\nhidden = 64\nstreams = 2\nweights = \"/models/v41\"\nfusion = \"gpu-or-cpu\"\n",
        )
        .expect("valid")
        .model
        .expect("model");
        assert_eq!(m.hashing, Preset::Base(1000));
        assert_eq!(
            m.token_map,
            TokenMapSource::Map(PathBuf::from("/etc/engram-rack/map.txt"))
        );
        assert_eq!(
            (m.compressed_vocab, m.pad_token, m.hidden, m.streams),
            (Some(500), 0, 64, 2)
        );
        assert_eq!(
            m.weights,
            Some(WeightsSource::Checkpoint(PathBuf::from("/models/v41")))
        );
        assert_eq!(m.fusion, FusionBackend::GpuOrCpu);
        let m = parse("[model]\nhash_base = 1000\ntokenizer = \"t.json\"\nweights_seed = 1\n")
            .expect("valid")
            .model
            .expect("model");
        assert_eq!(m.compressed_vocab, None, "no default size outside v41");
        assert_eq!(
            m.token_map,
            TokenMapSource::Tokenizer(PathBuf::from("/etc/engram-rack/t.json"))
        );
        assert_eq!(
            m.config_json, None,
            "no weights checkpoint, no config named"
        );
        // config.json: named, or beside the weights checkpoint.
        let m = parse("[model]\nweights = \"/models/v41\"\nconfig = \"c/config.json\"\n")
            .expect("valid")
            .model
            .expect("model");
        assert_eq!(
            m.config_json,
            Some(ConfigJson::Named(PathBuf::from(
                "/etc/engram-rack/c/config.json"
            )))
        );
        for (weights, beside) in [
            ("/models/v41", "/models/v41/config.json"),
            ("/models/v41/model.safetensors", "/models/v41/config.json"),
            (
                "/models/v41/model.safetensors.index.json",
                "/models/v41/config.json",
            ),
        ] {
            let m = parse(&format!("[model]\nweights = \"{weights}\"\n"))
                .expect("valid")
                .model
                .expect("model");
            assert_eq!(
                m.config_json,
                Some(ConfigJson::Beside(PathBuf::from(beside)))
            );
        }
        // Weights are the model loop's: a config for an embedding engine leaves them out.
        let m = parse("[model]\nhash_preset = \"v41\"\n")
            .expect("valid without weights")
            .model
            .expect("model");
        assert_eq!(m.weights, None);
    }

    #[test]
    fn each_rule_names_its_line_and_key() {
        let w = "weights_seed = 1\n";
        expect(
            &format!("[model]\n{w}hash_preset = \"v40\"\n"),
            6,
            "model.hash_preset",
            "not a preset",
        );
        expect(
            &format!("[model]\n{w}hash_preset = \"v41\"\nhash_base = 9\n"),
            6,
            "model.hash_preset",
            "not both",
        );
        expect(
            &format!("[model]\n{w}hash_base = 1\n"),
            6,
            "model.hash_base",
            "out of range",
        );
        expect(
            &format!("[model]\n{w}tokenizer = \"a\"\ntoken_map = \"b\"\n"),
            6,
            "model.tokenizer",
            "not both",
        );
        expect(
            &format!("[model]\n{w}tokenizer = \" \"\n"),
            6,
            "model.tokenizer",
            "empty",
        );
        expect(
            &format!("[model]\n{w}compressed_vocab = 99093\n"),
            6,
            "model.compressed_vocab",
            "out of range",
        );
        expect(
            &format!("[model]\n{w}compressed_vocab = 99091\n"),
            6,
            "model.compressed_vocab",
            "contradicts the v41 preset",
        );
        expect(
            &format!("[model]\n{w}config = \"\"\n"),
            6,
            "model.config",
            "empty",
        );
        expect(
            &format!("[model]\n{w}pad_token = -1\n"),
            6,
            "model.pad_token",
            "out of range",
        );
        expect(
            &format!("[model]\n{w}hidden = 0\n"),
            6,
            "model.hidden",
            "out of range",
        );
        expect(
            &format!("[model]\n{w}hidden = 65536\nstreams = 64\n"),
            6,
            "model.hidden",
            "GiB accepted",
        );
        expect(
            &format!("[model]\n{w}streams = 65\n"),
            6,
            "model.streams",
            "out of range",
        );
        expect(
            &format!("[model]\n{w}weights = \"x\"\n"),
            6,
            "model.weights",
            "not both",
        );
        expect(
            "[model]\nweights_seed = -3\n",
            5,
            "model.weights_seed",
            "out of range",
        );
        expect(
            &format!("[model]\n{w}fusion = \"tpu\"\n"),
            6,
            "model.fusion",
            "\"gpu-or-cpu\"",
        );
        expect(
            &format!("[model]\n{w}colour = 1\n"),
            6,
            "colour",
            "unknown field",
        );
    }
}
