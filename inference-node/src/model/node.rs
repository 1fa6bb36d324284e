//! The model loop on a real node: built from the cluster config (the
//! node's routes for layers 1 and 14, its `[model]` table, its token rate),
//! with the rows fetched through the node's routers.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use cluster_config::model::{Model, TokenMapSource, WeightsSource};
use cluster_config::{Config, Node};
use engram_protocol::hashing::HashParams;
use thiserror::Error;
use tokenizers::Tokenizer;

use super::clock::RealClock;
use super::fetch::RouterFetcher;
use super::input::{self, InputError, Tokens};
use super::{LoopError, LoopSpec, StepRecord, Summary, TableSlot};
use crate::engram::tokenmap::{TokenMap, load_tokenizer};
use crate::engram::{Fusion, FusionShape, FusionWeights, backend};
use crate::memory::{MemoryError, Routers};
use crate::metrics::NodeMetrics;
use crate::router::Router;

/// Why the node's model cannot start.
#[derive(Debug, Error)]
pub enum SetupError {
    /// The config lacks what the loop needs, or contradicts it.
    #[error("{0}")]
    Config(String),
    /// The memory could not be built.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A table has no source it could use at start.
    #[error("table {table} (layer {layer}) has no usable source at start: {why}")]
    NoSource {
        /// The table id.
        table: u32,
        /// Its Engram layer.
        layer: u32,
        /// Why each configured source is not usable (or that none is configured).
        why: String,
    },
    /// The token map, tokenizer or input failed.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The fusion weights or backend failed.
    #[error("fusion: {0}")]
    Fusion(String),
}

/// Where the backbone's stand-in compute runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Backbone {
    /// A precise wait on the CPU (sleeps, spins only the last 100 us).
    #[default]
    Cpu,
    /// A busy kernel on GPU 0 (`--features cuda`).
    Gpu,
}

/// Where the tokens come from.
#[derive(Debug, Clone)]
pub enum InputChoice {
    /// The built-in text.
    Builtin,
    /// A text file.
    Text(PathBuf),
    /// A file of raw token ids.
    Ids(PathBuf),
    /// Text given inline (the daemon's requests).
    InlineText(String),
    /// Raw token ids given inline.
    InlineIds(Vec<u32>),
}

/// A node ready to run its model loop.
pub struct NodeModel {
    memory: Routers,
    routers: [Arc<Router>; 2],
    slots: [TableSlot; 2],
    params: HashParams,
    model: Model,
    fusion: Box<dyn Fusion>,
    chunk_rows: usize,
    tokens_per_second: f64,
    max_batch: u32,
    prefill_budget: usize,
    tokenizer: Option<(Tokenizer, TokenMap)>,
    map: Option<TokenMap>,
}

impl std::fmt::Debug for NodeModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeModel")
            .field("slots", &self.slots)
            .field("fusion", &self.fusion.name())
            .field("tokens_per_second", &self.tokens_per_second)
            .finish_non_exhaustive()
    }
}

