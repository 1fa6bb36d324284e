//! The token-paced model loop: the node's stand-in for the GPU model, with
//! the real Engram path inside it.
//!
//! One step (a token, or a batch of them) runs:
//! 1. map and hash its positions (both Engram layers, every sequence);
//! 2. start both tables' fetches (one message per table: every position's
//!    rows, deduplicated; a wide prefill is a sweep of chunks striped across
//!    the table's replicas, [`fetch::fetch_rows`]);
//! 3. run the 40 blocks of the backbone on an absolute schedule, block `b`
//!    ending at `start + (b + 1) W / 40` plus the stalls so far (`W`: the
//!    step time at the target rate; on the CPU a precise wait, see
//!    [`clock`]); block 1 waits for layer 1's rows and block 14 for
//!    layer 14's, and the wait past the block's start is the step's stall
//!    from that table: a late table costs its overshoot, the blocks already
//!    computed stay computed;
//! 4. fuse the rows into each position's hidden state (CPU or GPU) as its
//!    block runs, inside that block's budget (work past the step's end is
//!    reported as overrun);
//! 5. checksum each position's fused state (two runs over the same input
//!    compare token by token), and write the step's trace record.
//!
//! The hidden state a position starts from is a deterministic function of
//! its raw token id, so a position's fused output depends only on its token
//! and the three before it, whichever way the positions are grouped into
//! steps (prefill, batch, speculation); tests hold the loop to that.

pub mod clock;
mod config_json;
pub mod ngram;
pub(crate) use config_json::check as check_config_json;
pub use summary::deployment;
pub mod fetch;
#[cfg(feature = "cuda")]
pub mod gpu_clock;
pub mod input;
pub mod node;
mod step;
pub mod summary;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use engram_protocol::hashing::{HashError, HashParams};
use engram_protocol::synthetic::SplitMix64;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::engram::fusion::{Fusion, FusionError};
use clock::Clock;
pub use input::Tokens;
pub use step::SeqSpec;
pub use summary::Summary;

/// Blocks of one V4.1 step.
pub const BLOCKS: u32 = cluster_config::MODEL_BLOCKS;

/// One Engram table as the loop uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableSlot {
    /// Table id in the config.
    pub table: u32,
    /// Engram layer (1 or 14); its block waits for the rows.
    pub layer: u32,
    /// Its window in blocks (seed 000: 1 for layer 1, 13 for layer 14).
    pub window_blocks: u32,
    /// Bytes per row (264 for V4.1's; a Qwen4Exp table's encoding's).
    pub row_bytes: usize,
}

/// The two V4.1 slots for tables `t1` (layer 1) and `t14` (layer 14).
pub fn v41_slots(t1: u32, t14: u32) -> [TableSlot; 2] {
    let layers = cluster_config::V41_ENGRAM_LAYERS;
    let slot = |table, layer| TableSlot {
        table,
        layer,
        window_blocks: cluster_config::window_blocks(layer, layers),
        row_bytes: engram_protocol::ROW_BYTES,
    };
    [slot(t1, layers[0]), slot(t14, layers[1])]
}

/// How the loop runs.
#[derive(Debug, Clone)]
pub struct LoopSpec {
    /// The target step rate (one step per `1 / rate` seconds without stalls).
    pub tokens_per_second: f64,
    /// Stop after this many decoded positions (`None`: at the input's end).
    pub max_tokens: Option<u64>,
    /// Sequences decoding together (the input is cut into this many parts).
    pub batch: usize,
    /// Positions of each sequence fetched and fused in one prefill step first.
    pub prefill: usize,
    /// Draft positions verified with each decoded position (their rows are
    /// fetched in the same message: `(k + 1) x 24` rows per table).
    pub speculate: usize,
    /// Seed of the stand-in hidden states.
    pub hidden_seed: u64,
    /// A draft model's stand-in before each verification (with
    /// `speculate` > 0): its drafts appear one by one, and their rows may be
    /// fetched as each appears.
    pub draft: Option<Draft>,
    /// Prefill positions a step takes, in all, while other sequences are
    /// decoding: a sequence that joins a running batch prefills in chunks
    /// of this many, so the decoders keep their step time (0: no limit).
    /// With nobody decoding a prefill runs whole in one step.
    pub prefill_budget: usize,
    /// How long before each step the loop wakes the path to its rows
    /// ([`Fetcher::warm`]): the node's I/O thread polls instead of
    /// sleeping from then until the step's rows are in, and each table's
    /// first donor gets a Ping. Zero: off.
    pub warm_lead: Duration,
}

