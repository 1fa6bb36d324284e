//! The end-of-run summary: what the run measured, next to what seed 000's
//! formula predicts from the fetch times the same run measured.

use std::collections::BTreeMap;
use std::hash::Hasher as _;
use std::time::Duration;

use cluster_config::plan::predict;
use daemon_runtime::latency::Latency;
use serde::{Deserialize, Serialize};
use twox_hash::xxhash3_64::{RawHasher, SecretBuffer};

pub mod deployment;

use super::{BLOCKS, LoopSpec, StepKind, StepRecord, TableSlot};
use deployment::{Deployment, deployment};

fn v41_row_bytes() -> usize {
    engram_protocol::ROW_BYTES
}

/// One table over the run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TableSummary {
    /// Table id.
    pub table: u32,
    /// Engram layer.
    pub layer: u32,
    /// Its window in blocks.
    pub window_blocks: u32,
    /// Bytes per row (264 for V4.1's).
    #[serde(default = "v41_row_bytes")]
    pub row_bytes: usize,
    /// Steps served, by source (`a+b` for a wide fetch that used several).
    pub by_source: BTreeMap<String, u64>,
    /// Steps whose fetch failed.
    pub failed: u64,
    /// Steps answered with zeros by policy.
    pub zeros: u64,
    /// Hedges sent.
    pub hedges: u64,
    /// Failovers.
    pub failovers: u64,
    /// Answers after the router's deadline.
    pub late: u64,
    /// Rows fetched.
    pub rows: u64,
    /// Fetch time (ready - step start) over the decode steps.
    #[serde(skip)]
    pub fetch: Latency,
    /// Rows the decode steps fetched, by source.
    #[serde(default)]
    pub rows_by_source: BTreeMap<String, u64>,
    /// Rows of the decode steps whose fetch was in before its block
    /// needed it (no stall): the prefetch's hits.
    #[serde(default)]
    pub rows_on_time: u64,
    /// Rows of the decode steps.
    #[serde(default)]
    pub decode_rows: u64,
    /// The decode steps' fetch time, in all, microseconds.
    #[serde(default)]
    pub fetch_us: f64,
    /// The part of it hidden under the backbone's compute (fetch time
    /// minus the stall it caused), microseconds.
    #[serde(default)]
    pub hidden_us: f64,
    /// Fetch-time p50, microseconds.
    pub fetch_p50_us: f64,
    /// Fetch-time p95, microseconds.
    #[serde(default)]
    pub fetch_p95_us: f64,
    /// Fetch-time p99, microseconds.
    pub fetch_p99_us: f64,
    /// Fetch-time maximum, microseconds.
    pub fetch_max_us: f64,
    /// Each hop of the decode steps' fetches ([`super::Hops`]: to the I/O
    /// thread, round trip, to the loop), where the fetcher tells.
    #[serde(skip)]
    pub hops: [Latency; 3],
    /// Their medians, microseconds (absent where no fetch told).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hops_p50_us: Option<super::Hops>,
}

