//! The donor's data-plane counters and service-time histogram: the one
//! place lookups, rows, bytes, errors and connections are counted. The
//! lookup path does relaxed atomic adds and one record into the latency
//! histogram (an uncontended lock, no allocation); readers (`Stats` over
//! gRPC, `/metrics`) take a [`StatsSnapshot`] and do the arithmetic there.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use daemon_runtime::latency::Latency;

use engram_protocol::ErrorCode;
use engram_sync::Mutex;

/// Error codes counted one by one; larger codes share the last slot.
pub const ERROR_SLOTS: usize = 16;

/// The service-time histogram: the rack's latency histogram (to 1%) and
/// the exact sum Prometheus wants. Recording takes an uncontended lock for
/// tens of nanoseconds and never allocates.
#[derive(Debug)]
pub struct ServiceTime(Mutex<(Latency, u64)>);

impl Default for ServiceTime {
    fn default() -> Self {
        Self(Mutex::new((Latency::coarse(), 0)))
    }
}

impl ServiceTime {
    /// Count one sample.
    #[inline]
    pub fn record(&self, d: Duration) {
        let mut g = self.0.lock();
        g.0.record(d);
        g.1 =
            g.1.saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    fn snapshot(&self) -> ServiceTimeSnapshot {
        let g = self.0.lock();
        ServiceTimeSnapshot {
            latency: g.0.clone(),
            sum_ns: g.1,
        }
    }
}

/// Service times at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceTimeSnapshot {
    /// Every sample so far.
    pub latency: Latency,
    /// Sum of every sample.
    pub sum_ns: u64,
}

impl ServiceTimeSnapshot {
    /// Samples counted.
    pub fn count(&self) -> u64 {
        self.latency.count()
    }

    /// The `q` quantile (0..=1) in nanoseconds, never above the maximum; 0
    /// with no samples.
    pub fn quantile_ns(&self, q: f64) -> f64 {
        self.latency.quantile(q).as_nanos() as f64
    }

    /// The slowest sample, in nanoseconds.
    pub fn max_ns(&self) -> u64 {
        self.latency.max().as_nanos() as u64
    }

    /// Samples in each Prometheus bucket: at or below each of `bounds_ns`
    /// (ascending) and above the one before, then the rest. Not cumulative.
    pub fn buckets(&self, bounds_ns: &[u64]) -> Vec<u64> {
        let mut out = Vec::with_capacity(bounds_ns.len() + 1);
        let mut below = 0;
        for &b in bounds_ns {
            let n = self.latency.count_at_or_below(Duration::from_nanos(b));
            out.push(n - below.min(n));
            below = n;
        }
        out.push(self.count().saturating_sub(below));
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
    /// Pings answered (a node's warm-up before each step, its probes).
    pub pings: AtomicU64,
    /// Time from a whole Lookup frame to its answer encoded.
    pub service: ServiceTime,
    /// QUIC Initials whose source address a token proved (a Retry's, or
    /// one from NEW_TOKEN).
    pub quic_validated: AtomicU64,
    errors: [AtomicU64; ERROR_SLOTS],
    refusals: Mutex<std::collections::BTreeMap<(&'static str, &'static str), u64>>,
    connection_errors: Mutex<std::collections::BTreeMap<&'static str, u64>>,
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

    /// A peer turned away by a security check on `plane` (`data`,
    /// `control`) for `reason` (a short snake_case word). Rare: a lock and
    /// a map are fine here.
    pub fn refusal(&self, plane: &'static str, reason: &'static str) {
        let mut m = self.refusals.lock();
        *m.entry((plane, reason)).or_default() += 1;
    }

    /// Refusals so far, by plane and reason; the pre-auth budget's
    /// evictions from the start, at 0 until one happens, so a rate over
    /// them (an alert, a dashboard) has a series to read.
    pub fn refusals(&self) -> Vec<((&'static str, &'static str), u64)> {
        let mut m = self.refusals.lock().clone();
        for plane in ["data", "control"] {
            m.entry((plane, "preauth_evicted")).or_default();
        }
        m.into_iter().collect()
    }

    /// A client session ended on an error, for `reason` (a short
    /// snake_case word: `write_timeout`, `peer_reset`, ...). Once per
    /// connection at most: a lock and a map are fine here.
    pub fn connection_error(&self, reason: &'static str) {
        let mut m = self.connection_errors.lock();
        *m.entry(reason).or_default() += 1;
    }

    /// Sessions ended on an error so far, by reason.
    pub fn connection_errors(&self) -> Vec<(&'static str, u64)> {
        let m = self.connection_errors.lock();
        m.iter().map(|(k, v)| (*k, *v)).collect()
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
            pings: load(&self.pings),
            quic_validated: load(&self.quic_validated),
            errors: std::array::from_fn(|i| load(&self.errors[i])),
            service: self.service.snapshot(),
        }
    }
}

/// The counters at one moment.
#[derive(Debug, Clone, PartialEq)]
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
    /// Pings answered.
    pub pings: u64,
    /// Bytes of Rows frames written.
    pub bytes: u64,
    /// QUIC Initials whose source address a token proved.
    pub quic_validated: u64,
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
    fn quantiles_follow_the_samples_and_never_pass_the_max() {
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
        assert_eq!(snap.sum_ns, 900 * 20_000 + 90 * 200_000 + 10 * 3_000_000);
        let near = |got: f64, want: f64| (got - want).abs() <= want * 0.01;
        assert!(near(snap.max_ns() as f64, 3e6), "{}", snap.max_ns());
        assert!(near(snap.quantile_ns(0.5), 20_000.0));
        assert!(near(snap.quantile_ns(0.99), 200_000.0));
        assert!(near(snap.quantile_ns(0.999), 3e6));
        assert!(snap.quantile_ns(1.0) <= snap.max_ns() as f64);
    }

    #[test]
    fn buckets_keep_every_sample() {
        let s = ServiceTime::default();
        for us in [1, 5, 6, 10, 11, 99, 100, 101, 5_000_000] {
            s.record(Duration::from_micros(us));
        }
        let g = s.snapshot().buckets(&[5_000, 10_000, 100_000]);
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
