//! A Qwen4Exp node's loop built from the cluster config: its one PLE
//! table's route, the `[model]` table (`family = "qwen4exp"`, its
//! `eos_token`, `hash_base` for Qwen4Exp's `ngram_vocab_size_base`, the
//! PLE shape in `hidden` and `streams`, `weights_seed`), the rows fetched
//! through the node's routers.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use cluster_config::Config;
use cluster_config::model::{Family, FusionBackend, Model, TokenMapSource, WeightsSource};
use engram_protocol::encoding::RowEncoding;
use engram_protocol::hashing::Preset;
use engram_protocol::qwen4exp::{QWEN38_BASE, Qwen4ExpConfig, Qwen4ExpHashing};
use engram_store::table_file::TableFile;
use tokenizers::Tokenizer;

use super::{EPS, KERNEL, NgramModel};
use crate::engram::tokenmap::load_tokenizer;
use crate::engram::weights::PleWeights;
use crate::memory::Routers;
use crate::metrics::NodeMetrics;
use crate::model::clock::RealClock;
use crate::model::fetch::RouterFetcher;
use crate::model::input::{self, InputError};
use crate::model::node::{
    InputChoice, SetupError, checked_rate, chunk_rows, pace_changes, usable_at_start,
};
use crate::model::{BatchDriver, LoopError, LoopSpec, StepRecord, Summary, TableSlot, Tokens};
use crate::router::Router;

/// A Qwen4Exp node's model loop, ready to run.
#[derive(Debug)]
pub struct NgramNode {
    memory: Routers,
    router: Arc<Router>,
    model: NgramModel,
    layout: Layout,
    chunk_rows: usize,
    /// `[model] tokenizer`: text in, the model's raw ids out.
    tokenizer: Option<Arc<Tokenizer>>,
}

/// What node `name` of a config says of its Qwen4Exp loop, checked.
#[derive(Debug, Clone, PartialEq)]
struct Layout {
    model: Model,
    slot: TableSlot,
    scale: f32,
    weights: WeightsSource,
    tokens_per_second: f64,
    max_batch: u32,
    prefill_budget: usize,
}

/// Check `[model]` and node `name`'s one route against each other: the
/// family, the table's rows against the hashing's, its table scale and
/// the PLE weights' seed.
fn layout(
    config: &Config,
    name: &str,
    tokens_per_second: Option<f64>,
) -> Result<(Layout, Qwen4ExpHashing, RowEncoding), SetupError> {
    let cfg = |s: String| SetupError::Config(s);
    let at = config.path.display();
    let model = match &config.model {
        Some(m) if m.family == Family::Qwen4Exp => m.clone(),
        _ => {
            return Err(cfg(format!(
                "{at}: the Qwen4Exp loop needs [model] family = \"qwen4exp\""
            )));
        }
    };
    let node = config
        .node(name)
        .ok_or_else(|| cfg(format!("node {name:?} is not in {at}")))?;
    let rate = checked_rate(tokens_per_second.unwrap_or(node.tokens_per_second))?;
    let [route] = node.routes.as_slice() else {
        return Err(cfg(format!(
            "{at}: node {name:?} routes {} tables; a Qwen4Exp node reads one, its PLE layer's",
            node.routes.len()
        )));
    };
    let table = config
        .table(route.table)
        .ok_or_else(|| cfg(format!("table {} is not in {at}", route.table)))?;
    let hashing = hashing_of(&model).map_err(|e| cfg(format!("{at}: {e}")))?;
    let base = hashing.config.base;
    if table.rows != hashing.padded_rows {
        return Err(cfg(format!(
            "table {} has {} rows but Qwen4Exp's hashing (ngram_vocab_size_base {base}) addresses {}: \
             generate it with `memory-donor gen --rows {} --encoding {}` or set [model] hash_base to the table's",
            table.id,
            table.rows,
            hashing.padded_rows,
            hashing.padded_rows,
            table.encoding.name()
        )));
    }
    let scale = table_scale(table, route.ssd_path.as_path())?;
    match model.fusion {
        FusionBackend::Cpu => {}
        FusionBackend::Gpu => {
            return Err(cfg(format!(
                "{at}: [model] fusion = \"gpu\": Qwen4Exp's PLE fusion runs on the node's CPU only \
                 (the engines run it on their GPUs; docs/models.md): set fusion = \"cpu\" or \"gpu-or-cpu\""
            )));
        }
        // Said once, at start (`NgramNode::from_config`).
        FusionBackend::GpuOrCpu => {}
    }
    let weights = model.weights.clone().ok_or_else(|| {
        cfg(format!(
            "{at}: the loop fuses, so [model] needs PLE weights: \
             `weights = \"CHECKPOINT\"` or `weights_seed = N`"
        ))
    })?;
    let slot = TableSlot {
        table: table.id,
        layer: table.layer,
        window_blocks: cluster_config::window_blocks(table.layer, [table.layer]),
        row_bytes: table.encoding.row_bytes(),
    };
    let layout = Layout {
        model,
        slot,
        scale,
        weights,
        tokens_per_second: rate,
        max_batch: node.max_batch,
        prefill_budget: node.prefill_budget,
    };
    Ok((layout, hashing, table.encoding))
}

