//! One step of the model loop, in the order the module header lists:
//! [`Loop::hash`] (1), [`Loop::start_fetches`] (2), [`Loop::blocks`] with
//! [`Loop::table_block`] for each Engram layer (3-4), and
//! [`Loop::record`] (5). [`Loop::step`] runs them; `run` in the parent
//! module checks the spec, steps until the input or the stop flag ends, and
//! keeps the summary.

use std::ops::Range;
use std::time::Duration;

use engram_protocol::ROW_BYTES;
use engram_protocol::hashing::{COLUMNS, HashParams, PositionRows, SequenceHasher};

use super::clock::Clock;
use super::{
    BLOCKS, Fetch, Fetcher, LoopError, LoopSpec, PositionRecord, StepKind, StepRecord, TableRecord,
    TableSlot, Tokens, checksum, initial_state, us,
};
use crate::engram::fusion::{Fusion, POSITION_ROW_BYTES};

/// A position waiting for its step.
#[derive(Debug, Clone, Copy)]
struct Work {
    seq: u32,
    index: u32,
    raw: u32,
    rows: Option<PositionRows>,
}

/// A step's fetches: the distinct rows of each table (sorted), the fetch
/// of each in flight, and how many rows the positions need per table.
struct StepFetches<P> {
    unique: [Vec<u64>; 2],
    pending: [Option<P>; 2],
    needed: usize,
}

/// The loop between steps: where each sequence is, and buffers reused.
pub(super) struct Loop<'a, C, F> {
    pub(super) clock: &'a C,
    pub(super) fetcher: &'a mut F,
    pub(super) fusion: &'a mut dyn Fusion,
    pub(super) slots: [TableSlot; 2],
    pub(super) tokens: &'a Tokens,
    pub(super) spec: &'a LoopSpec,
    /// The step time at the target rate.
    pub(super) w: Duration,
    seqs: Vec<Range<usize>>,
    hashers: Vec<SequenceHasher<'a>>,
    /// Next position of each sequence.
    next: Vec<usize>,
    decoded: u64,
    step: u64,
    state_len: usize,
    hidden: Vec<f32>,
    rowbuf: Vec<u8>,
    live: Vec<bool>,
}

/// Cut `n` tokens into `batch` contiguous sequences of equal length.
fn split(n: usize, batch: usize) -> Vec<Range<usize>> {
    let len = n / batch;
    (0..batch).map(|i| i * len..(i + 1) * len).collect()
}

