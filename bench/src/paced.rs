//! `engram-bench paced`: the real node (`inference-node run`) against local
//! sources (local RAM, a donor process over loopback TCP, the SSD copy)
//! across token rates, measured next to seed 000's prediction from the
//! fetch times the same run measured: a table, `paced.json`, and a
//! heatmap of slowdowns (PNG and SVG) in the style of seed 000's chapter 6.
//! A benchmark: it reports misses of the 10% target, it does not fail on
//! them.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use engram_bench::plot::Heatmap;
use inference_node::model::Summary;
use serde::Serialize;

use crate::rack::{self, Child, NodeSpec, RackSpec};
use crate::realtext::{NodeText, RealTextArgs};
use crate::stats::median;

/// Settings of `engram-bench paced`.
#[derive(Debug, Clone, clap::Args)]
pub struct PacedArgs {
    /// Token rates to run at (default 25,50,100,200,400,1000; with
    /// --contention 100,400).
    #[arg(long, value_delimiter = ',')]
    rates: Option<Vec<f64>>,
    /// Length of each run at its rate (tokens = rate x seconds).
    #[arg(long, default_value_t = 4.0)]
    seconds_per_point: f64,
    /// Runs per point; the table shows the median of each column.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Where the tables, config, paced.json, paced.png and paced.svg go.
    #[arg(long, default_value = "target/bench-paced")]
    out: PathBuf,
    /// Print paced.json on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// Hashing base of the tables (20000: about 480k rows, 127 MB per table).
    #[arg(long, default_value_t = 20_000)]
    hash_base: u64,
    /// Instead: the SSD copy alone, idle and beside a sequential reader on
    /// the same drive, at each I/O priority (`paced-contention.json`).
    #[arg(long)]
    contention: bool,
    /// Instead: speculative decoding with a draft stand-in, with and
    /// without draft prefetch, across --draft-ks and the rates (default
    /// 100,400,1000) (`paced-draft.json`).
    #[arg(long)]
    draft: bool,
    /// Instead: the node with both tables from a donor on its own host,
    /// mapped through its host socket, next to a donor over loopback TLS
    /// (default rates 100,400) (`paced-host.json`).
    #[arg(long)]
    host_local: bool,
    /// Instead: a sequence joining four decoding ones with a prefill of
    /// --join-prefill positions, with no prefill budget and with the
    /// node's: the decoders' step time while it prefills (default rates
    /// 100,400) (`paced-join.json`).
    #[arg(long)]
    join: bool,
    /// The joining sequence's prefill for --join, positions.
    #[arg(long, default_value_t = 2048)]
    join_prefill: usize,
    /// Draft lengths K for --draft.
    #[arg(long, value_delimiter = ',', default_values_t = [2, 4, 8])]
    draft_ks: Vec<usize>,
    /// Time per draft token for --draft, microseconds.
    #[arg(long, default_value_t = 200)]
    draft_us: u64,
    /// For --draft: the chance (0 to 100 %) that a draft is wrong and
    /// rejected by its verification (its rows, and those of the drafts
    /// after it, fetched for nothing).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=100))]
    draft_reject: u8,
    /// For the main series: a real text through the V4 tokenizer.
    #[command(flatten)]
    real: RealTextArgs,
}

/// (node, label, sources of both routes).
const SOURCES: [(&str, &str, &[&str]); 3] = [
    ("local", "local RAM", &["local"]),
    ("donor", "donor TCP", &["donor-a"]),
    ("ssd", "SSD copy", &["ssd"]),
];
/// Measured tokens/s within this fraction of the prediction meets the target.
const TARGET: f64 = 0.10;

/// One run of the node.
#[derive(Debug, Clone, Serialize)]
struct Run {
    tokens: u64,
    tokens_per_second: f64,
    predicted_tokens_per_second: f64,
    slowdown: f64,
    predicted_slowdown: f64,
    measured_over_predicted: f64,
    stall_p99_us: f64,
    overrun_ms: f64,
    /// Per table (layer 1, layer 14).
    fetch_p50_us: Vec<f64>,
    fetch_p99_us: Vec<f64>,
    /// Seed 004's figures: row bytes per token (both tables, every source).
    bytes_per_token: f64,
    /// Rows in before their block needed them.
    prefetch_hit_rate: f64,
    /// Fetch time hidden under compute.
    overlap: f64,
    /// Stall p95, microseconds.
    stall_p95_us: f64,
    /// The donor's CPU time per decoded token, microseconds (0 for the
    /// series without a donor).
    donor_cpu_us_per_token: f64,
}

