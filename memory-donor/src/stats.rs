//! The donor's data-plane counters and service-time histogram: the one
//! place lookups, rows, bytes, errors and connections are counted. The
//! lookup path only does relaxed atomic adds into fixed arrays (no lock, no
//! allocation); readers (`Stats` over gRPC, `/metrics`) take a
//! [`StatsSnapshot`] and do the arithmetic there.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use engram_protocol::ErrorCode;

/// Sub-steps of one decade (times 10^k x 100 ns): buckets about 10-20% wide.
const STEPS: [u64; 16] = [
    10, 12, 14, 16, 18, 20, 25, 30, 35, 40, 45, 50, 60, 70, 80, 90,
];
/// Decades covered: 1 us .. 1 s.
const DECADES: usize = 6;

/// Upper bounds (inclusive, in nanoseconds) of the service-time buckets:
/// 1 us, 1.2 us, ... 900 ms, 1 s. One more bucket holds everything slower.
pub const BOUNDS_NS: [u64; STEPS.len() * DECADES + 1] = {
    let mut b = [0u64; STEPS.len() * DECADES + 1];
    let mut scale = 100;
    let mut d = 0;
    while d < DECADES {
        let mut i = 0;
        while i < STEPS.len() {
            b[d * STEPS.len() + i] = STEPS[i] * scale;
            i += 1;
        }
        scale *= 10;
        d += 1;
    }
    b[STEPS.len() * DECADES] = 10 * scale;
    b
};

const BUCKETS: usize = BOUNDS_NS.len() + 1;

/// Error codes counted one by one; larger codes share the last slot.
pub const ERROR_SLOTS: usize = 16;

/// A histogram of service times, lock-free.
#[derive(Debug)]
pub struct ServiceTime {
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
    max_ns: AtomicU64,
}

impl Default for ServiceTime {
    fn default() -> Self {
        Self {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
            max_ns: AtomicU64::new(0),
        }
    }
}

impl ServiceTime {
    /// Count one sample.
    #[inline]
    pub fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = BOUNDS_NS.partition_point(|&b| b < ns);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        // Most samples are not a new maximum: skip the read-modify-write then.
        if ns > self.max_ns.load(Ordering::Relaxed) {
            self.max_ns.fetch_max(ns, Ordering::Relaxed);
        }
    }

    fn snapshot(&self) -> ServiceTimeSnapshot {
        ServiceTimeSnapshot {
            buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
            max_ns: self.max_ns.load(Ordering::Relaxed),
        }
    }
}

/// Service times at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceTimeSnapshot {
    /// Samples per bucket; bucket `i` holds `(BOUNDS_NS[i-1], BOUNDS_NS[i]]`,
    /// the last one everything above the last bound.
    pub buckets: [u64; BUCKETS],
    /// Sum of every sample.
    pub sum_ns: u64,
    /// Largest sample.
    pub max_ns: u64,
}

impl ServiceTimeSnapshot {
    /// Samples counted.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// The `q` quantile (0..=1) in nanoseconds, interpolated linearly inside
    /// its bucket and never above the maximum; 0 with no samples.
    pub fn quantile_ns(&self, q: f64) -> f64 {
        let count = self.count();
        if count == 0 {
            return 0.0;
        }
        let rank = (q.clamp(0.0, 1.0) * count as f64).ceil().max(1.0);
        let mut below = 0u64;
        for (i, &n) in self.buckets.iter().enumerate() {
            if n > 0 && (below + n) as f64 >= rank {
                let lo = if i == 0 { 0 } else { BOUNDS_NS[i - 1] } as f64;
                let hi = BOUNDS_NS.get(i).map_or(self.max_ns as f64, |&b| b as f64);
                let at = lo + (hi - lo) * (rank - below as f64) / n as f64;
                return at.min(self.max_ns as f64);
            }
            below += n;
        }
        self.max_ns as f64
    }

    /// Samples at or below each of `bounds_ns` (ascending, each one of
    /// [`BOUNDS_NS`]), not cumulative, then the rest: Prometheus buckets.
    pub fn regroup(&self, bounds_ns: &[u64]) -> Vec<u64> {
        let mut out = vec![0u64; bounds_ns.len() + 1];
        let mut g = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            let upper = BOUNDS_NS.get(i).copied().unwrap_or(u64::MAX);
            while g < bounds_ns.len() && bounds_ns[g] < upper {
                g += 1;
            }
            out[g] += n;
        }
        out
    }
}

/// Counters for the data plane (relaxed atomics: cheap on the lookup path).
#[derive(Debug, Default)]
pub struct Stats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Connections refused at the bound.
    pub refused: AtomicU64,
    /// Connections open now.
    pub open: AtomicU64,
    /// Lookups answered.
    pub lookups: AtomicU64,
    /// Rows served.
    pub rows: AtomicU64,
    /// Bytes of Rows frames written.
    pub bytes: AtomicU64,
    /// Time from a whole Lookup frame to its answer encoded.
    pub service: ServiceTime,
    errors: [AtomicU64; ERROR_SLOTS],
}