impl<'a, C: Clock, F: Fetcher> Loop<'a, C, F> {
    /// A loop at its first step (the spec already checked).
    #[allow(clippy::too_many_arguments)] // the loop's whole context, each kept
    pub(super) fn new(
        clock: &'a C,
        fetcher: &'a mut F,
        fusion: &'a mut dyn Fusion,
        params: &'a HashParams,
        slots: [TableSlot; 2],
        tokens: &'a Tokens,
        spec: &'a LoopSpec,
    ) -> Result<Self, LoopError> {
        let seqs = split(tokens.raw.len(), spec.batch);
        let hashers = seqs
            .iter()
            .map(|_| SequenceHasher::new(params, tokens.pad))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| LoopError::Hash {
                seq: 0,
                index: 0,
                error,
            })?;
        let state_len = fusion.shape().state_len();
        Ok(Self {
            clock,
            fetcher,
            fusion,
            slots,
            tokens,
            spec,
            w: Duration::from_secs_f64(1.0 / spec.tokens_per_second),
            next: vec![0; seqs.len()],
            seqs,
            hashers,
            decoded: 0,
            step: 0,
            state_len,
            hidden: Vec::new(),
            rowbuf: Vec::new(),
            live: Vec::new(),
        })
    }

    /// Run the next step; `None` once the input (or `max_tokens`) is done.
    pub(super) fn step(&mut self) -> Result<Option<StepRecord>, LoopError> {
        let prefill = self.step == 0 && self.spec.prefill > 0;
        let Some(take) = self.positions_per_sequence(prefill) else {
            return Ok(None);
        };
        let t0 = self.clock.now();
        let work = self.hash(take, prefill)?;
        if work.is_empty() {
            return Ok(None);
        }
        let fetches = self.start_fetches(&work);
        self.start_states(&work);
        let (tables, stall, fusion_time) = self.blocks(t0, &work, fetches)?;
        let end = t0 + self.w + stall;
        self.clock.sleep_until(end);
        let done = self.clock.now();
        let rec = StepRecord {
            step: self.step,
            kind: if prefill {
                StepKind::Prefill
            } else if self.spec.speculate > 0 {
                StepKind::Verify
            } else {
                StepKind::Decode
            },
            start_us: us(t0),
            w_us: us(self.w),
            tables,
            stall_us: us(stall),
            overrun_us: us(done.saturating_sub(end)),
            time_us: us(done - t0),
            fusion_us: us(fusion_time),
            positions: self.record(&work),
        };
        self.decoded += rec.decoded() as u64;
        self.step += 1;
        Ok(Some(rec))
    }

    /// Positions per sequence this step: the prefill's, or one plus the
    /// drafts (the last step takes what is left of `max_tokens`, spread
    /// over the batch); `None` when `max_tokens` are decoded.
    fn positions_per_sequence(&self, prefill: bool) -> Option<usize> {
        if prefill {
            return Some(self.spec.prefill);
        }
        let take = self.spec.speculate + 1;
        match self.spec.max_tokens {
            None => Some(take),
            Some(max) => {
                let left = max.saturating_sub(self.decoded);
                (left > 0).then(|| take.min(left.div_ceil(self.seqs.len() as u64) as usize))
            }
        }
    }

    /// 1. Map and hash up to `take` positions of each sequence.
    fn hash(&mut self, take: usize, prefill: bool) -> Result<Vec<Work>, LoopError> {
        let mut work = Vec::new();
        for (s, range) in self.seqs.iter().enumerate() {
            let mut n = take;
            if let Some(max) = self.spec.max_tokens.filter(|_| !prefill) {
                n = n.min(max.saturating_sub(self.decoded + work.len() as u64) as usize);
            }
            for _ in 0..n {
                let i = range.start + self.next[s];
                if i >= range.end {
                    break;
                }
                let mut rows = [[0u64; COLUMNS]; 2];
                let live = self.hashers[s]
                    .push(self.tokens.compressed[i], &mut rows)
                    .map_err(|error| LoopError::Hash {
                        seq: s,
                        index: self.next[s],
                        error,
                    })?;
                work.push(Work {
                    seq: s as u32,
                    index: self.next[s] as u32,
                    raw: self.tokens.raw[i],
                    rows: live.then_some(rows),
                });
                self.next[s] += 1;
            }
        }
        Ok(work)
    }

    /// 2. Start both fetches: each table's distinct rows, one message.
    fn start_fetches(&mut self, work: &[Work]) -> StepFetches<F::Pending> {
        let mut unique: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
        for (l, u) in unique.iter_mut().enumerate() {
            u.extend(work.iter().filter_map(|p| p.rows).flat_map(|r| r[l]));
            u.sort_unstable();
            u.dedup();
        }
        let mut pending = [None, None];
        for (l, p) in pending.iter_mut().enumerate() {
            if !unique[l].is_empty() {
                *p = Some(self.fetcher.start(l, unique[l].clone()));
            }
        }
        StepFetches {
            unique,
            pending,
            needed: work.iter().filter(|p| p.rows.is_some()).count() * COLUMNS,
        }
    }

    /// Each position's hidden state before fusion, and which ones are live.
    fn start_states(&mut self, work: &[Work]) {
        let n = self.state_len;
        self.hidden.resize(work.len() * n, 0.0);
        for (p, wk) in work.iter().enumerate() {
            initial_state(
                self.spec.hidden_seed,
                wk.raw,
                &mut self.hidden[p * n..(p + 1) * n],
            );
        }
        self.live.clear();
        self.live.extend(work.iter().map(|p| p.rows.is_some()));
    }

    /// 3-4. The blocks, each table waited for at its layer's block: the
    /// tables' records, the total stall and the time spent fusing.
    fn blocks(
        &mut self,
        t0: Duration,
        work: &[Work],
        mut fetches: StepFetches<F::Pending>,
    ) -> Result<(Vec<TableRecord>, Duration, Duration), LoopError> {
        let mut stall = Duration::ZERO;
        let mut fusion_time = Duration::ZERO;
        let mut records = Vec::with_capacity(2);
        for l in 0..self.slots.len() {
            let pending = fetches.pending[l].take();
            let (rec, this_stall, fused) =
                self.table_block(l, t0, stall, work, &fetches, pending)?;
            stall += this_stall;
            fusion_time += fused;
            records.push(rec);
        }
        Ok((records, stall, fusion_time))
    }

    /// The block of table `l`'s layer: wait for its rows, fuse them. Its
    /// record, its stall and the time fusing took.
    fn table_block(
        &mut self,
        l: usize,
        t0: Duration,
        stall_before: Duration,
        work: &[Work],
        fetches: &StepFetches<F::Pending>,
        pending: Option<F::Pending>,
    ) -> Result<(TableRecord, Duration, Duration), LoopError> {
        let slot = self.slots[l];
        let block_start = t0 + self.w * slot.layer / BLOCKS + stall_before;
        self.clock.sleep_until(block_start);
        let f = match pending {
            Some(p) => {
                let f = self.fetcher.wait(p);
                self.clock.sleep_until(f.ready);
                f
            }
            None => Fetch {
                ready: t0,
                ..Fetch::default()
            },
        };
        // The stall is how long the block would wait for the rows on the
        // model's schedule (its start, pushed back by the stalls before
        // it). The loop thread's own lateness (waking up, fusing) is not
        // stall: later blocks absorb it, or it shows as overrun at the
        // step's end.
        let stall = f.ready.saturating_sub(block_start);
        let fused_from = self.clock.now();
        if f.error.is_none() && self.live.iter().any(|&x| x) {
            gather(&mut self.rowbuf, work, l, &fetches.unique[l], &f, self.step)?;
            if !f.zeros {
                self.fusion
                    .fuse(slot.layer, &self.rowbuf, &self.live, &mut self.hidden)
                    .map_err(|error| LoopError::Fusion {
                        step: self.step,
                        error,
                    })?;
            }
        }
        let fused = self.clock.now().saturating_sub(fused_from);
        let rec = TableRecord {
            table: slot.table,
            layer: slot.layer,
            rows: fetches.needed,
            unique_rows: fetches.unique[l].len(),
            messages: f.messages,
            window_us: us(cluster_config::window(self.w, slot.window_blocks)),
            ready_us: us(f.ready.saturating_sub(t0)),
            stall_us: us(stall),
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
            error: f.error,
        };
        Ok((rec, stall, fused))
    }

    /// 5. Each position's checksum of its fused state.
    fn record(&self, work: &[Work]) -> Vec<PositionRecord> {
        let n = self.state_len;
        work.iter()
            .enumerate()
            .map(|(p, wk)| PositionRecord {
                seq: wk.seq,
                index: wk.index,
                id: wk.raw,
                checksum: checksum(&self.hidden[p * n..(p + 1) * n]),
            })
            .collect()
    }
}

