//! The random-schedule drill: three donors serve both tables to the node
//! (route donor-a, donor-b, donor-c, ssd) while a schedule drawn from a
//! seed kills (`kill -9`), freezes (SIGSTOP) and drains (SIGTERM) them
//! and brings them back, several times in a run and overlapping, where
//! the scripted drills inject one fault at a fixed token. A donor killed
//! or drained comes back without its fd store, as without systemd: it
//! loads a new generation. The same seed gives the same schedule over
//! every transport, so the host path and the network's are compared on
//! one schedule (`random-host` against `random-tls`).
//!
//! Checked: every output equal to local RAM's, no failed step, the worst
//! stall within the common bound; reported: the schedule, the worst
//! step's hops and, over host sockets, the new generations served.

use anyhow::Result;
use engram_protocol::synthetic::SplitMix64;

use super::generation::{start_fresh, worst_step_hops};
use super::scaffold::{Named, Opts, finish};
use super::{DonorPlan, Env, NodeRun, Placement, Plan, Rack, Report};

/// The donors of the drill.
const DONORS: [&str; 3] = ["donor-a", "donor-b", "donor-c"];
/// Faults start from here (seconds into the run)...
const FIRST_S: f64 = 0.4;
/// ...and none starts after this, so that every donor is back well before
/// the run ends.
const LAST_S: f64 = 4.8;
/// A fault lasts 150 to 600 ms.
const FOR_MS: (u64, u64) = (150, 600);
/// The next fault starts 250 to 750 ms after the last one started.
const GAP_MS: (u64, u64) = (250, 750);
/// A donor back from a fault is left alone this long (the node maps its
/// new generation or re-admits it meanwhile).
const REST_S: f64 = 0.5;

/// What a fault does to a donor, and how it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `kill -9`; restarted without its fd store.
    Kill,
    /// SIGSTOP; SIGCONT.
    Stop,
    /// SIGTERM (a drain); restarted without its fd store.
    Term,
}

/// One fault of a schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fault {
    /// When it starts, seconds into the run.
    pub at_s: f64,
    /// Which donor ([`DONORS`]).
    pub donor: usize,
    /// What it does.
    pub kind: Kind,
    /// How long until the donor is brought back, seconds.
    pub for_s: f64,
}

/// The schedule of `seed`: faults from [`FIRST_S`] to [`LAST_S`], each on
/// a donor that is up, of a kind and length drawn from the seed.
pub fn schedule(seed: u64) -> Vec<Fault> {
    let mut rng = SplitMix64::new(seed);
    let mut free_at = [0.0f64; DONORS.len()];
    let mut out = Vec::new();
    let mut t = FIRST_S;
    while t <= LAST_S {
        let up: Vec<usize> = (0..DONORS.len()).filter(|&d| free_at[d] <= t).collect();
        if up.is_empty() {
            t = free_at.iter().copied().fold(f64::INFINITY, f64::min);
            continue;
        }
        let donor = up[rng.below(up.len() as u64) as usize];
        let kind = [Kind::Kill, Kind::Stop, Kind::Term][rng.below(3) as usize];
        let for_s = seconds(&mut rng, FOR_MS);
        out.push(Fault {
            at_s: t,
            donor,
            kind,
            for_s,
        });
        free_at[donor] = t + for_s + REST_S;
        t += seconds(&mut rng, GAP_MS);
    }
    out
}

/// Seconds drawn from `lo..=hi` milliseconds.
fn seconds(rng: &mut SplitMix64, (lo, hi): (u64, u64)) -> f64 {
    (lo + rng.below(hi - lo + 1)) as f64 / 1e3
}

/// The schedule as one line.
fn describe(seed: u64, faults: &[Fault]) -> String {
    let each: Vec<String> = faults
        .iter()
        .map(|f| {
            let what = match f.kind {
                Kind::Kill => "kill -9",
                Kind::Stop => "SIGSTOP",
                Kind::Term => "SIGTERM",
            };
            format!(
                "{:.2} s {what} {} for {:.0} ms",
                f.at_s,
                DONORS[f.donor],
                f.for_s * 1e3
            )
        })
        .collect();
    format!("seed {seed}: {}", each.join(", "))
}

