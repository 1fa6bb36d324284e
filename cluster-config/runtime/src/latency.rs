//! The one latency histogram the rack computes percentiles with
//! (hdrhistogram): the donor's service times, the node's fetch and stall
//! percentiles, its hedging percentile, the canary's and the benchmarks'.
//!
//! Its size is fixed whatever it counts (a run of ten million tokens costs
//! what a run of ten does), it never allocates while recording, and values
//! outside its range are clamped into it (1 ns .. [`Latency::MAX`]), so
//! recording never fails.

use std::time::Duration;

use hdrhistogram::Histogram;

/// Percentiles of one series, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct LatencySummary {
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Slowest sample.
    pub max_us: f64,
}

/// A latency histogram in nanoseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        Self::new()
    }
}

impl Latency {
    /// The largest value kept apart; slower samples count as this.
    pub const MAX: Duration = Duration::from_secs(100);

    /// Three significant digits (values within 0.1%): reports and
    /// benchmarks. About 300 KB.
    pub fn new() -> Self {
        Self::with_digits(3)
    }

    /// Two significant digits (values within 1%), about 40 KB: for the many
    /// small windows of routing decisions and per-second lines.
    pub fn coarse() -> Self {
        Self::with_digits(2)
    }

    fn with_digits(digits: u8) -> Self {
        let max = Self::MAX.as_nanos() as u64;
        // The bounds and digits are constants hdrhistogram accepts.
        Self(Histogram::new_with_bounds(1, max, digits).expect("valid histogram bounds"))
    }

    /// Count one sample.
    #[inline]
    pub fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.record_ns(ns);
    }

    /// Count one sample given in microseconds (negative and NaN count as 0).
    #[inline]
    pub fn record_us(&mut self, us: f64) {
        let ns = (us * 1e3).max(0.0);
        self.record_ns(if ns.is_finite() { ns as u64 } else { u64::MAX });
    }

    #[inline]
    fn record_ns(&mut self, ns: u64) {
        let ns = ns.clamp(1, self.0.high());
        // In range by the clamp: recording cannot fail.
        let _ = self.0.record(ns);
    }

    /// Samples counted.
    pub fn count(&self) -> u64 {
        self.0.len()
    }

    /// The `q` quantile (0..=1); zero with no samples.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let q = if q.is_nan() { 0.0 } else { q.clamp(0.0, 1.0) };
        Duration::from_nanos(self.0.value_at_quantile(q).min(self.0.max()))
    }

    /// The `q` quantile in microseconds.
    pub fn quantile_us(&self, q: f64) -> f64 {
        self.quantile(q).as_nanos() as f64 / 1e3
    }

    /// The slowest sample (to the histogram's precision); zero with none.
    pub fn max(&self) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.0.max())
    }

    /// p50, p99, p99.9 and max in microseconds.
    pub fn summary(&self) -> LatencySummary {
        LatencySummary {
            p50_us: self.quantile_us(0.5),
            p99_us: self.quantile_us(0.99),
            p999_us: self.quantile_us(0.999),
            max_us: self.max().as_nanos() as f64 / 1e3,
        }
    }

    /// Samples at or below `d` (to the histogram's precision): a
    /// Prometheus bucket.
    pub fn count_at_or_below(&self, d: Duration) -> u64 {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        if self.0.is_empty() || ns == 0 {
            return 0;
        }
        self.0.count_between(0, ns.min(self.0.high()))
    }

    /// Add every sample of `other` (same precision or not).
    pub fn add(&mut self, other: &Latency) {
        // Same bounds on both sides: adding cannot fail.
        let _ = self.0.add(&other.0);
    }

    /// Forget every sample.
    pub fn clear(&mut self) {
        self.0.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_the_precision_and_never_past_the_max() {
        let mut l = Latency::new();
        assert_eq!(l.quantile(0.5), Duration::ZERO);
        assert_eq!(l.max(), Duration::ZERO);
        for us in 1..=1000u64 {
            l.record(Duration::from_micros(us));
        }
        assert_eq!(l.count(), 1000);
        let near = |got: f64, want: f64| (got - want).abs() <= want * 0.002;
        assert!(near(l.quantile_us(0.5), 500.0), "{}", l.quantile_us(0.5));
        assert!(near(l.quantile_us(0.99), 990.0), "{}", l.quantile_us(0.99));
        assert!(near(l.quantile_us(1.0), 1000.0));
        assert!(l.quantile(1.0) <= l.max());
        let s = l.summary();
        assert!(near(s.p999_us, 999.0) && near(s.max_us, 1000.0), "{s:?}");
    }

    #[test]
    fn out_of_range_values_are_clamped_not_lost() {
        let mut l = Latency::coarse();
        l.record(Duration::ZERO);
        l.record(Duration::from_secs(10_000));
        l.record_us(f64::NAN);
        l.record_us(-5.0);
        l.record_us(f64::INFINITY);
        assert_eq!(l.count(), 5);
        assert!(l.max() >= Latency::MAX.mul_f64(0.99));
    }

    #[test]
    fn buckets_count_at_or_below_and_histograms_add() {
        let mut a = Latency::new();
        let mut b = Latency::coarse();
        for us in [5, 10, 20, 40] {
            a.record(Duration::from_micros(us));
            b.record(Duration::from_micros(us * 100));
        }
        assert_eq!(a.count_at_or_below(Duration::from_micros(10)), 2);
        assert_eq!(a.count_at_or_below(Duration::from_micros(4)), 0);
        assert_eq!(a.count_at_or_below(Duration::from_secs(1)), 4);
        a.add(&b);
        assert_eq!(a.count(), 8);
        assert!(a.quantile_us(1.0) >= 3990.0);
        a.clear();
        assert_eq!(a.count(), 0);
    }
}
