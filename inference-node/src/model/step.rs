//! One step of the model loop, in the order the module header lists:
//! [`TokenLoop::hash`] (1), [`TokenLoop::start_fetches`] (2), [`TokenLoop::blocks`] with
//! [`TokenLoop::table_block`] for each Engram layer (3-4), and
//! [`TokenLoop::record`] (5). [`TokenLoop::step`] runs them; `run` in the parent
//! module checks the spec, steps until the input or the stop flag ends, and
//! keeps the summary.

use std::ops::Range;
use std::time::Duration;

use engram_protocol::ROW_BYTES;
use engram_protocol::hashing::{COLUMNS, HashParams, PositionRows, SequenceHasher};

use super::clock::Clock;
use super::{
    BLOCKS, Fetch, Fetcher, Hops, LoopError, LoopSpec, PositionRecord, StepKind, StepRecord,
    TableRecord, TableSlot, Tokens, checksum, initial_state, us,
};
use crate::engram::fusion::{Fusion, POSITION_ROW_BYTES};

/// A position waiting for its step.
#[derive(Debug, Clone, Copy)]
struct Work {
    seq: u32,
    index: u32,
    raw: u32,
    rows: Option<PositionRows>,
    /// Its place among its sequence's positions this step: 0 the known
    /// one (and every prefilled one), `j` the `j`-th draft.
    offset: u32,
    /// Prefilled (not decoded).
    prefill: bool,
    /// A wrong draft, or one after it: verified, then thrown away.
    rejected: bool,
    /// Its sequence's index in the loop this step.
    slot: usize,
}

/// One sequence in the loop: its input, where it is, and how it runs.
pub(crate) struct Seq<'a> {
    /// Its number in position records (the batch index for `run`, the
    /// request's for the daemon).
    pub(crate) tag: u64,
    tokens: std::sync::Arc<Tokens>,
    range: Range<usize>,
    hasher: SequenceHasher<'a>,
    /// Next position.
    next: usize,
    /// Positions fetched and fused in its first step.
    prefill: usize,
    /// Draft positions verified with each decoded one.
    speculate: usize,
    /// Most positions it decodes (`None`: to its input's end).
    limit: Option<u64>,
    /// Positions it decoded.
    decoded: u64,
}

impl Seq<'_> {
    /// Its prefill is not all fetched yet (it may take several steps
    /// beside decoding sequences).
    fn prefilling(&self) -> bool {
        self.next < self.prefill
    }

    /// Nothing left to fetch: its input's end or its limit reached.
    pub(crate) fn done(&self) -> bool {
        self.range.start + self.next >= self.range.end
            || self.limit.is_some_and(|l| self.decoded >= l)
    }
}

/// How a sequence joins the loop.
#[derive(Debug, Clone)]
pub struct SeqSpec {
    /// Its number in position records.
    pub tag: u64,
    /// Its input.
    pub tokens: std::sync::Arc<Tokens>,
    /// Which of the input's positions it runs.
    pub range: Range<usize>,
    /// Positions prefilled in its first step.
    pub prefill: usize,
    /// Draft positions per verification.
    pub speculate: usize,
    /// Most positions decoded.
    pub limit: Option<u64>,
}

/// A fetch in flight: the rows it asked for (sorted; kept only when a
/// table's rows come in several parts, draft prefetch's) and its handle.
struct Part<P> {
    rows: Option<Vec<u64>>,
    pending: P,
}

/// A step's fetches: the distinct rows of each table (sorted), the fetches
/// in flight for them (one, or one per position group with draft
/// prefetch), and how many rows the positions need per table. Its vectors
/// are the loop's, lent for the step and given back
/// ([`TokenLoop::put_back`]).
struct StepFetches<P> {
    unique: [Vec<u64>; 2],
    parts: [Vec<Part<P>>; 2],
    needed: usize,
    /// Whether table `l`'s one message asks its rows position by position
    /// (every position live, no row twice): its answer is then laid out as
    /// the fusion reads it, and is fused where it landed, without a gather.
    in_order: [bool; 2],
}