impl NodeModel {
    /// Build node `name` of `config` at `tokens_per_second` (default: the
    /// node's own): check the `[model]` table against the tables, load the
    /// token map and fusion weights, build the memory (every source opened
    /// and probed), and refuse to start when a table has no usable source.
    /// Must run inside a tokio runtime.
    pub async fn from_config(
        config: &Config,
        name: &str,
        tokens_per_second: Option<f64>,
        metrics: &NodeMetrics,
    ) -> Result<Self, SetupError> {
        let cfg = |s: String| SetupError::Config(s);
        let model = config.model.clone().ok_or_else(|| {
            cfg(format!(
                "{}: the model loop needs a [model] table (hash_base or hash_preset, weights_seed or weights, hidden, streams)",
                config.path.display()
            ))
        })?;
        let mut config = config.clone();
        let node = config
            .nodes
            .iter_mut()
            .find(|n| n.name == name)
            .ok_or_else(|| cfg(format!("node {name:?} is not in {}", config.path.display())))?;
        if let Some(r) = tokens_per_second {
            node.tokens_per_second = checked_rate(r)?;
        }
        let rate = node.tokens_per_second;
        let node = node.clone();
        let params = HashParams::new(model.hashing).map_err(|e| cfg(e.to_string()))?;

        let [t1, t14] = layer_tables(&config, &node, &model, &params)?;
        let slots = super::v41_slots(t1, t14);

        let (tokenizer, map) = token_map(&model)?;
        let loaded = tokenizer.as_ref().map(|(_, m)| m).or(map.as_ref());
        super::config_json::check(&model, &params, loaded).map_err(SetupError::Config)?;

        let fusion = fusion_of(&config, &model).await?;

        let memory = Routers::from_config(&config, name, metrics).await?;
        let router = |t: u32| {
            memory
                .router(t)
                .cloned()
                .ok_or_else(|| cfg(format!("table {t} has no router")))
        };
        let routers = [router(t1)?, router(t14)?];
        usable_at_start(&routers, &slots)?;
        let chunk_rows = chunk_rows(&config);
        Ok(Self {
            memory,
            routers,
            slots,
            params,
            model,
            fusion,
            chunk_rows,
            tokens_per_second: rate,
            max_batch: node.max_batch,
            prefill_budget: node.prefill_budget,
            tokenizer,
            map,
        })
    }

    /// The run's tokens, repeated until there are at least `min_len`.
    pub fn tokens(&self, input: &InputChoice, min_len: usize) -> Result<Tokens, SetupError> {
        tokens_of(
            self.model.pad_token,
            &self.tokenizer,
            &self.map,
            input,
            min_len,
        )
    }

    /// Apply a new config between sequences: what its routes change (see
    /// `Routers::reload`) and the node's token rate. The `[model]` table,
    /// and which tables the node routes, need a restart. All or nothing.
    pub fn reload(
        &mut self,
        handle: &tokio::runtime::Handle,
        config: &Config,
        name: &str,
        metrics: &NodeMetrics,
    ) -> Result<String, String> {
        if config.model.as_ref() != Some(&self.model) {
            return Err("the [model] table changed: restart the node to apply it".into());
        }
        let node = config
            .node(name)
            .ok_or_else(|| format!("node {name:?} is not in the new config"))?;
        let report = handle
            .block_on(self.memory.reload(config, name, metrics))
            .map_err(|e| e.to_string())?;
        let mut changes = report.to_string();
        pace_changes(
            &mut changes,
            (self.tokens_per_second, self.prefill_budget),
            (node.tokens_per_second, node.prefill_budget),
        );
        self.tokens_per_second = node.tokens_per_second;
        self.prefill_budget = node.prefill_budget;
        Ok(changes)
    }

    /// The tables the loop uses.
    pub fn slots(&self) -> [TableSlot; 2] {
        self.slots
    }

    /// The routers, layer 1's then layer 14's.
    pub fn routers(&self) -> &[Arc<Router>; 2] {
        &self.routers
    }

    /// The memory (every router of the node).
    pub fn memory(&self) -> &Routers {
        &self.memory
    }

    /// Prefill positions a batch step takes beside decoding sequences (the
    /// node's `prefill_budget`).
    pub fn prefill_budget(&self) -> usize {
        self.prefill_budget
    }

    /// Most sequences the daemon batches (the node's `max_batch`).
    pub fn max_batch(&self) -> u32 {
        self.max_batch
    }

