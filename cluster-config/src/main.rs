//! `engram-cluster`: check a rack config before deploying it, and plan
//! its RAM and timing.

mod ops;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cluster_config::plan::{Latencies, Plan};
use cluster_config::{Config, SourceRef};

#[derive(Parser)]
#[command(
    name = "engram-cluster",
    version,
    about = "Check and plan an engram-rack cluster config"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Validate a config: every problem is printed as FILE:LINE:COLUMN: KEY: MESSAGE.
    Check {
        /// The rack config (TOML).
        file: PathBuf,
    },
    /// Per donor: RAM for its tables plus headroom against `ram_gib` (exit
    /// code 1 when one does not fit); per node: each table's window and the
    /// predicted slowdown from assumed source latencies (seed 000's model).
    Plan {
        /// The rack config (TOML).
        file: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Assumed fetch latencies in microseconds, over the defaults
        /// local=5,donor=100,ssd=400; a donor's name sets that donor's.
        #[arg(long, value_name = "NAME=US,...")]
        latency_us: Vec<String>,
    },
    /// Operate donors through their control planes: status, drain, swap.
    #[command(flatten)]
    Ops(ops::OpsCmd),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Check { file } => match Config::load(&file) {
            Ok(c) => {
                println!(
                    "ok: rack {:?}: {} tables, {} donors, {} nodes",
                    c.rack,
                    c.tables.len(),
                    c.donors.len(),
                    c.nodes.len()
                );
                for d in &c.donors {
                    let ads: Vec<String> = d.advertise.iter().map(ToString::to_string).collect();
                    println!(
                        "  donor {}: tables {:?} at {}",
                        d.name,
                        d.tables,
                        ads.join(", ")
                    );
                }
                for n in &c.nodes {
                    for r in &n.routes {
                        let s: Vec<String> = r.sources.iter().map(SourceRef::to_string).collect();
                        println!("  node {}: table {} <- {}", n.name, r.table, s.join(" -> "));
                    }
                }
                if let Some(m) = &c.model {
                    println!(
                        "  model: hashing {}, hidden {} x {} streams, fusion {}",
                        m.hashing, m.hidden, m.streams, m.fusion
                    );
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(2)
            }
        },
        Cmd::Plan {
            file,
            json,
            latency_us,
        } => plan(&file, json, &latency_us),
        Cmd::Ops(cmd) => ops::run(cmd),
    }
}

fn plan(file: &std::path::Path, json: bool, latency_us: &[String]) -> ExitCode {
    let config = match Config::load(file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mut lat = Latencies::default();
    for spec in latency_us {
        if let Err(e) = lat.apply(spec) {
            eprintln!("--latency-us: {e}");
            return ExitCode::from(2);
        }
    }
    let plan = Plan::new(&config, &lat);
    if json {
        match serde_json::to_string_pretty(&plan) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        }
    } else {
        print!("{}", plan.render());
    }
    if plan.fits() {
        ExitCode::SUCCESS
    } else {
        for d in plan.donors.iter().filter(|d| !d.fits) {
            eprintln!(
                "donor {}: its tables and headroom need {:.2} GiB but ram_gib is {:.2}",
                d.name,
                d.need_bytes as f64 / cluster_config::GIB,
                d.ram_bytes as f64 / cluster_config::GIB
            );
        }
        ExitCode::from(1)
    }
}
