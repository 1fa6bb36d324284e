//! The drills. Each starts its rack, runs the paced node for [`SECONDS`],
//! injects its faults at chosen points of the run (as token counts: a
//! second at 100 tokens/s is token 100), and returns its [`Report`] once
//! every invariant has been checked; an error says which one broke, with
//! the timeline.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use inference_node::model::{Checksum, StepKind};

use super::generation;
use super::handshakes::{self, storm_handshakes};
use super::report::{ensure_timing, served_by};
use super::scaffold::{FAULT_AT, HEAL_AT, Named, begin, finish};
pub use super::scaffold::{Opts, SECONDS};
use super::storm::{self, storm};
use super::{Env, Placement, Plan, Rack, Report, Version};
use crate::netns::NetNs;
use crate::proxy::Faults;
use crate::sample;

/// A drill.
pub type DrillFn = fn(&Env, &Opts) -> Result<Report>;

/// Every drill: name, what it does, the function.
pub const ALL: &[(&str, &str, DrillFn)] = &[
    (
        "kill-9",
        "kill -9 the primary donor mid-run, restart it",
        kill_9,
    ),
    (
        "kill-9-tls",
        "kill -9 the primary donor mid-run, restart it: every donor over TLS",
        kill_9_tls,
    ),
    (
        "kill-9-quic",
        "kill -9 the primary donor mid-run, restart it: every donor over QUIC",
        kill_9_quic,
    ),
    (
        "kill-9-tls-batch",
        "every donor over TLS, the node decoding 16 sequences after a prefill of 256 positions each (answers over 64 KiB): kill -9 the primary mid-run, restart it",
        kill_9_tls_batch,
    ),
    (
        "kill-9-host",
        "the node maps both donors' tables through their host sockets: kill -9 the primary mid-run (its mapping keeps serving), restart it",
        kill_9_host,
    ),
    (
        "sigstop",
        "SIGSTOP both donors (hung, sockets open; hedging off), then SIGCONT",
        sigstop,
    ),
    (
        "sigstop-sweep",
        "donors only (no SSD copy), 16 sequences after a prefill of 256 positions each, hard timeout 200 ms, donor-a's answers 50 ms late (proxy): SIGSTOP donor-a mid-sweep (its chunks hedged to donor-b), SIGCONT it",
        sigstop_sweep,
    ),
    (
        "wrong-version",
        "restart the primary with another table version, then with the pinned one",
        wrong_version,
    ),
    (
        "partition",
        "cut the primary's link (its network namespace), heal it",
        partition,
    ),
    (
        "slow-link",
        "30 ms added to every answer of the primary (proxy); hedging at p99",
        slow_link,
    ),
    (
        "corrupt",
        "flip a payload byte in every answer of the primary (proxy)",
        corrupt,
    ),
    (
        "cut",
        "truncate answers mid-frame, then drop connections on every lookup (proxy)",
        cut,
    ),
    (
        "all-down-ssd",
        "kill -9 both donors; the SSD copy serves; restart them",
        all_down_ssd,
    ),
    (
        "all-down-ssd-busy",
        "kill -9 both donors while a sequential reader keeps the SSD copy's drive busy; restart them",
        all_down_ssd_busy,
    ),
    (
        "all-down-fail",
        "kill -9 both donors with no SSD copy, policy fail",
        all_down_fail,
    ),
    (
        "all-down-zeros",
        "kill -9 both donors with no SSD copy, policy zeros; restart them",
        all_down_zeros,
    ),
    (
        "sigterm",
        "SIGTERM the primary (drain: Goodbye), restart it",
        sigterm,
    ),
    (
        "hung-sigterm",
        "SIGSTOP the primary until the node opens its breaker, then SIGCONT + SIGTERM (drain while excluded)",
        hung_sigterm,
    ),
    (
        "restart-host-new-generation",
        "the node maps both donors' tables through their host sockets: donor-b, then donor-a (the primary) killed and restarted without the fd store, each loading a new generation the node maps while it serves",
        restart_host_new_generation,
    ),
    (
        "restart-tls-new-generation",
        "every donor over TLS: donor-b, then donor-a killed and restarted without the fd store (restart-host-new-generation's baseline)",
        restart_tls_new_generation,
    ),
    (
        "swap-host",
        "the node maps both donors' tables through their host sockets: donor-a's tables hot swapped to another version (the node moves to donor-b), then back (a new generation)",
        swap_host,
    ),
    (
        "swap-tls",
        "every donor over TLS: donor-a's tables hot swapped to another version, then back (swap-host's baseline)",
        swap_tls,
    ),
    (
        "random-host",
        "three donors beside host sockets, the node mapping their tables: a seeded random schedule of kill -9, SIGSTOP and SIGTERM, each killed or drained donor restarted without its fd store",
        random_host,
    ),
    (
        "random-tls",
        "three donors over TLS: the seeded random schedule of random-host (its baseline)",
        random_tls,
    ),
    (
        "random-quic",
        "three donors over QUIC: the seeded random schedule of random-host",
        random_quic,
    ),
    ("storm", storm::ABOUT, storm),
    (handshakes::NAME, handshakes::ABOUT, storm_handshakes),
];

