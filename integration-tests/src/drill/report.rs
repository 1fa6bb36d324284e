//! What a drill measured and whether its invariants held: the timeline in
//! buckets (tokens/s, worst stall, rows per source, failovers, failed and
//! zero-served tokens), the figures (worst stall against its bound,
//! re-admission time against two probe intervals), and the checks.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::{Result, bail};
use inference_node::model::{Checksum, StepKind, StepRecord};

use super::{Env, Event, Outcome, Plan, SCHED_ALLOWANCE_US};

/// A drill missed a bound on time only (a stall, a hedge share, a close
/// time), with every output right: the kind of miss a stalled VM causes,
/// which a test may run again. Every other failure is a plain error.
#[derive(Debug)]
pub struct TimingMiss(pub String);

impl std::fmt::Display for TimingMiss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TimingMiss {}

/// Fail with a [`TimingMiss`] unless `ok`.
macro_rules! ensure_timing {
    ($ok:expr, $($fmt:tt)+) => {
        let ok: bool = $ok;
        if !ok {
            return Err($crate::drill::report::TimingMiss(format!($($fmt)+)).into());
        }
    };
}
pub(crate) use ensure_timing;

/// Position `(seq, index)` -> checksum of its fused output.
pub fn checksums(steps: &[StepRecord]) -> BTreeMap<(u32, u32), Checksum> {
    steps
        .iter()
        .flat_map(|s| &s.positions)
        .map(|p| ((p.seq, p.index), p.checksum))
        .collect()
}

/// One slice of the run's time.
#[derive(Debug, Clone, Default)]
pub struct Bucket {
    /// Its start, seconds into the run.
    pub start_s: f64,
    /// Steps that ended in it.
    pub steps: u64,
    /// Their rate.
    pub tokens_per_second: f64,
    /// Worst stall of a step in it, microseconds.
    pub stall_max_us: f64,
    /// Rows served per source (both tables).
    pub rows_by_source: BTreeMap<String, u64>,
    /// Failovers.
    pub failovers: u64,
    /// Hedges sent.
    pub hedges: u64,
    /// Steps with a table that failed.
    pub failed: u64,
    /// Steps with zeros served by policy.
    pub zeros: u64,
}

/// Whether a step had a table that failed.
pub fn failed(s: &StepRecord) -> bool {
    s.tables.iter().any(|t| t.error.is_some())
}

/// Whether a step had a table served as zeros by policy.
pub fn zeros(s: &StepRecord) -> bool {
    s.tables
        .iter()
        .any(|t| t.source.as_deref() == Some("zeros"))
}

/// Whether `source` served a table of the step.
pub fn served_by(s: &StepRecord, source: &str) -> bool {
    s.tables.iter().any(|t| {
        t.source
            .as_deref()
            .is_some_and(|x| x.split('+').any(|p| p == source))
    })
}

/// The steps cut into buckets of `width_s` by their end.
pub fn buckets(steps: &[StepRecord], width_s: f64) -> Vec<Bucket> {
    let mut out: Vec<Bucket> = Vec::new();
    for s in steps {
        let end_s = (s.start_us + s.time_us) / 1e6;
        let k = (end_s / width_s).floor().max(0.0) as usize;
        while out.len() <= k {
            let start_s = out.len() as f64 * width_s;
            out.push(Bucket {
                start_s,
                ..Bucket::default()
            });
        }
        let b = &mut out[k];
        b.steps += 1;
        b.stall_max_us = b.stall_max_us.max(s.stall_us);
        for t in &s.tables {
            let src = t.source.clone().unwrap_or_else(|| "failed".into());
            *b.rows_by_source.entry(src).or_default() += t.rows as u64;
            b.failovers += u64::from(t.failovers);
            b.hedges += u64::from(t.hedges);
        }
        b.failed += u64::from(failed(s));
        b.zeros += u64::from(zeros(s));
    }
    for b in &mut out {
        b.tokens_per_second = b.steps as f64 / width_s;
    }
    out
}