/// The loop between steps: where each sequence is, and buffers reused.
pub(super) struct TokenLoop<'a, C, F: Fetcher> {
    pub(super) clock: &'a C,
    pub(super) fetcher: &'a mut F,
    pub(super) fusion: &'a mut dyn Fusion,
    pub(super) slots: [TableSlot; 2],
    params: &'a HashParams,
    pub(super) spec: &'a LoopSpec,
    /// The step time at the target rate.
    pub(super) w: Duration,
    seqs: Vec<Seq<'a>>,
    decoded: u64,
    step: u64,
    state_len: usize,
    hidden: Vec<f32>,
    rowbuf: Vec<u8>,
    live: Vec<bool>,
    /// Buffers kept from step to step, so that a step in the steady state
    /// allocates nothing: its positions, each table's distinct rows and
    /// fetches in flight, and rows asked in the fusion's order.
    work: Vec<Work>,
    unique: [Vec<u64>; 2],
    parts: [Vec<Part<F::Pending>>; 2],
    ordered: Vec<u64>,
}

/// Cut `n` tokens into `batch` contiguous sequences of equal length.
pub(super) fn split(n: usize, batch: usize) -> Vec<Range<usize>> {
    let len = n / batch;
    (0..batch).map(|i| i * len..(i + 1) * len).collect()
}

impl<'a, C: Clock, F: Fetcher> TokenLoop<'a, C, F> {
    /// A loop with no sequence yet (the spec already checked).
    pub(super) fn new(
        clock: &'a C,
        fetcher: &'a mut F,
        fusion: &'a mut dyn Fusion,
        params: &'a HashParams,
        slots: [TableSlot; 2],
        spec: &'a LoopSpec,
    ) -> Self {
        let state_len = fusion.shape().state_len();
        Self {
            clock,
            fetcher,
            fusion,
            slots,
            params,
            spec,
            w: Duration::from_secs_f64(1.0 / spec.tokens_per_second),
            seqs: Vec::new(),
            decoded: 0,
            step: 0,
            state_len,
            hidden: Vec::new(),
            rowbuf: Vec::new(),
            live: Vec::new(),
            work: Vec::new(),
            unique: [Vec::new(), Vec::new()],
            parts: [Vec::new(), Vec::new()],
            ordered: Vec::new(),
        }
    }

    /// A sequence joins at the next step.
    pub(super) fn admit(&mut self, s: SeqSpec) -> Result<(), LoopError> {
        let hasher =
            SequenceHasher::new(self.params, s.tokens.pad).map_err(|error| LoopError::Hash {
                seq: s.tag as usize,
                index: 0,
                error,
            })?;
        self.seqs.push(Seq {
            tag: s.tag,
            tokens: s.tokens,
            range: s.range,
            hasher,
            next: 0,
            prefill: s.prefill,
            speculate: s.speculate,
            limit: s.limit,
            decoded: 0,
        });
        Ok(())
    }

    /// Run the next step, its record written over `rec` (whose buffers
    /// it reuses); `false` once the input (or `max_tokens`) is done.
    pub(super) fn step(&mut self, rec: &mut StepRecord) -> Result<bool, LoopError> {
        let Some(take) = self.decode_take() else {
            return Ok(false);
        };
        let mut work = std::mem::take(&mut self.work);
        let ran = self.step_with(take, &mut work, rec);
        self.work = work;
        ran
    }

