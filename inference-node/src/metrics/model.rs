//! The model loop's deployment series (seed 004's figures, in /metrics as
//! counters a dashboard divides): decoded tokens, row bytes by source,
//! rows in before their block needed them and rows late, fetch time
//! hidden under compute and fetch time stalled on, and each step's stall
//! (a histogram for p50/p95/p99). The loop records through [`ModelSeries`]
//! (`StepRecord::count_in`), whose handles are taken once, so a step
//! allocates nothing.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::{SourceOnly, TableLabels};

/// A counter of seconds.
type Seconds = Counter<f64, AtomicU64>;

/// The model loop's series.
#[derive(Debug)]
pub struct ModelMetrics {
    /// Positions decoded (prefill excluded).
    pub tokens: Counter,
    /// Row bytes the decode steps fetched, by source.
    pub row_bytes: Family<SourceOnly, Counter>,
    /// Rows of decode steps in before their block needed them.
    pub rows_on_time: Family<TableLabels, Counter>,
    /// Rows of decode steps their block waited for.
    pub rows_late: Family<TableLabels, Counter>,
    /// Fetch time hidden under the backbone's compute.
    pub fetch_hidden_seconds: Family<TableLabels, Seconds>,
    /// Fetch time the loop stalled on.
    pub fetch_stalled_seconds: Family<TableLabels, Seconds>,
    /// Each decode step's stall.
    pub step_stall_seconds: Histogram,
}

impl Default for ModelMetrics {
    fn default() -> Self {
        Self {
            tokens: Counter::default(),
            row_bytes: Family::default(),
            rows_on_time: Family::default(),
            rows_late: Family::default(),
            fetch_hidden_seconds: Family::default(),
            fetch_stalled_seconds: Family::default(),
            // 1 us .. ~0.5 s.
            step_stall_seconds: Histogram::new(exponential_buckets(1e-6, 2.0, 20)),
        }
    }
}

impl ModelMetrics {
    /// Register every series under `model_`.
    pub(super) fn register(&self, r: &mut Registry) {
        let r = r.sub_registry_with_prefix("model");
        r.register(
            "tokens",
            "Positions the model loop decoded (prefill excluded)",
            self.tokens.clone(),
        );
        r.register(
            "row_bytes",
            "Row bytes the decode steps fetched, by source (over tokens: bytes per token)",
            self.row_bytes.clone(),
        );
        r.register(
            "rows_on_time",
            "Rows of decode steps in before their block needed them (the prefetch's hits)",
            self.rows_on_time.clone(),
        );
        r.register(
            "rows_late",
            "Rows of decode steps their block waited for",
            self.rows_late.clone(),
        );
        r.register("fetch_hidden_seconds", "Fetch time hidden under the backbone's compute (over hidden plus stalled: the overlap)", self.fetch_hidden_seconds.clone());
        r.register(
            "fetch_stalled_seconds",
            "Fetch time the model loop stalled on",
            self.fetch_stalled_seconds.clone(),
        );
        r.register(
            "step_stall_seconds",
            "Each decode step's stall",
            self.step_stall_seconds.clone(),
        );
    }

    /// The handles of tables `tables` (each with its row size in bytes:
    /// 264 for V4.1's), for [`ModelSeries::record`].
    pub fn series(&self, tables: &[(u32, usize)]) -> ModelSeries {
        let labels = |t: u32| TableLabels {
            table: t.to_string(),
        };
        ModelSeries {
            tokens: self.tokens.clone(),
            step_stall: self.step_stall_seconds.clone(),
            tables: tables
                .iter()
                .map(|&(t, row_bytes)| TableSeries {
                    table: t,
                    row_bytes: row_bytes as u64,
                    on_time: self.rows_on_time.get_or_create(&labels(t)).clone(),
                    late: self.rows_late.get_or_create(&labels(t)).clone(),
                    hidden: self.fetch_hidden_seconds.get_or_create(&labels(t)).clone(),
                    stalled: self.fetch_stalled_seconds.get_or_create(&labels(t)).clone(),
                })
                .collect(),
            row_bytes: self.row_bytes.clone(),
            sources: Vec::new(),
        }
    }
}

