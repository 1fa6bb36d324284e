//! The token-paced model loop: the node's stand-in for the GPU model, with
//! the real Engram path inside it.
//!
//! One step (a token, or a batch of them) runs:
//! 1. map and hash its positions (both Engram layers, every sequence);
//! 2. start both tables' fetches (one message per table: every position's
//!    rows, deduplicated; a wide prefill is cut into messages of at most
//!    the frame cap);
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
pub mod fetch;
#[cfg(feature = "cuda")]
pub mod gpu_clock;
pub mod input;
pub mod node;
pub mod summary;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use engram_protocol::ROW_BYTES;
use engram_protocol::hashing::{COLUMNS, HashError, HashParams, PositionRows, SequenceHasher};
use engram_protocol::synthetic::SplitMix64;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::engram::fusion::{Fusion, FusionError, POSITION_ROW_BYTES};
use clock::Clock;
pub use input::Tokens;
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
}

/// The two V4.1 slots for tables `t1` (layer 1) and `t14` (layer 14).
pub fn v41_slots(t1: u32, t14: u32) -> [TableSlot; 2] {
    [
        TableSlot {
            table: t1,
            layer: 1,
            window_blocks: 1,
        },
        TableSlot {
            table: t14,
            layer: 14,
            window_blocks: 13,
        },
    ]
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
}

impl Default for LoopSpec {
    fn default() -> Self {
        Self {
            tokens_per_second: 100.0,
            max_tokens: None,
            batch: 1,
            prefill: 0,
            speculate: 0,
            hidden_seed: 0x5eed,
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
        seq: usize,
        index: usize,
        error: HashError,
    },
    /// Fusion failed (a row that does not decode, a GPU error).
    #[error("step {step}: fusion: {error}")]
    Fusion { step: u64, error: FusionError },
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
    pub sources: Vec<String>,
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
}

/// Where the loop's rows come from.
pub trait Fetcher {
    /// A fetch in flight.
    type Pending;
    /// Start fetching `rows` (distinct row ids) of `slot`'s table now.
    fn start(&mut self, slot: usize, rows: Vec<u64>) -> Self::Pending;
    /// Wait for a fetch to end.
    fn wait(&mut self, pending: Self::Pending) -> Fetch;
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
    pub checksum: String,
}

/// One table of a step in the trace. Times are microseconds from the step's start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
}

/// One step (token) in the trace: one JSON line of `inference-node run
/// --trace`, read back by reports (`engram-bench demo`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Step index.
    pub step: u64,
    /// `prefill`, `decode` or `verify` (decode with draft positions).
    pub kind: StepKind,
    /// Start, in microseconds from the run's start.
    pub start_us: f64,
    /// Target step time `W`.
    pub w_us: f64,
    /// Both tables.
    pub tables: Vec<TableRecord>,
    /// Total stall.
    pub stall_us: f64,
    /// Time past `W + stall` (compute that did not fit its blocks).
    pub overrun_us: f64,
    /// Time the step took.
    pub time_us: f64,
    /// Time spent fusing.
    pub fusion_us: f64,
    /// The positions.
    pub positions: Vec<PositionRecord>,
}

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    /// Many positions of each sequence fetched and fused in one sweep.
    Prefill,
    /// One position per sequence.
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