/// The whole run (`inference-node run --json` prints it; reports read it back).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// Target rate.
    pub target_tokens_per_second: f64,
    /// Positions per decode step at most (batch x (1 + drafts)).
    pub positions_per_step: usize,
    /// Step time `W`, milliseconds.
    pub w_ms: f64,
    /// Steps run (prefill included).
    pub steps: u64,
    /// Positions decoded (prefill excluded).
    pub tokens: u64,
    /// Positions prefilled.
    pub prefill_positions: u64,
    /// Wall time of the prefill step, milliseconds.
    pub prefill_ms: f64,
    /// Wall time of the whole run, seconds.
    pub elapsed_s: f64,
    /// Wall time of the decode steps, seconds.
    pub decode_s: f64,
    /// Decoded positions per second of decode time.
    pub tokens_per_second: f64,
    /// Decode time over its stall-free time, minus one.
    pub slowdown: f64,
    /// Stall per decode step: p50, microseconds.
    pub stall_p50_us: f64,
    /// Stall per decode step: p95, microseconds.
    #[serde(default)]
    pub stall_p95_us: f64,
    /// Stall per decode step: p99, microseconds.
    pub stall_p99_us: f64,
    /// Stall per decode step: maximum, microseconds.
    pub stall_max_us: f64,
    /// Decode steps with any stall.
    pub stalled_steps: u64,
    /// Total overrun (compute past its blocks), milliseconds.
    pub overrun_ms: f64,
    /// Seed 000's formula over each decode step's measured fetch times:
    /// tokens/s.
    pub predicted_tokens_per_second: f64,
    /// The same formula's slowdown.
    pub predicted_slowdown: f64,
    /// Measured tokens/s over predicted.
    pub measured_over_predicted: f64,
    /// The formula with every table's fetch timed from the step's start
    /// (overlapping overshoots added: the worst case).
    #[serde(default)]
    pub predicted_from_start_tokens_per_second: f64,
    /// Steps with a failed table.
    pub failed_steps: u64,
    /// Seed 004's deployment figures over the decode steps.
    #[serde(default)]
    pub deployment: Deployment,
    /// Per table.
    pub tables: Vec<TableSummary>,
    #[serde(skip)]
    stalls: Latency,
    #[serde(skip)]
    predicted_ms: f64,
    #[serde(skip)]
    predicted_from_start_ms: f64,
    #[serde(skip)]
    decode_steps: u64,
    /// Time the draft stand-in took over the decode steps, seconds (part
    /// of the stall-free time).
    #[serde(default)]
    pub draft_s: f64,
    /// Draft positions verified and rejected.
    #[serde(default)]
    pub rejected_positions: u64,
    /// Bytes of rows fetched for rejected positions only.
    #[serde(default)]
    pub wasted_bytes: u64,
    /// A digest of every kept position's output (its sequence, index and
    /// checksum), whatever the order they came in: equal across runs
    /// exactly when they kept the same positions with bit-identical
    /// outputs.
    #[serde(default)]
    pub outputs_digest: String,
    /// CPU time the node's process took over the run, user and system,
    /// seconds (set by `inference-node run`; 0 where not measured): what
    /// its polling and warm-ups cost.
    #[serde(default)]
    pub cpu_s: f64,
    #[serde(skip)]
    outputs_sum: u64,
    #[serde(skip)]
    outputs_count: u64,
}

impl Summary {
    /// An empty summary.
    pub fn new(spec: &LoopSpec, slots: &[TableSlot], w: Duration) -> Self {
        Self {
            target_tokens_per_second: spec.tokens_per_second,
            positions_per_step: spec.batch * (spec.speculate + 1),
            w_ms: w.as_secs_f64() * 1e3,
            steps: 0,
            tokens: 0,
            prefill_positions: 0,
            prefill_ms: 0.0,
            elapsed_s: 0.0,
            decode_s: 0.0,
            tokens_per_second: 0.0,
            slowdown: 0.0,
            stall_p50_us: 0.0,
            stall_p95_us: 0.0,
            stall_p99_us: 0.0,
            stall_max_us: 0.0,
            stalled_steps: 0,
            overrun_ms: 0.0,
            predicted_tokens_per_second: 0.0,
            predicted_slowdown: 0.0,
            measured_over_predicted: 0.0,
            predicted_from_start_tokens_per_second: 0.0,
            failed_steps: 0,
            deployment: Deployment::default(),
            tables: slots
                .iter()
                .map(|s| TableSummary {
                    table: s.table,
                    layer: s.layer,
                    window_blocks: s.window_blocks,
                    row_bytes: s.row_bytes,
                    ..TableSummary::default()
                })
                .collect(),
            stalls: Latency::new(),
            predicted_ms: 0.0,
            predicted_from_start_ms: 0.0,
            decode_steps: 0,
            draft_s: 0.0,
            rejected_positions: 0,
            wasted_bytes: 0,
            outputs_digest: String::new(),
            cpu_s: 0.0,
            outputs_sum: 0,
            outputs_count: 0,
        }
    }