/// Default [`LoopSpec::warm_lead`]: 300 us, longer than a sleeping thread
/// takes to wake on a virtual machine, far shorter than a step.
pub const DEFAULT_WARM_LEAD: Duration = Duration::from_micros(300);

/// Default [`LoopSpec::prefill_budget`] (and the node's `prefill_budget`):
/// 256 positions (6,144 rows per table, about 1.6 MB) beside the decoders'
/// rows in a step.
pub const DEFAULT_PREFILL_BUDGET: usize = cluster_config::DEFAULT_PREFILL_BUDGET;

/// The draft stand-in of a speculative step: the `k` draft positions of a
/// verification appear one every `per_token` (draft `j` at `j x per_token`
/// after the step starts; the verification pass starts with the last).
/// A draft is the input's next token, except that each is wrong with
/// probability `reject_percent` (drawn from the run's seed, the sequence
/// and the position, so runs repeat): the pass then rejects it and every
/// draft after it, their rows fetched and fused for nothing, and the
/// sequence goes on from the rejected position with the right token. The
/// outputs kept are therefore the same whatever the timing and the
/// rejections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draft {
    /// Time the draft model takes per draft token.
    pub per_token: Duration,
    /// Fetch each position's rows as soon as it exists (the known position
    /// at the step's start, each draft when drafted), instead of all of
    /// them when the verification pass starts.
    pub prefetch: bool,
    /// Chance (0 to 100 %) that a draft is wrong.
    pub reject_percent: u8,
}

/// The longest a draft token may take.
pub const MAX_DRAFT_TIME: Duration = Duration::from_secs(1);

impl Default for LoopSpec {
    fn default() -> Self {
        Self {
            tokens_per_second: 100.0,
            max_tokens: None,
            batch: 1,
            prefill: 0,
            speculate: 0,
            hidden_seed: 0x5eed,
            draft: None,
            warm_lead: DEFAULT_WARM_LEAD,
            prefill_budget: DEFAULT_PREFILL_BUDGET,
        }
    }
}

/// Most sequences one batch holds.
pub const MAX_BATCH: usize = 1024;
/// Most draft positions per verification.
pub const MAX_SPECULATE: usize = 64;

/// Why the loop could not run.
#[derive(Debug, Error)]
pub enum LoopError {
    /// The spec is not usable.
    #[error("{0}")]
    Spec(String),
    /// A token id the hashing refuses.
    #[error("sequence {seq}, position {index}: {error}")]
    Hash {
        /// The sequence's tag.
        seq: usize,
        /// Index of the position in the sequence.
        index: usize,
        /// Why the hashing refuses it.
        error: HashError,
    },
    /// Fusion failed (a row that does not decode, a GPU error).
    #[error("step {step}: fusion: {error}")]
    Fusion {
        /// The step that failed.
        step: u64,
        /// Why fusion failed.
        error: FusionError,
    },
    /// A fetch did not hold the rows its positions need (a fetcher bug:
    /// no row is ever stood in for another).
    #[error("step {step}: {what}")]
    Rows {
        /// The step whose fetch fell short.
        step: u64,
        /// What the fetch lacked.
        what: String,
    },
    /// The trace could not be written.
    #[error("writing the trace: {0}")]
    Trace(#[from] std::io::Error),
}

/// What a fetch of one table's rows came to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fetch {
    /// The rows, in the order asked (`rows.len() * 264` bytes).
    pub bytes: Vec<u8>,
    /// When the last of them were ready, on the loop's clock.
    pub ready: Duration,
    /// Sources that answered, in order of first use (`zeros`: by policy).
    pub sources: Vec<std::sync::Arc<str>>,
    /// Messages sent (more than one only for a wide prefill).
    pub messages: u32,
    /// Hedges sent.
    pub hedges: u32,
    /// Failovers.
    pub failovers: u32,
    /// Whether any answer came after its deadline.
    pub late: bool,
    /// Whether any part was answered with zeros by policy.
    pub zeros: bool,
    /// Why the fetch failed (its rows are then unusable).
    pub error: Option<String>,
    /// Where its time went, for a fetcher that can tell (the node's
    /// routers): when it was asked for and when a runtime thread first
    /// ran it, on the loop's clock. The loop adds when it saw the rows.
    pub asked: Option<Duration>,
    /// When a runtime thread first ran the fetch, on the loop's clock.
    pub picked: Option<Duration>,
}