impl Run {
    fn of(s: &Summary, donor_cpu_s: f64) -> Self {
        Self {
            bytes_per_token: s.deployment.bytes_per_token.values().sum(),
            prefetch_hit_rate: s.deployment.prefetch_hit_rate,
            overlap: s.deployment.overlap,
            stall_p95_us: s.stall_p95_us,
            donor_cpu_us_per_token: donor_cpu_s * 1e6 / s.tokens.max(1) as f64,
            tokens: s.tokens,
            tokens_per_second: s.tokens_per_second,
            predicted_tokens_per_second: s.predicted_tokens_per_second,
            slowdown: s.slowdown,
            predicted_slowdown: s.predicted_slowdown,
            measured_over_predicted: s.measured_over_predicted,
            stall_p99_us: s.stall_p99_us,
            overrun_ms: s.overrun_ms,
            fetch_p50_us: s.tables.iter().map(|t| t.fetch_p50_us).collect(),
            fetch_p99_us: s.tables.iter().map(|t| t.fetch_p99_us).collect(),
        }
    }
}

/// One source at one rate: the median of each column over its runs.
#[derive(Debug, Clone, Serialize)]
struct Point {
    source: String,
    label: String,
    rate: f64,
    measured_tokens_per_second: f64,
    predicted_tokens_per_second: f64,
    measured_slowdown: f64,
    predicted_slowdown: f64,
    measured_over_predicted: f64,
    within_target: bool,
    stall_p99_us: f64,
    fetch_p50_us: Vec<f64>,
    prefetch_hit_rate: f64,
    overlap: f64,
    donor_cpu_us_per_token: f64,
    repeats: Vec<Run>,
}

/// What `paced.json` holds.
#[derive(Debug, Clone, Serialize)]
struct Report {
    hash_base: u64,
    rows: [u64; 2],
    seconds_per_point: f64,
    repeat: usize,
    fusion: String,
    target: String,
    points: Vec<Point>,
    missed: usize,
}

impl Point {
    fn of(source: (&str, &str), rate: f64, runs: Vec<Run>) -> Self {
        let m = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(f).collect());
        let fetch = (0..2)
            .map(|t| m(&|r: &Run| r.fetch_p50_us.get(t).copied().unwrap_or(f64::NAN)))
            .collect();
        let ratio = m(&|r| r.measured_over_predicted);
        Self {
            source: source.0.into(),
            label: source.1.into(),
            rate,
            measured_tokens_per_second: m(&|r| r.tokens_per_second),
            predicted_tokens_per_second: m(&|r| r.predicted_tokens_per_second),
            measured_slowdown: m(&|r| r.slowdown),
            predicted_slowdown: m(&|r| r.predicted_slowdown),
            measured_over_predicted: ratio,
            within_target: (ratio - 1.0).abs() <= TARGET,
            prefetch_hit_rate: m(&|r| r.prefetch_hit_rate),
            overlap: m(&|r| r.overlap),
            donor_cpu_us_per_token: m(&|r| r.donor_cpu_us_per_token),
            stall_p99_us: m(&|r| r.stall_p99_us),
            fetch_p50_us: fetch,
            repeats: runs,
        }
    }
}

