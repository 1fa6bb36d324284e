//! A Qwen4Exp node's loop built from the cluster config: its one PLE
//! table's route, the `[model]` table (`family = "qwen4exp"`, its
//! `eos_token`, `hash_base` for Qwen4Exp's `ngram_vocab_size_base`, the
//! PLE shape in `hidden` and `streams`, `weights_seed`), the rows fetched
//! through the node's routers.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use cluster_config::Config;
use cluster_config::model::{Family, Model, TokenMapSource, WeightsSource};
use engram_protocol::encoding::RowEncoding;
use engram_protocol::hashing::Preset;
use engram_protocol::qwen4exp::{QWEN38_BASE, Qwen4ExpConfig, Qwen4ExpHashing};
use engram_store::table_file::TableFile;
use tokenizers::Tokenizer;

use super::NgramModel;
use crate::engram::tokenmap::load_tokenizer;
use crate::memory::Routers;
use crate::metrics::NodeMetrics;
use crate::model::clock::RealClock;
use crate::model::fetch::RouterFetcher;
use crate::model::input::{self, InputError};
use crate::model::node::{InputChoice, SetupError, checked_rate, chunk_rows, usable_at_start};
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
    seed: u64,
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
    let seed = match &model.weights {
        Some(WeightsSource::Seed(s)) => *s,
        Some(WeightsSource::Checkpoint(p)) => {
            return Err(cfg(format!(
                "{at}: [model] weights = {:?}: a Qwen4Exp checkpoint's PLE weights are not read yet; \
                 give weights_seed = N for seeded ones (docs/models.md)",
                p.display()
            )));
        }
        None => {
            return Err(cfg(format!(
                "{at}: the loop fuses, so [model] needs weights_seed = N"
            )));
        }
    };
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
        seed,
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
        let (m, slot) = (&layout.model, layout.slot);
        let shape = (m.hidden as usize, m.streams as usize);
        let ngram =
            NgramModel::synthetic(hashing, encoding, layout.scale, slot, shape, layout.seed)
                .map_err(|e| SetupError::Fusion(e.to_string()))?;
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

    /// The run's raw ids, repeated until there are at least `min_len`
    /// (see [`NgramInput::tokens`]).
    pub fn tokens(&self, input: &InputChoice, min_len: usize) -> Result<Vec<u32>, SetupError> {
        Ok(self.input().tokens(input, min_len)?.raw)
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
        if new.tokens_per_second != old.tokens_per_second {
            changes.push_str(&format!(
                "; tokens/s {} -> {}",
                old.tokens_per_second, new.tokens_per_second
            ));
        }
        if new.prefill_budget != old.prefill_budget {
            changes.push_str(&format!(
                "; prefill budget {} -> {}",
                old.prefill_budget, new.prefill_budget
            ));
        }
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
