//! `engram-bench paced --host-local`: the paced node with both tables from
//! a donor on its own host, mapped through the donor's host socket, next to
//! the same node reading a donor over loopback TLS (the default transport)
//! and its own copy in RAM (the floor of the node's loop), at each token
//! rate (default 100 and 400 tokens/s). The figures that
//! decide whether table 1's rows arrive in its window (a quarter of a
//! block at V4.1's timing): its fetch p50 and p99, the fetches answered
//! after their window, and the steps that stalled.
//!
//! The TLS donor also runs without the node's warm-up (`--warm-us 0`), and
//! back to back (a step of 10 us, so nothing on the path sleeps between
//! lookups): each TLS point is given over that back-to-back p50 of the
//! same run (target 2 or less), with the cores the node and the donor
//! took (CPU seconds over the run's seconds).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use inference_node::model::Summary;
use serde::Serialize;

use crate::rack::{self, Child, NodeSpec, RackSpec};
use crate::stats::median;

/// (node, label, its extra arguments): donor-a mapped through its host
/// socket, donor-b over TLS with the node's warm-up (the default) and
/// without it, and the node's own copy in its RAM (the floor of the
/// node's loop).
const SERIES: [(&str, &str, &[&str]); 4] = [
    ("host", "host-local (mapped)", &[]),
    ("tls", "donor over loopback TLS", &[]),
    ("tls", "TLS, no warm-up", &["--warm-us", "0"]),
    ("local", "node's own RAM (floor)", &[]),
];

/// The rate of the back-to-back runs: a step of 10 us, so each step's
/// rows are asked for as soon as the last step's are in, and no thread
/// on the path sleeps between them (the baseline of the paced figures).
const BACK_TO_BACK_RATE: f64 = 100_000.0;
/// Steps of a back-to-back run.
const BACK_TO_BACK_TOKENS: f64 = 3000.0;

/// One node run.
#[derive(Debug, Clone, Serialize)]
struct Run {
    tokens: u64,
    tokens_per_second: f64,
    stall_p99_us: f64,
    stalled_steps: u64,
    /// Table 1 (layer 1): fetch p50 and p99, fetches after their window.
    table1_fetch_p50_us: f64,
    table1_fetch_p99_us: f64,
    table1_late: u64,
    /// Table 14's fetch p50.
    table14_fetch_p50_us: f64,
    /// CPU the node's process and the donor it read took, in cores (CPU
    /// seconds over the run's seconds).
    node_cores: f64,
    donor_cores: f64,
    /// Table 1's fetch hop by hop (p50s): to an I/O thread, round trip,
    /// to the loop.
    table1_hops_us: [f64; 3],
}

/// One series at one rate: medians over its runs.
#[derive(Debug, Clone, Serialize)]
struct Point {
    series: String,
    rate: f64,
    tokens_per_second: f64,
    table1_fetch_p50_us: f64,
    table1_fetch_p99_us: f64,
    table1_late: f64,
    table14_fetch_p50_us: f64,
    stalled_steps: f64,
    stall_p99_us: f64,
    node_cores: f64,
    donor_cores: f64,
    table1_hops_us: [f64; 3],
    /// For the TLS series: table 1's fetch p50 over the back-to-back p50
    /// of the same donor and node in the same run (target: 2 or less).
    over_back_to_back: Option<f64>,
    runs: Vec<Run>,
}

/// Run it in `out`.
pub fn run(
    out: &Path,
    hash_base: u64,
    rates: &[f64],
    seconds: f64,
    repeat: usize,
    json: bool,
) -> Result<()> {
    let t_all = Instant::now();
    let tables = rack::table_pair(out, hash_base)?;
    let rk = rack::write_config(out, &tables, &rack_spec())?;
    let donors: Vec<Child> = ["donor-a", "donor-b"]
        .iter()
        .map(|d| Child::launch_donor(&rk.config, d, &[]))
        .collect::<Result<_>>()?;
    for d in &donors {
        d.wait_ready(Duration::from_secs(120))?;
    }
    eprintln!(
        "donor-a on {} and its host socket {}; donor-b on {}",
        rk.donors[0].listen,
        rack::host_socket(out, "donor-a").display(),
        rk.donors[1].listen
    );
    let runs_dir = out.join("runs-host");
    std::fs::create_dir_all(&runs_dir)?;
    let mut runs = vec![vec![Vec::new(); rates.len()]; SERIES.len()];
    let mut back_to_back: Vec<f64> = Vec::new();
    let timeout = Duration::from_secs_f64(seconds * 10.0 + 120.0);
    for rep in 0..repeat {
        let round = Round {
            config: &rk.config,
            runs_dir: &runs_dir,
            donors: [donors[0].pid(), donors[1].pid()],
            rates,
            seconds,
            timeout,
            rep,
            repeat,
        };
        back_to_back.push(round.back_to_back()?);
        round.run_series(&mut runs)?;
    }
    drop(donors);
    let back_to_back_p50 = median(back_to_back.clone());
    let points = points_of(runs, rates, back_to_back_p50);
    let file = out.join("paced-host.json");
    let v = serde_json::json!({
        "benchmark": "paced --host-local",
        "hash_base": hash_base,
        "rows": [tables.tables[0].rows, tables.tables[1].rows],
        "seconds_per_point": seconds,
        "repeat": repeat,
        "tls_back_to_back_table1_fetch_p50_us": back_to_back_p50,
        "tls_back_to_back_runs_us": back_to_back,
        "points": points,
    });
    std::fs::write(&file, serde_json::to_vec_pretty(&v)?)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print_text(&points, repeat, seconds, back_to_back_p50);
    println!(
        "wrote {} ({:.0} s in all)",
        file.display(),
        rack::since(t_all)
    );
    Ok(())
}