    /// The target rate.
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens_per_second
    }

    /// The fusion backend's name.
    pub fn fusion_name(&self) -> &'static str {
        self.fusion.name()
    }

    /// Run the loop on this thread (not a runtime thread: it sleeps and
    /// blocks), fetching on `handle`'s runtime, with the backbone stand-in
    /// on the CPU (a precise wait) or the GPU (a busy kernel).
    pub fn run(
        &mut self,
        handle: tokio::runtime::Handle,
        tokens: &Tokens,
        spec: &LoopSpec,
        backbone: Backbone,
        stop: &AtomicBool,
        on_step: &mut dyn FnMut(&StepRecord) -> std::io::Result<()>,
    ) -> Result<Summary, LoopError> {
        match backbone {
            Backbone::Cpu => {
                let clock = RealClock::start();
                self.run_with(&clock, clock.origin(), handle, tokens, spec, stop, on_step)
            }
            #[cfg(feature = "cuda")]
            Backbone::Gpu => {
                let clock = super::gpu_clock::GpuClock::new(0)
                    .map_err(|e| LoopError::Spec(format!("GPU backbone: {e}")))?;
                let origin = clock.real().origin();
                self.run_with(&clock, origin, handle, tokens, spec, stop, on_step)
            }
            #[cfg(not(feature = "cuda"))]
            Backbone::Gpu => Err(LoopError::Spec(
                "GPU backbone: this build has no GPU support (build with --features cuda)".into(),
            )),
        }
    }

    /// Run a continuous batch on this thread (see [`super::run_batch`]),
    /// fetching on `handle`'s runtime; `tokenize` gives the driver this
    /// node's tokenizer for the requests it admits.
    pub fn run_batch(
        &mut self,
        handle: tokio::runtime::Handle,
        spec: &LoopSpec,
        driver: &mut dyn super::BatchDriver,
    ) -> Result<(), LoopError> {
        let clock = RealClock::start();
        let mut fetcher = RouterFetcher::new(
            handle,
            self.routers.to_vec(),
            clock.origin(),
            self.chunk_rows,
        );
        super::run_batch(
            &clock,
            &mut fetcher,
            self.fusion.as_mut(),
            &self.params,
            self.slots,
            spec,
            driver,
        )
    }

    /// A copy of this node's tokenizer, for a batch driver that admits
    /// requests while the loop runs.
    pub fn input_tokenizer(&self) -> InputTokenizer {
        InputTokenizer {
            pad: self.model.pad_token,
            tokenizer: self.tokenizer.clone(),
            map: self.map.clone(),
        }
    }

    #[allow(clippy::too_many_arguments)] // run's arguments plus its clock
    fn run_with<C: super::clock::Clock>(
        &mut self,
        clock: &C,
        origin: std::time::Instant,
        handle: tokio::runtime::Handle,
        tokens: &Tokens,
        spec: &LoopSpec,
        stop: &AtomicBool,
        on_step: &mut dyn FnMut(&StepRecord) -> std::io::Result<()>,
    ) -> Result<Summary, LoopError> {
        let mut fetcher =
            RouterFetcher::new(handle, self.routers.to_vec(), origin, self.chunk_rows);
        super::run(
            clock,
            &mut fetcher,
            self.fusion.as_mut(),
            &self.params,
            self.slots,
            tokens,
            spec,
            stop,
            on_step,
        )
    }
}

/// The node's tokenizer, apart from the node (a batch driver admits
/// requests as text or ids while the loop runs).
#[derive(Clone)]
pub struct InputTokenizer {
    pad: u32,
    tokenizer: Option<(Tokenizer, TokenMap)>,
    map: Option<TokenMap>,
}

impl std::fmt::Debug for InputTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InputTokenizer")
            .field("pad", &self.pad)
            .field("tokenizer", &self.tokenizer.is_some())
            .field("map", &self.map.is_some())
            .finish()
    }
}

impl InputTokenizer {
    /// As [`NodeModel::tokens`].
    pub fn tokens(&self, input: &InputChoice, min_len: usize) -> Result<Tokens, SetupError> {
        tokens_of(self.pad, &self.tokenizer, &self.map, input, min_len)
    }
}

