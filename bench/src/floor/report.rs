//! The floor benchmark's report: the donor/floor ratios of the medians,
//! printed as JSON or as a text table with the target's verdict.

use anyhow::Result;
use inference_node::DEFAULT_BUSY_POLL;
use integration_tests::DonorProcess;
use serde::Serialize;

use super::{FloorArgs, SeriesResult};
use crate::stats::print_table;

/// The target: the project client's p50 over the blocking floor's at most this...
const TARGET_P50: f64 = 1.15;
/// ...and its p99 over the floor's at most this.
const TARGET_P99: f64 = 1.3;

/// One donor/floor ratio of medians at one size.
#[derive(Debug, Serialize)]
pub(super) struct Ratio {
    rows: usize,
    what: &'static str,
    p50: f64,
    p99: f64,
}

impl Ratio {
    /// Whether the target is set on this ratio.
    fn is_target(&self) -> bool {
        self.what.contains("target")
    }

    /// Whether both percentiles are within the target.
    fn within_target(&self) -> bool {
        self.p50 <= TARGET_P50 && self.p99 <= TARGET_P99
    }
}

/// The donor/floor ratios of the medians, per size.
pub(super) fn ratios(results: &[SeriesResult]) -> Vec<Ratio> {
    // Per size: [floor blocking, floor polling, donor, donor not polling].
    let mut ratios = Vec::new();
    for (k, rows) in [(0usize, 24usize), (4, 48)] {
        let m = |i: usize| results[k + i].median;
        for (what, num, den) in [
            ("project client / blocking floor (the target)", 2, 0),
            ("both polling", 2, 1),
            ("neither polling", 3, 0),
        ] {
            ratios.push(Ratio {
                rows,
                what,
                p50: m(num).p50_us / m(den).p50_us,
                p99: m(num).p99_us / m(den).p99_us,
            });
        }
    }
    ratios
}

/// Everything the report shows.
pub(super) struct Report<'a> {
    pub(super) args: &'a FloorArgs,
    /// Size of each table in GiB.
    pub(super) gib: f64,
    pub(super) pinned: bool,
    pub(super) results: Vec<SeriesResult>,
    pub(super) ratios: Vec<Ratio>,
    /// Whether the donor exited cleanly on SIGTERM.
    pub(super) clean: bool,
}

impl Report<'_> {
    /// Print the report as JSON.
    pub(super) fn print_json(&self) -> Result<()> {
        let args = self.args;
        let met = self
            .ratios
            .iter()
            .filter(|r| r.is_target())
            .all(Ratio::within_target);
        let v = serde_json::json!({
            "benchmark": "floor",
            "rows_per_table": args.rows_per_table,
            "table_gib": self.gib,
            "lookups_per_series": args.lookups,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "in_flight": 1,
            "pinned": self.pinned,
            "busy_poll_us": DEFAULT_BUSY_POLL.as_micros() as u64,
            "series": self.results,
            "ratios": self.ratios,
            "target": { "p50": TARGET_P50, "p99": TARGET_P99, "met": met },
            "donor_exit_clean": self.clean,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        Ok(())
    }

    /// Print the report as text; `donor`'s log follows when it did not exit cleanly.
    pub(super) fn print_text(&self, donor: &DonorProcess) {
        let args = self.args;
        println!(
            "engram-bench floor: 2 tables x {} rows ({:.2} GiB each), {} timed lookups per series after {} warm-up, \
             1 in flight, loopback TCP{}; medians of {} rounds",
            args.rows_per_table,
            self.gib,
            args.lookups,
            args.warmup,
            if self.pinned {
                ", client and servers pinned to separate CPUs"
            } else {
                ""
            },
            args.rounds
        );
        let rows: Vec<Vec<String>> = self
            .results
            .iter()
            .map(|r| {
                vec![
                    r.series.clone(),
                    format!("{}/{}", r.request_bytes, r.answer_bytes),
                    format!("{:.1}", r.median.p50_us),
                    format!("{:.1}", r.median.p99_us),
                    format!("{:.1}", r.median.p999_us),
                ]
            })
            .collect();
        print_table(
            &["series", "req/ans bytes", "p50 us", "p99 us", "p99.9 us"],
            &rows,
        );
        println!(
            "(polling clients poll for up to {} us before sleeping)",
            DEFAULT_BUSY_POLL.as_micros()
        );
        for r in &self.ratios {
            let verdict = if !r.is_target() {
                ""
            } else if r.within_target() {
                "  met (p50 <= 1.15, p99 <= 1.30)"
            } else {
                "  MISSED (p50 <= 1.15, p99 <= 1.30)"
            };
            println!(
                "{} rows, {}: p50 {:.3}x, p99 {:.3}x{verdict}",
                r.rows, r.what, r.p50, r.p99
            );
        }
        if !self.clean {
            println!(
                "warning: the donor did not exit cleanly on SIGTERM; its log:\n{}",
                donor.log()
            );
        }
    }
}