    fn step_with(
        &mut self,
        take: usize,
        work: &mut Vec<Work>,
        rec: &mut StepRecord,
    ) -> Result<bool, LoopError> {
        let t0 = self.clock.now();
        self.hash(take, work)?;
        let work = &work[..];
        if work.is_empty() {
            return Ok(false);
        }
        let prefill = work.iter().all(|p| p.prefill);
        let drafts = work.iter().map(|p| p.offset).max().unwrap_or(0);
        let draft = self.spec.draft.filter(|_| drafts > 0);
        // The verification pass starts when the last draft exists.
        let pass = t0 + draft.map_or(Duration::ZERO, |d| d.per_token * drafts);
        let fetches = self.start_fetches(t0, work, draft, drafts);
        self.clock.sleep_until(pass);
        self.start_states(work);
        let blocks = self.blocks(pass, work, fetches, &mut rec.tables);
        let (stall, fusion_time) = blocks?;
        let end = pass + self.w + stall;
        let lead = self.spec.warm_lead;
        if !lead.is_zero() && end > lead {
            // The next step's rows are asked for at `end`.
            self.clock.sleep_until(end - lead);
            self.fetcher.warm(lead);
        }
        self.clock.sleep_until(end);
        let done = self.clock.now();
        rec.step = self.step;
        rec.kind = if prefill {
            StepKind::Prefill
        } else if work.iter().any(|p| p.offset > 0) || self.spec.speculate > 0 {
            StepKind::Verify
        } else {
            StepKind::Decode
        };
        rec.start_us = us(pass);
        rec.draft_us = us(pass - t0);
        rec.w_us = us(self.w);
        rec.stall_us = us(stall);
        rec.overrun_us = us(done.saturating_sub(end));
        rec.time_us = us(done - t0);
        rec.fusion_us = us(fusion_time);
        self.record(work, &mut rec.positions);
        rec.rejected = work.iter().filter(|p| p.rejected).count() as u64;
        rec.wasted_bytes = wasted_bytes(work);
        rec.prefilled = work.iter().filter(|p| p.prefill).count() as u64;
        for p in work {
            if !p.prefill && !p.rejected {
                self.decoded += 1;
                self.seqs[p.slot].decoded += 1;
            }
        }
        self.step += 1;
        Ok(true)
    }

    /// How many positions a decoding sequence may take this step under
    /// the run's `max_tokens` (what is left of it, spread over the
    /// sequences); `None` when `max_tokens` are decoded and no sequence
    /// still has its prefill to do.
    fn decode_take(&self) -> Option<usize> {
        let Some(max) = self.spec.max_tokens else {
            return Some(usize::MAX);
        };
        let left = max.saturating_sub(self.decoded);
        if left == 0 {
            return self.seqs.iter().any(Seq::prefilling).then_some(0);
        }
        let n = self.seqs.len().max(1) as u64;
        Some(usize::try_from(left.div_ceil(n)).unwrap_or(usize::MAX))
    }

    /// 1. Map and hash each sequence's positions this step: its prefill
    ///    (whole, or a chunk of the prefill budget while others decode),
    ///    else one plus its drafts (at most `take`, and what
    ///    is left of its limit and of the run's `max_tokens`).
    fn hash(&mut self, take: usize, work: &mut Vec<Work>) -> Result<(), LoopError> {
        work.clear();
        let mut decoding = 0u64;
        // Beside decoding sequences, prefills share a position budget.
        let decoders = self.seqs.iter().any(|q| !q.prefilling() && !q.done());
        let mut budget = if decoders && self.spec.prefill_budget > 0 {
            self.spec.prefill_budget
        } else {
            usize::MAX
        };
        for (slot, q) in self.seqs.iter_mut().enumerate() {
            let prefill = q.prefilling();
            let mut n = positions(q, self.spec, take, &mut budget, self.decoded + decoding);
            // Where the sequence goes on from when a draft is rejected: its
            // hasher before the wrong token, and that position.
            let mut resume = None;
            for offset in 0..n {
                let i = q.range.start + q.next;
                let wrong = !prefill
                    && offset > 0
                    && resume.is_none()
                    && self.spec.draft.is_some_and(|d| {
                        draft_is_wrong(self.spec.hidden_seed, q.tag, q.next, d.reject_percent)
                    });
                if wrong {
                    resume = Some((q.hasher.clone(), q.next));
                }
                let rejected = resume.is_some();
                let (id, raw) = if wrong {
                    // Another token: its rows are other rows.
                    let vocab = i64::from(self.params.vocab).max(2);
                    (
                        (q.tokens.compressed[i] + 1).rem_euclid(vocab),
                        q.tokens.raw[i].wrapping_add(1),
                    )
                } else {
                    (q.tokens.compressed[i], q.tokens.raw[i])
                };
                let mut rows = [[0u64; COLUMNS]; 2];
                let live = q
                    .hasher
                    .push(id, &mut rows)
                    .map_err(|error| LoopError::Hash {
                        seq: q.tag as usize,
                        index: q.next,
                        error,
                    })?;
                work.push(Work {
                    seq: q.tag as u32,
                    index: q.next as u32,
                    raw,
                    rows: live.then_some(rows),
                    offset: if prefill { 0 } else { offset as u32 },
                    prefill,
                    rejected,
                    slot,
                });
                q.next += 1;
            }
            if let Some((hasher, next)) = resume {
                n -= q.next - next;
                q.hasher = hasher;
                q.next = next;
            }
            if !prefill {
                decoding += n as u64;
            }
        }
        Ok(())
    }

