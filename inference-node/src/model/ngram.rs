//! The token loop of a Qwen4Exp model (`[model] family = "qwen4exp"`,
//! docs/models.md): one PLE n-gram table, 16 rows a token, and the PLE
//! fusion whose convolution carries each sequence's state from one step
//! to the next.
//!
//! One step runs, on the same schedule as V4.1's loop ([`super`]):
//! 1. hash each sequence's positions of the step (a prefill's first
//!    positions, then one a step) from their raw ids and the sequence's
//!    tokens before them (`engram_protocol::qwen4exp`: an EOS token starts
//!    a new n-gram window);
//! 2. start the table's fetch (its distinct rows, in one message; a
//!    prefill is a sweep);
//! 3. run the backbone's blocks to the PLE layer's, wait for the rows
//!    there (the wait past the block's start is the step's stall), and
//!    the rest of the step's blocks after;
//! 4. fuse: each position's rows dequantized into its n-gram embedding,
//!    `kv_proj`, the gate and the convolution over the sequence's last
//!    inputs ([`crate::engram::ple`]), its state kept for the next step (a
//!    failed fetch's positions are fused as zero rows, as policy `zeros`
//!    serves them, so the state stays in step; their outputs, and the next
//!    9 positions' through the convolution, differ from the model's);
//! 5. checksum each position's output and write the step's record, the
//!    same records and summary as V4.1's loop writes.
//!
//! A position's output depends on its sequence's tokens up to it alone,
//! however the positions are grouped into steps (prefill or decode, one
//! sequence or a batch): tests hold the loop to that.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use engram_protocol::encoding::RowEncoding;
use engram_protocol::qwen4exp::Qwen4ExpHashing;
use engram_protocol::row::f32_to_bf16_bits;

use super::clock::Clock;
use super::{
    BLOCKS, BatchDriver, Fetcher, LoopError, LoopSpec, MAX_BATCH, PositionRecord, SeqSpec,
    StepKind, StepRecord, Summary, TableRecord, TableSlot, Tokens, checksum, initial_state, us,
};
use crate::engram::FusionError;
use crate::engram::ple::{KvProj, PleError, PleLayer, PleState};
use crate::engram::weights::PleWeights;

/// A Qwen4Exp model as the loop runs it: its hashing, its table's rows and
/// its PLE layer's parameters.
#[derive(Debug, Clone)]
pub struct NgramModel {
    hashing: Qwen4ExpHashing,
    ple: PleLayer,
    /// `kv_proj` (`[C + H][heads x values]`), prepared.
    kv_proj: KvProj,
    encoding: RowEncoding,
    scale: f32,
    slot: TableSlot,
}

/// The convolution of Qwen4Exp's PLE layer: kernel 4 (`ple_conv_kernel_size`),
/// dilation the n-gram size (3).
pub const KERNEL: usize = 4;
/// RMSNorm's epsilon (`rms_norm_eps`).
pub const EPS: f32 = 1e-6;

impl NgramModel {
    /// The model whose table is `slot`'s (rows of `encoding`, table scale
    /// `scale`), hashed by `hashing`, with PLE parameters drawn from
    /// `seed` (`streams` streams of `h` channels): the stand-in for a
    /// checkpoint's, as V4.1's loop draws its fusion weights from
    /// `weights_seed`.
    pub fn synthetic(
        hashing: Qwen4ExpHashing,
        encoding: RowEncoding,
        scale: f32,
        slot: TableSlot,
        (h, streams): (usize, usize),
        seed: u64,
    ) -> Result<Self, FusionError> {
        let d = hashing.heads() * encoding.values();
        let weights = PleWeights::from_seed(seed, (h, streams), d, KERNEL)
            .map_err(|e| PleError(e.to_string()))?;
        Self::new(hashing, encoding, scale, slot, (h, streams), weights)
    }