/// A drill's result.
#[derive(Debug, Clone)]
pub struct Report {
    /// The drill's name.
    pub name: String,
    /// What it does, in a sentence.
    pub about: String,
    /// The trace.
    pub steps: Vec<StepRecord>,
    /// What the drill did, on the node's clock.
    pub events: Vec<Event>,
    /// The token rate.
    pub rate: f64,
    /// Figures worth quoting: (what, value).
    pub figures: Vec<(String, String)>,
    /// The worst stall of any decode step, microseconds.
    pub worst_stall_us: f64,
    /// What the stall may not exceed: hard timeout + one SSD fetch + the
    /// scheduling allowance.
    pub stall_bound_us: f64,
    /// Re-admissions measured: (donor, seconds from healthy to serving).
    pub readmitted: Vec<(String, f64)>,
    /// Two probe intervals plus a token and the allowance, seconds.
    pub readmit_bound_s: f64,
    /// Positions whose output equals the reference's.
    pub identical: usize,
    /// All positions.
    pub positions: usize,
    /// Steps with a failed table.
    pub failed: usize,
    /// Steps with zeros served by policy.
    pub zeros: usize,
}

impl Report {
    /// The common checks on `out`: outputs equal to the reference (zeros
    /// by policy aside), no failed token where the route has the SSD copy,
    /// every stall within its bound.
    pub fn check(name: &str, about: &str, env: &Env, plan: &Plan, out: &Outcome) -> Result<Self> {
        Self::check_with(name, about, env, plan, out, &env.reference)
    }

    /// [`Self::check`] against `reference`: each position's checksum, by
    /// sequence and index, from a run of the same shape on local RAM.
    pub fn check_with(
        name: &str,
        about: &str,
        env: &Env,
        plan: &Plan,
        out: &Outcome,
        reference: &BTreeMap<(u32, u32), Checksum>,
    ) -> Result<Self> {
        let mut r = Self {
            name: name.into(),
            about: about.into(),
            steps: out.steps.clone(),
            events: out.events.clone(),
            rate: out.rate,
            figures: Vec::new(),
            // A prefill sweep's stall grows with its length (many messages,
            // each with the hard timeout): only decode steps are bounded.
            worst_stall_us: out
                .steps
                .iter()
                .filter(|s| s.kind != StepKind::Prefill)
                .map(|s| s.stall_us)
                .fold(0.0, f64::max),
            stall_bound_us: plan.hard_timeout_ms as f64 * 1e3
                + plan.ssd_fetch_us.unwrap_or(env.ssd_fetch_us)
                + SCHED_ALLOWANCE_US,
            readmitted: Vec::new(),
            readmit_bound_s: (2.0 * plan.probe_interval_ms as f64 * 1e3
                + 1e6 / out.rate
                + SCHED_ALLOWANCE_US)
                / 1e6,
            identical: 0,
            positions: 0,
            failed: out.steps.iter().filter(|s| failed(s)).count(),
            zeros: out.steps.iter().filter(|s| zeros(s)).count(),
        };
        let wrong = r.compare(out, reference, env.model.carry());
        r.figures.push((
            "outputs identical to local RAM".into(),
            format!("{}/{} positions", r.identical, r.positions),
        ));
        r.figures.push((
            "worst stall".into(),
            format!(
                "{:.2} ms (bound {:.2} ms: hard timeout {} ms + SSD fetch {:.2} ms + {:.0} ms allowance)",
                r.worst_stall_us / 1e3,
                r.stall_bound_us / 1e3,
                plan.hard_timeout_ms,
                plan.ssd_fetch_us.unwrap_or(env.ssd_fetch_us) / 1e3,
                SCHED_ALLOWANCE_US / 1e3
            ),
        ));
        if !wrong.is_empty() {
            bail!(
                "{} positions fused output that differs from local RAM (first: step {}, position {})\n{}",
                wrong.len(),
                wrong[0].0,
                wrong[0].1,
                r.timeline(0.5)
            );
        }
        if plan.has_copy() && r.failed > 0 {
            bail!(
                "{} steps failed although the route has the SSD copy\n{}",
                r.failed,
                r.timeline(0.5)
            );
        }
        ensure_timing!(
            r.worst_stall_us <= r.stall_bound_us,
            "worst stall {:.2} ms is over its bound {:.2} ms\n{}",
            r.worst_stall_us / 1e3,
            r.stall_bound_us / 1e3,
            r.timeline(0.5)
        );
        Ok(r)
    }