    /// 2. Start both fetches: each table's distinct rows, one message, when
    ///    the step's last position exists (with a draft stand-in, `drafts`
    ///    tokens after `t0`). With draft prefetch, each position group's
    ///    rows instead, as soon as the group exists (the known positions at
    ///    `t0`, draft `j` at `j` draft times), less the rows asked already.
    fn start_fetches(
        &mut self,
        t0: Duration,
        work: &[Work],
        draft: Option<super::Draft>,
        drafts: u32,
    ) -> StepFetches<F::Pending> {
        let mut unique = std::mem::take(&mut self.unique);
        let mut parts = std::mem::take(&mut self.parts);
        for (l, u) in unique.iter_mut().enumerate() {
            rows_of(u, work, l, None);
        }
        let mut in_order = [false; 2];
        match draft {
            Some(d) if d.prefetch => {
                let mut asked: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
                for g in 0..=drafts {
                    self.clock.sleep_until(t0 + d.per_token * g);
                    for l in 0..2 {
                        let mut rows = Vec::new();
                        rows_of(&mut rows, work, l, Some(g));
                        rows.retain(|r| asked[l].binary_search(r).is_err());
                        if rows.is_empty() {
                            continue;
                        }
                        asked[l].extend_from_slice(&rows);
                        asked[l].sort_unstable();
                        let pending = self.fetcher.start(l, &rows, false);
                        parts[l].push(Part {
                            rows: Some(rows),
                            pending,
                        });
                    }
                }
            }
            _ => {
                if let Some(d) = draft {
                    self.clock.sleep_until(t0 + d.per_token * drafts);
                }
                let all_live = work.iter().all(|p| p.rows.is_some());
                // A prefill is a sweep; a step's rows are one message.
                let sweep = work.iter().all(|p| p.prefill);
                for (l, part) in parts.iter_mut().enumerate() {
                    if unique[l].is_empty() {
                        continue;
                    }
                    // Every row once: ask them in the fusion's order.
                    let rows = if all_live && unique[l].len() == work.len() * COLUMNS {
                        in_order[l] = true;
                        self.ordered.clear();
                        self.ordered
                            .extend(work.iter().filter_map(|p| p.rows).flat_map(|r| r[l]));
                        &self.ordered[..]
                    } else {
                        &unique[l][..]
                    };
                    let pending = self.fetcher.start(l, rows, sweep);
                    part.push(Part {
                        rows: None,
                        pending,
                    });
                }
            }
        }
        StepFetches {
            unique,
            parts,
            needed: work.iter().filter(|p| p.rows.is_some()).count() * COLUMNS,
            in_order,
        }
    }