/// The drill named `name`.
pub fn find(name: &str) -> Option<DrillFn> {
    ALL.iter().find(|(n, _, _)| *n == name).map(|(_, _, f)| *f)
}

pub(super) fn about(name: &str) -> &'static str {
    ALL.iter()
        .find(|(n, _, _)| *n == name)
        .map_or("", |(_, a, _)| a)
}

/// Drill `name` with its description, for a drill kept in a module of its own.
fn named(name: &'static str) -> Named {
    Named {
        name,
        about: about(name),
    }
}

/// `kill -9` both donors; when.
fn kill_both(rack: &mut Rack, run: &mut super::NodeRun) -> Result<f64> {
    let at = run.event("kill -9 donor-a and donor-b");
    rack.end("donor-a", libc::SIGKILL)?;
    rack.end("donor-b", libc::SIGKILL)?;
    Ok(at)
}

/// Restart both donors at the heal's moment; when donor-a was ready.
fn restart_both(rack: &mut Rack, run: &mut super::NodeRun) -> Result<f64> {
    run.at_second(HEAL_AT)?;
    run.event("restart both");
    rack.restart("donor-a", Version::Pinned)?;
    let ready = run.event("donor-a ready");
    rack.restart("donor-b", Version::Pinned)?;
    run.event("donor-b ready");
    Ok(ready)
}

/// A node counter summed over tables 1 and 14 (`labels`: more labels
/// after the table's, e.g. `,source="donor-a"`).
fn both_tables(metrics: &str, name: &str, labels: &str) -> f64 {
    [1, 14]
        .iter()
        .filter_map(|t| sample(metrics, &format!("{name}{{table=\"{t}\"{labels}}}")))
        .sum()
}

fn kill_9(env: &Env, o: &Opts) -> Result<Report> {
    kill_9_over(env, o, "kill-9", cluster_config::Transport::Tcp)
}

fn kill_9_tls(env: &Env, o: &Opts) -> Result<Report> {
    kill_9_over(env, o, "kill-9-tls", cluster_config::Transport::Tls)
}

fn kill_9_quic(env: &Env, o: &Opts) -> Result<Report> {
    kill_9_over(env, o, "kill-9-quic", cluster_config::Transport::Quic)
}

/// kill -9 donor-a and restart it, every donor on `transport`.
fn kill_9_over(
    env: &Env,
    o: &Opts,
    name: &str,
    transport: cluster_config::Transport,
) -> Result<Report> {
    let mut plan = Plan::new(name);
    plan.transport = transport;
    kill_9_with(env, o, name, &plan, &env.reference).map(|(r, _)| r)
}

/// Sequences and prefill of the batch drill: each decode step asks 384
/// rows per table in one message (101 KB of rows), the prefill sweeps
/// 4,096 positions in chunks of up to 4,096 rows (1 MB each).
const BATCH: usize = 16;
const PREFILL: usize = 256;

/// The run of `plan`'s shape (batch, prefill) on local RAM: each
/// position's checksum.
fn reference_of(
    env: &Env,
    plan: &Plan,
    o: &Opts,
) -> Result<std::collections::BTreeMap<(u32, u32), Checksum>> {
    let run = super::NodeRun::start_with(
        &env.dir.join("prepare.toml"),
        "ref",
        o.tokens(SECONDS) * plan.batch as u64,
        5_000.0,
        &env.dir.join(format!("{}-ref", plan.name)),
        &plan.node_args(),
    )?;
    let out = run.finish(Duration::from_secs(120))?;
    if !out.success {
        bail!("the reference run on local RAM failed:\n{}", out.log);
    }
    Ok(super::report::checksums(&out.steps))
}