impl Fetch {
    /// Empty it for another fetch, keeping its buffers' memory.
    pub fn reset(&mut self) {
        let (mut bytes, mut sources) = (
            std::mem::take(&mut self.bytes),
            std::mem::take(&mut self.sources),
        );
        bytes.clear();
        sources.clear();
        *self = Self {
            bytes,
            sources,
            ..Self::default()
        };
    }
}

/// Where the loop's rows come from.
pub trait Fetcher {
    /// A fetch in flight.
    type Pending;
    /// Start fetching `rows` (distinct row ids) of `slot`'s table now:
    /// one message where they fit in one (a step's rows, up to the frame
    /// cap), or a sweep striped across the replicas (`sweep`: a prefill,
    /// and anything past the cap).
    fn start(&mut self, slot: usize, rows: &[u64], sweep: bool) -> Self::Pending;
    /// Wait for a fetch to end.
    fn wait(&mut self, pending: Self::Pending) -> Fetch;
    /// A fetch of `slot`'s table the loop is done with: its buffers may
    /// serve a later fetch (no allocation per step). Default: dropped.
    fn recycle(&mut self, slot: usize, f: Fetch) {
        let _ = (slot, f);
    }
    /// The next fetches start in about `lead`: wake the path to their
    /// rows now, so that no thread on it sleeps when they are asked for.
    /// Default: nothing.
    fn warm(&mut self, lead: Duration) {
        let _ = lead;
    }
}

/// One position of a step in the trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PositionRecord {
    /// Sequence.
    pub seq: u32,
    /// Position in its sequence.
    pub index: u32,
    /// Raw token id.
    pub id: u32,
    /// Checksum of its fused hidden state (hex; equal across runs and modes
    /// exactly when the fused outputs are bit-identical).
    pub checksum: Checksum,
}

/// A fused state's checksum ([`checksum`]): the first 8 bytes of the
/// BLAKE3 of its f32 bytes, written as 16 hex digits (a plain value: a
/// step's records allocate nothing for it).
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Checksum(pub [u8; 8]);

impl Checksum {
    /// Its 16 hex digits, as ASCII.
    pub fn hex(&self) -> [u8; 16] {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 16];
        for (i, b) in self.0.iter().enumerate() {
            out[2 * i] = DIGITS[usize::from(b >> 4)];
            out[2 * i + 1] = DIGITS[usize::from(b & 15)];
        }
        out
    }
}

impl std::fmt::Display for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hex = self.hex();
        // 16 ASCII hex digits.
        f.write_str(std::str::from_utf8(&hex).unwrap_or_default())
    }
}

impl std::fmt::Debug for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

impl std::str::FromStr for Checksum {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not a checksum (16 hex digits)");
        if s.len() != 16 || !s.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 8];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(out))
    }
}

impl Serialize for Checksum {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let hex = self.hex();
        s.serialize_str(std::str::from_utf8(&hex).unwrap_or_default())
    }
}