    /// Compare every fused position of `out` with the local-RAM
    /// `reference`, counting the identical ones: the `(step, position)` of
    /// each that differs. A failed or zero-filled step's positions do not
    /// count, nor the next `carry` positions of their sequences (a model
    /// whose fusion carries state along a sequence: Qwen4Exp's
    /// convolution reads the last 9 positions' inputs).
    fn compare(
        &mut self,
        out: &Outcome,
        reference: &BTreeMap<(u32, u32), Checksum>,
        carry: u32,
    ) -> Vec<(u64, u32)> {
        let mut wrong = Vec::new();
        // Each sequence's last suppressed position.
        let mut last: BTreeMap<u32, u32> = BTreeMap::new();
        for s in &out.steps {
            let suppressed = failed(s) || zeros(s);
            for p in &s.positions {
                if suppressed {
                    last.insert(p.seq, p.index);
                }
                let reached = last
                    .get(&p.seq)
                    .is_some_and(|&l| p.index <= l.saturating_add(carry));
                self.positions += 1;
                match reference.get(&(p.seq, p.index)) {
                    Some(c) if *c == p.checksum => self.identical += 1,
                    _ if reached => {}
                    _ => wrong.push((s.step, p.index)),
                }
            }
        }
        wrong
    }

    /// The first step at or after `from_us` that `source` served, if any.
    pub fn first_use(&self, source: &str, from_us: f64) -> Option<&StepRecord> {
        self.steps
            .iter()
            .find(|s| s.start_us >= from_us && served_by(s, source))
    }

    /// Check that `source` serves again within two probe intervals of
    /// `healthy_us` (when it was healthy again), and record the time.
    pub fn readmitted(&mut self, source: &str, healthy_us: f64) -> Result<f64> {
        let Some(s) = self.first_use(source, healthy_us) else {
            bail!(
                "{source} never served again after it was healthy at {:.2} s\n{}",
                healthy_us / 1e6,
                self.timeline(0.5)
            );
        };
        let after = (s.start_us - healthy_us).max(0.0) / 1e6;
        self.readmitted.push((source.to_string(), after));
        self.figures.push((
            format!("{source} re-admitted"),
            format!(
                "{:.0} ms after it was healthy (bound {:.0} ms: two probe intervals + a token + allowance)",
                after * 1e3,
                self.readmit_bound_s * 1e3
            ),
        ));
        ensure_timing!(
            after <= self.readmit_bound_s,
            "{source} served again {:.0} ms after it was healthy, over the {:.0} ms bound\n{}",
            after * 1e3,
            self.readmit_bound_s * 1e3,
            self.timeline(0.5)
        );
        Ok(after)
    }

    /// Check that `source` served no step that started in `[from_us, to_us)`.
    pub fn never_used(&self, source: &str, from_us: f64, to_us: f64) -> Result<()> {
        if let Some(s) = self
            .steps
            .iter()
            .find(|s| s.start_us >= from_us && s.start_us < to_us && served_by(s, source))
        {
            bail!(
                "{source} served step {} at {:.2} s, inside [{:.2} s, {:.2} s) where it must not\n{}",
                s.step,
                s.start_us / 1e6,
                from_us / 1e6,
                to_us / 1e6,
                self.timeline(0.5)
            );
        }
        Ok(())
    }

