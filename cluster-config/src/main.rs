//! `engram-cluster`: check a rack config before deploying it.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cluster_config::{Config, SourceRef};

#[derive(Parser)]
#[command(
    name = "engram-cluster",
    version,
    about = "Check an engram-rack cluster config"
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
    }
}