/// Run it.
pub fn run(args: &PacedArgs) -> Result<()> {
    let rates = rates(args)?;
    rack::kill_children_on_interrupt()?;
    let t_all = Instant::now();
    let out = &rack::work_dir(&args.out)?;
    if let Some(done) = other_mode(args, out, rates) {
        return done;
    }
    let tables = rack::table_pair(out, args.hash_base)?;
    let rows = [tables.tables[0].rows, tables.tables[1].rows];
    let text = args.real.node_text(out)?;
    eprintln!("{}", args.real.describe(text.as_ref()));
    let spec = RackSpec {
        donors: &["donor-a"],
        nodes: SOURCES
            .iter()
            .map(|&(name, _, sources)| NodeSpec {
                name,
                sources,
                ssd_ioprio: None,
            })
            .collect(),
        probe_interval_ms: 1000,
        // Every run starts a node: its copies were verified at generation.
        trust_copies: true,
        transport: cluster_config::Transport::Tcp,
        host_sockets: &[],
        tokenizer: text.as_ref().map(|t| t.tokenizer.clone()),
    };
    let rk = rack::write_config(out, &tables, &spec)?;
    let fusion = format!(
        "CPU, hidden {} x {} streams: small, so fusion stays far below a token's budget even at 1000 tokens/s",
        rack::HIDDEN,
        rack::STREAMS
    );
    eprintln!(
        "tables: hash base {} ({} and {} rows, {}); config {}",
        args.hash_base,
        rows[0],
        rows[1],
        if tables.reused { "reused" } else { "generated" },
        rk.config.display()
    );
    eprintln!("fusion: {fusion}");
    let donor = Child::launch_donor(&rk.config, "donor-a", &[])?;
    donor.wait_ready(Duration::from_secs(120))?;
    eprintln!(
        "donor-a ready on {} (pid {})",
        rk.donors[0].listen,
        donor.pid()
    );

    let points = measure(args, rates, &rk.config, out, (text.as_ref(), donor.pid()))?;
    drop(donor);

    let missed = points.iter().filter(|p| !p.within_target).count();
    let report = Report {
        hash_base: args.hash_base,
        rows,
        seconds_per_point: args.seconds_per_point,
        repeat: args.repeat,
        fusion,
        target:
            "measured tokens/s within 10% of seed 000's prediction from the measured fetch times"
                .into(),
        points,
        missed,
    };
    std::fs::write(out.join("paced.json"), serde_json::to_vec_pretty(&report)?)?;
    let (svg, png) = heatmap(&report, rates)
        .write_both(&out.join("paced"))
        .with_context(|| format!("writing the heatmap into {}", out.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_text(&report, out, &svg, &png, t_all);
    Ok(())
}

/// The rates to run at: `--rates`, or the mode's defaults; checked.
fn rates(args: &PacedArgs) -> Result<&[f64]> {
    let default_rates: &[f64] = if args.contention || args.host_local || args.join {
        &[100.0, 400.0]
    } else if args.draft {
        &[100.0, 400.0, 1000.0]
    } else {
        &[25.0, 50.0, 100.0, 200.0, 400.0, 1000.0]
    };
    let rates = args.rates.as_deref().unwrap_or(default_rates);
    if rates.is_empty()
        || rates
            .iter()
            .any(|r| !(r.is_finite() && *r > 0.0 && *r <= 100_000.0))
    {
        bail!("--rates must be token rates (0 < rate <= 100000)");
    }
    if !(args.seconds_per_point.is_finite() && args.seconds_per_point > 0.0) {
        bail!("--seconds-per-point must be above 0");
    }
    if args.repeat == 0 {
        bail!("--repeat must be 1 or more");
    }
    Ok(rates)
}

/// The modes with a module of their own (`--contention`, `--host-local`,
/// `--join`, `--draft`): their result, or `None` for the plain sweep.
fn other_mode(args: &PacedArgs, out: &Path, rates: &[f64]) -> Option<Result<()>> {
    if args.contention {
        return Some(crate::paced_contention::run(
            out,
            args.hash_base,
            rates,
            args.seconds_per_point,
            args.json,
        ));
    }
    if args.host_local {
        return Some(crate::paced_host::run(
            out,
            args.hash_base,
            rates,
            args.seconds_per_point,
            args.repeat,
            args.json,
        ));
    }
    if args.join {
        return Some(crate::paced_join::run(&crate::paced_join::JoinArgs {
            out,
            hash_base: args.hash_base,
            rates,
            prefill: args.join_prefill,
            seconds: args.seconds_per_point,
            repeat: args.repeat,
            json: args.json,
        }));
    }
    if args.draft {
        if args.draft_us > inference_node::model::MAX_DRAFT_TIME.as_micros() as u64 {
            return Some(Err(anyhow::anyhow!(
                "--draft-us {} is over 1000000",
                args.draft_us
            )));
        }
        return Some(crate::paced_draft::run(&crate::paced_draft::DraftArgs {
            out,
            hash_base: args.hash_base,
            rates,
            ks: &args.draft_ks,
            draft_us: args.draft_us,
            reject_percent: args.draft_reject,
            seconds: args.seconds_per_point,
            repeat: args.repeat,
            json: args.json,
        }));
    }
    None
}

/// Every source at every rate, `--repeat` times; one point each.
fn measure(
    args: &PacedArgs,
    rates: &[f64],
    config: &Path,
    out: &Path,
    (text, donor): (Option<&NodeText>, u32),
) -> Result<Vec<Point>> {
    let runs_dir = out.join("runs");
    std::fs::create_dir_all(&runs_dir)?;
    let mut runs: Vec<Vec<Vec<Run>>> = vec![vec![Vec::new(); rates.len()]; SOURCES.len()];
    for rep in 0..args.repeat {
        for (si, (node, label, _)) in SOURCES.iter().enumerate() {
            for (ri, &rate) in rates.iter().enumerate() {
                let file = runs_dir.join(format!("{node}-{rate}-{}.json", rep + 1));
                let mut a = rack::paced_args(rate, args.seconds_per_point);
                a.extend(text.map(NodeText::args).unwrap_or_default());
                let timeout = Duration::from_secs_f64(args.seconds_per_point * 10.0 + 120.0);
                let cpu_before = rack::cpu_s(donor)?;
                rack::run_node(config, node, &a, &file, timeout)?;
                let donor_cpu = rack::cpu_s(donor)? - cpu_before;
                let s: Summary = serde_json::from_slice(&std::fs::read(&file)?)
                    .with_context(|| format!("reading {}", file.display()))?;
                let on_donor = *node == "donor";
                let r = Run::of(&s, if on_donor { donor_cpu } else { 0.0 });
                eprintln!(
                    "run {}/{}: {label:<9} {rate:>6} tokens/s: measured {:>7.1}, predicted {:>7.1} ({:.3}); {:.0} B/token, hits {:.1}%, overlap {:.1}%, stall p95 {:.0} us, donor CPU {:.1} us/token",
                    rep + 1,
                    args.repeat,
                    r.tokens_per_second,
                    r.predicted_tokens_per_second,
                    r.measured_over_predicted,
                    r.bytes_per_token,
                    r.prefetch_hit_rate * 100.0,
                    r.overlap * 100.0,
                    r.stall_p95_us,
                    r.donor_cpu_us_per_token
                );
                runs[si][ri].push(r);
            }
        }
    }
    let mut points = Vec::new();
    for (si, (node, label, _)) in SOURCES.iter().enumerate() {
        for (ri, &rate) in rates.iter().enumerate() {
            points.push(Point::of(
                (node, label),
                rate,
                std::mem::take(&mut runs[si][ri]),
            ));
        }
    }
    Ok(points)
}

fn print_text(report: &Report, out: &Path, svg: &Path, png: &Path, t_all: Instant) {
    let missed = report.missed;
    print!("{}", table(report));
    println!("fusion: {}", report.fusion);
    if missed == 0 {
        println!("every point is within 10% of its prediction");
    } else {
        let list: Vec<String> = report
            .points
            .iter()
            .filter(|p| !p.within_target)
            .map(|p| {
                format!(
                    "{} at {} tokens/s (measured/predicted {:.3})",
                    p.label, p.rate, p.measured_over_predicted
                )
            })
            .collect();
        println!(
            "MISSED the 10% target at {missed} of {} points: {}",
            report.points.len(),
            list.join("; ")
        );
    }
    println!(
        "wrote {}, {} and {} ({:.0} s in all)",
        out.join("paced.json").display(),
        png.display(),
        svg.display(),
        rack::since(t_all)
    );
}

fn table(r: &Report) -> String {
    let mut s = format!(
        "{:<10} {:>6} {:>10} {:>10} {:>9} {:>9} {:>9} {:>14} {:>7} {:>7} {:>8} {:>10}\n",
        "source",
        "rate",
        "measured",
        "predicted",
        "slowdown",
        "predicted",
        "meas/pred",
        "fetch p50 us",
        "within",
        "hits",
        "overlap",
        "donor CPU"
    );
    s += &format!(
        "{:<10} {:>6} {:>10} {:>10} {:>9} {:>9} {:>9} {:>14} {:>7} {:>7} {:>8} {:>10}\n",
        "", "tok/s", "tok/s", "tok/s", "", "slowdown", "", "layer 1/14", "10%", "", "", "us/token"
    );
    for p in &r.points {
        s += &format!(
            "{:<10} {:>6} {:>10.1} {:>10.1} {:>8.2}% {:>8.2}% {:>9.3} {:>14} {:>7} {:>6.1}% {:>7.1}% {:>10.1}\n",
            p.label,
            p.rate,
            p.measured_tokens_per_second,
            p.predicted_tokens_per_second,
            p.measured_slowdown * 100.0,
            p.predicted_slowdown * 100.0,
            p.measured_over_predicted,
            format!(
                "{:.0} / {:.0}",
                p.fetch_p50_us.first().copied().unwrap_or(f64::NAN),
                p.fetch_p50_us.get(1).copied().unwrap_or(f64::NAN)
            ),
            if p.within_target { "yes" } else { "NO" },
            p.prefetch_hit_rate * 100.0,
            p.overlap * 100.0,
            p.donor_cpu_us_per_token
        );
    }
    s
}

fn heatmap(r: &Report, rates: &[f64]) -> Heatmap {
    let cell = |si: usize, f: &dyn Fn(&Point) -> f64| -> Vec<Option<f64>> {
        (0..rates.len())
            .map(|ri| r.points.get(si * rates.len() + ri).map(f))
            .collect()
    };
    Heatmap {
        title: format!(
            "inference-node run: slowdown by source and rate (median of {})",
            r.repeat
        ),
        rows: SOURCES.iter().map(|s| s.1.to_string()).collect(),
        cols: rates.iter().map(|r| format!("{r} tok/s")).collect(),
        measured: (0..SOURCES.len())
            .map(|si| cell(si, &|p| p.measured_slowdown))
            .collect(),
        predicted: (0..SOURCES.len())
            .map(|si| cell(si, &|p| p.predicted_slowdown))
            .collect(),
    }
}