    /// The model whose table is `slot`'s (rows of `encoding`, table scale
    /// `scale`), hashed by `hashing`, its PLE layer `streams` streams of
    /// `h` channels with `weights` (a checkpoint's: [`PleWeights::from_checkpoint`]).
    pub fn new(
        hashing: Qwen4ExpHashing,
        encoding: RowEncoding,
        scale: f32,
        slot: TableSlot,
        (h, streams): (usize, usize),
        weights: PleWeights,
    ) -> Result<Self, FusionError> {
        let dilation = hashing.config.ngram_size;
        let w = &weights;
        let ple = PleLayer::new(
            h,
            streams,
            KERNEL,
            dilation,
            EPS,
            &w.norm_key,
            &w.norm_query,
            &w.norm_conv,
            &w.conv,
        )?;
        let d = hashing.heads() * encoding.values();
        if w.kv_proj.len() != (ple.channels() + h) * d {
            return Err(PleError(format!(
                "kv_proj has {} values, not [{} + {h}] x {d}",
                w.kv_proj.len(),
                ple.channels()
            ))
            .into());
        }
        let kv_proj = KvProj::new(&weights.kv_proj, ple.channels() + h)?;
        Ok(Self {
            hashing,
            ple,
            kv_proj,
            encoding,
            scale,
            slot,
        })
    }

    /// The table the loop reads.
    pub fn slot(&self) -> TableSlot {
        self.slot
    }

    /// Rows a token needs.
    pub fn rows_per_token(&self) -> usize {
        self.hashing.heads()
    }

    /// The hashing.
    pub fn hashing(&self) -> &Qwen4ExpHashing {
        &self.hashing
    }

    /// Project positions' rows (`heads` rows of the table's encoding each,
    /// in the order of their ids; any sequences' positions together, as
    /// each position's projection is its own): their keys `[n][C]` and
    /// values `[n][H]`.
    fn project(&self, rows: &[u8]) -> Result<(Vec<u16>, Vec<u16>), FusionError> {
        let emb = PleLayer::embed(self.encoding, rows, self.scale)?;
        Ok(self.ple.project_with(&emb, &self.kv_proj)?)
    }

    /// Fuse `n` positions of one sequence from their keys and values
    /// ([`NgramModel::project`]) and raw ids, its state carried; each
    /// position's output checksum into `out`.
    fn fuse(
        &self,
        state: &mut PleState,
        (key, value): (&[u16], &[u16]),
        ids: &[u32],
        hidden_seed: u64,
        out: &mut Vec<super::Checksum>,
    ) -> Result<(), FusionError> {
        let c = self.ple.channels();
        let mut h32 = vec![0f32; c];
        let mut hidden = Vec::with_capacity(ids.len() * c);
        for &id in ids {
            initial_state(hidden_seed, id, &mut h32);
            hidden.extend(h32.iter().map(|&v| f32_to_bf16_bits(v)));
        }
        let o = self.ple.forward(state, key, value, &hidden)?;
        for t in o.out.chunks_exact(c) {
            let f: Vec<f32> = t
                .iter()
                .map(|&b| engram_protocol::row::bf16_bits_to_f32(b))
                .collect();
            out.push(checksum(&f));
        }
        Ok(())
    }
}

/// One sequence of the loop.
struct Seq {
    /// Its number in position records (the batch index for `run`, the
    /// request's for the daemon).
    tag: u64,
    tokens: Arc<Tokens>,
    range: Range<usize>,
    /// Next position (from `range.start`).
    next: usize,
    /// Positions prefilled before it decodes (in one step, or in chunks of
    /// the prefill budget beside decoding sequences).
    prefill: usize,
    /// Most positions it decodes (`None`: to its input's end).
    limit: Option<u64>,
    decoded: u64,
    state: PleState,
    /// Its positions this step: `next..next + n`.
    n: usize,
    /// Whether they are prefilled.
    prefilling: bool,
    /// Where its row ids start in the step's list.
    ids_at: usize,
}

impl Seq {
    fn prefilling(&self) -> bool {
        self.next < self.prefill
    }

    fn done(&self) -> bool {
        self.next >= self.range.len() || self.limit.is_some_and(|l| self.decoded >= l)
    }
}

/// The Qwen4Exp loop between steps: its sequences, each with its PLE
/// state, and buffers reused from step to step.
pub(super) struct NgramLoop<'a, C, F: Fetcher> {
    clock: &'a C,
    fetcher: &'a mut F,
    model: &'a NgramModel,
    spec: &'a LoopSpec,
    /// The step time at the target rate.
    w: Duration,
    seqs: Vec<Seq>,
    step: u64,
    decoded: u64,
    ids: Vec<u64>,
    unique: Vec<u64>,
    rowbuf: Vec<u8>,
    sums: Vec<super::Checksum>,
}