#[derive(Debug)]
struct TableSeries {
    table: u32,
    row_bytes: u64,
    on_time: Counter,
    late: Counter,
    hidden: Seconds,
    stalled: Seconds,
}

/// One loop's handles on the model series.
#[derive(Debug)]
pub struct ModelSeries {
    tokens: Counter,
    step_stall: Histogram,
    tables: Vec<TableSeries>,
    row_bytes: Family<SourceOnly, Counter>,
    /// Each source's bytes counter, taken the first time it serves.
    sources: Vec<(String, Counter)>,
}

impl ModelSeries {
    /// Count one decode step: `decoded` positions (a joining sequence's
    /// prefill chunk excluded) and the step's stall.
    pub fn step(&mut self, decoded: u64, stall_s: f64) {
        self.tokens.inc_by(decoded);
        self.step_stall.observe(stall_s);
    }

    /// Count one table's fetch of a decode step: `rows` unique rows, in
    /// `ready_us` from the step's start, of which `stall_us` its block
    /// waited, served by `source`.
    pub fn table(
        &mut self,
        table: u32,
        rows: u64,
        ready_us: f64,
        stall_us: f64,
        source: Option<&str>,
    ) {
        let Some(t) = self.tables.iter().find(|t| t.table == table) else {
            return;
        };
        if stall_us > 0.0 { &t.late } else { &t.on_time }.inc_by(rows);
        t.hidden.inc_by((ready_us - stall_us).max(0.0) / 1e6);
        t.stalled.inc_by(stall_us.max(0.0) / 1e6);
        let Some(src) = source else { return };
        let bytes = rows * t.row_bytes;
        match self.sources.iter().find(|(s, _)| s == src) {
            Some((_, c)) => {
                c.inc_by(bytes);
            }
            None => {
                let c = self
                    .row_bytes
                    .get_or_create(&SourceOnly {
                        source: src.to_owned(),
                    })
                    .clone();
                c.inc_by(bytes);
                self.sources.push((src.to_owned(), c));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::metrics::NodeMetrics;
    use crate::model::{Checksum, PositionRecord, StepKind, StepRecord, TableRecord};

    #[test]
    fn a_step_counts_tokens_bytes_hits_and_hidden_time() {
        let m = NodeMetrics::new();
        let mut series = m.model.series(&[(1, 264), (14, 264)]);
        let table = |table: u32, source: &str, ready_us: f64, stall_us: f64| TableRecord {
            table,
            unique_rows: 24,
            ready_us,
            stall_us,
            source: Some(source.into()),
            ..TableRecord::default()
        };
        let mut rec = StepRecord {
            kind: StepKind::Decode,
            positions: vec![PositionRecord {
                seq: 0,
                index: 0,
                id: 0,
                checksum: Checksum::default(),
            }],
            tables: vec![table(1, "d", 200.0, 0.0), table(14, "ssd", 900.0, 400.0)],
            stall_us: 400.0,
            ..StepRecord::default()
        };
        rec.count_in(&mut series);
        rec.count_in(&mut series);
        rec.kind = StepKind::Prefill;
        rec.count_in(&mut series);
        let text = m.render();
        for line in [
            "engram_node_model_tokens_total 2",
            "engram_node_model_row_bytes_total{source=\"d\"} 12672",
            "engram_node_model_row_bytes_total{source=\"ssd\"} 12672",
            "engram_node_model_rows_on_time_total{table=\"1\"} 48",
            "engram_node_model_rows_late_total{table=\"14\"} 48",
            "engram_node_model_fetch_hidden_seconds_total{table=\"14\"} 0.001",
            "engram_node_model_fetch_stalled_seconds_total{table=\"14\"} 0.0008",
            "engram_node_model_step_stall_seconds_count 2",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }
}