    /// Count one step.
    pub fn add(&mut self, r: &StepRecord) {
        self.steps += 1;
        self.rejected_positions += r.rejected;
        self.wasted_bytes += r.wasted_bytes;
        for p in &r.positions {
            let mut h = RawHasher::new(SecretBuffer::default());
            h.write(&p.seq.to_le_bytes());
            h.write(&p.index.to_le_bytes());
            h.write(&p.checksum.hex());
            // A sum: the same whatever order the positions came in.
            self.outputs_sum = self.outputs_sum.wrapping_add(h.finish());
            self.outputs_count += 1;
        }
        self.overrun_ms += r.overrun_us / 1e3;
        if r.tables.iter().any(|t| t.error.is_some()) {
            self.failed_steps += 1;
        }
        self.count_sources(r);
        if r.kind == StepKind::Prefill {
            self.prefill_positions += r.positions.len() as u64;
            self.prefill_ms += r.time_us / 1e3;
            return;
        }
        self.decode_steps += 1;
        // A joining sequence's prefill chunk may share a decode step.
        self.prefill_positions += r.prefilled;
        self.tokens += (r.positions.len() as u64).saturating_sub(r.prefilled);
        self.stalls.record_us(r.stall_us);
        self.decode_s += r.time_us / 1e6;
        if r.stall_us > 0.0 {
            self.stalled_steps += 1;
        }
        // Seed 000 times each table's fetch from the start of its window:
        // the first table's from the step's start, a later table's from the
        // start of the block after the previous table's (which the stalls
        // before it have pushed back). Counting every fetch from the step's
        // start instead adds overshoots that overlap (the worst case).
        let w_ms = r.w_us / 1e3;
        let block_ms = w_ms / f64::from(BLOCKS);
        let (mut window_start_ms, mut stalls_ms) = (0.0, 0.0);
        // Two tables: on the stack, as every step's figures are.
        let mut tables = [(0.0, 0.0); 2];
        let mut from_start = [(0.0, 0.0); 2];
        let mut n = 0;
        self.deployment.stall_ms += r.stall_us / 1e3;
        for (t, rec) in self.tables.iter_mut().zip(&r.tables).take(2) {
            t.fetch.record_us(rec.ready_us);
            if let (Some(src), None) = (&rec.source, &rec.error) {
                let rows = rec.unique_rows as u64;
                // Counted in place: a name is cloned only the first time.
                match t.rows_by_source.get_mut(src.as_str()) {
                    Some(n) => *n += rows,
                    None => {
                        t.rows_by_source.insert(src.clone(), rows);
                    }
                }
                t.decode_rows += rows;
                t.rows_on_time += if rec.stall_us > 0.0 { 0 } else { rows };
                t.fetch_us += rec.ready_us;
                t.hidden_us += (rec.ready_us - rec.stall_us).max(0.0);
            }
            if let Some(h) = rec.hops {
                for (l, v) in t
                    .hops
                    .iter_mut()
                    .zip([h.to_io_us, h.round_trip_us, h.to_loop_us])
                {
                    l.record_us(v);
                }
            }
            let window_ms = block_ms * f64::from(t.window_blocks);
            let ready_ms = rec.ready_us / 1e3;
            tables[n] = (window_ms, (ready_ms - window_start_ms).max(0.0));
            from_start[n] = (window_ms, ready_ms);
            n += 1;
            stalls_ms += rec.stall_us / 1e3;
            window_start_ms = block_ms * f64::from(t.layer) + stalls_ms;
        }
        // The drafts come before the pass, stall-free: the formula's step
        // is the pass, and the drafts' time is added to both.
        let draft_ms = r.draft_us / 1e3;
        self.draft_s += draft_ms / 1e3;
        self.predicted_ms += predict(w_ms, &tables[..n]).time_ms + draft_ms;
        self.predicted_from_start_ms += predict(w_ms, &from_start[..n]).time_ms + draft_ms;
    }

    /// Each table's answers of step `r`, by source (failed, zeros, hedges,
    /// failovers, late, rows).
    fn count_sources(&mut self, r: &StepRecord) {
        for (t, rec) in self.tables.iter_mut().zip(&r.tables) {
            match (&rec.source, &rec.error) {
                (_, Some(_)) => t.failed += 1,
                (Some(s), None) => {
                    t.zeros += u64::from(s == "zeros");
                    // Counted in place: a name is cloned only the first time.
                    match t.by_source.get_mut(s.as_str()) {
                        Some(n) => *n += 1,
                        None => {
                            t.by_source.insert(s.clone(), 1);
                        }
                    }
                }
                (None, None) => {}
            }
            t.hedges += u64::from(rec.hedges);
            t.failovers += u64::from(rec.failovers);
            t.late += u64::from(rec.late);
            t.rows += rec.unique_rows as u64;
        }
    }