/// Two donors (donor-a with a host socket), the node three ways: through
/// donor-a's host socket, to donor-b over TLS, and from its own RAM.
fn rack_spec() -> RackSpec {
    RackSpec {
        donors: &["donor-a", "donor-b"],
        nodes: vec![
            NodeSpec {
                name: "host",
                sources: &["donor-a"],
                ssd_ioprio: None,
            },
            NodeSpec {
                name: "tls",
                sources: &["donor-b"],
                ssd_ioprio: None,
            },
            NodeSpec {
                name: "local",
                sources: &["local"],
                ssd_ioprio: None,
            },
        ],
        probe_interval_ms: 1000,
        trust_copies: true,
        transport: cluster_config::Transport::Tls,
        host_sockets: &["donor-a"],
        tokenizer: None,
    }
}

/// One repetition of every series at every rate.
struct Round<'a> {
    config: &'a Path,
    runs_dir: &'a Path,
    /// donor-a's and donor-b's pids (their CPU time is measured).
    donors: [u32; 2],
    rates: &'a [f64],
    seconds: f64,
    timeout: Duration,
    rep: usize,
    repeat: usize,
}

impl Round<'_> {
    /// The TLS node back to back: table 1's fetch p50.
    fn back_to_back(&self) -> Result<f64> {
        let file = self
            .runs_dir
            .join(format!("tls-back-to-back-{}.json", self.rep + 1));
        let a = rack::paced_args(BACK_TO_BACK_RATE, BACK_TO_BACK_TOKENS / BACK_TO_BACK_RATE);
        rack::run_node(self.config, "tls", &a, &file, self.timeout)?;
        let s: Summary = serde_json::from_slice(&std::fs::read(&file)?)
            .with_context(|| format!("reading {}", file.display()))?;
        let r = run_of(&s, 0.0)?;
        eprintln!(
            "run {}/{}: TLS back to back: table 1 fetch p50 {:.1} us",
            self.rep + 1,
            self.repeat,
            r.table1_fetch_p50_us
        );
        Ok(r.table1_fetch_p50_us)
    }

    fn run_series(&self, runs: &mut [Vec<Vec<Run>>]) -> Result<()> {
        let (rates, seconds, timeout, rep, repeat) = (
            self.rates,
            self.seconds,
            self.timeout,
            self.rep,
            self.repeat,
        );
        for (si, (node, label, extra)) in SERIES.iter().enumerate() {
            for (ri, &rate) in rates.iter().enumerate() {
                let file = self
                    .runs_dir
                    .join(format!("{node}-{si}-{rate}-{}.json", rep + 1));
                let mut a = rack::paced_args(rate, seconds);
                a.extend(extra.iter().map(|x| x.to_string()));
                // The donor the node reads: donor-a through its host
                // socket, donor-b over TLS (none for `local`).
                let donor = match *node {
                    "host" => Some(self.donors[0]),
                    "tls" => Some(self.donors[1]),
                    _ => None,
                };
                let donor_before = donor.map(rack::cpu_s).transpose()?.unwrap_or(0.0);
                rack::run_node(self.config, node, &a, &file, timeout)?;
                let donor_cpu = donor.map(rack::cpu_s).transpose()?.unwrap_or(0.0) - donor_before;
                let s: Summary = serde_json::from_slice(&std::fs::read(&file)?)
                    .with_context(|| format!("reading {}", file.display()))?;
                let r = run_of(&s, donor_cpu)?;
                eprintln!(
                    "run {}/{repeat}: {label:<24} {rate:>5} tokens/s: table 1 fetch p50 {:.1} us, {} late",
                    rep + 1,
                    r.table1_fetch_p50_us,
                    r.table1_late
                );
                runs[si][ri].push(r);
            }
        }
        Ok(())
    }
}

