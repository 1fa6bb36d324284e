//! What the node knows of one source's health, shared by every table's
//! router that uses it: the circuit breaker, version exclusions per table,
//! and recent latencies (for percentile hedging). Probes run from here.
//!
//! Breaker: `Closed` counts consecutive failures; at the threshold it opens
//! and the source gets no traffic. A probe that passes (the source answers
//! and serves the pinned versions) half-opens it: traffic flows again, the
//! first success or a second passing probe closes it, and any failure opens
//! it again (a lost hedge race only counts towards the threshold). A
//! version mismatch excludes the source for that table until a probe sees
//! the pinned digest again.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cluster_config::Hedge;
use daemon_runtime::latency::Latency;
use engram_protocol::TableDigest;
use engram_sync::Mutex;
use prometheus_client::metrics::gauge::Gauge;

use crate::source::{RowSource, SourceError};

/// Latencies kept for percentile hedging: the last 128 to 256 (two epochs
/// of 128, the older one dropped when the newer one is full).
const EPOCH: u64 = 128;
/// Fewer samples than this and a percentile is not trusted.
const MIN_SAMPLES: u64 = 32;
/// The cached percentile is recomputed after this many new samples.
const RECOMPUTE_EVERY: u32 = 32;

/// The breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breaker {
    /// Traffic flows.
    Closed,
    /// On trial after a passing probe.
    HalfOpen,
    /// No traffic until a probe passes.
    Open,
}

impl Breaker {
    /// 0 closed, 1 half-open, 2 open (the metrics gauge).
    pub fn as_gauge(self) -> i64 {
        match self {
            Self::Closed => 0,
            Self::HalfOpen => 1,
            Self::Open => 2,
        }
    }
}

#[derive(Debug)]
struct State {
    breaker: Breaker,
    failures: u32,
    excluded: Vec<u32>,
    /// This epoch's latencies, the previous epoch's, and both together
    /// (rebuilt when the percentile is recomputed).
    recent: Latency,
    older: Latency,
    both: Latency,
    since_recompute: u32,
    cached: Option<(f64, Duration)>,
}

/// One source with its health.
#[derive(Debug)]
pub struct SourceHealth {
    /// The source.
    pub source: Arc<dyn RowSource>,
    pinned: Vec<(u32, TableDigest)>,
    threshold: AtomicU32,
    state: Mutex<State>,
    gauge: Gauge,
}

/// Why a source was not asked for a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// It serves another version of the table.
    Excluded,
    /// Its circuit breaker is open.
    BreakerOpen,
    /// It said Goodbye.
    Draining,
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Excluded => "excluded: serves another version",
            Self::BreakerOpen => "circuit breaker open",
            Self::Draining => "draining",
        })
    }
}

impl SourceHealth {
    /// `pinned`: the tables this node reads from it and their versions;
    /// `threshold`: consecutive failures that open the breaker.
    pub fn new(
        source: Arc<dyn RowSource>,
        pinned: Vec<(u32, TableDigest)>,
        threshold: u32,
        gauge: Gauge,
    ) -> Self {
        // The series may be a replaced source's: start it at this one's state.
        gauge.set(Breaker::Closed.as_gauge());
        Self {
            source,
            pinned,
            threshold: AtomicU32::new(threshold.max(1)),
            state: Mutex::new(State {
                breaker: Breaker::Closed,
                failures: 0,
                excluded: Vec::new(),
                recent: Latency::coarse(),
                older: Latency::coarse(),
                both: Latency::coarse(),
                since_recompute: 0,
                cached: None,
            }),
            gauge,
        }
    }

    /// Consecutive failures that open the breaker from now on.
    pub fn set_threshold(&self, threshold: u32) {
        self.threshold.store(threshold.max(1), Ordering::Relaxed);
    }

