//! Drills where a donor comes back with a new generation of the tables it
//! serves: a restart without the fd store (it loads them again, into new
//! memory), and a hot swap to another version and back. Over host sockets
//! the node maps the new memory while its lookups go on reading the old
//! (the same rows); over TLS the same schedule is the baseline the host
//! path is compared with (`engram-bench drill` prints the ratio).
//!
//! Besides the common checks, each reports the time from the donor being
//! ready with its new generation to the node serving from it, and the
//! worst step's hops (which thread the stall was spent waiting for).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use super::scaffold::{FAULT_AT, HEAL_AT, Named, Opts, begin, finish};
use super::{Env, NodeRun, Plan, Rack, Report, Version};
use crate::sample;

/// How long after a donor's swap the node may still read its old version
/// (over a host socket: the donor's watch of 50 ms, and a margin for this
/// machine), in microseconds.
const SWITCH_US: f64 = 150_000.0;

/// The longest the node may take to serve a new generation before a drill
/// gives up on it (a busy machine maps a small table in milliseconds).
const SERVE_TIMEOUT: Duration = Duration::from_secs(20);

/// The plan of a generation drill: every donor beside a host socket (over
/// TCP), or over TLS alone; with `control`, each serves its control plane.
pub(super) fn plan(name: &str, host: bool, control: bool) -> Plan {
    let mut plan = Plan::new(name);
    if host {
        plan.host_socket = true;
    } else {
        plan.transport = cluster_config::Transport::Tls;
    }
    plan.control = control;
    plan
}

/// `kill -9` donor `name` and start it again without its fd store
/// ([`start_fresh`]). When it was ready.
fn restart_fresh(rack: &mut Rack, run: &mut NodeRun, name: &str) -> Result<f64> {
    run.event(format!("kill -9 {name}"));
    rack.end(name, libc::SIGKILL)?;
    start_fresh(rack, run, name)
}

/// Empty the fd store of donor `name` (not running) and start it: it
/// loads both tables from their files into new memory (a new generation),
/// as a donor does that runs without systemd. When it was ready.
pub(super) fn start_fresh(rack: &mut Rack, run: &mut NodeRun, name: &str) -> Result<f64> {
    rack.donor(name)?.notify.clear_store();
    rack.restart(name, Version::Pinned)?;
    let ready = run.event(format!("{name} ready: a new generation"));
    let log = rack.log(name)?;
    if log.contains("table adopted from the fd store") {
        bail!("the restarted {name} adopted a table from the fd store:\n{log}");
    }
    Ok(ready)
}

/// Generations of `donor`'s tables the node has put in service; `None`
/// from a node that does not count them (one built before the counter, in
/// a comparison of builds: the drill then reports no time to serve).
fn generations(run: &NodeRun, donor: &str) -> Result<Option<f64>> {
    let m = run
        .metrics()
        .context("reading the node's metrics (did its run end before the drill's schedule?)")?;
    Ok(sample(
        &m,
        &format!("engram_node_host_generations_total{{source=\"{donor}\"}}"),
    ))
}

