//! Failover drills against the real binaries: each starts its own rack of
//! donors on loopback addresses (or in network namespaces it creates), runs
//! the paced node, injects its fault at chosen tokens and checks the
//! invariants (`rack_harness::drill`). Every drill prints its timeline.
//! The tables, the local-RAM reference and the SSD calibration are made
//! once per run of this file.

use std::sync::OnceLock;

use engram_sync::Mutex;
use rack_harness::drill::drills::{self, Opts, SECONDS};
use rack_harness::drill::report::TimingMiss;
use rack_harness::drill::{Env, Report};
use rack_harness::netns::NetNs;

const OPTS: Opts = Opts {
    tokens_per_second: 100.0,
    seed: SEED,
};

/// The random-schedule drills' seed: the same schedule in every run, over
/// every transport.
const SEED: u64 = 1;

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let tmp = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
        remove_stale(tmp);
        let dir = tmp.join(format!("drills-{}", std::process::id()));
        Env::prepare(&dir, OPTS.tokens(SECONDS)).expect("the drills' tables and reference")
    })
}

/// A Qwen4Exp rack's tables and reference (one PLE table of FP8 rows).
fn qwen_env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let tmp = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
        let dir = tmp
            .join(format!("drills-{}", std::process::id()))
            .join("qwen4exp");
        Env::prepare_model(
            &dir,
            OPTS.tokens(SECONDS),
            rack_harness::drill::BASE,
            rack_harness::drill::Model::Qwen4Exp,
        )
        .expect("the Qwen4Exp drills' tables and reference")
    })
}

/// Remove the work directories of earlier runs whose process is gone (about
/// 1 GB each: tables, configs, logs). The newest run's stays for a look
/// after a failure until the next run.
fn remove_stale(tmp: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("drills-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let alive = std::path::Path::new(&format!("/proc/{pid}")).exists();
        if pid != std::process::id() && !alive {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// One drill at a time: each checks stalls of a few milliseconds, which a
/// second rack starting beside it on a 2-core machine can exceed (its
/// donors loading and verifying tables), and the busy-drive drill loads the
/// disk the others' SSD bounds were calibrated on idle.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn drill(name: &str) -> Report {
    drill_on(env, name)
}

/// Drill `name` on the rack of `env()`'s tables.
fn drill_on(env: fn() -> &'static Env, name: &str) -> Report {
    let _alone = ONE_AT_A_TIME.lock();
    let f = drills::find(name).expect("a drill of that name");
    let run = || match f(env(), &OPTS) {
        Ok(r) => {
            println!("{}", r.timeline(0.5));
            Ok(r)
        }
        Err(e) => Err((e.downcast_ref::<TimingMiss>().is_some(), format!("{e:#}"))),
    };
    // This VM stalls a process now and then for about half a second (seen
    // before any fault was injected, with a donor serving), and its
    // virtual disk, kept busy, sometimes takes a few hundred milliseconds
    // for one read: a drill that misses only a bound on time (a stall, the
    // share of steps a hedge won, a close or re-admission time) gets up to
    // two more runs. Every other failure, and a third miss, fails the drill.
    let mut missed: Vec<String> = Vec::new();
    loop {
        match run() {
            Ok(r) => return r,
            Err((true, e)) if missed.len() < TIMING_RUNS - 1 => {
                println!("drill {name}: a bound on time missed; running it again:\n{e}");
                missed.push(e);
            }
            Err((_, e)) if missed.is_empty() => panic!("drill {name}: {e}"),
            Err((_, e)) => panic!(
                "drill {name}: {e}\n(its {} earlier runs also missed:\n{})",
                missed.len(),
                missed.join("\n")
            ),
        }
    }
}

/// Runs a drill gets when it misses only bounds on time.
const TIMING_RUNS: usize = 3;

#[test]
fn drill_kill_9() {
    drill("kill-9");
}

/// The drills on a Qwen4Exp rack (`engram-bench drill --model qwen4exp`
/// runs them all): a kill of the primary over QUIC, and over TLS with 16
/// sequences prefilling 256 positions each (FP8 answers over 64 KiB), a
/// kill with its mapping serving, a swap to another version and back, both
/// donors down with policy zeros (the outputs after zeros differ for the
/// next 9 positions, through the convolution, and nowhere else).
#[test]
fn qwen4exp_drill_kill_9_quic() {
    drill_on(qwen_env, "kill-9-quic");
}

#[test]
fn qwen4exp_drill_kill_9_tls_batch() {
    drill_on(qwen_env, "kill-9-tls-batch");
}

#[test]
fn qwen4exp_drill_kill_9_host() {
    drill_on(qwen_env, "kill-9-host");
}

#[test]
fn qwen4exp_drill_swap_host() {
    drill_on(qwen_env, "swap-host");
}

#[test]
fn qwen4exp_drill_all_down_zeros() {
    drill_on(qwen_env, "all-down-zeros");
}

#[test]
fn drill_kill_9_tls() {
    drill("kill-9-tls");
}

#[test]
fn drill_kill_9_quic() {
    drill("kill-9-quic");
}

#[test]
fn drill_kill_9_tls_batch() {
    drill("kill-9-tls-batch");
}

#[test]
fn drill_kill_9_host() {
    drill("kill-9-host");
}

#[test]
fn drill_restart_host_new_generation() {
    drill("restart-host-new-generation");
}

#[test]
fn drill_restart_tls_new_generation() {
    drill("restart-tls-new-generation");
}

#[test]
fn drill_swap_host() {
    drill("swap-host");
}

#[test]
fn drill_swap_tls() {
    drill("swap-tls");
}

#[test]
fn drill_random_host() {
    drill("random-host");
}

#[test]
fn drill_random_tls() {
    drill("random-tls");
}

#[test]
fn drill_random_quic() {
    drill("random-quic");
}

#[test]
fn drill_sigstop() {
    drill("sigstop");
}

#[test]
fn drill_sigstop_sweep() {
    drill("sigstop-sweep");
}

#[test]
fn drill_hung_sigterm() {
    drill("hung-sigterm");
}

#[test]
fn drill_wrong_version() {
    drill("wrong-version");
}

#[test]
fn drill_partition() {
    if let Err(why) = NetNs::check() {
        if std::env::var_os("ENGRAM_REQUIRE_NETNS").is_some() {
            panic!("network namespaces are required (ENGRAM_REQUIRE_NETNS): {why}");
        }
        eprintln!("skipped: {why}");
        return;
    }
    drill("partition");
}

#[test]
fn drill_slow_link() {
    drill("slow-link");
}

#[test]
fn drill_corrupt() {
    drill("corrupt");
}

#[test]
fn drill_cut() {
    drill("cut");
}

#[test]
fn drill_all_down_ssd() {
    drill("all-down-ssd");
}

#[test]
fn drill_all_down_ssd_busy() {
    drill("all-down-ssd-busy");
}

#[test]
fn drill_all_down_fail() {
    drill("all-down-fail");
}

#[test]
fn drill_all_down_zeros() {
    drill("all-down-zeros");
}

#[test]
fn drill_sigterm() {
    drill("sigterm");
}

#[test]
fn drill_storm() {
    drill("storm");
}

#[test]
fn drill_storm_handshakes() {
    drill("storm-handshakes");
}

#[test]
fn every_drill_has_a_test() {
    let src = include_str!("drills.rs");
    for (name, _, _) in drills::ALL {
        let call = format!("drill(\"{name}\")");
        assert!(src.contains(&call), "no test runs drill {name}");
    }
}