    /// A step's vectors back to the loop, for the next step.
    fn put_back(&mut self, fetches: StepFetches<F::Pending>) {
        self.unique = fetches.unique;
        for (mine, mut lent) in self.parts.iter_mut().zip(fetches.parts) {
            lent.clear();
            *mine = lent;
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

    /// 3-4. The blocks, each table waited for at its layer's block, each
    /// table's record written over `records`' (their buffers reused): the
    /// total stall and the time spent fusing.
    fn blocks(
        &mut self,
        t0: Duration,
        work: &[Work],
        mut fetches: StepFetches<F::Pending>,
        records: &mut Vec<TableRecord>,
    ) -> Result<(Duration, Duration), LoopError> {
        let mut stall = Duration::ZERO;
        let mut fusion_time = Duration::ZERO;
        records.resize_with(self.slots.len(), TableRecord::default);
        let mut res = Ok(());
        for (l, rec) in records.iter_mut().enumerate() {
            let parts = &mut fetches.parts[l];
            match self.table_block(
                l,
                t0,
                stall,
                work,
                &fetches.unique[l],
                fetches.in_order[l],
                fetches.needed,
                parts,
                rec,
            ) {
                Ok((this_stall, fused)) => {
                    stall += this_stall;
                    fusion_time += fused;
                }
                Err(e) => {
                    res = Err(e);
                    break;
                }
            }
        }
        self.put_back(fetches);
        res.map(|()| (stall, fusion_time))
    }

    /// The block of table `l`'s layer: wait for its rows (`parts`, left
    /// empty), fuse them, and write its record over `rec`. Its stall and
    /// the time fusing took.
    #[allow(clippy::too_many_arguments)] // one table's share of the step
    fn table_block(
        &mut self,
        l: usize,
        t0: Duration,
        stall_before: Duration,
        work: &[Work],
        unique: &[u64],
        in_order: bool,
        needed: usize,
        parts: &mut Vec<Part<F::Pending>>,
        rec: &mut TableRecord,
    ) -> Result<(Duration, Duration), LoopError> {
        let slot = self.slots[l];
        let block_start = t0 + self.w * slot.layer / BLOCKS + stall_before;
        self.clock.sleep_until(block_start);
        let mut hops = None;
        let mut f = if parts.is_empty() {
            Fetch {
                ready: t0,
                ..Fetch::default()
            }
        } else {
            let waiting_from = self.clock.now();
            let f = if parts.len() == 1 {
                let part = parts.pop().map(|p| p.pending);
                let f = part.map(|p| self.fetcher.wait(p)).unwrap_or_default();
                hops = hops_of(&f, waiting_from, self.clock.now());
                f
            } else {
                let got: Vec<(Vec<u64>, Fetch)> = parts
                    .drain(..)
                    .map(|p| (p.rows.unwrap_or_default(), self.fetcher.wait(p.pending)))
                    .collect();
                let seen = self.clock.now();
                // The last part to be ready is the one the block waited for.
                hops = got
                    .iter()
                    .max_by_key(|(_, f)| f.ready)
                    .and_then(|(_, f)| hops_of(f, waiting_from, seen));
                merge_parts(got, unique)
            };
            self.clock.sleep_until(f.ready);
            f
        };
        // The stall is how long the block would wait for the rows on the
        // model's schedule (its start, pushed back by the stalls before
        // it). The loop thread's own lateness (waking up, fusing) is not
        // stall: later blocks absorb it, or it shows as overrun at the
        // step's end.
        let stall = f.ready.saturating_sub(block_start);
        let fused_from = self.clock.now();
        if f.error.is_none() && self.live.iter().any(|&x| x) {
            if in_order {
                take_in_order(&mut self.rowbuf, work.len(), &mut f, self.step)?;
            } else {
                gather(&mut self.rowbuf, work, l, unique, &f, self.step)?;
            }
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
        let times = (self.w, t0, stall);
        fill_record(rec, slot, times, (needed, unique.len()), hops, &mut f);
        // Its buffers serve a later fetch.
        self.fetcher.recycle(l, f);
        Ok((stall, fused))
    }

    /// 5. Each kept position's checksum of its fused state (written over
    ///    `out`).
    fn record(&self, work: &[Work], out: &mut Vec<PositionRecord>) {
        let n = self.state_len;
        out.clear();
        out.extend(
            work.iter()
                .enumerate()
                .filter(|(_, wk)| !wk.rejected)
                .map(|(p, wk)| PositionRecord {
                    seq: wk.seq,
                    index: wk.index,
                    id: wk.raw,
                    checksum: checksum(&self.hidden[p * n..(p + 1) * n]),
                }),
        );
    }
}

impl<C: Clock, F: Fetcher> super::Batched for TokenLoop<'_, C, F> {
    fn running(&self) -> usize {
        self.seqs.len()
    }

    fn admit(&mut self, s: SeqSpec) -> Result<(), LoopError> {
        TokenLoop::admit(self, s)
    }

    fn remove(&mut self, tag: u64) {
        self.seqs.retain(|s| s.tag != tag);
    }

    fn step(&mut self, rec: &mut StepRecord) -> Result<bool, LoopError> {
        TokenLoop::step(self, rec)
    }

    fn retire(&mut self) -> Vec<u64> {
        super::retire(&mut self.seqs, Seq::done, |s| s.tag)
    }
}

/// Table `l`'s distinct rows (sorted) into `out`: those of every
/// position, or (`group`) of the positions at that draft offset.
fn rows_of(out: &mut Vec<u64>, work: &[Work], l: usize, group: Option<u32>) {
    out.clear();
    out.extend(
        work.iter()
            .filter(|p| group.is_none_or(|g| p.offset == g))
            .filter_map(|p| p.rows)
            .flat_map(|r| r[l]),
    );
    out.sort_unstable();
    out.dedup();
}

/// A table's line of the step record: its rows (`needed`, `unique`),
/// window, readiness and stall (from the step time `w`, the step's start
/// `t0` and the `stall`), the sources that answered and how, taken from
/// the fetch `f` (its error moved out). The source's name is written over
/// the last step's, whose memory is kept.
pub(super) fn fill_record(
    rec: &mut TableRecord,
    slot: TableSlot,
    (w, t0, stall): (Duration, Duration, Duration),
    (needed, unique): (usize, usize),
    hops: Option<Hops>,
    f: &mut Fetch,
) {
    rec.table = slot.table;
    rec.layer = slot.layer;
    rec.rows = needed;
    rec.unique_rows = unique;
    rec.messages = f.messages;
    rec.window_us = us(cluster_config::window(w, slot.window_blocks));
    rec.ready_us = us(f.ready.saturating_sub(t0));
    rec.stall_us = us(stall);
    let mut source = rec.source.take().unwrap_or_default();
    source.clear();
    rec.source = if f.error.is_some() {
        None
    } else if f.sources.is_empty() {
        source.push_str("none");
        Some(source)
    } else {
        for (i, s) in f.sources.iter().enumerate() {
            if i > 0 {
                source.push('+');
            }
            source.push_str(s);
        }
        Some(source)
    };
    rec.hedges = f.hedges;
    rec.failovers = f.failovers;
    rec.late = f.late;
    rec.error = f.error.take();
    rec.hops = hops;
}

/// Fetch `f`'s hops ([`Hops`]), the loop having waited for it from
/// `waiting_from` and seen it at `seen`; `None` where the fetcher did not
/// say when it was asked for and taken up.
fn hops_of(f: &Fetch, waiting_from: Duration, seen: Duration) -> Option<Hops> {
    let (asked, picked) = (f.asked?, f.picked?);
    Some(Hops {
        to_io_us: us(picked.saturating_sub(asked)),
        round_trip_us: us(f.ready.saturating_sub(picked)),
        to_loop_us: us(seen.saturating_sub(f.ready.max(waiting_from))),
    })
}

/// Whether the draft at position `index` of sequence `tag` is wrong, at a
/// rate of `percent` in a hundred: a hash of the run's seed, the sequence
/// and the position, so every run with the same seed rejects the same
/// drafts.
fn draft_is_wrong(seed: u64, tag: u64, index: usize, percent: u8) -> bool {
    if percent == 0 {
        return false;
    }
    let mut x = seed ^ tag.rotate_left(32) ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    // SplitMix64's finalizer.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    x % 100 < u64::from(percent)
}

/// Bytes of the rows that only rejected positions asked for (each
/// distinct row once per table).
fn wasted_bytes(work: &[Work]) -> u64 {
    if !work.iter().any(|p| p.rejected) {
        return 0;
    }
    let mut wasted = 0;
    for l in 0..2 {
        let rows = |rejected: bool| {
            let mut v: Vec<u64> = work
                .iter()
                .filter(|p| p.rejected == rejected)
                .filter_map(|p| p.rows)
                .flat_map(|r| r[l])
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let kept = rows(false);
        wasted += rows(true)
            .iter()
            .filter(|r| kept.binary_search(r).is_err())
            .count() as u64;
    }
    wasted * ROW_BYTES as u64
}

/// One table's fetches of a step as one: the rows of each part placed at
/// their rank in `unique` (the parts' rows are disjoint and cover it), the
/// last part's time, every source and count, and the first error.
fn merge_parts(mut parts: Vec<(Vec<u64>, Fetch)>, unique: &[u64]) -> Fetch {
    if parts.len() == 1 {
        return parts.pop().map(|(_, f)| f).unwrap_or_default();
    }
    let mut all = Fetch {
        bytes: vec![0; unique.len() * ROW_BYTES],
        ..Fetch::default()
    };
    for (rows, f) in parts {
        all.ready = all.ready.max(f.ready);
        for s in f.sources {
            if !all.sources.contains(&s) {
                all.sources.push(s);
            }
        }
        all.messages += f.messages;
        all.hedges += f.hedges;
        all.failovers += f.failovers;
        all.late |= f.late;
        all.zeros |= f.zeros;
        if all.error.is_none() {
            all.error = f.error;
        }
        if f.bytes.len() != rows.len() * ROW_BYTES {
            // `gather` refuses a row that was not fetched; say why here.
            all.error.get_or_insert_with(|| {
                format!(
                    "a fetch returned {} bytes for {} rows",
                    f.bytes.len(),
                    rows.len()
                )
            });
            continue;
        }
        for (r, src) in rows.iter().zip(f.bytes.chunks_exact(ROW_BYTES)) {
            if let Ok(k) = unique.binary_search(r) {
                all.bytes[k * ROW_BYTES..(k + 1) * ROW_BYTES].copy_from_slice(src);
            }
        }
    }
    all
}

/// A fetch asked position by position ([`StepFetches::in_order`]) is
/// already laid out as the fusion reads it: its buffer becomes `rowbuf`
/// (no copy; the buffer `rowbuf` held goes with the fetch).
fn take_in_order(
    rowbuf: &mut Vec<u8>,
    positions: usize,
    f: &mut Fetch,
    step: u64,
) -> Result<(), LoopError> {
    if f.bytes.len() != positions * POSITION_ROW_BYTES {
        return Err(LoopError::Rows {
            step,
            what: format!(
                "the fetch returned {} bytes for {} rows",
                f.bytes.len(),
                positions * COLUMNS
            ),
        });
    }
    std::mem::swap(rowbuf, &mut f.bytes);
    Ok(())
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

/// How many positions sequence `q` takes this step: a prefill's share of
/// the `budget` left (taken from it), or a decoder's next token and its
/// drafts within `take`, its own limit and the loop's (`decoded` tokens
/// so far); never past the sequence's end.
fn positions(q: &Seq<'_>, spec: &LoopSpec, take: usize, budget: &mut usize, decoded: u64) -> usize {
    let n = if q.prefilling() {
        let n = (q.prefill - q.next).min(*budget);
        *budget -= n;
        n
    } else {
        let mut n = (q.speculate + 1).min(take);
        if let Some(l) = q.limit {
            n = n.min(l.saturating_sub(q.decoded) as usize);
        }
        if let Some(max) = spec.max_tokens {
            n = n.min(max.saturating_sub(decoded) as usize);
        }
        n
    };
    n.min(q.range.end.saturating_sub(q.range.start + q.next))
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
            offset: 0,
            prefill: false,
            rejected: false,
            slot: 0,
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