/// The drill's plan: three donors over `transport`, each beside a host
/// socket when `host`.
fn plan(name: &str, transport: cluster_config::Transport, host: bool) -> Plan {
    let mut plan = Plan::new(name);
    plan.transport = transport;
    plan.host_socket = host;
    plan.donors = DONORS
        .iter()
        .map(|name| DonorPlan {
            name,
            placement: Placement::Loopback,
            proxied: false,
        })
        .collect();
    plan.sources = vec!["donor-a", "donor-b", "donor-c", "ssd"];
    plan
}

/// Start fault `f` (`begin`) or end it.
fn act(rack: &mut Rack, run: &mut NodeRun, f: &Fault, begin: bool) -> Result<()> {
    let name = DONORS[f.donor];
    match (f.kind, begin) {
        (Kind::Kill, true) => {
            run.event(format!("kill -9 {name}"));
            rack.end(name, libc::SIGKILL)?;
        }
        (Kind::Stop, true) => {
            run.event(format!("SIGSTOP {name}"));
            rack.stop(name)?;
        }
        (Kind::Term, true) => {
            run.event(format!("SIGTERM {name}"));
            let st = rack.end(name, libc::SIGTERM)?;
            run.event(format!("{name} exited ({st})"));
        }
        (Kind::Stop, false) => {
            rack.signal(name, libc::SIGCONT)?;
            run.event(format!("SIGCONT {name}"));
        }
        (Kind::Kill | Kind::Term, false) => {
            start_fresh(rack, run, name)?;
        }
    }
    Ok(())
}

/// The drill over `transport` (beside host sockets when `host`), on the
/// schedule of the run's seed.
pub(super) fn random(
    env: &Env,
    o: &Opts,
    drill: Named,
    transport: cluster_config::Transport,
    host: bool,
) -> Result<Report> {
    let plan = plan(drill.name, transport, host);
    let faults = schedule(o.seed);
    let mut moments: Vec<(f64, usize, bool)> = faults
        .iter()
        .enumerate()
        .flat_map(|(i, f)| [(f.at_s, i, true), (f.at_s + f.for_s, i, false)])
        .collect();
    moments.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut rack = Rack::start(env, plan.clone())?;
    let mut run = rack.run_node(o.tokens(super::scaffold::SECONDS), o.tokens_per_second)?;
    for (at_s, i, begin) in moments {
        run.at_second(at_s)?;
        act(&mut rack, &mut run, &faults[i], begin)?;
    }
    let out = finish(run, o, true)?;
    let mut r = Report::check(drill.name, drill.about, env, &plan, &out)?;
    r.figure("schedule", describe(o.seed, &faults));
    let restarts = faults.iter().filter(|f| f.kind != Kind::Stop).count();
    if host {
        let served = out.log.matches("new generation in service").count();
        r.figure(
            "new generations",
            format!("{restarts} restarts without the fd store; {served} new generations of a table served from their mappings"),
        );
    }
    worst_step_hops(&mut r);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_one_schedule_of_faults_on_donors_that_are_up() {
        for seed in 0..200 {
            let s = schedule(seed);
            assert_eq!(s, schedule(seed), "seed {seed}");
            assert!(s.len() >= 5, "seed {seed}: {s:?}");
            for (i, f) in s.iter().enumerate() {
                assert!((FIRST_S..=LAST_S).contains(&f.at_s), "{f:?}");
                assert!((0.15..=0.6).contains(&f.for_s), "{f:?}");
                // A donor is faulted again only once it has been back for a while.
                for g in &s[..i] {
                    if g.donor == f.donor {
                        assert!(
                            g.at_s + g.for_s + REST_S <= f.at_s + 1e-9,
                            "{g:?} then {f:?}"
                        );
                    }
                }
            }
        }
        assert_ne!(schedule(1), schedule(2));
        let kinds: Vec<Kind> = (0..20).flat_map(schedule).map(|f| f.kind).collect();
        for k in [Kind::Kill, Kind::Stop, Kind::Term] {
            assert!(kinds.contains(&k), "{k:?} is drawn");
        }
    }
}