/// Checksum of a fused state: BLAKE3 of its f32 bytes, first 8 bytes in hex.
pub fn checksum(state: &[f32]) -> String {
    let mut h = blake3::Hasher::new();
    for v in state {
        h.update(&v.to_le_bytes());
    }
    let b = h.finalize();
    b.as_bytes()[..8]
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// A position waiting for its step.
#[derive(Debug, Clone, Copy)]
struct Work {
    seq: u32,
    index: u32,
    raw: u32,
    rows: Option<PositionRows>,
}

/// Cut `n` tokens into `batch` contiguous sequences of equal length.
fn split(n: usize, batch: usize) -> Vec<std::ops::Range<usize>> {
    let len = n / batch;
    (0..batch).map(|i| i * len..(i + 1) * len).collect()
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
    for s in &slots {
        if !(1..BLOCKS).contains(&s.layer) {
            return Err(LoopError::Spec(format!("layer {} has no block", s.layer)));
        }
    }
    let w = Duration::from_secs_f64(1.0 / spec.tokens_per_second);
    let state_len = fusion.shape().state_len();
    let seqs = split(tokens.raw.len(), spec.batch);
    let mut hashers = seqs
        .iter()
        .map(|_| SequenceHasher::new(params, tokens.pad))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| LoopError::Hash {
            seq: 0,
            index: 0,
            error,
        })?;
    let mut next = vec![0usize; seqs.len()];
    let mut summary = Summary::new(spec, slots, w);
    let mut decoded = 0u64;
    let mut step = 0u64;
    let mut hidden: Vec<f32> = Vec::new();
    let mut rowbuf: Vec<u8> = Vec::new();
    let mut live: Vec<bool> = Vec::new();

    loop {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let prefill = step == 0 && spec.prefill > 0;
        let mut take = if prefill {
            spec.prefill
        } else {
            spec.speculate + 1
        };
        if !prefill && let Some(max) = spec.max_tokens {
            let left = max.saturating_sub(decoded);
            if left == 0 {
                break;
            }
            // The last step takes what is left, spread over the batch.
            take = take.min(left.div_ceil(seqs.len() as u64) as usize);
        }
        let t0 = clock.now();

        // 1. Map and hash.
        let mut work = Vec::new();
        for (s, range) in seqs.iter().enumerate() {
            let mut n = take;
            if let Some(max) = spec.max_tokens.filter(|_| !prefill) {
                n = n.min(max.saturating_sub(decoded + work.len() as u64) as usize);
            }
            for _ in 0..n {
                let i = range.start + next[s];
                if i >= range.end {
                    break;
                }
                let mut rows = [[0u64; COLUMNS]; 2];
                let live = hashers[s]
                    .push(tokens.compressed[i], &mut rows)
                    .map_err(|error| LoopError::Hash {
                        seq: s,
                        index: next[s],
                        error,
                    })?;
                work.push(Work {
                    seq: s as u32,
                    index: next[s] as u32,
                    raw: tokens.raw[i],
                    rows: live.then_some(rows),
                });
                next[s] += 1;
            }
        }
        if work.is_empty() {
            break;
        }

        // 2. Start both fetches (distinct rows, one message per table).
        let mut unique: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
        for (l, u) in unique.iter_mut().enumerate() {
            u.extend(work.iter().filter_map(|p| p.rows).flat_map(|r| r[l]));
            u.sort_unstable();
            u.dedup();
        }
        let needed = work.iter().filter(|p| p.rows.is_some()).count() * COLUMNS;
        let mut pending: [Option<F::Pending>; 2] = [None, None];
        for (l, p) in pending.iter_mut().enumerate() {
            if !unique[l].is_empty() {
                *p = Some(fetcher.start(l, unique[l].clone()));
            }
        }

        hidden.resize(work.len() * state_len, 0.0);
        for (p, wk) in work.iter().enumerate() {
            initial_state(
                spec.hidden_seed,
                wk.raw,
                &mut hidden[p * state_len..(p + 1) * state_len],
            );
        }
        live.clear();
        live.extend(work.iter().map(|p| p.rows.is_some()));

        // 3-4. The blocks, waiting for each table at its layer's block.
        let mut stall = Duration::ZERO;
        let mut fusion_time = Duration::ZERO;
        let mut records = Vec::with_capacity(2);
        for (l, slot) in slots.iter().enumerate() {
            let block_start = t0 + w * slot.layer / BLOCKS + stall;
            clock.sleep_until(block_start);
            let f = match pending[l].take() {
                Some(p) => {
                    let f = fetcher.wait(p);
                    clock.sleep_until(f.ready);
                    f
                }
                None => Fetch {
                    ready: t0,
                    ..Fetch::default()
                },
            };
            // The stall is how long the block would wait for the rows on
            // the model's schedule (its start, pushed back by the stalls
            // before it). The loop thread's own lateness (waking up,
            // fusing) is not stall: later blocks absorb it, or it shows as
            // overrun at the step's end.
            let this_stall = f.ready.saturating_sub(block_start);
            stall += this_stall;
            let fused_from = clock.now();
            let usable = f.error.is_none();
            if usable && live.iter().any(|&x| x) {
                rowbuf.clear();
                rowbuf.resize(work.len() * POSITION_ROW_BYTES, 0);
                for (p, wk) in work.iter().enumerate() {
                    let Some(rows) = wk.rows else { continue };
                    for (c, r) in rows[l].iter().enumerate() {
                        // Every row of a live position is in `unique[l]`.
                        let k = unique[l].binary_search(r).unwrap_or(0);
                        let dst = p * POSITION_ROW_BYTES + c * ROW_BYTES;
                        rowbuf[dst..dst + ROW_BYTES]
                            .copy_from_slice(&f.bytes[k * ROW_BYTES..(k + 1) * ROW_BYTES]);
                    }
                }
                if !f.zeros {
                    fusion
                        .fuse(slot.layer, &rowbuf, &live, &mut hidden)
                        .map_err(|error| LoopError::Fusion { step, error })?;
                }
            }
            fusion_time += clock.now().saturating_sub(fused_from);
            records.push(TableRecord {
                table: slot.table,
                layer: slot.layer,
                rows: needed,
                unique_rows: unique[l].len(),
                messages: f.messages,
                window_us: us(w * slot.window_blocks / BLOCKS),
                ready_us: us(f.ready.saturating_sub(t0)),
                stall_us: us(this_stall),
                source: if f.error.is_some() {
                    None
                } else if f.sources.is_empty() {
                    Some("none".into())
                } else {
                    Some(f.sources.join("+"))
                },
                hedges: f.hedges,
                failovers: f.failovers,
                late: f.late,
                error: f.error.clone(),
            });
        }
        let end = t0 + w + stall;
        clock.sleep_until(end);
        let done = clock.now();

        // 5. Checksums and the record.
        let positions = work
            .iter()
            .enumerate()
            .map(|(p, wk)| PositionRecord {
                seq: wk.seq,
                index: wk.index,
                id: wk.raw,
                checksum: checksum(&hidden[p * state_len..(p + 1) * state_len]),
            })
            .collect();
        let rec = StepRecord {
            step,
            kind: if prefill {
                StepKind::Prefill
            } else if spec.speculate > 0 {
                StepKind::Verify
            } else {
                StepKind::Decode
            },
            start_us: us(t0),
            w_us: us(w),
            tables: records,
            stall_us: us(stall),
            overrun_us: us(done.saturating_sub(end)),
            time_us: us(done - t0),
            fusion_us: us(fusion_time),
            positions,
        };
        decoded += rec.decoded() as u64;
        summary.add(&rec);
        on_step(&rec)?;
        step += 1;
    }
    summary.finish(clock.now());
    Ok(summary)
}

#[cfg(test)]
mod tests;