    /// Close the run at `now` (its wall time).
    pub fn finish(&mut self, now: Duration) {
        self.elapsed_s = now.as_secs_f64();
        self.outputs_digest = format!("{:016x}/{}", self.outputs_sum, self.outputs_count);
        let ideal_s = self.decode_steps as f64 * self.w_ms / 1e3 + self.draft_s;
        if self.decode_s > 0.0 {
            self.tokens_per_second = self.tokens as f64 / self.decode_s;
            self.slowdown = self.decode_s / ideal_s - 1.0;
        }
        if self.predicted_ms > 0.0 {
            self.predicted_tokens_per_second = self.tokens as f64 / (self.predicted_ms / 1e3);
            self.predicted_slowdown = self.predicted_ms / 1e3 / ideal_s - 1.0;
            self.measured_over_predicted =
                self.tokens_per_second / self.predicted_tokens_per_second;
            self.predicted_from_start_tokens_per_second =
                self.tokens as f64 / (self.predicted_from_start_ms / 1e3);
        }
        self.deployment = deployment(&self.tables, self.tokens, self.deployment.stall_ms);
        self.stall_p50_us = self.stalls.quantile_us(0.5);
        self.stall_p95_us = self.stalls.quantile_us(0.95);
        self.stall_p99_us = self.stalls.quantile_us(0.99);
        self.stall_max_us = self.stalls.quantile_us(1.0);
        for t in &mut self.tables {
            t.fetch_p50_us = t.fetch.quantile_us(0.5);
            t.fetch_p95_us = t.fetch.quantile_us(0.95);
            t.fetch_p99_us = t.fetch.quantile_us(0.99);
            t.fetch_max_us = t.fetch.quantile_us(1.0);
            t.hops_p50_us = (t.hops[0].count() > 0).then(|| super::Hops {
                to_io_us: t.hops[0].quantile_us(0.5),
                round_trip_us: t.hops[1].quantile_us(0.5),
                to_loop_us: t.hops[2].quantile_us(0.5),
            });
        }
    }

    /// The summary for people.
    pub fn render(&self) -> String {
        let mut s = format!(
            "{} tokens in {} steps ({:.1} s; target {} tokens/s, W = {:.3} ms, {} positions per step)\n",
            self.tokens,
            self.steps,
            self.elapsed_s,
            self.target_tokens_per_second,
            self.w_ms,
            self.positions_per_step,
        );
        if self.prefill_positions > 0 {
            s += &format!(
                "prefill: {} positions in one sweep, {:.2} ms\n",
                self.prefill_positions, self.prefill_ms
            );
        }
        s += &format!(
            "measured:  {:.1} tokens/s, slowdown {:+.2}% vs no stall; stall p50 {:.0} us, p95 {:.0} us, p99 {:.0} us, max {:.0} us ({} of {} steps stalled); overrun {:.2} ms\n",
            self.tokens_per_second,
            self.slowdown * 100.0,
            self.stall_p50_us,
            self.stall_p95_us,
            self.stall_p99_us,
            self.stall_max_us,
            self.stalled_steps,
            self.decode_steps,
            self.overrun_ms,
        );
        s += &format!(
            "predicted: {:.1} tokens/s, slowdown {:+.2}% (seed 000's formula on the measured fetch times); measured/predicted {:.3}\n",
            self.predicted_tokens_per_second,
            self.predicted_slowdown * 100.0,
            self.measured_over_predicted,
        );
        s += &format!(
            "           ({:.1} tokens/s with every fetch timed from the step's start: overlapping overshoots added)\n",
            self.predicted_from_start_tokens_per_second,
        );
        s += &self.deployment.render();
        for t in &self.tables {
            let sources: Vec<String> = t
                .by_source
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            s += &format!(
                "table {} (layer {}, window {}W/40): fetch p50 {:.0} us p95 {:.0} us p99 {:.0} us max {:.0} us; sources [{}]; hedges {} failovers {} late {} zeros {} failed {}\n",
                t.table,
                t.layer,
                t.window_blocks,
                t.fetch_p50_us,
                t.fetch_p95_us,
                t.fetch_p99_us,
                t.fetch_max_us,
                sources.join(" "),
                t.hedges,
                t.failovers,
                t.late,
                t.zeros,
                t.failed,
            );
            if let Some(h) = t.hops_p50_us {
                s += &format!(
                    "   its hops, p50: to an I/O thread {:.0} us, round trip {:.0} us, to the loop {:.0} us\n",
                    h.to_io_us, h.round_trip_us, h.to_loop_us
                );
            }
        }
        if self.rejected_positions > 0 {
            s += &format!(
                "drafts: {} positions rejected, {:.1} KB of rows fetched for them only\n",
                self.rejected_positions,
                self.wasted_bytes as f64 / 1e3
            );
        }
        s += &format!("outputs: {}\n", self.outputs_digest);
        if self.failed_steps > 0 {
            s += &format!("{} steps had a table fail\n", self.failed_steps);
        }
        s
    }
}