impl<'a, C: Clock, F: Fetcher> NgramLoop<'a, C, F> {
    /// A loop with no sequence yet (the spec already checked).
    pub(super) fn new(
        clock: &'a C,
        fetcher: &'a mut F,
        model: &'a NgramModel,
        spec: &'a LoopSpec,
    ) -> Self {
        Self {
            clock,
            fetcher,
            model,
            spec,
            w: Duration::from_secs_f64(1.0 / spec.tokens_per_second),
            seqs: Vec::new(),
            step: 0,
            decoded: 0,
            ids: Vec::new(),
            unique: Vec::new(),
            rowbuf: Vec::new(),
            sums: Vec::new(),
        }
    }

    /// This step's positions of each sequence: a prefilling one's prefill
    /// (whole, or what the prefill budget leaves while others decode),
    /// else one, within its limit and the run's `max_tokens`; their row
    /// ids into `self.ids`. The number of positions.
    fn plan(&mut self) -> Result<usize, LoopError> {
        self.ids.clear();
        let decoders = self.seqs.iter().any(|q| !q.prefilling() && !q.done());
        let mut budget = if decoders && self.spec.prefill_budget > 0 {
            self.spec.prefill_budget
        } else {
            usize::MAX
        };
        let mut room = self
            .spec
            .max_tokens
            .map_or(u64::MAX, |m| m.saturating_sub(self.decoded));
        let window = self.model.hashing.config.ngram_size.saturating_sub(1);
        let mut positions = 0;
        for s in &mut self.seqs {
            let left = s.range.len().saturating_sub(s.next);
            s.prefilling = s.prefilling();
            s.n = if s.prefilling {
                let n = (s.prefill - s.next).min(budget).min(left);
                budget -= n;
                n
            } else if s.done() || room == 0 {
                0
            } else {
                room -= 1;
                left.min(1)
            };
            s.ids_at = self.ids.len();
            if s.n == 0 {
                continue;
            }
            let at = s.range.start + s.next;
            // The hashing reads the last `window` tokens before `at`.
            let from = at.saturating_sub(window).max(s.range.start);
            let ctx = &s.tokens.compressed;
            let got = self
                .model
                .hashing
                .ids(&ctx[from..at], &ctx[at..at + s.n])
                .map_err(|e| LoopError::Spec(format!("position {at}: {e}")))?;
            self.ids.extend_from_slice(&got);
            positions += s.n;
        }
        Ok(positions)
    }