    /// Check that `source` served every table of every step, with no
    /// failover (a host-local donor whose mapping serves through its own
    /// restart).
    pub fn all_from(&self, source: &str) -> Result<()> {
        let failovers: u32 = self
            .steps
            .iter()
            .flat_map(|s| &s.tables)
            .map(|t| t.failovers)
            .sum();
        let elsewhere = self
            .steps
            .iter()
            .filter(|s| s.tables.iter().any(|t| t.source.as_deref() != Some(source)))
            .count();
        if failovers > 0 || elsewhere > 0 {
            bail!(
                "{failovers} failovers and {elsewhere} steps not served by {source} alone\n{}",
                self.timeline(0.5)
            );
        }
        Ok(())
    }

    /// Steps that started in `[from_us, to_us)`.
    pub fn between(&self, from_us: f64, to_us: f64) -> impl Iterator<Item = &StepRecord> {
        self.steps
            .iter()
            .filter(move |s| s.start_us >= from_us && s.start_us < to_us)
    }

    /// Add a figure.
    pub fn figure(&mut self, what: impl Into<String>, value: impl Into<String>) {
        self.figures.push((what.into(), value.into()));
    }

    /// The source columns: names seen, donors first.
    pub fn sources(&self) -> Vec<String> {
        let mut cols: Vec<String> = Vec::new();
        for s in &self.steps {
            for t in &s.tables {
                let n = t.source.clone().unwrap_or_else(|| "failed".into());
                if !cols.contains(&n) {
                    cols.push(n);
                }
            }
        }
        cols.sort_by_key(|c| (!c.starts_with("donor"), c.clone()));
        cols
    }

    /// The timeline as a table (buckets of `width_s`), its events, then the figures.
    pub fn timeline(&self, width_s: f64) -> String {
        let cols = self.sources();
        let mut t = format!("drill {}: {}\n", self.name, self.about);
        let _ = write!(t, "{:>7} {:>9} {:>12}", "time s", "tokens/s", "worst stall");
        for c in &cols {
            let _ = write!(t, " {:>9}", c);
        }
        let _ = writeln!(
            t,
            " {:>9} {:>6} {:>6} {:>6}  events",
            "failovers", "hedges", "failed", "zeros"
        );
        let bs = buckets(&self.steps, width_s);
        let mut events = self.events.iter().peekable();
        for b in &bs {
            let _ = write!(
                t,
                "{:>7.1} {:>9.0} {:>9.2} ms",
                b.start_s,
                b.tokens_per_second,
                b.stall_max_us / 1e3
            );
            for c in &cols {
                let _ = write!(t, " {:>9}", b.rows_by_source.get(c).copied().unwrap_or(0));
            }
            let _ = write!(
                t,
                " {:>9} {:>6} {:>6} {:>6} ",
                b.failovers, b.hedges, b.failed, b.zeros
            );
            let end_us = (b.start_s + width_s) * 1e6;
            let mut here = Vec::new();
            while let Some(e) = events.next_if(|e| e.at_us < end_us) {
                here.push(format!("{:.2} s {}", e.at_us / 1e6, e.what));
            }
            let _ = writeln!(t, " {}", here.join("; "));
        }
        for e in events {
            let _ = writeln!(t, "{:>7} {:.2} s {}", "", e.at_us / 1e6, e.what);
        }
        let _ = writeln!(
            t,
            "{:>7} (rows per source per bucket of {width_s} s; the last bucket may be partial)",
            ""
        );
        for (k, v) in &self.figures {
            let _ = writeln!(t, "  {k}: {v}");
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use anyhow::{Context, Result, ensure};

    use super::TimingMiss;

    fn check(stall_ms: u32, sources_ok: bool) -> Result<()> {
        ensure!(sources_ok, "a step was served by the wrong source");
        ensure_timing!(stall_ms <= 30, "worst stall {stall_ms} ms");
        Ok(())
    }

    #[test]
    fn only_a_missed_bound_on_time_is_a_timing_miss() {
        assert!(check(10, true).is_ok());
        let slow = check(40, true).context("drill kill-9").unwrap_err();
        assert!(slow.downcast_ref::<TimingMiss>().is_some());
        assert!(format!("{slow:#}").contains("worst stall 40 ms"));
        let wrong = check(40, false).unwrap_err();
        assert!(wrong.downcast_ref::<TimingMiss>().is_none());
    }
}
