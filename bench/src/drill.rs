//! `engram-bench drill`: the failover drills of `rack_harness::drill`
//! outside the test harness, with the paced node at a chosen token rate.
//! Per drill: its timeline table, a PNG and SVG chart (tokens/s, worst
//! stall, rows per source over time, the drill's events marked), and its
//! figures; then one table of every drill's worst stall and re-admission
//! time against their bounds, also written as `drills.json`. Exits non-zero
//! when a drill's invariant broke (the others still run).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use engram_bench::plot::{Panel, Series, Timeline};
use rack_harness::drill::drills::{self, Opts, SECONDS};
use rack_harness::drill::report::buckets;
use rack_harness::drill::{Env, Report};
use rack_harness::netns::NetNs;
use serde::Serialize;

/// Settings of `drill`.
#[derive(Debug, Clone, clap::Args)]
pub struct DrillArgs {
    /// Work directory: tables, configs, traces, node logs, charts, drills.json.
    #[arg(long, default_value = "target/drill")]
    dir: PathBuf,
    /// The node's token rate (faults come at the same seconds of the run whatever the rate).
    #[arg(long, default_value_t = 100.0)]
    tokens_per_second: f64,
    /// Run only these drills (comma-separated names; default: all).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Width of a timeline row, seconds.
    #[arg(long, default_value_t = 0.5)]
    bucket: f64,
    /// The seed of the random-schedule drills (`random-*`): the same seed
    /// gives the same schedule over every transport.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The drill tables' hashing base (1000: about 24k rows, 6 MB a table;
    /// 100000: about 2.5M rows, 660 MB): larger tables make a donor's load
    /// and the mapping of a new generation take longer.
    #[arg(long, default_value_t = rack_harness::drill::BASE)]
    base: u64,
    /// The model the rack serves: DeepSeek V4.1's two tables, or
    /// Qwen3.8-Flash-Next's (Qwen4Exp) one PLE table of FP8 rows.
    #[arg(long, value_enum, default_value_t = crate::rack::ModelKind::DeepseekV41)]
    model: crate::rack::ModelKind,
}

/// One drill's line in `drills.json`.
#[derive(Debug, Serialize)]
struct Row {
    drill: String,
    passed: bool,
    error: Option<String>,
    worst_stall_ms: Option<f64>,
    stall_bound_ms: Option<f64>,
    readmitted_ms: Vec<(String, f64)>,
    readmit_bound_ms: Option<f64>,
    figures: Vec<(String, String)>,
}

/// Run the drills.
pub fn run(args: &DrillArgs) -> Result<()> {
    check_args(args)?;
    crate::rack::kill_children_on_interrupt()?;
    let chosen: Vec<_> = drills::ALL
        .iter()
        .filter(|(n, _, _)| args.only.is_empty() || args.only.iter().any(|o| o == n))
        .collect();
    let opts = Opts {
        tokens_per_second: args.tokens_per_second,
        seed: args.seed,
    };
    let t = Instant::now();
    println!(
        "preparing: tables (pinned and another version), the local-RAM reference ({} positions) and the SSD calibration in {}",
        opts.tokens(SECONDS),
        args.dir.display()
    );
    let model = match args.model {
        crate::rack::ModelKind::DeepseekV41 => rack_harness::drill::Model::DeepseekV41,
        crate::rack::ModelKind::Qwen4Exp => rack_harness::drill::Model::Qwen4Exp,
    };
    let env = Env::prepare_model(&args.dir, opts.tokens(SECONDS), args.base, model)?;
    println!(
        "prepared in {:.1} s; one SSD fetch of a step's rows takes at most {:.2} ms here\n",
        t.elapsed().as_secs_f64(),
        env.ssd_fetch_us / 1e3
    );
    let mut rows = Vec::new();
    for (i, (name, about, f)) in chosen.iter().enumerate() {
        crate::rack::check_interrupted()?;
        println!("[{}/{}] {name}: {about}", i + 1, chosen.len());
        if *name == "partition"
            && let Err(why) = NetNs::check()
        {
            println!("  skipped: {why}\n");
            rows.push(Row::not_run(name, true, format!("skipped: {why}")));
            continue;
        }
        rows.push(run_one(&env, &opts, args, name, *f)?);
    }
    print!("{}", summary(&rows, args.tokens_per_second));
    print!("{}", host_against_tls(&rows));
    let json = env.dir.join("drills.json");
    std::fs::write(&json, serde_json::to_vec_pretty(&rows)?)
        .with_context(|| format!("writing {}", json.display()))?;
    println!("written: {}", json.display());
    let failed: Vec<&str> = rows
        .iter()
        .filter(|r| !r.passed)
        .map(|r| r.drill.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("drills failed: {}", failed.join(", "));
    }
    Ok(())
}

fn check_args(args: &DrillArgs) -> Result<()> {
    if !(args.tokens_per_second.is_finite() && (10.0..=2_000.0).contains(&args.tokens_per_second)) {
        bail!(
            "--tokens-per-second {} is outside 10..=2000",
            args.tokens_per_second
        );
    }
    if !(args.bucket.is_finite() && (0.05..=SECONDS).contains(&args.bucket)) {
        bail!("--bucket {} is outside 0.05..={SECONDS} s", args.bucket);
    }
    for name in &args.only {
        if drills::find(name).is_none() {
            let all: Vec<&str> = drills::ALL.iter().map(|(n, _, _)| *n).collect();
            bail!("no drill named {name:?}; the drills: {}", all.join(", "));
        }
    }
    Ok(())
}