impl Stats {
    /// One lookup answered: `rows` rows in a frame of `bytes` bytes, taking `took`.
    #[inline]
    pub fn lookup(&self, rows: u64, bytes: u64, took: Duration) {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        self.rows.fetch_add(rows, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.service.record(took);
    }

    /// One error answered with `code`.
    #[inline]
    pub fn error(&self, code: ErrorCode) {
        self.errors[Self::slot(code)].fetch_add(1, Ordering::Relaxed);
    }

    fn slot(code: ErrorCode) -> usize {
        usize::from(code.to_u16()).min(ERROR_SLOTS - 1)
    }

    /// Errors answered with `code`.
    pub fn errors(&self, code: ErrorCode) -> u64 {
        self.errors[Self::slot(code)].load(Ordering::Relaxed)
    }

    /// Every counter at one moment (each read on its own, relaxed).
    pub fn snapshot(&self) -> StatsSnapshot {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            connections: load(&self.connections),
            refused: load(&self.refused),
            open: load(&self.open),
            lookups: load(&self.lookups),
            rows: load(&self.rows),
            bytes: load(&self.bytes),
            errors: std::array::from_fn(|i| load(&self.errors[i])),
            service: self.service.snapshot(),
        }
    }
}

/// The counters at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Connections accepted.
    pub connections: u64,
    /// Connections refused at the bound.
    pub refused: u64,
    /// Connections open.
    pub open: u64,
    /// Lookups answered.
    pub lookups: u64,
    /// Rows served.
    pub rows: u64,
    /// Bytes of Rows frames written.
    pub bytes: u64,
    /// Errors by code (index: the code's number; the last slot also holds larger codes).
    pub errors: [u64; ERROR_SLOTS],
    /// Service times.
    pub service: ServiceTimeSnapshot,
}

impl StatsSnapshot {
    /// `(code, count)` for every code seen at least once.
    pub fn errors_seen(&self) -> impl Iterator<Item = (ErrorCode, u64)> + '_ {
        self.errors
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .filter_map(|(i, n)| Some((ErrorCode::from_u16(u16::try_from(i).ok()?)?, *n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_ascend_from_one_microsecond_to_one_second() {
        assert_eq!(BOUNDS_NS[0], 1_000);
        assert_eq!(*BOUNDS_NS.last().expect("bounds"), 1_000_000_000);
        assert!(BOUNDS_NS.windows(2).all(|w| w[0] < w[1]));
        for b in [5_000, 10_000, 100_000, 1_000_000, 100_000_000] {
            assert!(BOUNDS_NS.contains(&b), "{b}");
        }
    }

    #[test]
    fn quantiles_land_in_the_right_bucket_and_never_pass_the_max() {
        let s = ServiceTime::default();
        assert_eq!(s.snapshot().quantile_ns(0.5), 0.0);
        // 900 samples at 20 us, 90 at 200 us, 10 at 3 ms.
        for _ in 0..900 {
            s.record(Duration::from_micros(20));
        }
        for _ in 0..90 {
            s.record(Duration::from_micros(200));
        }
        for _ in 0..10 {
            s.record(Duration::from_millis(3));
        }
        let snap = s.snapshot();
        assert_eq!(snap.count(), 1000);
        assert_eq!(snap.max_ns, 3_000_000);
        let p50 = snap.quantile_ns(0.5);
        assert!((18_000.0..=20_000.0).contains(&p50), "{p50}");
        let p99 = snap.quantile_ns(0.99);
        assert!((180_000.0..=200_000.0).contains(&p99), "{p99}");
        let p999 = snap.quantile_ns(0.999);
        assert!((2_500_000.0..=3_000_000.0).contains(&p999), "{p999}");
        assert_eq!(snap.quantile_ns(1.0), 3_000_000.0);
        let slow = ServiceTime::default();
        slow.record(Duration::from_secs(7));
        assert_eq!(
            slow.snapshot().quantile_ns(0.5),
            7e9,
            "above the last bound: the max"
        );
    }

    #[test]
    fn regrouping_keeps_every_sample() {
        let s = ServiceTime::default();
        for us in [1, 5, 6, 10, 11, 99, 100, 101, 5_000_000] {
            s.record(Duration::from_micros(us));
        }
        let g = s.snapshot().regroup(&[5_000, 10_000, 100_000]);
        assert_eq!(g, vec![2, 2, 3, 2]);
    }

    #[test]
    fn errors_are_counted_by_code() {
        let s = Stats::default();
        s.error(ErrorCode::UnknownTable);
        s.error(ErrorCode::UnknownTable);
        s.error(ErrorCode::Busy);
        s.lookup(24, 6400, Duration::from_micros(3));
        let snap = s.snapshot();
        let seen: Vec<_> = snap.errors_seen().collect();
        assert_eq!(
            seen,
            vec![(ErrorCode::UnknownTable, 2), (ErrorCode::Busy, 1)]
        );
        assert_eq!((snap.lookups, snap.rows, snap.bytes), (1, 24, 6400));
        assert_eq!(s.errors(ErrorCode::Busy), 1);
    }
}