    /// Run the next step, its record written over `rec`; `false` when no
    /// sequence has a position left to run.
    pub(super) fn step(&mut self, rec: &mut StepRecord) -> Result<bool, LoopError> {
        // 1. This step's positions and their rows.
        let positions = self.plan()?;
        if positions == 0 {
            return Ok(false);
        }
        let step = self.step;
        let prefilled: usize = self.seqs.iter().filter(|s| s.prefilling).map(|s| s.n).sum();
        let sweep = prefilled == positions;
        self.unique.clear();
        self.unique.extend_from_slice(&self.ids);
        self.unique.sort_unstable();
        self.unique.dedup();
        // 2. The fetch, then 3. the blocks up to the PLE layer's.
        if !self.spec.warm_lead.is_zero() {
            self.fetcher.warm(self.spec.warm_lead);
        }
        let (clock, w, slot) = (self.clock, self.w, self.model.slot);
        let t0 = clock.now();
        let pending = self.fetcher.start(0, &self.unique, sweep);
        let block_start = t0 + w * slot.layer / BLOCKS;
        clock.sleep_until(block_start);
        let mut f = self.fetcher.wait(pending);
        clock.sleep_until(f.ready);
        let stall = f.ready.saturating_sub(block_start);
        // 4. Fusion: every position's rows projected together, then
        // sequence by sequence (each carries its state).
        let fused_from = clock.now();
        rec.positions.clear();
        let size = self.model.encoding.row_bytes();
        let heads = self.model.rows_per_token();
        self.rowbuf.clear();
        if f.error.is_none() {
            for id in &self.ids {
                let i = self.unique.binary_search(id).map_err(|_| LoopError::Rows {
                    step,
                    what: format!("row {id} was not fetched"),
                })?;
                let row = f
                    .bytes
                    .get(i * size..(i + 1) * size)
                    .ok_or_else(|| LoopError::Rows {
                        step,
                        what: format!("{} bytes for {} rows", f.bytes.len(), self.unique.len()),
                    })?;
                self.rowbuf.extend_from_slice(row);
            }
        } else {
            // No rows: fused as zero rows (what policy `zeros` serves), so
            // that each sequence's convolution state stays in step with its
            // positions.
            self.rowbuf.resize(self.ids.len() * size, 0);
        }
        let (key, value) = self
            .model
            .project(&self.rowbuf)
            .map_err(|error| LoopError::Fusion { step, error })?;
        // Each position's key is `C` values, its value `H` (positions > 0).
        let (c, h) = (key.len() / positions, value.len() / positions);
        for s in &mut self.seqs {
            if s.n == 0 {
                continue;
            }
            let at = s.range.start + s.next;
            let p0 = s.ids_at / heads;
            let mine = (&key[p0 * c..(p0 + s.n) * c], &value[p0 * h..(p0 + s.n) * h]);
            self.sums.clear();
            let raw = &s.tokens.raw[at..at + s.n];
            self.model
                .fuse(
                    &mut s.state,
                    mine,
                    raw,
                    self.spec.hidden_seed,
                    &mut self.sums,
                )
                .map_err(|error| LoopError::Fusion { step, error })?;
            for (k, sum) in self.sums.iter().enumerate() {
                rec.positions.push(PositionRecord {
                    seq: s.tag as u32,
                    index: (s.next + k) as u32,
                    id: raw[k],
                    checksum: *sum,
                });
            }
            s.next += s.n;
            if !s.prefilling {
                s.decoded += s.n as u64;
                self.decoded += s.n as u64;
            }
        }
        let fused = clock.now().saturating_sub(fused_from);
        // The blocks after the PLE layer's, then 5. the record.
        let end = t0 + w + stall;
        clock.sleep_until(end);
        let now = clock.now();
        rec.step = step;
        rec.kind = if sweep {
            StepKind::Prefill
        } else {
            StepKind::Decode
        };
        rec.start_us = us(t0);
        rec.draft_us = 0.0;
        rec.w_us = us(w);
        rec.tables.resize_with(1, TableRecord::default);
        super::step::fill_record(
            &mut rec.tables[0],
            slot,
            (w, t0, stall),
            (self.ids.len(), self.unique.len()),
            None,
            &mut f,
        );
        self.fetcher.recycle(0, f);
        rec.stall_us = us(stall);
        rec.overrun_us = us(now.saturating_sub(end));
        rec.time_us = us(now.saturating_sub(t0));
        rec.fusion_us = us(fused);
        rec.rejected = 0;
        rec.wasted_bytes = 0;
        rec.prefilled = prefilled as u64;
        self.step += 1;
        Ok(true)
    }
}

impl<C: Clock, F: Fetcher> super::Batched for NgramLoop<'_, C, F> {
    fn running(&self) -> usize {
        self.seqs.len()
    }

    /// A sequence joins at the next step, its PLE state fresh.
    fn admit(&mut self, s: SeqSpec) -> Result<(), LoopError> {
        if s.speculate > 0 {
            return Err(LoopError::Spec(SPECULATION.into()));
        }
        if s.range.end > s.tokens.raw.len().min(s.tokens.compressed.len()) {
            return Err(LoopError::Spec(format!(
                "positions {:?} of {} tokens",
                s.range,
                s.tokens.raw.len()
            )));
        }
        self.seqs.push(Seq {
            tag: s.tag,
            tokens: s.tokens,
            range: s.range,
            next: 0,
            prefill: s.prefill,
            limit: s.limit,
            decoded: 0,
            state: PleState::default(),
            n: 0,
            prefilling: false,
            ids_at: 0,
        });
        Ok(())
    }

    fn remove(&mut self, tag: u64) {
        self.seqs.retain(|s| s.tag != tag);
    }

    fn step(&mut self, rec: &mut StepRecord) -> Result<bool, LoopError> {
        NgramLoop::step(self, rec)
    }

    fn retire(&mut self) -> Vec<u64> {
        super::retire(&mut self.seqs, Seq::done, |s| s.tag)
    }
}

