//! `engram-bench engines --pss`: what engine processes on one host cost
//! in memory. Each engine is a process (this binary's hidden
//! `engines-pss-engine`) that opens the node's Engram memory
//! (`inference_node::embed`, as the Python and C libraries do), takes
//! both layers' table views and reads every page of them, as an engine
//! that gathers rows itself would. With 1 and then 4 engines at once,
//! reading the tables either from a donor on the host (mapped through its
//! host socket: one copy) or from each engine's own `local` copy, the
//! kernel's proportional set size (`Pss` in `smaps_rollup`) of each engine
//! and of the donor is read while every engine holds its views.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use inference_node::embed::{EmbeddedNode, MetricsAt, OpenOptions};
use rack_harness::bin;
use serde::Serialize;

use crate::rack::{self, Child, NodeSpec, RackSpec};
use crate::stats::print_table;

/// Arguments of one engine process.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    #[arg(long)]
    config: PathBuf,
    #[arg(long)]
    node: String,
}

/// The engine process: open, view both tables, read every page, say
/// `ready BYTES`, and hold the views until stdin closes.
pub fn engine(args: &EngineArgs) -> Result<()> {
    let mem = EmbeddedNode::open_with(
        &args.config,
        &args.node,
        &OpenOptions {
            metrics: MetricsAt::Off,
        },
    )?;
    let mut views = Vec::new();
    let mut bytes = 0usize;
    let mut sum = 0u64;
    for layer in mem.layers() {
        let v = mem.table_view(layer, Duration::from_secs(10))?;
        for page in v.bytes().chunks(4096) {
            sum = sum.wrapping_add(u64::from(page[0]));
        }
        bytes += v.bytes().len();
        views.push(v);
    }
    println!("ready {bytes} {sum} {}", views.iter().all(|v| v.shared()));
    std::io::stdout().flush()?;
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    drop(views);
    mem.close(Duration::from_secs(1));
    Ok(())
}

/// Bytes of `pid`'s proportional set size.
fn pss(pid: u32) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .with_context(|| format!("reading process {pid}'s smaps_rollup"))?;
    let kib = text
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .context("no Pss line")?;
    Ok(kib * 1024)
}

/// One configuration with `processes` engines.
#[derive(Debug, Serialize)]
struct Point {
    source: &'static str,
    processes: usize,
    /// Each engine's Pss.
    engine_pss: Vec<u64>,
    /// The donor's Pss (0 for engines with their own copies).
    donor_pss: u64,
    /// All of them.
    total_pss: u64,
    /// Bytes of the tables each engine views.
    table_bytes: u64,
}

/// Run it in `out` with tables of `hash_base`.
pub fn run(out: &Path, hash_base: u64, json: bool) -> Result<()> {
    let tables = rack::table_pair(out, hash_base)?;
    let spec = RackSpec {
        donors: &["donor-a"],
        nodes: vec![
            NodeSpec {
                name: "host",
                sources: &["donor-a"],
                ssd_ioprio: None,
            },
            NodeSpec {
                name: "own",
                sources: &["local"],
                ssd_ioprio: None,
            },
        ],
        probe_interval_ms: 1000,
        trust_copies: true,
        transport: cluster_config::Transport::Tls,
        host_sockets: &["donor-a"],
        tokenizer: None,
    };
    let rk = rack::write_config(out, &tables, &spec)?;
    let donor = Child::launch_donor(&rk.config, "donor-a", &[])?;
    donor.wait_ready(Duration::from_secs(120))?;
    let mut points = Vec::new();
    for (source, node) in [
        ("host socket (one copy)", "host"),
        ("own local copy", "own"),
    ] {
        for processes in [1usize, 4] {
            points.push(measure(&rk.config, node, source, processes, donor.pid())?);
        }
    }
    drop(donor);
    let v = serde_json::json!({
        "benchmark": "engines --pss",
        "hash_base": hash_base,
        "rows": [tables.tables[0].rows, tables.tables[1].rows],
        "points": points,
    });
    std::fs::write(out.join("engines-pss.json"), serde_json::to_vec_pretty(&v)?)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mib = |b: u64| format!("{:.1}", b as f64 / (1u64 << 20) as f64);
    println!(
        "engine processes reading both tables ({} MiB) whole through table views: Pss (MiB)",
        mib(points[0].table_bytes)
    );
    let rows: Vec<Vec<String>> = points
        .iter()
        .map(|p| {
            let each: Vec<String> = p.engine_pss.iter().map(|b| mib(*b)).collect();
            vec![
                p.source.to_string(),
                p.processes.to_string(),
                each.join(", "),
                mib(p.donor_pss),
                mib(p.total_pss),
            ]
        })
        .collect();
    print_table(
        &[
            "tables from",
            "engines",
            "Pss per engine",
            "donor Pss",
            "total",
        ],
        &rows,
    );
    Ok(())
}

/// Start `processes` engines on node `node`, read every Pss while they
/// hold their views, then let them end.
fn measure(
    config: &Path,
    node: &str,
    source: &'static str,
    processes: usize,
    donor: u32,
) -> Result<Point> {
    let mut engines = Vec::new();
    for _ in 0..processes {
        let child = Command::new(bin("engram-bench"))
            .arg("engines-pss-engine")
            .arg("--config")
            .arg(config)
            .args(["--node", node])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting an engine process")?;
        engines.push(child);
    }
    let mut table_bytes = 0;
    for e in &mut engines {
        let out = e.stdout.take().context("engine stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let mut f = line.split_whitespace();
        if f.next() != Some("ready") {
            bail!("an engine on node {node} did not start: {line:?}");
        }
        table_bytes = f.next().and_then(|b| b.parse().ok()).unwrap_or(0);
    }
    let engine_pss = engines
        .iter()
        .map(|e| pss(e.id()))
        .collect::<Result<Vec<_>>>()?;
    let donor_pss = if node == "host" { pss(donor)? } else { 0 };
    for mut e in engines {
        drop(e.stdin.take());
        let st = e.wait()?;
        if !st.success() {
            bail!("an engine on node {node} failed ({st})");
        }
    }
    Ok(Point {
        source,
        processes,
        total_pss: engine_pss.iter().sum::<u64>() + donor_pss,
        engine_pss,
        donor_pss,
        table_bytes,
    })
}