/// Wait until the node has put `more` generations of `donor`'s tables in
/// service beyond `before` (looking every 20 ms: often enough to time it,
/// seldom enough not to load the node); how long after `since` (an
/// instant of this process) that was, if the node counts them.
fn await_generations(
    run: &NodeRun,
    donor: &str,
    before: Option<f64>,
    more: f64,
    since: Instant,
) -> Result<Option<Duration>> {
    let Some(before) = before else {
        return Ok(None);
    };
    while generations(run, donor)?.unwrap_or(0.0) < before + more {
        ensure!(
            since.elapsed() < SERVE_TIMEOUT,
            "the node did not serve {donor}'s new generation within {SERVE_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Some(since.elapsed()))
}

/// How a time to serve reads in a figure.
fn ms(took: Option<Duration>) -> String {
    took.map_or("(not counted by this node)".into(), |t| {
        format!("{:.0} ms", t.as_secs_f64() * 1e3)
    })
}

/// A figure of where the worst decode step's stall went, table by table:
/// waiting for the node's I/O thread to take the fetch up (`to I/O`: the
/// thread was busy or not running), in the source (`source`: the gather,
/// or the network and the donor), and for the loop to take the rows (`to
/// loop`).
pub(super) fn worst_step_hops(r: &mut Report) {
    let Some(s) = r
        .steps
        .iter()
        .filter(|s| s.kind != inference_node::model::StepKind::Prefill)
        .max_by(|a, b| a.stall_us.total_cmp(&b.stall_us))
    else {
        return;
    };
    let tables: Vec<String> = s
        .tables
        .iter()
        .map(|t| {
            let by = t.source.as_deref().unwrap_or("nothing");
            match t.hops {
                Some(h) => format!(
                    "t{} from {by}: to I/O {:.2} ms, source {:.2} ms, to loop {:.2} ms",
                    t.table,
                    h.to_io_us / 1e3,
                    h.round_trip_us / 1e3,
                    h.to_loop_us / 1e3
                ),
                None => format!("t{} from {by}", t.table),
            }
        })
        .collect();
    let what = format!(
        "step {} at {:.2} s, stall {:.2} ms; {}",
        s.step,
        s.start_us / 1e6,
        s.stall_us / 1e3,
        tables.join("; ")
    );
    r.figure("worst step's hops", what);
}

/// `restart-host-new-generation` (`host`) and its baseline over TLS:
/// donor-b, then donor-a, killed and restarted without the fd store while
/// the node serves from donor-a.
pub(super) fn restart_new_generation(
    env: &Env,
    o: &Opts,
    drill: Named,
    host: bool,
) -> Result<Report> {
    let plan = plan(drill.name, host, false);
    let (mut rack, mut run) = begin(env, &plan, o)?;
    let mut served = Vec::new();
    for (donor, at) in [("donor-b", FAULT_AT), ("donor-a", HEAL_AT)] {
        run.at_second(at)?;
        let before = if host {
            generations(&run, donor)?
        } else {
            None
        };
        let ready = restart_fresh(&mut rack, &mut run, donor)?;
        let took = await_generations(&run, donor, before, env.tables.len() as f64, Instant::now())?;
        if took.is_some() {
            run.event(format!("{donor}'s new generation served"));
        }
        served.push((donor, ready, took));
    }
    let out = finish(run, o, true)?;
    let mut r = Report::check(drill.name, drill.about, env, &plan, &out)?;
    if host {
        r.all_from("donor-a")?;
        for (donor, ready, took) in served {
            r.figure(
                format!("{donor}'s new generation"),
                format!(
                    "both tables served from it {} after {donor} was ready ({:.2} s)",
                    ms(took),
                    ready / 1e6
                ),
            );
        }
    } else {
        let (_, ready, _) = served[1];
        r.readmitted("donor-a", ready)?;
    }
    worst_step_hops(&mut r);
    Ok(r)
}

/// Swap donor `donor`'s two tables to `version` (`engram-cluster swap`, as
/// the rack's operator; one at a time, as the donor takes them) and wait
/// until it serves them; when the first swap was asked, and when the
/// donor served both.
fn swap_both(
    rack: &Rack,
    run: &mut NodeRun,
    env: &Env,
    donor: &str,
    version: Version,
) -> Result<(f64, f64)> {
    let files = match version {
        Version::Pinned => &env.tables,
        Version::Other => &env.other,
    };
    let swapped = || -> Result<usize> { Ok(rack.log(donor)?.matches("table swapped").count()) };
    let asked = run.event(format!("swap {donor} to the {version:?} version"));
    for f in files {
        let before = swapped()?;
        let out = std::process::Command::new(crate::bin("engram-cluster"))
            .args(["swap", "--config"])
            .arg(&rack.config)
            .arg(donor)
            .args(["--table", &f.id.to_string(), "--file"])
            .arg(&f.path)
            .args(["--digest", &f.digest])
            .output()
            .context("running engram-cluster swap")?;
        ensure!(
            out.status.success(),
            "engram-cluster swap of table {} on {donor} failed: {}{}",
            f.id,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let t0 = Instant::now();
        while swapped()? == before {
            ensure!(
                t0.elapsed() < SERVE_TIMEOUT,
                "{donor} did not finish swapping table {} within {SERVE_TIMEOUT:?}:\n{}",
                f.id,
                rack.log(donor)?
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let done = run.event(format!("{donor} serves the {version:?} version"));
    Ok((asked, done))
}

/// `swap-host` (`host`) and its baseline over TLS: donor-a's tables hot
/// swapped to another version (the node moves to donor-b), then back to
/// the pinned one, a new generation the node takes up again.
pub(super) fn swap(env: &Env, o: &Opts, drill: Named, host: bool) -> Result<Report> {
    let plan = plan(drill.name, host, true);
    let (rack, mut run) = begin(env, &plan, o)?;
    let (_, away) = swap_both(&rack, &mut run, env, "donor-a", Version::Other)?;
    run.at_second(HEAL_AT)?;
    let before = if host {
        generations(&run, "donor-a")?
    } else {
        None
    };
    let since = Instant::now();
    let (back_asked, back) = swap_both(&rack, &mut run, env, "donor-a", Version::Pinned)?;
    let took = await_generations(&run, "donor-a", before, env.tables.len() as f64, since)?;
    if took.is_some() {
        run.event("donor-a's new generation mapped");
    }
    let out = finish(run, o, true)?;
    let mut r = Report::check(drill.name, drill.about, env, &plan, &out)?;
    // After the last swap away: lookups already asked of donor-a may
    // land, and over a host socket the node hears of the new version
    // within the donor's 50 ms watch, reading its mapping of the pinned
    // version (the right rows) until then. From the first swap back on,
    // table 1 may be served at the pinned version while table 14 is not.
    r.never_used("donor-a", away + SWITCH_US, back_asked)?;
    let after = r.readmitted("donor-a", back)?;
    let mut how = format!(
        "donor-a served again {:.0} ms after its swap back ended",
        after * 1e3
    );
    if host {
        how += &format!(
            "; the node had both tables of its new generation mapped {} after the swaps were asked",
            ms(took)
        );
    }
    r.figure("new generation", how);
    worst_step_hops(&mut r);
    Ok(r)
}