/// `input`'s tokens with `pad`, through the tokenizer or map `[model]`
/// names, repeated until there are at least `min_len`.
fn tokens_of(
    pad: u32,
    tokenizer: &Option<(Tokenizer, TokenMap)>,
    map: &Option<TokenMap>,
    input: &InputChoice,
    min_len: usize,
) -> Result<Tokens, SetupError> {
    let from_text = |text: &str, origin: String| -> Result<Tokens, InputError> {
        match &tokenizer {
            Some((tok, map)) => input::tokenize(tok, map, text, pad, origin),
            None if map.is_some() => Err(InputError::Tokenizer(
                "the config's token map has no tokenizer to read text with: give --ids FILE, or set [model] tokenizer".into(),
            )),
            None => {
                let tok = input::word_tokenizer(text)?;
                let map = TokenMap::from_tokenizer(&tok)?;
                input::tokenize(&tok, &map, text, pad, format!("{origin} (built-in word tokenizer)"))
            }
        }
    };
    let mut t = match input {
        InputChoice::Builtin => from_text(input::BUILTIN_TEXT, "the built-in text".into())?,
        InputChoice::Text(p) => from_text(&input::read_text(p)?, p.display().to_string())?,
        InputChoice::InlineText(text) => from_text(text, "the request's text".into())?,
        InputChoice::Ids(_) | InputChoice::InlineIds(_) => {
            let (raw, origin) = match input {
                InputChoice::Ids(p) => (input::read_ids(p)?, p.display().to_string()),
                InputChoice::InlineIds(ids) => (ids.clone(), "the request's ids".to_string()),
                _ => return Err(SetupError::Config("unreachable input kind".into())),
            };
            match (&tokenizer, &map) {
                (Some((_, map)), _) | (None, Some(map)) => input::compress(map, raw, pad, origin)?,
                (None, None) => {
                    // No map: the ids are compressed ids already.
                    let compressed = raw.iter().map(|&i| i64::from(i)).collect();
                    Tokens {
                        raw,
                        compressed,
                        pad: i64::from(pad),
                        origin,
                    }
                }
            }
        }
    };
    let n = t.raw.len();
    let min_len = min_len.min(input::MAX_TOKENS);
    while t.raw.len() < min_len {
        let k = (min_len - t.raw.len()).min(n);
        t.raw.extend_from_within(..k);
        t.compressed.extend_from_within(..k);
    }
    Ok(t)
}

/// The tables node `node` routes for Engram layers 1 and 14, each sized as
/// `params` (the config's `[model]` hashing) addresses it.
pub(crate) fn layer_tables(
    config: &Config,
    node: &Node,
    model: &Model,
    params: &HashParams,
) -> Result<[u32; 2], SetupError> {
    let cfg = |s: String| SetupError::Config(s);
    let name = &node.name;
    if model.family != cluster_config::model::Family::DeepseekV41 {
        return Err(cfg(format!(
            "{}: [model] family = {:?}: this loop and V4.1's memory (engram_rack.Memory, engram_open) run DeepSeek V4.1's model; \
             this rack's model runs in `inference-node run` and `inference-node serve`, its rows in `inference-node canary`, and an engine opens \
             its tables with `engram_rack.Tables` (or `inference-node engines`), its rings at the tables' row size (docs/models.md)",
            config.path.display(),
            model.family.name()
        )));
    }
    let mut table_of = [None, None];
    for (slot, lh) in table_of.iter_mut().zip(&params.layers) {
        let t = node
            .routes
            .iter()
            .filter_map(|r| config.table(r.table))
            .find(|t| t.layer == lh.layer)
            .ok_or_else(|| {
                cfg(format!(
                    "node {name:?} routes no table of layer {}: the model needs layers 1 and 14",
                    lh.layer
                ))
            })?;
        if t.rows != lh.rows {
            return Err(cfg(format!(
                "table {} (layer {}) has {} rows but the hashing ({}) addresses {}: \
                 generate it with `memory-donor gen --hash-base {}` or set [model] to the table's hashing",
                t.id,
                t.layer,
                t.rows,
                model
                    .hashing
                    .name()
                    .map_or_else(|| format!("base {}", model.hashing.base()), str::to_string),
                lh.rows,
                model.hashing.base(),
            )));
        }
        *slot = Some(t.id);
    }
    match table_of {
        [Some(t1), Some(t14)] => Ok([t1, t14]),
        _ => Err(cfg("the model needs both Engram layers".into())),
    }
}

/// The token map `[model]` names: from its tokenizer (kept, to tokenize
/// text), from a map file, or none (ids are compressed ids already).
pub(crate) type LoadedMap = (Option<(Tokenizer, TokenMap)>, Option<TokenMap>);