/// One second of a run, for status lines and timelines.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Second {
    /// Which second (from the run's start).
    pub second: u64,
    /// Positions decoded in it.
    pub tokens: u64,
    /// Steps in it.
    pub steps: u64,
    /// Stall p99 over its steps, microseconds.
    pub stall_p99_us: f64,
    /// Stall maximum over its steps, microseconds.
    pub stall_max_us: f64,
    /// Rows served, by source, over both tables.
    pub rows_by_source: BTreeMap<String, u64>,
    /// Failovers.
    pub failovers: u64,
    /// Hedges sent.
    pub hedges: u64,
    /// Steps with a failed table.
    pub failed: u64,
    #[serde(skip)]
    stalls: Latency,
}

impl Second {
    /// A status line.
    pub fn line(&self) -> String {
        let src: Vec<String> = self
            .rows_by_source
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!(
            "t={:>4}s {:>6} tokens/s  stall p99 {:>7.0} us max {:>7.0} us  rows [{}]  failovers {} hedges {} failed {}",
            self.second,
            self.tokens,
            self.stall_p99_us,
            self.stall_max_us,
            src.join(" "),
            self.failovers,
            self.hedges,
            self.failed
        )
    }
}

/// Cuts a run into seconds (by each step's end).
#[derive(Debug, Default)]
pub struct Seconds {
    current: Second,
}

impl Seconds {
    /// Count a step; returns the seconds it closed (empty ones included).
    pub fn add(&mut self, r: &StepRecord) -> Vec<Second> {
        let sec = ((r.start_us + r.time_us) / 1e6) as u64;
        let mut closed = Vec::new();
        while sec > self.current.second {
            let next = self.current.second + 1;
            closed.push(self.close(next));
        }
        let c = &mut self.current;
        c.steps += 1;
        c.tokens += r.decoded() as u64;
        c.stalls.record_us(r.stall_us);
        for t in &r.tables {
            if t.error.is_some() {
                continue;
            }
            let name = t.source.clone().unwrap_or_default();
            *c.rows_by_source.entry(name).or_default() += t.unique_rows as u64;
            c.failovers += u64::from(t.failovers);
            c.hedges += u64::from(t.hedges);
        }
        c.failed += u64::from(r.tables.iter().any(|t| t.error.is_some()));
        closed
    }

    fn close(&mut self, next: u64) -> Second {
        let mut s = std::mem::replace(
            &mut self.current,
            Second {
                second: next,
                ..Second::default()
            },
        );
        s.stall_p99_us = s.stalls.quantile_us(0.99);
        s.stall_max_us = s.stalls.quantile_us(1.0);
        s
    }

    /// The last, partial second.
    pub fn finish(mut self) -> Option<Second> {
        (self.current.steps > 0).then(|| {
            let n = self.current.second + 1;
            self.close(n)
        })
    }
}