impl Row {
    /// A drill that did not run through: skipped (`passed`) or failed.
    fn not_run(drill: &str, passed: bool, error: String) -> Self {
        Self {
            drill: drill.to_string(),
            passed,
            error: Some(error),
            worst_stall_ms: None,
            stall_bound_ms: None,
            readmitted_ms: Vec::new(),
            readmit_bound_ms: None,
            figures: Vec::new(),
        }
    }
}

/// One drill: its timeline and chart when it passed; its row either way.
fn run_one(
    env: &Env,
    opts: &Opts,
    args: &DrillArgs,
    name: &str,
    f: drills::DrillFn,
) -> Result<Row> {
    let t = Instant::now();
    Ok(match f(env, opts) {
        Ok(r) => {
            println!("{}", r.timeline(args.bucket));
            let stem = env.dir.join(name).join("timeline");
            let (svg, png) = chart(&r)
                .write_both(&stem)
                .with_context(|| format!("writing {}", stem.display()))?;
            println!(
                "  passed in {:.1} s; chart: {} and {}\n",
                t.elapsed().as_secs_f64(),
                png.display(),
                svg.display()
            );
            Row {
                drill: name.to_string(),
                passed: true,
                error: None,
                worst_stall_ms: Some(r.worst_stall_us / 1e3),
                stall_bound_ms: Some(r.stall_bound_us / 1e3),
                readmitted_ms: r
                    .readmitted
                    .iter()
                    .map(|(d, s)| (d.clone(), s * 1e3))
                    .collect(),
                readmit_bound_ms: Some(r.readmit_bound_s * 1e3),
                figures: r.figures.clone(),
            }
        }
        Err(e) => {
            println!("  FAILED: {e:#}\n");
            Row::not_run(name, false, format!("{e:#}"))
        }
    })
}

/// Every drill on one line: worst stall and re-admission against their bounds.
fn summary(rows: &[Row], rate: f64) -> String {
    let w = rows.iter().map(|r| r.drill.len()).fold(15, usize::max);
    let mut t = format!(
        "drills at {rate} tokens/s:\n{:<w$} {:>7} {:>13} {:>10} {:>17} {:>10}\n",
        "drill", "result", "worst stall", "bound", "re-admitted after", "bound"
    );
    for r in rows {
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2} ms"));
        let re = r
            .readmitted_ms
            .first()
            .map_or("-".to_string(), |(_, v)| format!("{v:.0} ms"));
        let re_bound = if r.readmitted_ms.is_empty() {
            "-".to_string()
        } else {
            r.readmit_bound_ms
                .map_or("-".into(), |v| format!("{v:.0} ms"))
        };
        t += &format!(
            "{:<w$} {:>7} {:>13} {:>10} {:>17} {:>10}\n",
            r.drill,
            match (r.passed, &r.error) {
                (true, Some(_)) => "skipped",
                (true, None) => "passed",
                (false, _) => "FAILED",
            },
            ms(r.worst_stall_ms),
            ms(r.stall_bound_ms),
            re,
            re_bound
        );
    }
    t
}

/// Each drill over host sockets beside its baseline over TLS, when both
/// ran: their worst stalls and the ratio, measured in this run (the same
/// schedule, the same machine).
fn host_against_tls(rows: &[Row]) -> String {
    let mut t = String::new();
    for host in rows.iter().filter(|r| r.drill.contains("host")) {
        let twin = host.drill.replace("host", "tls");
        let Some(tls) = rows.iter().find(|r| r.drill == twin) else {
            continue;
        };
        let (Some(h), Some(n)) = (host.worst_stall_ms, tls.worst_stall_ms) else {
            continue;
        };
        if t.is_empty() {
            t += "host sockets against TLS (worst stall, same schedule):\n";
        }
        t += &format!(
            "  {:<28} {h:>7.2} ms  {twin:<27} {n:>7.2} ms  ratio {:.2}\n",
            host.drill,
            h / n.max(1e-3)
        );
    }
    t
}

/// The drill's chart: tokens/s, worst stall, rows per source; its events.
fn chart(r: &Report) -> Timeline {
    const WIDTH: f64 = 0.25;
    let bs = buckets(&r.steps, WIDTH);
    // The last bucket is partial.
    let full = &bs[..bs.len().saturating_sub(1)];
    let mid = |start: f64| start + WIDTH / 2.0;
    let rows = r
        .sources()
        .into_iter()
        .map(|c| Series {
            points: full
                .iter()
                .map(|b| {
                    let n = b.rows_by_source.get(&c).copied().unwrap_or(0);
                    (mid(b.start_s), n as f64 / WIDTH)
                })
                .collect(),
            name: c,
        })
        .collect();
    Timeline {
        title: format!("engram-bench drill {}: {}", r.name, r.about),
        x_label: "time into the run (s)".into(),
        panels: vec![
            Panel {
                title: "token rate".into(),
                unit: "tokens/s".into(),
                series: vec![
                    Series {
                        name: "measured".into(),
                        points: full
                            .iter()
                            .map(|b| (mid(b.start_s), b.tokens_per_second))
                            .collect(),
                    },
                    Series {
                        name: "target".into(),
                        points: full.iter().map(|b| (mid(b.start_s), r.rate)).collect(),
                    },
                ],
            },
            Panel {
                title: format!(
                    "worst stall per 0.25 s (bound {:.1} ms)",
                    r.stall_bound_us / 1e3
                ),
                unit: "ms".into(),
                series: vec![Series {
                    name: "worst stall".into(),
                    points: full
                        .iter()
                        .map(|b| (mid(b.start_s), b.stall_max_us / 1e3))
                        .collect(),
                }],
            },
            Panel {
                title: "rows per source".into(),
                unit: "rows/s".into(),
                series: rows,
            },
        ],
        events: r
            .events
            .iter()
            .map(|e| (e.at_us / 1e6, e.what.clone()))
            .collect(),
    }
}
