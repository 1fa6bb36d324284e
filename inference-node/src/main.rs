//! `inference-node`: the engram-rack inference node (`run`, `serve`,
//! `engines`) and
//! its tools (`fetch`, `canary`, `addresses`, `token-map`, `gpu-check`).
//! This file parses the command line; each subcommand is a module of `cmd`.

mod cmd;

use anyhow::Result;
use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "inference-node",
    version,
    about = "The engram-rack inference node"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Fetch rows from a donor by hand.
    Fetch(cmd::fetch::FetchArgs),
    /// Token-paced random lookups through the node's routers, with status lines and /metrics.
    Canary(cmd::canary::CanaryArgs),
    /// Print the Engram row ids of a sequence of tokens (24 per layer per position).
    Addresses(cmd::engram::AddressArgs),
    /// Build the compressed-vocabulary map from a tokenizer.json and write it as a map file.
    TokenMap(cmd::engram::TokenMapArgs),
    /// The node daemon: gRPC API (submit sequences, stream per-token records, table state), health, /metrics, systemd notify.
    Serve(cmd::serve::ServeArgs),
    /// The host's one rack client for its engine processes: serves their rings and hands them host-local tables (docs/engines.md).
    Engines(cmd::engines::EnginesArgs),
    /// Run the model loop over an input at a token rate: trace, status lines, summary vs seed 000's formula.
    Run(cmd::run::RunArgs),
    /// Compare GPU fusion with the CPU path and measure its throughput (needs --features cuda).
    GpuCheck(cmd::engram::GpuCheckArgs),
    /// Write this command's man pages and shell completions into DIR (the packages ship them).
    #[command(hide = true)]
    Manuals {
        /// Where `man/` and `completions/` go.
        dir: std::path::PathBuf,
    },
}

fn main() -> Result<()> {
    let log = daemon_runtime::logging::init_logging("warn");
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let res = match cli.cmd {
        Cmd::Fetch(args) => rt.block_on(cmd::fetch::fetch(args)),
        Cmd::Canary(args) => rt.block_on(cmd::canary::canary(args)),
        Cmd::Run(args) => rt.block_on(cmd::run::run(args)),
        Cmd::Serve(args) => rt.block_on(cmd::serve::run(args, log)),
        Cmd::Engines(args) => rt.block_on(cmd::engines::run(args)),
        Cmd::Addresses(args) => cmd::engram::addresses(args),
        Cmd::TokenMap(args) => cmd::engram::token_map(args),
        Cmd::GpuCheck(args) => cmd::engram::gpu_check(&args),
        Cmd::Manuals { dir } => Ok(cluster_config::manuals::write(Cli::command(), &dir)?),
    };
    match res {
        // Output piped into `head` and the like: the reader has what it wanted.
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            Ok(())
        }
        other => other,
    }
}
