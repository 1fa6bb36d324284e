//! Seed 004's deployment figures over a run's decode steps: row bytes
//! per token from each source, the prefetch's hit rate (rows in before
//! their block needed them), the overlap (fetch time hidden under the
//! backbone's compute) and the stall, from the per-table sums the summary
//! keeps. `/metrics` has the same as counters (`engram_node_model_*`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::TableSummary;

/// Seed 004's deployment figures: what the rows cost and how well their
/// fetch hid under the backbone's compute, over the decode steps.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Deployment {
    /// Row bytes fetched per decoded token, by source (both tables).
    pub bytes_per_token: BTreeMap<String, f64>,
    /// Rows in before their block needed them, over all rows (both tables).
    pub prefetch_hit_rate: f64,
    /// Fetch time hidden under compute, over all fetch time (both tables).
    pub overlap: f64,
    /// Stall time in all, milliseconds.
    pub stall_ms: f64,
}

/// The deployment figures of `tables` over `tokens` decoded tokens.
pub(crate) fn deployment(tables: &[TableSummary], tokens: u64, stall_ms: f64) -> Deployment {
    let mut bytes_per_token = BTreeMap::new();
    for t in tables {
        let row = t.row_bytes as f64;
        for (src, rows) in &t.rows_by_source {
            *bytes_per_token.entry(src.clone()).or_insert(0.0) += *rows as f64 * row;
        }
    }
    for b in bytes_per_token.values_mut() {
        *b /= tokens.max(1) as f64;
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let sum = |f: &dyn Fn(&TableSummary) -> f64| tables.iter().map(f).sum::<f64>();
    Deployment {
        bytes_per_token,
        prefetch_hit_rate: ratio(
            sum(&|t| t.rows_on_time as f64),
            sum(&|t| t.decode_rows as f64),
        ),
        overlap: ratio(sum(&|t| t.hidden_us), sum(&|t| t.fetch_us)),
        stall_ms,
    }
}

impl Deployment {
    /// Its line of the summary.
    pub(crate) fn render(&self) -> String {
        let bytes: Vec<String> = self
            .bytes_per_token
            .iter()
            .map(|(k, v)| format!("{k}={v:.0}"))
            .collect();
        format!(
            "deployment: bytes per token [{}]; prefetch hit rate {:.2}% (rows in before their block); overlap {:.2}% (fetch time hidden); stall {:.2} ms in all\n",
            bytes.join(" "),
            self.prefetch_hit_rate * 100.0,
            self.overlap * 100.0,
            self.stall_ms
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_come_from_the_tables_sums() {
        let t = |src: &str, rows: u64, on_time: u64, fetch_us: f64, hidden_us: f64| TableSummary {
            rows_by_source: [(src.to_string(), rows)].into(),
            decode_rows: rows,
            rows_on_time: on_time,
            fetch_us,
            hidden_us,
            row_bytes: 264,
            ..TableSummary::default()
        };
        let d = deployment(
            &[
                t("a", 240, 240, 100.0, 100.0),
                t("ssd", 240, 120, 300.0, 100.0),
            ],
            10,
            1.5,
        );
        assert_eq!(d.bytes_per_token["a"], 24.0 * 264.0);
        assert_eq!(d.bytes_per_token["ssd"], 24.0 * 264.0);
        // A table of other rows counts its own size (Qwen4Exp's FP8: 160).
        let fp8 = TableSummary {
            row_bytes: 160,
            ..t("b", 160, 160, 1.0, 1.0)
        };
        assert_eq!(
            deployment(&[fp8], 10, 0.0).bytes_per_token["b"],
            16.0 * 160.0
        );
        assert_eq!(d.prefetch_hit_rate, 0.75);
        assert_eq!(d.overlap, 0.5);
        assert_eq!(d.stall_ms, 1.5);
        assert!(
            d.render().contains("prefetch hit rate 75.00%"),
            "{}",
            d.render()
        );
        // Nothing decoded: no division by zero.
        let none = deployment(&[], 0, 0.0);
        assert_eq!((none.prefetch_hit_rate, none.overlap), (0.0, 0.0));
    }
}
