//! `engram-bench paced --contention`: the node served by its SSD copy
//! alone (every donor gone), at each token rate, with the drive idle and
//! beside a saturating sequential reader on the same drive, at each I/O
//! priority of the copy's reads; measured tokens/s next to seed 000's
//! prediction from the fetch times each run measured.
//!
//! A run beside the reader lasts the same wall time as an idle one (the
//! node is stopped with SIGTERM once it is up; it finishes its step and
//! prints its summary), since at best-effort priority a token can take
//! half a second.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use inference_node::model::Summary;
use rack_harness::load::{Meter, Streamer};
use serde::Serialize;

use crate::rack::{self, NodeSpec, RackSpec};

/// The series at each rate: (name, node, whether the reader runs).
const SERIES: [(&str, &str, bool); 4] = [
    ("idle drive, realtime", "ssd-rt", false),
    ("reader, realtime", "ssd-rt", true),
    ("reader, best-effort", "ssd-be", true),
    ("reader, idle class", "ssd-idle", true),
];

/// The nodes, each reading its SSD copy at one priority.
const NODES: [(&str, &str); 3] = [
    ("ssd-rt", "realtime:4"),
    ("ssd-be", "best-effort:4"),
    ("ssd-idle", "idle"),
];

/// The file the sequential reader streams: 1 GiB of data on the tables'
/// drive (written once, kept in the work directory).
const LOAD_FILE_BYTES: u64 = 1 << 30;

/// One run.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    rate: f64,
    series: String,
    tokens: u64,
    tokens_per_second: f64,
    predicted_tokens_per_second: f64,
    measured_over_predicted: f64,
    stall_p99_us: f64,
    /// Table 1's fetch p50 and p99.
    fetch_p50_us: f64,
    fetch_p99_us: f64,
    /// The reader's bandwidth during the run.
    load_mib_s: f64,
    /// Steps whose lookup failed (every source, the copy too, out of time).
    failed_steps: u64,
}

/// Run every series at every rate (`seconds` each) in `out`.
pub fn run(out: &Path, hash_base: u64, rates: &[f64], seconds: f64, json: bool) -> Result<()> {
    let t_all = Instant::now();
    let tables = rack::table_pair(out, hash_base)?;
    let spec = RackSpec {
        donors: &[],
        nodes: NODES
            .iter()
            .map(|&(name, p)| NodeSpec {
                name,
                sources: &["ssd"],
                ssd_ioprio: Some(p),
            })
            .collect(),
        probe_interval_ms: 1000,
        trust_copies: true,
        transport: cluster_config::Transport::Tcp,
        host_sockets: &[],
        tokenizer: None,
    };
    let rk = rack::write_config(out, &tables, &spec)?;
    let load_file = out.join("load.bin");
    rack_harness::load::data_file(&load_file, LOAD_FILE_BYTES)
        .with_context(|| format!("writing {}", load_file.display()))?;
    let runs_dir = out.join("runs");
    std::fs::create_dir_all(&runs_dir)?;
    let mut points = Vec::new();
    for &rate in rates {
        for (series, node, loaded) in SERIES {
            let file = runs_dir.join(format!("contention-{node}-{rate}-{}.json", loaded as u8));
            let streamer = loaded.then(|| Streamer::reader(&load_file)).transpose()?;
            std::thread::sleep(Duration::from_millis(300));
            let meter = streamer.as_ref().map(Meter::start);
            run_for(&rk.config, node, rate, seconds, &file)?;
            let load_mib_s = match (&streamer, meter) {
                (Some(s), Some(m)) => m.mib_per_second(s),
                _ => 0.0,
            };
            if let Some(s) = streamer {
                s.stop()?;
            }
            let s: Summary = serde_json::from_slice(&std::fs::read(&file)?)
                .with_context(|| format!("reading {}", file.display()))?;
            let p = Point {
                rate,
                series: series.into(),
                tokens: s.tokens,
                tokens_per_second: s.tokens_per_second,
                predicted_tokens_per_second: s.predicted_tokens_per_second,
                measured_over_predicted: s.measured_over_predicted,
                stall_p99_us: s.stall_p99_us,
                fetch_p50_us: s.tables.first().map_or(0.0, |t| t.fetch_p50_us),
                fetch_p99_us: s.tables.first().map_or(0.0, |t| t.fetch_p99_us),
                load_mib_s,
                failed_steps: s.failed_steps,
            };
            eprintln!(
                "{rate:>6} tokens/s  {series:<22} measured {:>7.1}  predicted {:>7.1}  fetch p99 {:>8.0} us",
                p.tokens_per_second, p.predicted_tokens_per_second, p.fetch_p99_us
            );
            points.push(p);
        }
    }
    let path = out.join("paced-contention.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&points)?)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&points)?);
        return Ok(());
    }
    print_points(&points, seconds);
    println!(
        "wrote {} ({:.0} s in all)",
        path.display(),
        rack::since(t_all)
    );
    Ok(())
}

/// Run node `node` at `rate` for about `seconds` of wall time; its summary
/// goes to `file`.
fn run_for(config: &Path, node: &str, rate: f64, seconds: f64, file: &Path) -> Result<()> {
    let args = rack::paced_args(rate, seconds);
    let mut child = rack::start_node(config, node, &args, file)?;
    // Up once it says what it runs (its SSD copies are open by then);
    // then at most `seconds` of steps.
    child.wait_line(Duration::from_secs(120), |l| {
        l.starts_with("running ").then_some(())
    })?;
    let until = Instant::now() + Duration::from_secs_f64(seconds + 1.0);
    while Instant::now() < until {
        if let Ok(st) = child.wait_exit(Duration::from_millis(100)) {
            return ok(node, &child, st);
        }
    }
    child.signal(libc::SIGTERM);
    let st = child.wait_exit(Duration::from_secs(60))?;
    ok(node, &child, st)
}

/// A node that ran is fine even if some of its lookups failed (it exits
/// 1 then, with its summary written): that is a measured outcome.
fn ok(node: &str, child: &rack::Child, st: std::process::ExitStatus) -> Result<()> {
    if !st.success() && !child.log().contains("had a table with no usable rows") {
        bail!("node {node} failed ({st}):\n{}", child.log());
    }
    Ok(())
}

fn print_points(points: &[Point], seconds: f64) {
    println!(
        "the node on its SSD copy alone, {seconds:.0} s per run; reader: 1 MiB O_DIRECT reads, 32 in flight, on the same drive"
    );
    let rows: Vec<Vec<String>> = points
        .iter()
        .map(|p| {
            vec![
                format!("{}", p.rate),
                p.series.clone(),
                format!("{:.1}", p.tokens_per_second),
                format!("{:.1}", p.predicted_tokens_per_second),
                format!("{:.3}", p.measured_over_predicted),
                format!("{:.0}", p.fetch_p50_us),
                format!("{:.0}", p.fetch_p99_us),
                format!("{:.0}", p.stall_p99_us),
                if p.load_mib_s > 0.0 {
                    format!("{:.0}", p.load_mib_s)
                } else {
                    "-".into()
                },
                p.failed_steps.to_string(),
            ]
        })
        .collect();
    crate::stats::print_table(
        &[
            "rate",
            "series",
            "tokens/s",
            "predicted",
            "meas/pred",
            "t1 fetch p50 us",
            "t1 fetch p99 us",
            "stall p99 us",
            "reader MiB/s",
            "failed steps",
        ],
        &rows,
    );
}