fn kill_9_tls_batch(env: &Env, o: &Opts) -> Result<Report> {
    let name = "kill-9-tls-batch";
    let mut plan = Plan::new(name);
    plan.transport = cluster_config::Transport::Tls;
    plan.batch = BATCH;
    plan.prefill = PREFILL;
    let reference = reference_of(env, &plan, o)?;
    let (mut r, killed) = kill_9_with(env, o, name, &plan, &reference)?;
    // The prefill, before any fault: a sweep served by the donors alone.
    let prefill = r
        .steps
        .iter()
        .find(|s| s.kind == StepKind::Prefill)
        .context("the run has no prefill step")?;
    // Each chunk has the hard timeout (20 ms) to arrive, so a chunk held
    // up by this machine moves on like a failed one: a miss of time.
    for t in &prefill.tables {
        let by = t.source.as_deref().unwrap_or("nothing");
        ensure!(
            t.messages > 1,
            "table {}'s prefill was one message",
            t.table
        );
        ensure_timing!(
            t.error.is_none() && t.failovers == 0 && by.split('+').all(|s| s.starts_with("donor-")),
            "table {}'s prefill was served by {by} with {} failovers, not by the donors alone: {:?}\n{}",
            t.table,
            t.failovers,
            t.error,
            r.timeline(0.5)
        );
    }
    let rows = prefill.tables.iter().map(|t| t.unique_rows).sum::<usize>();
    r.figure(
        "prefill over TLS",
        format!(
            "{} positions, {rows} rows in {} messages, served by the donors; stall {:.2} ms",
            BATCH * PREFILL,
            prefill.tables.iter().map(|t| t.messages).sum::<u32>(),
            prefill.stall_us / 1e3
        ),
    );
    // Decode steps before the kill: one message per table of up to 384
    // rows, answered by the donors (a hedge to the SSD copy now and then
    // on a busy machine, never most of them).
    let before: Vec<_> = r
        .steps
        .iter()
        .filter(|s| s.kind != StepKind::Prefill && s.start_us + s.time_us < killed)
        .collect();
    let by_copy = before.iter().filter(|s| served_by(s, "ssd")).count();
    ensure_timing!(
        by_copy * 10 <= before.len(),
        "{by_copy} of {} batch steps before the kill touched the SSD copy\n{}",
        before.len(),
        r.timeline(0.5)
    );
    let widest = before
        .iter()
        .flat_map(|s| &s.tables)
        .map(|t| t.unique_rows)
        .max()
        .unwrap_or(0);
    ensure!(
        widest > 248,
        "no batch step asked more than 248 rows of a table (the widest: {widest})"
    );
    r.figure(
        "batch steps over TLS before the kill",
        format!(
            "{} steps of {BATCH} positions (up to {widest} rows per table in one message), {by_copy} touched the SSD copy",
            before.len()
        ),
    );
    Ok(r)
}

/// kill -9 donor-a and restart it, as `plan` says; the outputs checked
/// against `reference`. The report, and when donor-a was killed.
fn kill_9_with(
    env: &Env,
    o: &Opts,
    name: &str,
    plan: &Plan,
    reference: &std::collections::BTreeMap<(u32, u32), Checksum>,
) -> Result<(Report, f64)> {
    let (mut rack, mut run) = begin(env, plan, o)?;
    let killed = run.event("kill -9 donor-a");
    rack.end("donor-a", libc::SIGKILL)?;
    run.at_second(HEAL_AT)?;
    run.event("restart donor-a");
    let took = rack.restart("donor-a", Version::Pinned)?;
    let healthy = run.event("donor-a ready");
    // Its systemd (the rack's fake) handed its tables back: nothing read.
    let log = rack.log("donor-a")?;
    let adopted = log.matches("table adopted from the fd store").count();
    if adopted != env.tables.len() || log.contains("progress: loading") {
        bail!("the restarted donor-a did not serve every table from the fd store:\n{log}");
    }
    let out = finish(run, o, true)?;
    let mut r = Report::check_with(name, about(name), env, plan, &out, reference)?;
    r.never_used("donor-a", killed, healthy)?;
    r.readmitted("donor-a", healthy)?;
    r.figure(
        "donor-a restart",
        format!(
            "ready {:.0} ms after it was started: both tables adopted from the fd store, no file read",
            took.as_secs_f64() * 1e3
        ),
    );
    Ok((r, killed))
}

/// Both donors on the node's host, reached through their host sockets:
/// the node maps their tables, so a `kill -9` of the primary costs
/// nothing. The mapping outlives the process, every step stays on
/// donor-a with no failover, and the node counts the gap and picks the
/// same memory up again when donor-a is back from the fd store.
fn kill_9_host(env: &Env, o: &Opts) -> Result<Report> {
    let name = "kill-9-host";
    let mut plan = Plan::new(name);
    plan.host_socket = true;
    let (mut rack, mut run) = begin(env, &plan, o)?;
    let killed = run.event("kill -9 donor-a");
    rack.end("donor-a", libc::SIGKILL)?;
    run.at_second(HEAL_AT)?;
    run.event("restart donor-a");
    let took = rack.restart("donor-a", Version::Pinned)?;
    let back = run.event("donor-a ready");
    let log = rack.log("donor-a")?;
    if log.matches("table adopted from the fd store").count() != env.tables.len() {
        bail!("the restarted donor-a did not serve every table from the fd store:\n{log}");
    }
    let out = finish(run, o, true)?;
    let mut r = Report::check(name, about(name), env, &plan, &out)?;
    r.all_from("donor-a")?;
    let dead = r.between(killed, back).count();
    ensure!(dead > 0, "no step ran while donor-a was dead");
    ensure!(
        out.log
            .contains("the donor went away; its memory keeps being served")
            && out.log.contains("host socket: the donor is back"),
        "the node did not log donor-a's gap and return:\n{}",
        out.log
    );
    r.figure(
        "while donor-a was dead",
        format!("{dead} steps served from its mapping, 0 failovers"),
    );
    r.figure(
        "donor-a restart",
        format!(
            "ready {:.0} ms after it was started, both tables adopted from the fd store",
            took.as_secs_f64() * 1e3
        ),
    );
    Ok(r)
}

fn restart_host_new_generation(env: &Env, o: &Opts) -> Result<Report> {
    generation::restart_new_generation(env, o, named("restart-host-new-generation"), true)
}

fn restart_tls_new_generation(env: &Env, o: &Opts) -> Result<Report> {
    generation::restart_new_generation(env, o, named("restart-tls-new-generation"), false)
}