impl<'de> Deserialize<'de> for Checksum {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// One table of a step in the trace. Times are microseconds from the step's start.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TableRecord {
    /// Table id.
    pub table: u32,
    /// Engram layer.
    pub layer: u32,
    /// Rows the positions need.
    pub rows: usize,
    /// Distinct rows fetched.
    pub unique_rows: usize,
    /// Messages sent.
    pub messages: u32,
    /// The table's window (seed 000).
    pub window_us: f64,
    /// When its rows were ready.
    pub ready_us: f64,
    /// How long its block waited for them.
    pub stall_us: f64,
    /// Which source served it (`a+b` when a wide fetch used several;
    /// `zeros` by policy; null when it failed).
    pub source: Option<String>,
    /// Hedges sent.
    pub hedges: u32,
    /// Failovers.
    pub failovers: u32,
    /// Answered after the router's deadline.
    pub late: bool,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Where the fetch's time went, microseconds ([`Hops`]); absent where
    /// the fetcher does not tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hops: Option<Hops>,
}

/// A fetch's time, hop by hop: from the loop asking to a runtime thread
/// taking the task up (`to_io`: the wake-up of a sleeping I/O thread),
/// from there to the rows being in (`round_trip`: the request written,
/// the source's work and the answer read), and from then to the loop
/// having them (`to_loop`: counted only while the loop was already
/// waiting; rows in before their block cost nothing here).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Hops {
    /// From the loop asking to a runtime thread taking the task up, in microseconds.
    pub to_io_us: f64,
    /// From then to the rows being in, in microseconds.
    pub round_trip_us: f64,
    /// From then to the loop having them, in microseconds.
    pub to_loop_us: f64,
}

/// One step (token) in the trace: one JSON line of `inference-node run
/// --trace`, read back by reports (`engram-bench demo`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Step index.
    pub step: u64,
    /// `prefill`, `decode` or `verify` (decode with draft positions).
    pub kind: StepKind,
    /// Start, in microseconds from the run's start (with a draft stand-in:
    /// of the verification pass, after the drafts).
    pub start_us: f64,
    /// Time the draft stand-in took before the pass (0 without one).
    #[serde(default)]
    pub draft_us: f64,
    /// Target step time `W`.
    pub w_us: f64,
    /// Both tables.
    pub tables: Vec<TableRecord>,
    /// Total stall.
    pub stall_us: f64,
    /// Time past `W + stall` (compute that did not fit its blocks).
    pub overrun_us: f64,
    /// Time the step took (the drafts' time included).
    pub time_us: f64,
    /// Time spent fusing.
    pub fusion_us: f64,
    /// The positions kept (a rejected draft's are not).
    pub positions: Vec<PositionRecord>,
    /// Draft positions verified and rejected (with the drafts after a
    /// rejected one).
    #[serde(default)]
    pub rejected: u64,
    /// Bytes of rows fetched for rejected positions only.
    #[serde(default)]
    pub wasted_bytes: u64,
    /// Of `positions`, those prefilled (a joining sequence's prefill chunk
    /// beside decoding ones; all of them in a prefill step).
    #[serde(default)]
    pub prefilled: u64,
}

/// What a step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    /// Many positions of each sequence fetched and fused in one sweep.
    Prefill,
    /// One position per sequence.
    #[default]
    Decode,
    /// A position and its draft positions, verified together.
    Verify,
}

impl StepKind {
    /// As the trace spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Verify => "verify",
        }
    }
}

impl StepRecord {
    /// Count this step in the model loop's /metrics series (decode steps
    /// only; prefill is not a token's cost).
    pub fn count_in(&self, series: &mut crate::metrics::ModelSeries) {
        if self.kind == StepKind::Prefill {
            return;
        }
        // A joining sequence's prefill chunk may share a decode step.
        let decoded = (self.positions.len() as u64).saturating_sub(self.prefilled);
        series.step(decoded, self.stall_us / 1e6);
        for t in self.tables.iter().filter(|t| t.error.is_none()) {
            series.table(
                t.table,
                t.unique_rows as u64,
                t.ready_us,
                t.stall_us,
                t.source.as_deref(),
            );
        }
    }