    fn st(&self) -> engram_sync::MutexGuard<'_, State> {
        self.state.lock()
    }

    fn set(&self, st: &mut State, b: Breaker) {
        if st.breaker != b {
            tracing::info!(source = self.source.name(), from = ?st.breaker, to = ?b, "breaker");
            st.breaker = b;
            self.gauge.set(b.as_gauge());
        }
    }

    /// The breaker's state now.
    pub fn breaker(&self) -> Breaker {
        self.st().breaker
    }

    /// Whether a lookup of `table` may go to this source now.
    pub fn admissible(&self, table: u32) -> bool {
        let st = self.st();
        st.breaker != Breaker::Open && !st.excluded.contains(&table) && self.source.accepting()
    }

    /// Why not, for error messages.
    pub fn why_not(&self, table: u32) -> Skip {
        let st = self.st();
        if st.excluded.contains(&table) {
            Skip::Excluded
        } else if st.breaker == Breaker::Open {
            Skip::BreakerOpen
        } else {
            Skip::Draining
        }
    }

    /// A lookup succeeded in `latency`.
    pub fn on_success(&self, latency: Duration) {
        let mut st = self.st();
        st.failures = 0;
        if st.breaker == Breaker::HalfOpen {
            self.set(&mut st, Breaker::Closed);
        }
        if st.recent.count() >= EPOCH {
            let st = &mut *st;
            std::mem::swap(&mut st.older, &mut st.recent);
            st.recent.clear();
        }
        st.recent.record(latency);
        st.since_recompute += 1;
    }

    /// A lookup of `table` failed. Returns true when this opened the breaker.
    pub fn on_failure(&self, table: u32, err: &SourceError) -> bool {
        let mut st = self.st();
        match err {
            SourceError::VersionMismatch { .. } => {
                if !st.excluded.contains(&table) {
                    tracing::warn!(source = self.source.name(), table, error = %err, "excluded until it serves the pinned version");
                    st.excluded.push(table);
                }
                false
            }
            // A Goodbye is not a fault: the source stops taking lookups.
            SourceError::Draining | SourceError::BadRequest(_) => false,
            _ => {
                st.failures += 1;
                let open = st.breaker == Breaker::HalfOpen
                    || st.failures >= self.threshold.load(Ordering::Relaxed);
                if open && st.breaker != Breaker::Open {
                    tracing::warn!(source = self.source.name(), failures = st.failures, error = %err, "circuit breaker opens");
                    self.set(&mut st, Breaker::Open);
                    return true;
                }
                false
            }
        }
    }

    /// A lookup sent here lost the race to a source asked after it (a
    /// hedge or a failover). It counts towards the threshold like a
    /// failure, but even on trial (half-open) it takes `threshold` of them
    /// to open the breaker again: a donor just back from a restart may be
    /// slower than its peer for its first answers without being wrong.
    /// Returns true when this opened the breaker.
    pub fn on_lost_race(&self) -> bool {
        let mut st = self.st();
        st.failures += 1;
        if st.failures >= self.threshold.load(Ordering::Relaxed) && st.breaker != Breaker::Open {
            tracing::warn!(
                source = self.source.name(),
                failures = st.failures,
                "circuit breaker opens: lost every race"
            );
            self.set(&mut st, Breaker::Open);
            return true;
        }
        false
    }

    /// The delay after which a lookup sent here is hedged, if any; `None`
    /// when hedging is off or too few latencies are known yet.
    pub fn hedge_delay(&self, hedge: Hedge) -> Option<Duration> {
        match hedge {
            Hedge::Off => None,
            Hedge::Fixed(d) => Some(d),
            Hedge::Percentile(p) => {
                let mut st = self.st();
                if st.recent.count() + st.older.count() < MIN_SAMPLES {
                    return None;
                }
                match st.cached {
                    Some((cp, d)) if cp == p && st.since_recompute < RECOMPUTE_EVERY => Some(d),
                    _ => {
                        let st = &mut *st;
                        st.both.clear();
                        st.both.add(&st.older);
                        st.both.add(&st.recent);
                        let d = st.both.quantile(p / 100.0);
                        st.cached = Some((p, d));
                        st.since_recompute = 0;
                        Some(d)
                    }
                }
            }
        }
    }

    /// Whether a probe has something to find out.
    pub fn needs_probe(&self) -> bool {
        let st = self.st();
        st.breaker != Breaker::Closed || !st.excluded.is_empty() || !self.source.accepting()
    }

    /// Probe once and apply what it found.
    pub async fn probe(&self) {
        let res = self.source.probe().await;
        self.apply(res, false);
    }

    /// The first probe, at startup: a source that does not answer starts
    /// with its breaker open (lookups skip it until a probe passes).
    pub async fn probe_at_start(&self) {
        let res = self.source.probe().await;
        self.apply(res, true);
    }

    fn apply(&self, res: Result<Vec<(u32, TableDigest)>, SourceError>, at_start: bool) {
        let mut st = self.st();
        match res {
            Ok(tables) => {
                let mut all_pinned = true;
                for &(table, digest) in &self.pinned {
                    let matches = tables.iter().any(|&(t, d)| t == table && d == digest);
                    if matches {
                        if st.excluded.contains(&table) {
                            tracing::info!(
                                source = self.source.name(),
                                table,
                                "serves the pinned version again: re-admitted"
                            );
                        }
                        st.excluded.retain(|&t| t != table);
                    } else {
                        all_pinned = false;
                        if !st.excluded.contains(&table) {
                            tracing::warn!(
                                source = self.source.name(),
                                table,
                                "probe: not at the pinned version; excluded"
                            );
                            st.excluded.push(table);
                        }
                    }
                }
                if all_pinned {
                    match st.breaker {
                        Breaker::Open => self.set(&mut st, Breaker::HalfOpen),
                        Breaker::HalfOpen => self.set(&mut st, Breaker::Closed),
                        Breaker::Closed => {}
                    }
                    st.failures = 0;
                }
            }
            Err(e @ SourceError::VersionMismatch { table, .. }) => {
                if !st.excluded.contains(&table) {
                    tracing::warn!(source = self.source.name(), table, error = %e, "probe: serves another version; excluded");
                    st.excluded.push(table);
                }
            }
            Err(e) if at_start => {
                tracing::warn!(source = self.source.name(), error = %e, "not reachable at startup: excluded until a probe passes");
                self.set(&mut st, Breaker::Open);
            }
            Err(e) => {
                tracing::debug!(source = self.source.name(), error = %e, "probe failed");
                if st.breaker == Breaker::HalfOpen {
                    self.set(&mut st, Breaker::Open);
                }
            }
        }
    }

    /// Tend the source every `every` ([`RowSource::tend`]), whatever its
    /// breaker state, until the last other reference to this health record
    /// is dropped.
    pub async fn tend_loop(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if Arc::strong_count(&self) == 1 {
                return;
            }
            self.source.tend();
        }
    }

    /// Probe every `interval` while there is something to find out, until
    /// the last other reference to this health record is dropped.
    pub async fn probe_loop(self: Arc<Self>, interval: Duration) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            if Arc::strong_count(&self) == 1 {
                return;
            }
            if self.needs_probe() {
                self.probe().await;
            }
        }
    }
}
