//! What every drill does, whatever its fault: the run's length and the
//! fault's moments, the options, starting the rack and the node, and
//! checking the node's end. The drills' modules (`drills`, `storm`,
//! `handshakes`) build on it; the list of drills is `drills::ALL`.

use std::time::Duration;

use anyhow::{Result, bail};
use inference_node::model::StepKind;

use super::{Env, NodeRun, Outcome, Plan, Rack};
use crate::sample;

/// Length of each drill's run at its token rate, seconds.
pub const SECONDS: f64 = 6.0;
/// When the fault starts and when it ends (the donor is healthy again),
/// seconds into the run.
pub(super) const FAULT_AT: f64 = 2.0;
pub(super) const HEAL_AT: f64 = 4.0;

/// A drill's name and what it does, as its report shows them (handed to
/// the drills that live outside `drills`, which holds the list).
#[derive(Debug, Clone, Copy)]
pub(super) struct Named {
    pub name: &'static str,
    pub about: &'static str,
}

/// How the drills run.
#[derive(Debug, Clone, Copy)]
pub struct Opts {
    /// The node's token rate.
    pub tokens_per_second: f64,
    /// The seed of the random-schedule drills' schedule.
    pub seed: u64,
}

impl Opts {
    /// Positions in a run of `seconds`.
    pub fn tokens(&self, seconds: f64) -> u64 {
        (seconds * self.tokens_per_second).round() as u64
    }
}

/// The node's run and its end; `expect_ok`: it must exit 0.
pub(super) fn finish(run: NodeRun, o: &Opts, expect_ok: bool) -> Result<Outcome> {
    let out = run.finish(Duration::from_secs_f64(SECONDS * 4.0 + 60.0))?;
    if expect_ok && !out.success {
        bail!("the node failed:\n{}", out.log);
    }
    let want = o.tokens(SECONDS);
    let decoded = out
        .steps
        .iter()
        .filter(|s| s.kind != StepKind::Prefill)
        .count() as u64;
    if expect_ok && decoded != want {
        bail!("the node ran {decoded} decode steps, not {want}");
    }
    Ok(out)
}

/// Follow the run from the fault's moment to the heal's, a tenth of a
/// second at a time, sampling donor `donor`'s open connections; the most seen.
pub(super) fn max_open_during_fault(
    rack: &Rack,
    run: &mut NodeRun,
    o: &Opts,
    donor: &str,
) -> Result<f64> {
    let mut open_max = 0.0f64;
    let end_step = o.tokens(HEAL_AT);
    let mut step = o.tokens(FAULT_AT);
    while step < end_step {
        step = (step + o.tokens(0.1).max(1)).min(end_step);
        run.at_step(step)?;
        let m = rack.donor_metrics(donor)?;
        open_max = open_max.max(sample(&m, "engram_donor_connections_open").unwrap_or(0.0));
    }
    Ok(open_max)
}

/// Start the plan's rack and the node, and wait for the fault's moment.
pub(super) fn begin(env: &Env, plan: &Plan, o: &Opts) -> Result<(Rack, NodeRun)> {
    let rack = Rack::start(env, plan.clone())?;
    let mut run = rack.run_node(o.tokens(SECONDS), o.tokens_per_second)?;
    run.at_second(FAULT_AT)?;
    Ok((rack, run))
}