/// Why a Qwen4Exp sequence cannot speculate.
pub const SPECULATION: &str =
    "speculation and draft stand-ins run in DeepSeek V4.1's loop only (docs/models.md)";

/// `raw` (token ids below the hashing's vocabulary) as the loop's input:
/// the hashing reads raw ids, so the compressed ids are the raw ones.
pub fn raw_tokens(raw: Vec<u32>, origin: String) -> Tokens {
    Tokens {
        compressed: raw.iter().map(|&t| i64::from(t)).collect(),
        raw,
        pad: -1,
        origin,
    }
}

/// Run the Qwen4Exp loop over `raw` (token ids, below the hashing's
/// vocabulary) at `spec`'s rate, `spec.batch` sequences at once (the
/// input cut into as many), each prefilling `spec.prefill` positions in
/// its first step; `on_step` gets each step's record; `stop` ends the run
/// after the current step. Speculation and draft stand-ins are V4.1's
/// loop's alone.
pub fn run<C: Clock, F: Fetcher>(
    clock: &C,
    fetcher: &mut F,
    model: &NgramModel,
    raw: &[u32],
    spec: &LoopSpec,
    stop: &std::sync::atomic::AtomicBool,
    on_step: &mut dyn FnMut(&StepRecord) -> std::io::Result<()>,
) -> Result<Summary, LoopError> {
    check(spec, raw.len(), model)?;
    let tokens = Arc::new(raw_tokens(raw.to_vec(), String::new()));
    let mut lp = NgramLoop::new(clock, fetcher, model, spec);
    for (tag, range) in super::step::split(raw.len(), spec.batch)
        .into_iter()
        .enumerate()
    {
        super::Batched::admit(
            &mut lp,
            SeqSpec {
                tag: tag as u64,
                tokens: tokens.clone(),
                range,
                prefill: spec.prefill,
                speculate: 0,
                limit: None,
            },
        )?;
    }
    let mut summary = Summary::new(spec, &[model.slot], lp.w);
    let mut rec = StepRecord::default();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) && lp.step(&mut rec)? {
        summary.add(&rec);
        on_step(&rec)?;
    }
    summary.finish(clock.now());
    Ok(summary)
}

/// Run a continuous batch of Qwen4Exp sequences (see [`super::run_batch`]):
/// each joins with a fresh PLE state and its own prefill and limit.
pub fn run_batch<C: Clock, F: Fetcher>(
    clock: &C,
    fetcher: &mut F,
    model: &NgramModel,
    spec: &LoopSpec,
    driver: &mut dyn BatchDriver,
) -> Result<(), LoopError> {
    let spec = LoopSpec {
        max_tokens: None,
        batch: 1,
        ..spec.clone()
    };
    check(&spec, 1, model)?;
    let mut lp = NgramLoop::new(clock, fetcher, model, &spec);
    super::drive(&mut lp, driver)
}

/// Refuse a spec this loop cannot run.
fn check(spec: &LoopSpec, tokens: usize, model: &NgramModel) -> Result<(), LoopError> {
    if !(spec.tokens_per_second.is_finite() && spec.tokens_per_second > 0.0) {
        return Err(LoopError::Spec(format!(
            "a rate of {} tokens/s is not usable",
            spec.tokens_per_second
        )));
    }
    if !(1..=MAX_BATCH).contains(&spec.batch) {
        return Err(LoopError::Spec(format!("batch must be 1..={MAX_BATCH}")));
    }
    if spec.speculate > 0 || spec.draft.is_some() {
        return Err(LoopError::Spec(SPECULATION.into()));
    }
    if tokens < spec.batch {
        return Err(LoopError::Spec(format!(
            "{tokens} tokens cannot make {} sequences",
            spec.batch
        )));
    }
    if !(1..BLOCKS).contains(&model.slot.layer) {
        return Err(LoopError::Spec(format!(
            "layer {} has no block",
            model.slot.layer
        )));
    }
    Ok(())
}

pub mod node;
#[cfg(test)]
mod tests;