fn swap_host(env: &Env, o: &Opts) -> Result<Report> {
    generation::swap(env, o, named("swap-host"), true)
}

fn swap_tls(env: &Env, o: &Opts) -> Result<Report> {
    generation::swap(env, o, named("swap-tls"), false)
}

fn random_host(env: &Env, o: &Opts) -> Result<Report> {
    let tcp = cluster_config::Transport::Tcp;
    super::random::random(env, o, named("random-host"), tcp, true)
}

fn random_tls(env: &Env, o: &Opts) -> Result<Report> {
    let tls = cluster_config::Transport::Tls;
    super::random::random(env, o, named("random-tls"), tls, false)
}

fn random_quic(env: &Env, o: &Opts) -> Result<Report> {
    let quic = cluster_config::Transport::Quic;
    super::random::random(env, o, named("random-quic"), quic, false)
}

fn sigstop(env: &Env, o: &Opts) -> Result<Report> {
    let mut plan = Plan::new("sigstop");
    // No hedge: a hung donor is left only at the deadline (the next donor)
    // and at the hard timeout (the SSD copy), the slowest path there is.
    plan.hedge = "off";
    let (rack, mut run) = begin(env, &plan, o)?;
    run.event("SIGSTOP donor-a and donor-b");
    rack.stop("donor-a")?;
    rack.stop("donor-b")?;
    run.at_second(HEAL_AT)?;
    rack.signal("donor-a", libc::SIGCONT)?;
    rack.signal("donor-b", libc::SIGCONT)?;
    let healthy = run.event("SIGCONT both");
    let out = finish(run, o, true)?;
    let mut r = Report::check("sigstop", about("sigstop"), env, &plan, &out)?;
    let ssd = r
        .between(0.0, healthy)
        .filter(|s| served_by(s, "ssd"))
        .count();
    ensure!(ssd > 0, "the SSD copy never served while both donors hung");
    r.figure("steps served from SSD while both hung", ssd.to_string());
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

/// Positions of each sequence in the hung sweep's prefill.
const SWEEP_PREFILL: usize = 256;
/// The hung sweep's hard timeout: a chunk is a megabyte, which a donor
/// built for debugging on a busy 2-core machine may take tens of
/// milliseconds to gather and check; its chunks are hedged at half this.
const SWEEP_HARD_TIMEOUT_MS: u64 = 200;
/// Added to each of donor-a's answers until the SIGCONT.
const SWEEP_DELAY: Duration = Duration::from_millis(50);

/// A replica hung mid-sweep costs the sweep a delay, not the sweep: with
/// no SSD copy to fall back on, the chunks donor-a holds (SIGSTOP: its
/// sockets open, nothing answered) are hedged to donor-b once they miss
/// their share of the deadline, and the prefill ends with every row.
fn sigstop_sweep(env: &Env, o: &Opts) -> Result<Report> {
    let name = "sigstop-sweep";
    let mut plan = Plan::new(name);
    plan.sources = vec!["donor-a", "donor-b"];
    plan.batch = BATCH;
    plan.prefill = SWEEP_PREFILL;
    plan.hard_timeout_ms = SWEEP_HARD_TIMEOUT_MS;
    plan.donors[0].proxied = true;
    let reference = reference_of(env, &plan, o)?;
    let rack = Rack::start(env, plan.clone())?;
    // donor-a's answers come late (a proxy), so that the sweep, the loop's
    // first step, is still under way when the SIGSTOP lands just after
    // the loop has started; hung then, donor-a answers nothing more.
    let proxy = rack.proxy("donor-a")?;
    proxy.set(Faults {
        delay: SWEEP_DELAY,
        ..Faults::default()
    });
    let mut run = rack.run_node(o.tokens(SECONDS), o.tokens_per_second)?;
    rack.stop("donor-a")?;
    let at = inference_node::model::clock::monotonic_us();
    let stopped = run.event_at("SIGSTOP donor-a mid-sweep", at)?;
    run.at_second(HEAL_AT)?;
    rack.signal("donor-a", libc::SIGCONT)?;
    proxy.set(Faults::default());
    let healthy = run.event("SIGCONT donor-a");
    let out = finish(run, o, true)?;
    let mut r = Report::check_with(name, about(name), env, &plan, &out, &reference)?;
    let prefill = r
        .steps
        .iter()
        .find(|s| s.kind == StepKind::Prefill)
        .context("the run has no prefill step")?
        .clone();
    // When the sweep's last rows were in, on the node's clock.
    let rows_in = prefill.start_us
        + prefill
            .tables
            .iter()
            .map(|t| t.ready_us)
            .fold(0.0, f64::max);
    ensure_timing!(
        rows_in > stopped,
        "the sweep's rows were all in ({:.1} ms) before donor-a was stopped ({:.1} ms)\n{}",
        rows_in / 1e3,
        stopped / 1e3,
        r.timeline(0.5)
    );
    let mut moved = 0;
    for t in &prefill.tables {
        let by = t.source.as_deref().unwrap_or("nothing");
        ensure!(
            t.error.is_none() && by.split('+').all(|s| s.starts_with("donor-")),
            "table {}'s prefill failed with donor-a hung: served by {by}, {:?}",
            t.table,
            t.error
        );
        moved += t.hedges + t.failovers;
    }
    ensure!(
        moved > 0,
        "no chunk of the sweep was hedged or failed over from the hung donor-a"
    );
    r.figure(
        "the sweep with donor-a hung mid-way",
        format!(
            "{} positions in {} messages, {moved} chunks hedged or failed over to donor-b; \
             every row in {:.0} ms after the SIGSTOP (hedges at {} ms)",
            BATCH * SWEEP_PREFILL,
            prefill.tables.iter().map(|t| t.messages).sum::<u32>(),
            (rows_in - stopped) / 1e3,
            SWEEP_HARD_TIMEOUT_MS / 2
        ),
    );
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

fn wrong_version(env: &Env, o: &Opts) -> Result<Report> {
    let plan = Plan::new("wrong-version");
    let (mut rack, mut run) = begin(env, &plan, o)?;
    let killed = run.event("kill -9 donor-a");
    rack.end("donor-a", libc::SIGKILL)?;
    rack.restart("donor-a", Version::Other)?;
    run.event("donor-a ready with another table version");
    run.at_second(HEAL_AT)?;
    run.event("kill -9 donor-a");
    rack.end("donor-a", libc::SIGKILL)?;
    rack.restart("donor-a", Version::Pinned)?;
    let healthy = run.event("donor-a ready with the pinned version");
    let out = finish(run, o, true)?;
    let mut r = Report::check("wrong-version", about("wrong-version"), env, &plan, &out)?;
    r.never_used("donor-a", killed, healthy)?;
    // Found by a lookup (the donor was back before the probe looked) or
    // by the probe.
    ensure!(
        out.log
            .contains("excluded until it serves the pinned version")
            || out.log.contains("serves another version; excluded")
            || out.log.contains("not at the pinned version; excluded"),
        "the node never logged that it excluded donor-a for its version:\n{}",
        out.log
    );
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

fn partition(env: &Env, o: &Opts) -> Result<Report> {
    NetNs::check()
        .map_err(|e| anyhow::anyhow!("the partition drill needs network namespaces: {e}"))?;
    let mut plan = Plan::new("partition");
    for d in &mut plan.donors {
        d.placement = Placement::Netns;
    }
    let (rack, mut run) = begin(env, &plan, o)?;
    let cut = run.event("link of donor-a down");
    rack.partition("donor-a")?;
    run.at_second(HEAL_AT)?;
    // Recorded before the link comes up: the node may use the donor the
    // moment it can, before the command returns.
    let up = run.event("link of donor-a up");
    rack.heal("donor-a")?;
    // The path is back once the root namespace can reach the donor again
    // (its neighbour entry resolves: up to the kernel's ARP retransmit
    // time, 1 s by default): that is when the donor is healthy.
    let back = rack.wait_reachable("donor-a", Duration::from_secs(10))?;
    let healthy = run.event(format!(
        "donor-a reachable again ({:.0} ms after the link came up)",
        back.as_secs_f64() * 1e3
    ));
    let out = finish(run, o, true)?;
    let mut r = Report::check("partition", about("partition"), env, &plan, &out)?;
    // Lookups already on their way when the link went down may land.
    r.never_used("donor-a", cut + 50_000.0, up)?;
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

fn slow_link(env: &Env, o: &Opts) -> Result<Report> {
    const DELAY: Duration = Duration::from_millis(30);
    let mut plan = Plan::new("slow-link");
    plan.donors[0].proxied = true;
    let (rack, mut run) = begin(env, &plan, o)?;
    let proxy = rack.proxy("donor-a")?;
    proxy.set(Faults {
        delay: DELAY,
        ..Faults::default()
    });
    let slow = run.event("donor-a's link: +30 ms on every answer");
    run.at_second(HEAL_AT)?;
    proxy.set(Faults::default());
    let healthy = run.event("donor-a's link back to normal");
    let out = finish(run, o, true)?;
    let mut r = Report::check("slow-link", about("slow-link"), env, &plan, &out)?;
    let worst = r
        .between(slow, healthy)
        .map(|s| s.stall_us)
        .fold(0.0, f64::max);
    let hedged: u64 = r
        .between(slow, healthy)
        .flat_map(|s| &s.tables)
        .map(|t| u64::from(t.hedges))
        .sum();
    r.figure(
        "worst stall while slow",
        format!(
            "{:.2} ms, against {} ms added to donor-a's answers; {hedged} hedges",
            worst / 1e3,
            DELAY.as_millis()
        ),
    );
    ensure!(hedged > 0, "no hedge went out while donor-a was slow");
    ensure_timing!(
        worst < DELAY.as_secs_f64() * 1e6 / 2.0,
        "hedging did not bound the stall: {:.2} ms while donor-a answered {} ms late",
        worst / 1e3,
        DELAY.as_millis()
    );
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

fn corrupt(env: &Env, o: &Opts) -> Result<Report> {
    let mut plan = Plan::new("corrupt");
    plan.donors[0].proxied = true;
    let (rack, mut run) = begin(env, &plan, o)?;
    let proxy = rack.proxy("donor-a")?;
    proxy.set(Faults {
        corrupt_rows: true,
        ..Faults::default()
    });
    run.event("donor-a's answers corrupted (one payload byte each)");
    run.at_second(HEAL_AT - 0.1)?;
    let m = run.metrics()?;
    let bad = both_tables(
        &m,
        "engram_node_checksum_failures_total",
        ",source=\"donor-a\"",
    );
    run.at_second(HEAL_AT)?;
    proxy.set(Faults::default());
    let healthy = run.event("donor-a's answers intact again");
    let corrupted = proxy.stats().corrupted;
    let out = finish(run, o, true)?;
    let mut r = Report::check("corrupt", about("corrupt"), env, &plan, &out)?;
    r.figure(
        "corrupted answers",
        format!("{corrupted} sent by the proxy, {bad} counted by the node as checksum failures, none used"),
    );
    ensure!(
        corrupted > 0 && bad > 0.0,
        "no corrupted answer reached the node (proxy {corrupted}, node {bad})"
    );
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

fn cut(env: &Env, o: &Opts) -> Result<Report> {
    let mut plan = Plan::new("cut");
    plan.donors[0].proxied = true;
    let (rack, mut run) = begin(env, &plan, o)?;
    let proxy = rack.proxy("donor-a")?;
    proxy.set(Faults {
        truncate_rows: true,
        ..Faults::default()
    });
    run.event("donor-a's answers truncated mid-frame, connection closed");
    run.at_second((FAULT_AT + HEAL_AT) / 2.0)?;
    proxy.set(Faults {
        drop_on_lookup: true,
        ..Faults::default()
    });
    run.event("donor-a's connections dropped on every lookup");
    run.at_second(HEAL_AT)?;
    proxy.set(Faults::default());
    let healthy = run.event("donor-a's link intact again");
    let stats = proxy.stats();
    let out = finish(run, o, true)?;
    let mut r = Report::check("cut", about("cut"), env, &plan, &out)?;
    r.figure(
        "cut by the proxy",
        format!(
            "{} answers truncated, {} connections dropped on a lookup",
            stats.truncated, stats.dropped
        ),
    );
    ensure!(
        stats.truncated > 0 && stats.dropped > 0,
        "the proxy cut nothing: {stats:?}"
    );
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

fn all_down_ssd(env: &Env, o: &Opts) -> Result<Report> {
    let plan = Plan::new("all-down-ssd");
    let (mut rack, mut run) = begin(env, &plan, o)?;
    let down = kill_both(&mut rack, &mut run)?;
    let healthy = restart_both(&mut rack, &mut run)?;
    let out = finish(run, o, true)?;
    let mut r = Report::check("all-down-ssd", about("all-down-ssd"), env, &plan, &out)?;
    // Give lookups in flight at the kill a moment to fail over.
    let from = down + 50_000.0;
    let not_ssd = r
        .between(from, healthy)
        .filter(|s| s.tables.iter().any(|t| t.source.as_deref() != Some("ssd")))
        .count();
    ensure!(
        not_ssd == 0,
        "{not_ssd} steps were not served from SSD while both donors were down"
    );
    let n = r.between(from, healthy).count();
    r.figure(
        "served from SSD while both donors were down",
        format!("{n} steps"),
    );
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

/// The file the busy drive's sequential reader streams.
const LOAD_FILE_BYTES: u64 = 1 << 30;

/// `all-down-ssd` while a sequential reader (1 MiB O_DIRECT reads, 32 in
/// flight) keeps the SSD copy's drive busy. The copy reads at its default
/// priority (real-time, where the node may use it); "one SSD fetch" of the
/// stall bound is calibrated under the same load.
fn all_down_ssd_busy(env: &Env, o: &Opts) -> Result<Report> {
    let load_file = env.dir.join("load.bin");
    crate::load::data_file(&load_file, LOAD_FILE_BYTES)?;
    let reader = crate::load::Streamer::reader(&load_file)?;
    let meter = crate::load::Meter::start(&reader);
    let cal = super::NodeRun::start(
        &env.dir.join("prepare.toml"),
        "cal",
        100,
        o.tokens_per_second,
        &env.dir.join("cal-busy"),
    )?
    .finish(Duration::from_secs(120))?;
    ensure!(cal.success, "the busy calibration run failed:\n{}", cal.log);
    let busy_fetch_us = cal
        .steps
        .iter()
        .flat_map(|s| &s.tables)
        .map(|t| t.ready_us)
        .fold(0.0, f64::max);
    let mut plan = Plan::new("all-down-ssd-busy");
    plan.ssd_fetch_us = Some(busy_fetch_us);
    let (mut rack, mut run) = begin(env, &plan, o)?;
    reader.take_longest_wait_us();
    let down = kill_both(&mut rack, &mut run)?;
    let metrics = run.metrics()?;
    let healthy = restart_both(&mut rack, &mut run)?;
    let out = finish(run, o, true)?;
    let load_mib_s = meter.mib_per_second(&reader);
    // One SSD read can take as long as the drive kept the reader beside it
    // waiting (a virtual disk, kept busy, sometimes stalls for a few
    // hundred milliseconds): the stall bound's SSD fetch is the longer.
    let drive_wait_us = reader.take_longest_wait_us() as f64;
    plan.ssd_fetch_us = Some(busy_fetch_us.max(drive_wait_us));
    reader.stop()?;
    let mut r = Report::check(
        "all-down-ssd-busy",
        about("all-down-ssd-busy"),
        env,
        &plan,
        &out,
    )?;
    let from = down + 50_000.0;
    let n = r
        .between(from, healthy)
        .filter(|s| s.tables.iter().all(|t| t.source.as_deref() == Some("ssd")))
        .count();
    ensure!(
        n > 0,
        "the SSD copy never served while both donors were down"
    );
    let ioprio = metrics
        .lines()
        .find(|l| l.starts_with("engram_node_ssd_engine{") && l.ends_with(" 1"))
        .and_then(|l| l.split("ioprio=\"").nth(1))
        .and_then(|p| p.split('"').next())
        .context("no SSD engine in the node's metrics")?
        .to_string();
    if inference_node::source::ssd::ioprio::permitted(cluster_config::SsdIoprio::DEFAULT) {
        // This process may read at real-time, so the node it started does.
        ensure!(
            ioprio.starts_with("realtime"),
            "the SSD copy read at {ioprio}, not real-time"
        );
    }
    r.figure(
        "SSD fetch, longest",
        format!(
            "{:.2} ms with the drive busy ({ioprio}), {:.2} ms idle; the reader beside it waited up to {:.2} ms for the drive while the donors were down",
            busy_fetch_us / 1e3,
            env.ssd_fetch_us / 1e3,
            drive_wait_us / 1e3
        ),
    );
    r.figure(
        "sequential reader",
        format!("{load_mib_s:.0} MiB/s beside the node; {n} steps served from SSD"),
    );
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

fn all_down_fail(env: &Env, o: &Opts) -> Result<Report> {
    let mut plan = Plan::new("all-down-fail");
    plan.sources = vec!["donor-a", "donor-b"];
    let (mut rack, mut run) = begin(env, &plan, o)?;
    let down = kill_both(&mut rack, &mut run)?;
    let out = finish(run, o, false)?;
    ensure!(!out.success, "the node exited 0 although steps failed");
    ensure!(
        out.log.contains("steps had a table with no usable rows"),
        "the node's exit does not say why:\n{}",
        out.log
    );
    let r = Report::check("all-down-fail", about("all-down-fail"), env, &plan, &out)?;
    // Steps that ended before the kill: one still waiting for its rows
    // when both donors died fails rightly (its lookups had nowhere to go).
    let early = r
        .between(0.0, down)
        .filter(|s| s.start_us + s.time_us < down && super::report::failed(s))
        .count();
    ensure!(
        early == 0,
        "{early} steps failed before the donors went down"
    );
    let late = r
        .between(down + 50_000.0, f64::INFINITY)
        .filter(|s| !super::report::failed(s))
        .count();
    ensure!(
        late == 0,
        "{late} steps were served after both donors went down (from where?)"
    );
    let err = out
        .steps
        .iter()
        .flat_map(|s| &s.tables)
        .find_map(|t| t.error.clone())
        .context("no step failed")?;
    ensure!(
        err.contains("donor-a") && err.contains("donor-b"),
        "the error does not name both donors: {err}"
    );
    let mut r = r;
    r.figure(
        "failed steps",
        format!(
            "{} (every one after the kill); first error: {err}",
            r.failed
        ),
    );
    Ok(r)
}

fn all_down_zeros(env: &Env, o: &Opts) -> Result<Report> {
    let mut plan = Plan::new("all-down-zeros");
    plan.sources = vec!["donor-a", "donor-b"];
    plan.policy = "zeros";
    let (mut rack, mut run) = begin(env, &plan, o)?;
    let down = kill_both(&mut rack, &mut run)?;
    run.at_second(HEAL_AT)?;
    let m = run.metrics()?;
    let counted = both_tables(&m, "engram_node_zeros_served_total", "");
    let healthy = restart_both(&mut rack, &mut run)?;
    let out = finish(run, o, true)?;
    let mut r = Report::check("all-down-zeros", about("all-down-zeros"), env, &plan, &out)?;
    ensure!(
        r.zeros > 0,
        "no zeros were served while every donor was down"
    );
    // A step in flight at the kill may lose both donors mid-fetch: only
    // steps that began a step time and a hard timeout before it count.
    let in_flight_us = 1e6 / o.tokens_per_second + plan.hard_timeout_ms as f64 * 1e3;
    let stray: Vec<String> = r
        .between(0.0, down - in_flight_us)
        .filter(|s| super::report::zeros(s))
        .map(|s| format!("step {} at {:.1} ms", s.step, s.start_us / 1e3))
        .collect();
    ensure!(
        stray.is_empty(),
        "{} steps got zeros before the donors went down at {:.1} ms: {}",
        stray.len(),
        down / 1e3,
        stray.join(", ")
    );
    ensure!(counted > 0.0, "engram_node_zeros_served_total stayed 0");
    ensure!(
        out.log.contains("serving zeros"),
        "the node did not warn that it served zeros:\n{}",
        out.log
    );
    r.figure(
        "steps with zeros (Engram suppressed)",
        format!(
            "{} in the trace; {counted} lookups counted by the node",
            r.zeros
        ),
    );
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

fn sigterm(env: &Env, o: &Opts) -> Result<Report> {
    let plan = Plan::new("sigterm");
    let (mut rack, mut run) = begin(env, &plan, o)?;
    let before = donor_errors(&run.metrics()?, "donor-a");
    let term = run.event("SIGTERM donor-a");
    let st = rack.end("donor-a", libc::SIGTERM)?;
    let gone = run.event(format!("donor-a exited ({st})"));
    ensure!(st.success(), "donor-a's drain did not end cleanly: {st}");
    let after = donor_errors(&run.metrics()?, "donor-a");
    run.at_second(HEAL_AT)?;
    rack.restart("donor-a", Version::Pinned)?;
    let healthy = run.event("donor-a ready");
    let out = finish(run, o, true)?;
    let mut r = Report::check("sigterm", about("sigterm"), env, &plan, &out)?;
    let failovers: u64 = r
        .between(term, healthy)
        .flat_map(|s| &s.tables)
        .map(|t| u64::from(t.failovers))
        .sum();
    // A lookup that met a closing connection fails as unavailable (or a
    // plain failure); a hedge race lost to donor-b counts as a timeout and
    // is not the drain's doing.
    let broken: f64 = ["unavailable", "failed", "corrupt"]
        .iter()
        .map(|k| after.get(*k).unwrap_or(&0.0) - before.get(*k).unwrap_or(&0.0))
        .sum();
    r.figure(
        "drain",
        format!(
            "donor-a exited {:.0} ms after SIGTERM; {failovers} failovers and {broken} lookups on a closing connection meanwhile",
            (gone - term) / 1e3
        ),
    );
    ensure!(
        failovers == 0 && broken == 0.0,
        "a drain must cost no failover and no broken lookup: {failovers} failovers, {broken} broken lookups ({before:?} -> {after:?})"
    );
    r.never_used("donor-a", gone, healthy)?;
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

/// The longest a drain may take once the node has excluded the donor: the
/// node still reads the Goodbye on its idle connection and closes it.
const EXCLUDED_DRAIN_MS: f64 = 100.0;

fn hung_sigterm(env: &Env, o: &Opts) -> Result<Report> {
    let plan = Plan::new("hung-sigterm");
    let (mut rack, mut run) = begin(env, &plan, o)?;
    run.event("SIGSTOP donor-a");
    rack.stop("donor-a")?;
    // Until the node's breaker for donor-a opens: it routes nothing there.
    let open = "engram_node_breaker_state{source=\"donor-a\"} 2";
    let waited = std::time::Instant::now();
    while !run.metrics()?.lines().any(|l| l == open) {
        ensure!(
            waited.elapsed() < Duration::from_secs(5),
            "the node did not open donor-a's breaker within 5 s of SIGSTOP"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    run.event("donor-a's breaker open");
    rack.signal("donor-a", libc::SIGCONT)?;
    let term = run.event("SIGCONT + SIGTERM donor-a");
    let st = rack.end("donor-a", libc::SIGTERM)?;
    let gone = run.event(format!("donor-a exited ({st})"));
    ensure!(st.success(), "donor-a's drain did not end cleanly: {st}");
    let drain_ms = (gone - term) / 1e3;
    run.at_second(HEAL_AT)?;
    rack.restart("donor-a", Version::Pinned)?;
    let healthy = run.event("donor-a ready");
    let out = finish(run, o, true)?;
    let mut r = Report::check("hung-sigterm", about("hung-sigterm"), env, &plan, &out)?;
    r.figure(
        "drain while excluded",
        format!("donor-a exited {drain_ms:.0} ms after SIGTERM (bound {EXCLUDED_DRAIN_MS:.0} ms)"),
    );
    ensure_timing!(
        drain_ms <= EXCLUDED_DRAIN_MS,
        "donor-a exited {drain_ms:.0} ms after SIGTERM: the node held its excluded connection (bound {EXCLUDED_DRAIN_MS:.0} ms)"
    );
    r.never_used("donor-a", gone, healthy)?;
    r.readmitted("donor-a", healthy)?;
    Ok(r)
}

/// `engram_node_source_errors_total` of `donor` by kind, both tables summed.
fn donor_errors(metrics: &str, donor: &str) -> std::collections::BTreeMap<String, f64> {
    let mut out = std::collections::BTreeMap::new();
    let src = format!("source=\"{donor}\"");
    for l in metrics.lines() {
        if !(l.starts_with("engram_node_source_errors_total{") && l.contains(&src)) {
            continue;
        }
        let kind = l.split("kind=\"").nth(1).and_then(|k| k.split('"').next());
        let value = l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok());
        if let (Some(k), Some(v)) = (kind, value) {
            *out.entry(k.to_string()).or_default() += v;
        }
    }
    out
}