/// Each series' point at each rate: medians of its runs.
fn points_of(mut runs: Vec<Vec<Vec<Run>>>, rates: &[f64], back_to_back_p50: f64) -> Vec<Point> {
    let mut points = Vec::new();
    for (si, (node, label, _)) in SERIES.iter().enumerate() {
        for (ri, &rate) in rates.iter().enumerate() {
            let rs = std::mem::take(&mut runs[si][ri]);
            let m = |f: &dyn Fn(&Run) -> f64| median(rs.iter().map(f).collect());
            points.push(Point {
                series: label.to_string(),
                rate,
                tokens_per_second: m(&|r| r.tokens_per_second),
                table1_fetch_p50_us: m(&|r| r.table1_fetch_p50_us),
                table1_fetch_p99_us: m(&|r| r.table1_fetch_p99_us),
                table1_late: m(&|r| r.table1_late as f64),
                table14_fetch_p50_us: m(&|r| r.table14_fetch_p50_us),
                stalled_steps: m(&|r| r.stalled_steps as f64),
                stall_p99_us: m(&|r| r.stall_p99_us),
                node_cores: m(&|r| r.node_cores),
                donor_cores: m(&|r| r.donor_cores),
                table1_hops_us: [0, 1, 2].map(|i| m(&|r| r.table1_hops_us[i])),
                over_back_to_back: (*node == "tls")
                    .then(|| m(&|r| r.table1_fetch_p50_us) / back_to_back_p50),
                runs: rs,
            });
        }
    }
    points
}

fn print_text(points: &[Point], repeat: usize, seconds: f64, back_to_back_p50: f64) {
    println!(
        "paced node, both tables from one donor: mapped through its host socket, or over loopback TLS \
         (medians of {repeat} runs of {seconds} s)"
    );
    println!(
        "{:<24} {:>6} {:>9} {:>13} {:>13} {:>8} {:>13} {:>8} {:>10} {:>6} {:>6} {:>6}",
        "series",
        "rate",
        "tokens/s",
        "t1 fetch p50",
        "t1 fetch p99",
        "t1 late",
        "t14 fetch p50",
        "stalled",
        "stall p99",
        "node",
        "donor",
        "/b2b"
    );
    for p in points {
        println!(
            "{:<24} {:>6} {:>9.1} {:>10.1} us {:>10.1} us {:>8.0} {:>10.1} us {:>8.0} {:>7.0} us {:>6.2} {:>6.2} {:>6}",
            p.series,
            p.rate,
            p.tokens_per_second,
            p.table1_fetch_p50_us,
            p.table1_fetch_p99_us,
            p.table1_late,
            p.table14_fetch_p50_us,
            p.stalled_steps,
            p.stall_p99_us,
            p.node_cores,
            p.donor_cores,
            p.over_back_to_back
                .map_or("-".to_string(), |x| format!("{x:.2}"))
        );
    }
    println!(
        "table 1's fetch hop by hop (p50s): from the loop to an I/O thread, its round trip, back to the loop"
    );
    for p in points {
        let [io, rt, back] = p.table1_hops_us;
        println!(
            "{:<24} {:>6} {:>10.1} us {:>10.1} us {:>10.1} us",
            p.series, p.rate, io, rt, back
        );
    }
    println!(
        "(t1 late: table 1's fetches answered after its window; stalled: steps that waited for rows; \
         node, donor: cores their processes took; /b2b: t1 fetch p50 over the same node's back-to-back \
         p50 over TLS, {back_to_back_p50:.1} us in this run, target 2 or less)"
    );
}

/// One run's figures; `donor_cpu_s`: the CPU its donor took meanwhile.
fn run_of(s: &Summary, donor_cpu_s: f64) -> Result<Run> {
    let [t1, t14] = s.tables.as_slice() else {
        bail!("a summary with {} tables, not 2", s.tables.len());
    };
    for t in [t1, t14] {
        if t.by_source
            .keys()
            .any(|k| !["donor-a", "donor-b", "local"].contains(&k.as_str()))
        {
            bail!("table {} was served by {:?}", t.table, t.by_source);
        }
    }
    Ok(Run {
        tokens: s.tokens,
        tokens_per_second: s.tokens_per_second,
        stall_p99_us: s.stall_p99_us,
        stalled_steps: s.stalled_steps,
        table1_fetch_p50_us: t1.fetch_p50_us,
        table1_fetch_p99_us: t1.fetch_p99_us,
        table1_late: t1.late,
        table14_fetch_p50_us: t14.fetch_p50_us,
        node_cores: s.cpu_s / s.elapsed_s.max(1e-9),
        donor_cores: donor_cpu_s / s.elapsed_s.max(1e-9),
        table1_hops_us: t1
            .hops_p50_us
            .map_or([0.0; 3], |h| [h.to_io_us, h.round_trip_us, h.to_loop_us]),
    })
}