impl NgramNode {
    /// Build node `name` of `config` at `tokens_per_second` (default: the
    /// node's own): check `[model]` and the table against each other,
    /// build the memory, and refuse to start when the table has no usable
    /// source. Must run inside a tokio runtime.
    pub async fn from_config(
        config: &Config,
        name: &str,
        tokens_per_second: Option<f64>,
        metrics: &NodeMetrics,
    ) -> Result<Self, SetupError> {
        let (layout, hashing, encoding) = layout(config, name, tokens_per_second)?;
        if layout.model.fusion == FusionBackend::GpuOrCpu {
            tracing::warn!(
                "[model] fusion = \"gpu-or-cpu\": Qwen4Exp's PLE fusion runs on the CPU (it has no GPU path in the node)"
            );
        }
        let (m, slot) = (&layout.model, layout.slot);
        let shape = (m.hidden as usize, m.streams as usize);
        let fusion = |e: &dyn std::fmt::Display| SetupError::Fusion(e.to_string());
        let ngram = match &layout.weights {
            WeightsSource::Seed(seed) => {
                NgramModel::synthetic(hashing, encoding, layout.scale, slot, shape, *seed)
                    .map_err(|e| fusion(&e))?
            }
            WeightsSource::Checkpoint(p) => {
                let dim = hashing.heads() * encoding.values();
                check_config_json(m, &hashing, slot.layer, dim).map_err(SetupError::Config)?;
                let (p, layer) = (p.clone(), slot.layer);
                let weights = tokio::task::spawn_blocking(move || {
                    PleWeights::from_checkpoint(&p, layer, shape, dim, KERNEL)
                })
                .await
                .map_err(|e| fusion(&e))?
                .map_err(|e| fusion(&e))?;
                NgramModel::new(hashing, encoding, layout.scale, slot, shape, weights)
                    .map_err(|e| fusion(&e))?
            }
        };
        let tokenizer = match &m.token_map {
            TokenMapSource::Tokenizer(p) => {
                let tok = load_tokenizer(p).map_err(InputError::from)?;
                let vocab = ngram.hashing().config.vocab;
                let n = tok.get_vocab_size(true) as u64;
                if n > vocab {
                    return Err(SetupError::Config(format!(
                        "{}: {n} tokens, more than the model's vocabulary of {vocab}: \
                         is it this model's tokenizer?",
                        p.display()
                    )));
                }
                Some(Arc::new(tok))
            }
            _ => None,
        };
        let memory = Routers::from_config(config, name, metrics).await?;
        let router = memory
            .router(slot.table)
            .cloned()
            .ok_or_else(|| SetupError::Config(format!("table {} has no router", slot.table)))?;
        usable_at_start(std::slice::from_ref(&router), &[slot])?;
        Ok(Self {
            memory,
            router,
            model: ngram,
            layout,
            chunk_rows: chunk_rows(config),
            tokenizer,
        })
    }

    /// What turns a request's input into the loop's tokens, apart from the
    /// node (the daemon admits requests while the loop runs).
    pub fn input(&self) -> NgramInput {
        NgramInput {
            vocab: self.model.hashing().config.vocab,
            tokenizer: self.tokenizer.clone(),
        }
    }

