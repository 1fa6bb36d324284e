//! Latency samples: percentiles from a histogram, medians over rounds, and a plain table.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Latency recorder in nanoseconds (1 ns to 60 s, 3 significant digits).
#[derive(Debug)]
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        // Bounds are constants within what hdrhistogram accepts.
        Self(Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds"))
    }
}

impl Latency {
    /// Record one sample.
    pub fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos())
            .unwrap_or(u64::MAX)
            .clamp(1, 60_000_000_000);
        // In bounds by the clamp above.
        let _ = self.0.record(ns);
    }

    /// p50, p99, p99.9 and max in microseconds.
    pub fn summary(&self) -> Summary {
        let us = |q: f64| self.0.value_at_quantile(q) as f64 / 1000.0;
        Summary {
            p50_us: us(0.5),
            p99_us: us(0.99),
            p999_us: us(0.999),
            max_us: self.0.max() as f64 / 1000.0,
        }
    }
}

/// Percentiles of one series, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Slowest sample.
    pub max_us: f64,
}

/// Median of values (the mean of the middle two for an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Per-field medians of several rounds' summaries.
pub fn median_summary(rounds: &[Summary]) -> Summary {
    let m = |f: fn(&Summary) -> f64| median(rounds.iter().map(f).collect());
    Summary {
        p50_us: m(|s| s.p50_us),
        p99_us: m(|s| s.p99_us),
        p999_us: m(|s| s.p999_us),
        max_us: m(|s| s.max_us),
    }
}

/// Print rows of cells as an aligned plain-text table.
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:>w$}"))
            .collect();
        println!("{}", padded.join("  "));
    };
    line(header.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_percentiles() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(vec![]).is_nan());
        let mut l = Latency::default();
        for us in 1..=1000u64 {
            l.record(Duration::from_micros(us));
        }
        let s = l.summary();
        assert!((s.p50_us - 500.0).abs() < 1.0, "{s:?}");
        assert!((s.p99_us - 990.0).abs() < 1.5, "{s:?}");
        assert!((s.max_us - 1000.0).abs() < 1.5, "{s:?}");
        let m = median_summary(&[
            s,
            Summary { p50_us: 0.0, ..s },
            Summary { p50_us: 1e9, ..s },
        ]);
        assert_eq!(m.p50_us, s.p50_us);
    }
}
