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

use std::time::Duration;

use engram_protocol::encoding::RowEncoding;
use engram_protocol::qwen4exp::Qwen4ExpHashing;
use engram_protocol::row::f32_to_bf16_bits;
use engram_protocol::synthetic::SplitMix64;

use super::clock::Clock;
use super::{
    BLOCKS, Fetcher, LoopError, LoopSpec, MAX_BATCH, PositionRecord, StepKind, StepRecord, Summary,
    TableRecord, TableSlot, checksum, initial_state, us,
};
use crate::engram::FusionError;
use crate::engram::ple::{PleError, PleLayer, PleState};

/// A Qwen4Exp model as the loop runs it: its hashing, its table's rows and
/// its PLE layer's parameters.
#[derive(Debug, Clone)]
pub struct NgramModel {
    hashing: Qwen4ExpHashing,
    ple: PleLayer,
    /// `kv_proj`: `[C + H][heads x values]`, bf16 bits.
    kv_proj: Vec<u16>,
    encoding: RowEncoding,
    scale: f32,
    slot: TableSlot,
}

/// The convolution of Qwen4Exp's PLE layer: kernel 4, dilation the
/// n-gram size (3).
const KERNEL: usize = 4;
/// RMSNorm's epsilon.
const EPS: f32 = 1e-6;

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
        let c = h
            .checked_mul(streams)
            .filter(|&c| c > 0 && c <= 1 << 16)
            .ok_or_else(|| PleError(format!("{streams} streams of {h} channels")))?;
        let d = hashing.heads() * encoding.values();
        let mut g = SplitMix64::new(seed ^ 0x51e5_7a11);
        let mut draw = |n: usize, amp: f32| -> Vec<u16> {
            (0..n)
                .map(|_| {
                    let u = (g.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                    f32_to_bf16_bits((u * 2.0 - 1.0) * amp)
                })
                .collect()
        };
        let (nk, nq, nc) = (draw(c, 0.1), draw(c, 0.1), draw(c, 0.1));
        let conv = draw(c * KERNEL, 0.5);
        let kv_proj = draw((c + h) * d, 1.0 / (d as f32).sqrt());
        let dilation = hashing.config.ngram_size;
        let ple = PleLayer::new(h, streams, KERNEL, dilation, EPS, &nk, &nq, &nc, &conv)?;
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

    /// Fuse `n` positions of one sequence: their rows (`n x heads` rows of
    /// the table's encoding, in the order of their ids) and raw ids, its
    /// state carried; each position's output checksum into `out`.
    fn fuse(
        &self,
        state: &mut PleState,
        rows: &[u8],
        ids: &[u32],
        hidden_seed: u64,
        out: &mut Vec<super::Checksum>,
    ) -> Result<(), FusionError> {
        let emb = PleLayer::embed(self.encoding, rows, self.scale)?;
        let (key, value) = self.ple.project(&emb, &self.kv_proj)?;
        let c = self.ple.channels();
        let mut h32 = vec![0f32; c];
        let mut hidden = Vec::with_capacity(ids.len() * c);
        for &id in ids {
            initial_state(hidden_seed, id, &mut h32);
            hidden.extend(h32.iter().map(|&v| f32_to_bf16_bits(v)));
        }
        let o = self.ple.forward(state, &key, &value, &hidden)?;
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
    /// Its number in position records.
    tag: u32,
    range: std::ops::Range<usize>,
    next: usize,
    state: PleState,
    /// Its positions this step: `next..next + n`.
    n: usize,
    /// Where its row ids start in the step's list.
    ids_at: usize,
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
    let w = Duration::from_secs_f64(1.0 / spec.tokens_per_second);
    let slot = model.slot;
    let mut seqs: Vec<Seq> = super::step::split(raw.len(), spec.batch)
        .into_iter()
        .enumerate()
        .map(|(tag, range)| Seq {
            tag: tag as u32,
            range,
            next: 0,
            state: PleState::default(),
            n: 0,
            ids_at: 0,
        })
        .collect();
    let ctx: Vec<i64> = raw.iter().map(|&t| i64::from(t)).collect();
    let mut summary = Summary::new(spec, &[slot], w);
    let (mut ids, mut unique, mut rowbuf) = (Vec::new(), Vec::new(), Vec::new());
    let mut rec = StepRecord::default();
    let (mut step, mut decoded) = (0u64, 0u64);
    let size = model.encoding.row_bytes();
    let heads = model.rows_per_token();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        // 1. This step's positions and their rows.
        let first = step == 0 && spec.prefill > 0;
        ids.clear();
        let mut positions = 0;
        for s in &mut seqs {
            let left = s.range.len() - s.next;
            let room = spec
                .max_tokens
                .map_or(usize::MAX, |m| m.saturating_sub(decoded) as usize);
            s.n = if first {
                spec.prefill.min(left)
            } else {
                left.min(1).min(room)
            };
            s.ids_at = ids.len();
            if s.n == 0 {
                continue;
            }
            let at = s.range.start + s.next;
            let got = model
                .hashing
                .ids(&ctx[s.range.start..at], &ctx[at..at + s.n])
                .map_err(|e| LoopError::Spec(format!("position {at}: {e}")))?;
            ids.extend_from_slice(&got);
            positions += s.n;
        }
        if positions == 0 {
            break;
        }
        if !first {
            decoded += seqs.iter().filter(|s| s.n > 0).count() as u64;
        }
        unique.clear();
        unique.extend_from_slice(&ids);
        unique.sort_unstable();
        unique.dedup();
        // 2. The fetch, then 3. the blocks up to the PLE layer's.
        if !spec.warm_lead.is_zero() {
            fetcher.warm(spec.warm_lead);
        }
        let t0 = clock.now();
        let pending = fetcher.start(0, &unique, first);
        let block_start = t0 + w * slot.layer / BLOCKS;
        clock.sleep_until(block_start);
        let mut f = fetcher.wait(pending);
        clock.sleep_until(f.ready);
        let stall = f.ready.saturating_sub(block_start);
        // 4. Fusion, sequence by sequence (each carries its state).
        let fused_from = clock.now();
        rec.positions.clear();
        let mut sums = Vec::with_capacity(positions);
        for s in &mut seqs {
            if s.n == 0 {
                continue;
            }
            let at = s.range.start + s.next;
            let mine = &ids[s.ids_at..s.ids_at + s.n * heads];
            rowbuf.clear();
            if f.error.is_none() {
                for id in mine {
                    let i = unique.binary_search(id).map_err(|_| LoopError::Rows {
                        step,
                        what: format!("row {id} was not fetched"),
                    })?;
                    let row =
                        f.bytes
                            .get(i * size..(i + 1) * size)
                            .ok_or_else(|| LoopError::Rows {
                                step,
                                what: format!("{} bytes for {} rows", f.bytes.len(), unique.len()),
                            })?;
                    rowbuf.extend_from_slice(row);
                }
            } else {
                // No rows: fused as zero rows (what policy `zeros` serves),
                // so that the sequence's convolution state stays in step
                // with its positions.
                rowbuf.resize(mine.len() * size, 0);
            }
            sums.clear();
            model
                .fuse(
                    &mut s.state,
                    &rowbuf,
                    &raw[at..at + s.n],
                    spec.hidden_seed,
                    &mut sums,
                )
                .map_err(|error| LoopError::Fusion { step, error })?;
            for (k, sum) in sums.iter().enumerate() {
                rec.positions.push(PositionRecord {
                    seq: s.tag,
                    index: (s.next + k) as u32,
                    id: raw[at + k],
                    checksum: *sum,
                });
            }
            s.next += s.n;
        }
        let fused = clock.now().saturating_sub(fused_from);
        // The blocks after the PLE layer's, then 5. the record.
        let end = t0 + w + stall;
        clock.sleep_until(end);
        let now = clock.now();
        rec.step = step;
        rec.kind = if first {
            StepKind::Prefill
        } else {
            StepKind::Decode
        };
        rec.start_us = us(t0);
        rec.draft_us = 0.0;
        rec.w_us = us(w);
        rec.tables.resize_with(1, TableRecord::default);
        let needed = ids.len();
        super::step::fill_record(
            &mut rec.tables[0],
            slot,
            (w, t0, stall),
            (needed, unique.len()),
            None,
            &mut f,
        );
        fetcher.recycle(0, f);
        rec.stall_us = us(stall);
        rec.overrun_us = us(now.saturating_sub(end));
        rec.time_us = us(now.saturating_sub(t0));
        rec.fusion_us = us(fused);
        rec.rejected = 0;
        rec.wasted_bytes = 0;
        rec.prefilled = if first { positions as u64 } else { 0 };
        summary.add(&rec);
        on_step(&rec)?;
        step += 1;
        if spec.max_tokens.is_some_and(|m| decoded >= m) {
            break;
        }
    }
    summary.finish(clock.now());
    Ok(summary)
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
        return Err(LoopError::Spec(
            "speculation and draft stand-ins run in DeepSeek V4.1's loop only (docs/models.md)"
                .into(),
        ));
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