    /// Apply a new config between sequences: what its route changes (see
    /// `Routers::reload`), the node's token rate and prefill budget. The
    /// `[model]` table, the table and its scale need a restart. All or
    /// nothing.
    pub fn reload(
        &mut self,
        handle: &tokio::runtime::Handle,
        config: &Config,
        name: &str,
        metrics: &NodeMetrics,
    ) -> Result<String, String> {
        let (new, _, _) = layout(config, name, None).map_err(|e| e.to_string())?;
        let old = &self.layout;
        if new.model != old.model {
            return Err("the [model] table changed: restart the node to apply it".into());
        }
        if (new.slot, new.scale.to_bits()) != (old.slot, old.scale.to_bits()) {
            return Err(format!(
                "the PLE table changed (table {} of scale {} -> table {} of scale {}): restart the node to apply it",
                old.slot.table, old.scale, new.slot.table, new.scale
            ));
        }
        let report = handle
            .block_on(self.memory.reload(config, name, metrics))
            .map_err(|e| e.to_string())?;
        let mut changes = report.to_string();
        pace_changes(
            &mut changes,
            (old.tokens_per_second, old.prefill_budget),
            (new.tokens_per_second, new.prefill_budget),
        );
        self.layout = new;
        Ok(changes)
    }

    /// The table the loop reads.
    pub fn slot(&self) -> TableSlot {
        self.model.slot()
    }

    /// The target rate.
    pub fn tokens_per_second(&self) -> f64 {
        self.layout.tokens_per_second
    }

    /// Most sequences the daemon batches (the node's `max_batch`).
    pub fn max_batch(&self) -> u32 {
        self.layout.max_batch
    }

    /// Prefill positions a batch step takes beside decoding sequences (the
    /// node's `prefill_budget`).
    pub fn prefill_budget(&self) -> usize {
        self.layout.prefill_budget
    }

    /// The fusion's name.
    pub fn fusion_name(&self) -> &'static str {
        FUSION
    }

    /// The memory (every router of the node).
    pub fn memory(&self) -> &Routers {
        &self.memory
    }

    /// The one router, the PLE table's.
    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// Run the loop on this thread (not a runtime thread: it sleeps and
    /// blocks), fetching on `handle`'s runtime.
    pub fn run(
        &mut self,
        handle: tokio::runtime::Handle,
        raw: &[u32],
        spec: &LoopSpec,
        stop: &AtomicBool,
        on_step: &mut dyn FnMut(&StepRecord) -> std::io::Result<()>,
    ) -> Result<Summary, LoopError> {
        let clock = RealClock::start();
        let mut fetcher = self.fetcher(handle, &clock);
        super::run(&clock, &mut fetcher, &self.model, raw, spec, stop, on_step)
    }

    /// Run a continuous batch on this thread (see [`super::run_batch`]),
    /// fetching on `handle`'s runtime.
    pub fn run_batch(
        &mut self,
        handle: tokio::runtime::Handle,
        spec: &LoopSpec,
        driver: &mut dyn BatchDriver,
    ) -> Result<(), LoopError> {
        let clock = RealClock::start();
        let mut fetcher = self.fetcher(handle, &clock);
        super::run_batch(&clock, &mut fetcher, &self.model, spec, driver)
    }

    fn fetcher(&self, handle: tokio::runtime::Handle, clock: &RealClock) -> RouterFetcher {
        RouterFetcher::new(
            handle,
            vec![self.router.clone()],
            clock.origin(),
            self.chunk_rows,
        )
    }
}

/// The fusion a Qwen4Exp node runs.
pub const FUSION: &str = "cpu (Qwen4Exp PLE)";

/// Why a Qwen4Exp node without a tokenizer refuses text.
pub const NO_TEXT: &str = "a Qwen4Exp node without [model] tokenizer takes token ids \
                           (--ids FILE, or a request's ids): set tokenizer to the model's tokenizer.json for text";

/// A Qwen4Exp node's input: raw token ids below the vocabulary, given or
/// from the model's tokenizer.
#[derive(Debug, Clone)]
pub struct NgramInput {
    vocab: u64,
    tokenizer: Option<Arc<Tokenizer>>,
}