    /// Decoded positions in it (none for prefill).
    pub fn decoded(&self) -> usize {
        if self.kind == StepKind::Prefill {
            0
        } else {
            self.positions.len()
        }
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The stand-in hidden state of a position with raw id `id`: S*H values
/// in [-1, 1), a pure function of (seed, id).
pub fn initial_state(seed: u64, id: u32, out: &mut [f32]) {
    let mut rng = SplitMix64::new(seed ^ (u64::from(id) << 20) ^ 0x9e37_79b9);
    for v in out {
        *v = ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
    }
}

/// Checksum of a fused state: BLAKE3 of its f32 bytes, first 8 bytes.
pub fn checksum(state: &[f32]) -> Checksum {
    let mut h = blake3::Hasher::new();
    for v in state {
        h.update(&v.to_le_bytes());
    }
    let b = h.finalize();
    let mut out = [0u8; 8];
    out.copy_from_slice(&b.as_bytes()[..8]);
    Checksum(out)
}

/// Run the loop over `tokens`; `on_step` gets each step's record (the
/// trace and status lines); `stop` ends the run after the current step.
#[allow(clippy::too_many_arguments)] // the loop's whole context, each used once
pub fn run<C: Clock, F: Fetcher>(
    clock: &C,
    fetcher: &mut F,
    fusion: &mut dyn Fusion,
    params: &HashParams,
    slots: [TableSlot; 2],
    tokens: &Tokens,
    spec: &LoopSpec,
    stop: &AtomicBool,
    on_step: &mut dyn FnMut(&StepRecord) -> std::io::Result<()>,
) -> Result<Summary, LoopError> {
    check_spec(spec, tokens, &slots)?;
    let mut lp = step::TokenLoop::new(clock, fetcher, fusion, params, slots, spec);
    let shared = std::sync::Arc::new(tokens.clone());
    for (s, range) in step::split(tokens.raw.len(), spec.batch)
        .into_iter()
        .enumerate()
    {
        lp.admit(SeqSpec {
            tag: s as u64,
            tokens: shared.clone(),
            range,
            prefill: spec.prefill,
            speculate: spec.speculate,
            limit: None,
        })?;
    }
    let mut summary = Summary::new(spec, &slots, lp.w);
    // One record, written over by each step (its buffers reused).
    let mut rec = StepRecord::default();
    while !stop.load(Ordering::Relaxed) && lp.step(&mut rec)? {
        summary.add(&rec);
        on_step(&rec)?;
    }
    summary.finish(clock.now());
    Ok(summary)
}

/// What a continuous batch does between its steps (the node daemon's
/// requests joining and leaving).
pub trait BatchDriver {
    /// Sequences that join before the next step; `running` are in the
    /// loop now. The batch ends when none are running and none join.
    fn admit(&mut self, running: usize) -> Vec<SeqSpec>;
    /// Sequences that leave before the next step, unfinished (their
    /// caller went away).
    fn cancelled(&mut self) -> Vec<u64>;
    /// A step ran (`Some`: every sequence's positions in one record), or
    /// none could; `finished` are the tags of the sequences that ended
    /// with it (their last positions are in the record).
    fn after_step(&mut self, rec: Option<&StepRecord>, finished: &[u64]);
}

/// Run a continuous batch: before each step `driver` admits sequences,
/// after it learns which finished; one message per table per step for
/// every sequence in the batch. `spec` gives the rate, hidden seed and
/// draft stand-in; each sequence brings its own prefill, speculation and
/// limit (`spec.max_tokens` and `spec.batch` are not used).
#[allow(clippy::too_many_arguments)] // the loop's whole context, each used once
pub fn run_batch<C: Clock, F: Fetcher>(
    clock: &C,
    fetcher: &mut F,
    fusion: &mut dyn Fusion,
    params: &HashParams,
    slots: [TableSlot; 2],
    spec: &LoopSpec,
    driver: &mut dyn BatchDriver,
) -> Result<(), LoopError> {
    let spec = LoopSpec {
        max_tokens: None,
        batch: 1,
        ..spec.clone()
    };
    check_spec(
        &spec,
        &Tokens {
            raw: vec![0],
            compressed: vec![0],
            pad: 0,
            origin: String::new(),
        },
        &slots,
    )?;
    let mut lp = step::TokenLoop::new(clock, fetcher, fusion, params, slots, &spec);
    drive(&mut lp, driver)
}

/// A loop that runs a continuous batch: sequences join and leave between
/// its steps (V4.1's [`step::TokenLoop`], Qwen4Exp's [`ngram`] loop).
pub(crate) trait Batched {
    /// Sequences in the loop, finished ones included until [`Batched::retire`].
    fn running(&self) -> usize;
    /// A sequence joins at the next step.
    fn admit(&mut self, s: SeqSpec) -> Result<(), LoopError>;
    /// Take sequence `tag` out, finished or not.
    fn remove(&mut self, tag: u64);
    /// Run the next step, its record written over `rec`; `false` when no
    /// position was left to run.
    fn step(&mut self, rec: &mut StepRecord) -> Result<bool, LoopError>;
    /// Take the finished sequences out; their tags.
    fn retire(&mut self) -> Vec<u64>;
}

/// Take the sequences `done` says are finished out of `seqs`; their tags.
pub(crate) fn retire<S>(seqs: &mut Vec<S>, done: fn(&S) -> bool, tag: fn(&S) -> u64) -> Vec<u64> {
    let out = seqs.iter().filter(|s| done(s)).map(tag).collect();
    seqs.retain(|s| !done(s));
    out
}

/// Step `lp` while `driver` has sequences for it: before each step the
/// driver's cancellations and admissions, after it the record and the
/// sequences that finished.
fn drive(lp: &mut dyn Batched, driver: &mut dyn BatchDriver) -> Result<(), LoopError> {
    let mut rec = StepRecord::default();
    loop {
        for tag in driver.cancelled() {
            lp.remove(tag);
        }
        let running = lp.running();
        for s in driver.admit(running) {
            if s.speculate > MAX_SPECULATE {
                return Err(LoopError::Spec(format!(
                    "speculation {} is over {MAX_SPECULATE}",
                    s.speculate
                )));
            }
            lp.admit(s)?;
        }
        if lp.running() == 0 {
            return Ok(());
        }
        let ran = lp.step(&mut rec)?;
        let finished = lp.retire();
        if !ran && lp.running() > 0 {
            return Err(LoopError::Spec(
                "a step had no position to run while sequences were unfinished".into(),
            ));
        }
        driver.after_step(ran.then_some(&rec), &finished);
    }
}

/// Refuse a spec the loop cannot run.
fn check_spec(spec: &LoopSpec, tokens: &Tokens, slots: &[TableSlot; 2]) -> Result<(), LoopError> {
    if !(spec.tokens_per_second.is_finite() && spec.tokens_per_second > 0.0) {
        return Err(LoopError::Spec(format!(
            "a rate of {} tokens/s is not usable",
            spec.tokens_per_second
        )));
    }
    if !(1..=MAX_BATCH).contains(&spec.batch) || spec.speculate > MAX_SPECULATE {
        return Err(LoopError::Spec(format!(
            "batch must be 1..={MAX_BATCH} and speculation 0..={MAX_SPECULATE}"
        )));
    }
    if tokens.raw.len() < spec.batch {
        return Err(LoopError::Spec(format!(
            "{} tokens cannot make {} sequences",
            tokens.raw.len(),
            spec.batch
        )));
    }
    if let Some(d) = spec.draft {
        if spec.speculate == 0 {
            return Err(LoopError::Spec(
                "a draft stand-in needs speculation (--speculate 1 or more)".into(),
            ));
        }
        if d.per_token > MAX_DRAFT_TIME {
            return Err(LoopError::Spec(format!(
                "a draft token of {:?} is over the limit of {MAX_DRAFT_TIME:?}",
                d.per_token
            )));
        }
        if d.reject_percent > 100 {
            return Err(LoopError::Spec(format!(
                "a draft rejection rate of {}% is over 100%",
                d.reject_percent
            )));
        }
    }
    if let Some(s) = slots.iter().find(|s| !(1..BLOCKS).contains(&s.layer)) {
        return Err(LoopError::Spec(format!("layer {} has no block", s.layer)));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
