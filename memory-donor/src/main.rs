//! `memory-donor`: serve Engram tables from RAM; generate, pack, verify and
//! inspect table files. This file parses the command line; each
//! subcommand is a module of `cmd`. Operators ask a running donor with
//! `engram-cluster status|drain|swap`.

mod cmd;

use anyhow::Result;
use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "memory-donor",
    version,
    about = "Keep Engram tables resident in RAM and serve batched row lookups"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a deterministic synthetic table (rows are a pure function of seed, layer and row id).
    Gen(cmd::tables::GenArgs),
    /// Build a table from a V4.1 checkpoint (a safetensors file, its directory, or model.safetensors.index.json).
    Pack(cmd::tables::PackArgs),
    /// Recompute a table's digest and check every row decodes and every
    /// page matches its checksum.
    Verify(cmd::tables::VerifyArgs),
    /// Print a table's metadata.
    Inspect(cmd::tables::InspectArgs),
    /// Load tables resident and serve lookups (TCP, TLS, QUIC, RDMA, the host socket).
    Serve(cmd::serve::ServeArgs),
    /// Write this command's man pages and shell completions into DIR (the packages ship them).
    #[command(hide = true)]
    Manuals {
        /// Where `man/` and `completions/` go.
        dir: std::path::PathBuf,
    },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Gen(a) => cmd::tables::gen_table(a),
        Cmd::Pack(a) => cmd::tables::pack_table(a),
        Cmd::Verify(a) => cmd::tables::verify(a),
        Cmd::Inspect(a) => cmd::tables::inspect(a),
        Cmd::Serve(a) => cmd::serve::run(a),
        Cmd::Manuals { dir } => Ok(cluster_config::manuals::write(Cli::command(), &dir)?),
    }
}