impl NgramInput {
    /// Whether text is taken (`[model] tokenizer` is set).
    pub fn takes_text(&self) -> bool {
        self.tokenizer.is_some()
    }

    /// `input`'s ids, checked against the vocabulary and repeated until
    /// there are at least `min_len`: text through the model's tokenizer
    /// (refused without one); the built-in text through it too, or without
    /// one a word tokenizer's ids.
    pub fn tokens(&self, input: &InputChoice, min_len: usize) -> Result<Tokens, SetupError> {
        let encode = |text: &str, origin: String| -> Result<(Vec<u32>, String), SetupError> {
            let tok = self
                .tokenizer
                .as_ref()
                .ok_or_else(|| SetupError::Config(NO_TEXT.into()))?;
            let enc = tok
                .encode(text, false)
                .map_err(|e| InputError::Tokenizer(e.to_string()))?;
            Ok((enc.get_ids().to_vec(), origin))
        };
        let (mut raw, origin) = match input {
            InputChoice::Builtin if self.tokenizer.is_some() => {
                encode(input::BUILTIN_TEXT, "the built-in text".into())?
            }
            InputChoice::Builtin => (input::builtin()?.raw, "the built-in text's ids".into()),
            InputChoice::Ids(p) => (input::read_ids(p)?, p.display().to_string()),
            InputChoice::InlineIds(ids) => (ids.clone(), "the request's ids".into()),
            InputChoice::Text(p) => encode(&input::read_text(p)?, p.display().to_string())?,
            InputChoice::InlineText(t) => encode(t, "the request's text".into())?,
        };
        if raw.len() > input::MAX_TOKENS {
            return Err(InputError::TooMany.into());
        }
        let vocab = self.vocab;
        if let Some((i, &t)) = raw
            .iter()
            .enumerate()
            .find(|&(_, &t)| u64::from(t) >= vocab)
        {
            return Err(SetupError::Config(format!(
                "token {i} is id {t}, outside the vocabulary (ids are 0..{vocab})"
            )));
        }
        let n = raw.len();
        if n == 0 {
            return Err(InputError::Empty.into());
        }
        let min_len = min_len.min(input::MAX_TOKENS);
        while raw.len() < min_len {
            let k = (min_len - raw.len()).min(n);
            raw.extend_from_within(..k);
        }
        Ok(super::raw_tokens(raw, origin))
    }
}

/// The Qwen4Exp hashing a `qwen4exp` rack's `[model]` says: its
/// `eos_token`, and `hash_base` as `ngram_vocab_size_base` (Qwen3.8's
/// 20,000,000 without one); Qwen3.8-Flash-Next's other constants.
pub fn hashing_of(model: &Model) -> Result<Qwen4ExpHashing, String> {
    let eos = model.eos_token.ok_or("[model] needs eos_token")?;
    let base = match model.hashing {
        Preset::Base(b) => b,
        _ => QWEN38_BASE,
    };
    Qwen4ExpHashing::new(Qwen4ExpConfig {
        base,
        ..Qwen4ExpConfig::qwen38_flash_next(u64::from(eos))
    })
    .map_err(|e| format!("[model]: {e}"))
}

