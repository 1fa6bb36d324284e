//! `engram-bench`: engram-rack measurements, each reported against a
//! baseline measured in the same run (never as a pass/fail test).

#![allow(clippy::print_stdout)]

mod checksum;
mod contention;
mod demo;
mod drill;
mod engines;
mod engines_pss;
mod floor;
mod layout;
mod load;
mod paced;
mod paced_contention;
mod paced_draft;
mod paced_host;
mod paced_join;
mod ple;
mod prefill;
mod rack;
mod realtext;
mod ssd;
mod stats;

use anyhow::Result;
use clap::{Parser, Subcommand};
use engram_bench::{model, plot};

/// How long the bench's own clients wait for one answer. A bench measures
/// and never routes around a slow answer, so one stall on a busy machine
/// shows in the tail instead of ending the run (the library's default is
/// a node's deadline, 100 ms, which a 16,384-row lookup on a loaded VM can
/// pass).
pub(crate) const LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Parser)]
#[command(
    name = "engram-bench",
    version,
    about = "engram-rack measurements and the local demo"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The local rack: two donors and an SSD copy, the node at 100 tokens/s, the primary donor killed and restarted; a per-second timeline.
    Demo(demo::DemoArgs),
    /// Failover drills on a local rack: donors killed, hung, partitioned, slowed, corrupting, swapped, drained and stormed; a timeline and chart per drill.
    Drill(drill::DrillArgs),
    /// The real node against local RAM, a donor over TCP and the SSD copy across token rates, next to seed 000's prediction.
    Paced(paced::PacedArgs),
    /// The embeddable memory from C and Python against its Rust API on one donor, and a paced Python loop against the node's own.
    Engines(engines::EnginesArgs),
    /// Donor lookups against a raw blocking-socket ping-pong of the same sizes.
    Floor(floor::FloorArgs),
    /// A Rows answer's checksum on a core idle a moment before: SSE2 against the widest vectors, by length.
    Checksum(checksum::ChecksumArgs),
    /// What a planar table (host_layout = "planar") costs the donor's network gather against a packed one.
    Layout(layout::LayoutArgs),
    /// A prompt's rows in one sweep: one donor, two replicas on links of their own (network namespaces) and local RAM, against the raw bandwidth of the same link.
    Prefill(prefill::PrefillArgs),
    /// Donor start: a verified, a trusted, a cold load and a restart from systemd's fd store, against the hash and read floors of the same file.
    Load(load::LoadArgs),
    /// SSD copy reads: mmap, seed 000's 4 x 6 pread scheme, and io_uring with 24 reads in flight.
    Ssd(ssd::SsdArgs),
    /// What a real text does to the rows (V4 tokenizer, V4.1 hashing): repeats per n-gram order, LRU and static hot-set hits by size, batch deduplication, SSD pages per token.
    Locality(realtext::LocalityArgs),
    /// A Qwen4Exp PLE layer on the node's CPU a token: kv_proj with the weight prepared once against converting it per call, then the gate and convolution.
    Ple(ple::PleArgs),
    /// Seed 000's timing model for one V4.1 token: windows, overshoot, tokens/s, slowdown.
    Model(model::ModelArgs),
    /// (internal) Write a sample heatmap and timeline (SVG and PNG) to look at.
    #[command(hide = true)]
    PlotSample(plot::PlotSampleArgs),
    /// (internal) The Rust side of `engines`.
    #[command(hide = true)]
    EnginesRustSide(engines::RustSideArgs),
    /// (internal) One engine process of `engines --pss`.
    #[command(hide = true)]
    EnginesPssEngine(engines_pss::EngineArgs),
    /// (internal) The prefill floor's server side.
    #[command(hide = true)]
    PrefillFloorServer(prefill::PrefillFloorArgs),
    /// (internal) The floor's server side.
    #[command(hide = true)]
    FloorServer(floor::FloorServerArgs),
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Demo(a) => demo::run(&a),
        Cmd::Drill(a) => drill::run(&a),
        Cmd::Paced(a) => paced::run(&a),
        Cmd::Engines(a) => engines::run(&a),
        Cmd::EnginesRustSide(a) => engines::rust_side(&a),
        Cmd::Floor(a) => floor::run(&a),
        Cmd::Checksum(a) => checksum::run(&a),
        Cmd::Ple(a) => ple::run(&a),
        Cmd::Layout(a) => layout::run(&a),
        Cmd::Ssd(a) => ssd::run(&a),
        Cmd::Locality(a) => realtext::locality(&a),
        Cmd::Load(a) => load::run(&a),
        Cmd::Prefill(a) => prefill::run(&a),
        Cmd::PrefillFloorServer(a) => prefill::floor_server(&a),
        Cmd::Model(a) => model::run(&a),
        Cmd::PlotSample(a) => plot::run_sample(&a),
        Cmd::FloorServer(a) => floor::floor_server(&a),
        Cmd::EnginesPssEngine(a) => engines_pss::engine(&a),
    }
}