/// Lay out table `l`'s rows position by position (24 per live position,
/// in column order) from the fetched distinct rows `unique` (sorted) into
/// `rowbuf`. A row the fetch does not hold is an error, never a stand-in.
fn gather(
    rowbuf: &mut Vec<u8>,
    work: &[Work],
    l: usize,
    unique: &[u64],
    f: &Fetch,
    step: u64,
) -> Result<(), LoopError> {
    if f.bytes.len() != unique.len() * ROW_BYTES {
        return Err(LoopError::Rows {
            step,
            what: format!(
                "the fetch returned {} bytes for {} rows",
                f.bytes.len(),
                unique.len()
            ),
        });
    }
    rowbuf.clear();
    rowbuf.resize(work.len() * POSITION_ROW_BYTES, 0);
    for (p, wk) in work.iter().enumerate() {
        let Some(rows) = wk.rows else { continue };
        for (c, r) in rows[l].iter().enumerate() {
            let k = unique.binary_search(r).map_err(|_| LoopError::Rows {
                step,
                what: format!("row {r} of position {p} was not fetched"),
            })?;
            let dst = p * POSITION_ROW_BYTES + c * ROW_BYTES;
            rowbuf[dst..dst + ROW_BYTES]
                .copy_from_slice(&f.bytes[k * ROW_BYTES..(k + 1) * ROW_BYTES]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_missing_from_the_fetch_is_an_error_not_row_zero() {
        let rows = [[5u64; COLUMNS], [9u64; COLUMNS]];
        let work = [Work {
            seq: 0,
            index: 0,
            raw: 1,
            rows: Some(rows),
        }];
        let f = Fetch {
            bytes: vec![7u8; ROW_BYTES],
            ..Fetch::default()
        };
        let mut buf = Vec::new();
        gather(&mut buf, &work, 0, &[5], &f, 3).expect("row 5 was fetched");
        assert!(buf.iter().all(|&b| b == 7));
        let e = gather(&mut buf, &work, 1, &[5], &f, 3).expect_err("row 9 was not");
        assert!(e.to_string().contains("row 9 of position 0"), "{e}");
        let short = Fetch {
            bytes: vec![7u8; 3],
            ..Fetch::default()
        };
        let e = gather(&mut buf, &work, 0, &[5], &short, 3).expect_err("short");
        assert!(e.to_string().contains("3 bytes for 1 rows"), "{e}");
    }
}