/// Check the PLE weights' checkpoint's `config.json` (its `text_config`
/// where the PLE fields are; the one `[model] config` names, else the one
/// beside the checkpoint, if any) against the node: the hashing's
/// constants, the table's layer among `ple_layer_ids`, `[model]`'s shape
/// and the fusion's constants. A field the file does not have is not
/// compared; a difference is refused, naming the field.
fn check_config_json(
    model: &Model,
    hashing: &Qwen4ExpHashing,
    layer: u32,
    dim: usize,
) -> Result<(), String> {
    use cluster_config::model::ConfigJson;
    let path = match &model.config_json {
        None => return Ok(()),
        Some(ConfigJson::Beside(p)) if !p.is_file() => return Ok(()),
        Some(c) => c.path().to_path_buf(),
    };
    let err = |e: String| format!("{}: {e}", path.display());
    let len = std::fs::metadata(&path)
        .map_err(|e| err(e.to_string()))?
        .len();
    if len > engram_protocol::model_config::MAX_CONFIG_BYTES {
        return Err(err(format!("{len} bytes: too large for a config")));
    }
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).map_err(|e| err(e.to_string()))?)
            .map_err(|e| err(format!("not JSON: {e}")))?;
    let c = v
        .get("text_config")
        .filter(|t| t.get("ngram_vocab_size_base").is_some())
        .unwrap_or(&v);
    let q = &hashing.config;
    let ints: [(&str, u64, &str); 9] = [
        ("hidden_size", u64::from(model.hidden), "[model] hidden"),
        ("hc_count", u64::from(model.streams), "[model] streams"),
        ("ple_embed_dim", dim as u64, "16 rows of the table's values"),
        (
            "ple_conv_kernel_size",
            KERNEL as u64,
            "this build's convolution",
        ),
        ("ngram_size", q.ngram_size as u64, "Qwen4Exp's hashing"),
        (
            "heads_per_ngram",
            q.heads_per_ngram as u64,
            "Qwen4Exp's hashing",
        ),
        ("vocab_size", q.vocab, "Qwen4Exp's hashing"),
        ("ngram_vocab_size_base", q.base, "[model] hash_base"),
        ("eos_token_id", q.eos, "[model] eos_token"),
    ];
    for (key, want, what) in ints {
        let Some(got) = c.get(key) else { continue };
        // eos_token_id may list several ids; the node's must be among them.
        let ok = match got {
            serde_json::Value::Array(a) if key == "eos_token_id" => {
                a.iter().any(|x| x.as_u64() == Some(want))
            }
            other => other.as_u64() == Some(want),
        };
        if !ok {
            return Err(err(format!(
                "`{key}` is {got}, but {what} gives {want}: the PLE layer would be computed \
                 differently from the model's, so this is refused"
            )));
        }
    }
    if let Some(got) = c.get("rms_norm_eps")
        && got.as_f64().map(|e| e as f32) != Some(EPS)
    {
        return Err(err(format!(
            "`rms_norm_eps` is {got}, but this build's PLE norms use {EPS}"
        )));
    }
    if let Some(ids) = c.get("ple_layer_ids").and_then(serde_json::Value::as_array) {
        let mut ids: Vec<u64> = ids.iter().filter_map(serde_json::Value::as_u64).collect();
        ids.sort_unstable();
        ids.dedup();
        // The hashing's layer index is the table's place among the PLE
        // layers; the node hashes as the first's (Qwen3.8-Flash-Next has one).
        match ids.iter().position(|&l| l == u64::from(layer)) {
            Some(i) if i as u64 == q.layer_index => {}
            Some(i) => {
                return Err(err(format!(
                    "the PLE table is layer {layer}'s, PLE layer {i} of `ple_layer_ids` {ids:?}: \
                     this node hashes as PLE layer {} (the first), so its rows would be another layer's",
                    q.layer_index
                )));
            }
            None => {
                return Err(err(format!(
                    "the PLE table is layer {layer}'s, not one of `ple_layer_ids` {ids:?}"
                )));
            }
        }
    }
    tracing::info!(config = %path.display(), "the checkpoint's config.json agrees with the node's PLE layer");
    Ok(())
}

/// The table scale `table`'s rows are read with: the config's
/// `tensor_scale`, else the header of the node's copy of the file at
/// `copy` (its SSD copy's path, the table's by default); none for an
/// encoding without one.
fn table_scale(table: &cluster_config::Table, copy: &std::path::Path) -> Result<f32, SetupError> {
    if !table.encoding.has_tensor_scale() {
        return Ok(1.0);
    }
    if let Some(s) = table.tensor_scale {
        return Ok(s);
    }
    let from = |p: &std::path::Path| {
        TableFile::read_meta(p)
            .ok()
            .filter(|(m, _)| m.digest == table.digest && m.encoding == table.encoding)
            .and_then(|(m, _)| m.tensor_scale)
    };
    from(copy)
        .or_else(|| from(&table.path))
        .map(f32::from_bits)
        .ok_or_else(|| {
            SetupError::Config(format!(
                "table {}: {} rows are read with a table scale: set [[table]] tensor_scale \
                 (`memory-donor inspect FILE` prints it), or keep the table's file at {}",
                table.id,
                table.encoding.name(),
                copy.display()
            ))
        })
}