/// Load the token map `[model]` names, checking its size.
pub(crate) fn token_map(model: &Model) -> Result<LoadedMap, SetupError> {
    Ok(match &model.token_map {
        TokenMapSource::Tokenizer(p) => {
            let tok = load_tokenizer(p).map_err(InputError::from)?;
            let map = TokenMap::from_tokenizer(&tok).map_err(InputError::from)?;
            if let Some(n) = model.compressed_vocab {
                map.check_size(n).map_err(InputError::from)?;
            }
            (Some((tok, map)), None)
        }
        TokenMapSource::Map(p) => {
            let map = TokenMap::load(p).map_err(InputError::from)?;
            if let Some(n) = model.compressed_vocab {
                map.check_size(n).map_err(InputError::from)?;
            }
            (None, Some(map))
        }
        TokenMapSource::None => (None, None),
    })
}

/// What a reload changes of a node's pace, `(tokens/s, prefill budget)`
/// from `old` to `new`, said after `changes`.
pub(crate) fn pace_changes(changes: &mut String, old: (f64, usize), new: (f64, usize)) {
    if new.0 != old.0 {
        changes.push_str(&format!("; tokens/s {} -> {}", old.0, new.0));
    }
    if new.1 != old.1 {
        changes.push_str(&format!("; prefill budget {} -> {}", old.1, new.1));
    }
}

/// A token rate asked for on the command line, checked.
pub(crate) fn checked_rate(r: f64) -> Result<f64, SetupError> {
    if r.is_finite() && r > 0.0 && r <= 100_000.0 {
        Ok(r)
    } else {
        Err(SetupError::Config(format!(
            "{r} tokens/s is not a rate (0 < rate <= 100000)"
        )))
    }
}

/// Refuse to start when a table has no source it could use now.
pub(crate) fn usable_at_start(
    routers: &[Arc<Router>],
    slots: &[TableSlot],
) -> Result<(), SetupError> {
    for (r, s) in routers.iter().zip(slots) {
        let sources = r.sources();
        if !sources.iter().any(|h| h.admissible(s.table)) {
            let why = if sources.is_empty() {
                "no source configured".to_string()
            } else {
                sources
                    .iter()
                    .map(|h| format!("{}: {}", h.source.name(), h.why_not(s.table)))
                    .collect::<Vec<_>>()
                    .join("; ")
            };
            return Err(SetupError::NoSource {
                table: s.table,
                layer: s.layer,
                why,
            });
        }
    }
    Ok(())
}

/// Most rows one message asks for: the smallest frame cap of the rack's
/// donors (a wider fetch is cut into messages of this many, sent together).
pub(crate) fn chunk_rows(config: &Config) -> usize {
    config
        .donors
        .iter()
        .map(|d| d.max_rows as usize)
        .min()
        .unwrap_or(engram_protocol::frame::DEFAULT_MAX_ROWS as usize)
        .max(24)
}

/// The fusion backend `model` asks for, with its weights (a seed's, or a
/// checkpoint's read off the runtime's threads).
async fn fusion_of(config: &Config, model: &Model) -> Result<Box<dyn Fusion>, SetupError> {
    let shape = FusionShape::new(model.hidden as usize, model.streams as usize)
        .map_err(|e| SetupError::Fusion(e.to_string()))?;
    let weights = match &model.weights {
        None => {
            return Err(SetupError::Config(format!(
                "{}: the model loop fuses, so [model] needs fusion weights: \
                 `weights = \"CHECKPOINT\"` or `weights_seed = N`",
                config.path.display()
            )));
        }
        Some(WeightsSource::Seed(s)) => FusionWeights::from_seed(*s, shape),
        Some(WeightsSource::Checkpoint(p)) => {
            let p = p.clone();
            tokio::task::spawn_blocking(move || FusionWeights::from_checkpoint(&p, shape))
                .await
                .map_err(|e| SetupError::Fusion(e.to_string()))?
                .map_err(|e| SetupError::Fusion(e.to_string()))?
        }
    };
    backend(model.fusion, Arc::new(weights)).map_err(|e| SetupError::Fusion(e.to_string()))
}
