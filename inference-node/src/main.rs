//! `inference-node`: the engram-rack inference node's tools.

use std::fs::File;
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use engram_protocol::etab::{TableLayout, read_header};
use engram_protocol::row::{ROW_VALUES, dequantize_row_f32};
use engram_protocol::{ROW_BYTES, RowBytes, TableDigest};
use inference_node::rowlist::parse_rows;
use inference_node::{ClientOptions, DonorClient, Request};

/// Most rows one `fetch` takes.
const MAX_FETCH_ROWS: usize = 1_000_000;

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
    Fetch(FetchArgs),
    /// Token-paced random lookups through the node's routers, with status lines and /metrics.
    Canary(CanaryArgs),
}

#[derive(clap::Args)]
struct CanaryArgs {
    /// The cluster config.
    #[arg(long)]
    config: PathBuf,
    /// This node's name in it.
    #[arg(long)]
    name: String,
    /// Tokens to run (default: until SIGINT or SIGTERM).
    #[arg(long)]
    tokens: Option<u64>,
    /// Token rate (default: the node's tokens_per_second).
    #[arg(long)]
    tokens_per_second: Option<f64>,
    /// Serve /metrics here (default: the node's `metrics` key, if set).
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Seed of the random rows.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(clap::Args)]
struct FetchArgs {
    /// Donor data-plane address.
    #[arg(long)]
    donor: SocketAddr,
    /// Pin the digest of this local table file (and allow --verify).
    #[arg(long, conflicts_with = "digest", required_unless_present = "digest")]
    table: Option<PathBuf>,
    /// Pin this digest (64 hex digits).
    #[arg(long)]
    digest: Option<TableDigest>,
    /// Table id on the donor.
    #[arg(long)]
    table_id: u32,
    /// Rows: `1,2,3`, ranges `10-20`, or both.
    #[arg(long)]
    rows: String,
    /// Print each row as hex.
    #[arg(long, conflicts_with = "out")]
    hex: bool,
    /// Write the raw 264-byte rows, in the order asked, to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// With --table: compare every fetched row with the local file.
    #[arg(long, requires = "table")]
    verify: bool,
    /// Name sent in Hello.
    #[arg(long, default_value = "inference-node-fetch")]
    node_name: String,
    /// File holding the rack credential.
    #[arg(long)]
    credential_file: Option<PathBuf>,
    /// Give up after this long, connecting or per lookup.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
}

fn main() -> Result<()> {
    cluster_config::logging::init_logging("warn");
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match cli.cmd {
        Cmd::Fetch(args) => rt.block_on(fetch(args)),
        Cmd::Canary(args) => rt.block_on(canary(args)),
    }
}

async fn canary(args: CanaryArgs) -> Result<()> {
    use std::sync::Arc;
    let config = cluster_config::Config::load(&args.config)?;
    let node = config
        .node(&args.name)
        .with_context(|| format!("node {:?} is not in {}", args.name, args.config.display()))?;
    if let Some(r) = args.tokens_per_second
        && !(r.is_finite() && r > 0.0 && r <= 10_000.0)
    {
        bail!("--tokens-per-second {r} is not a rate (0 < rate <= 10000)");
    }
    let metrics = Arc::new(inference_node::metrics::NodeMetrics::new());
    if let Some(addr) = args.metrics.or(node.metrics) {
        let (bound, _task) = inference_node::memory::serve_metrics(addr, metrics.clone())
            .await
            .with_context(|| format!("binding the metrics address {addr}"))?;
        eprintln!("metrics listen={bound}");
    }
    let spec = inference_node::canary::CanarySpec {
        tokens: args.tokens,
        tokens_per_second: args.tokens_per_second,
        seed: args.seed,
    };
    let shutdown = async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
    };
    let reports = inference_node::canary::run(
        &config,
        &args.name,
        &spec,
        metrics,
        |line| eprintln!("{line}"),
        shutdown,
    )
    .await?;
    let failed: u64 = reports.iter().map(|(_, r)| r.failed).sum();
    if failed > 0 {
        bail!("{failed} lookups failed (policy fail)");
    }
    Ok(())
}

fn open_table(path: &Path) -> Result<(File, TableDigest, TableLayout)> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = f.metadata()?.len();
    let (meta, layout) = read_header(len, |buf, off| f.read_exact_at(buf, off))
        .with_context(|| format!("{}", path.display()))?;
    Ok((f, meta.digest, layout))
}

async fn fetch(args: FetchArgs) -> Result<()> {
    let rows = parse_rows(&args.rows, MAX_FETCH_ROWS).map_err(anyhow::Error::msg)?;
    let local = args.table.as_deref().map(open_table).transpose()?;
    let digest = match (&local, args.digest) {
        (Some((_, d, _)), _) => *d,
        (None, Some(d)) => d,
        (None, None) => bail!("give --table FILE or --digest HEX"),
    };
    let timeout = Duration::from_millis(args.timeout_ms);
    let mut opts = ClientOptions::new(&args.node_name, vec![(args.table_id, digest)]);
    opts.connect_timeout = timeout;
    if let Some(f) = &args.credential_file {
        let c = cluster_config::read_credential(f)?;
        opts.credential = Some(c);
    }
    let client = DonorClient::connect(args.donor, &opts).await?;
    let mut data = vec![0u8; rows.len() * ROW_BYTES];
    let chunk = client.max_rows() as usize;
    for (ids, out) in rows.chunks(chunk).zip(data.chunks_mut(chunk * ROW_BYTES)) {
        let req = [Request {
            table: args.table_id,
            rows: ids,
        }];
        tokio::time::timeout(timeout, client.lookup(&req, out))
            .await
            .map_err(|_| anyhow::anyhow!("lookup timed out after {timeout:?}"))??;
    }
    if args.verify
        && let Some((file, _, layout)) = &local
    {
        let mut want = [0u8; ROW_BYTES];
        for (id, got) in rows.iter().zip(data.chunks_exact(ROW_BYTES)) {
            let off = layout
                .row_offset(*id)
                .context("row out of the local table's range")?;
            file.read_exact_at(&mut want, off)?;
            if got != want {
                bail!(
                    "row {id} differs from {}",
                    args.table.as_deref().unwrap_or(Path::new("")).display()
                );
            }
        }
        eprintln!("verified {} rows against the local table", rows.len());
    }
    if let Some(path) = &args.out {
        std::fs::write(path, &data).with_context(|| format!("writing {}", path.display()))?;
        eprintln!(
            "wrote {} rows ({} bytes) to {}",
            rows.len(),
            data.len(),
            path.display()
        );
        return Ok(());
    }
    let mut so = std::io::stdout().lock();
    for (id, row) in rows.iter().zip(data.chunks_exact(ROW_BYTES)) {
        if args.hex {
            let hex: String = row.iter().map(|b| format!("{b:02x}")).collect();
            writeln!(so, "{id} {hex}")?;
            continue;
        }
        let mut vals = [0f32; ROW_VALUES];
        let row: &RowBytes = row.try_into()?;
        match dequantize_row_f32(row, &mut vals) {
            Ok(()) => writeln!(so, "row {id}: {:?} ...", &vals[..8])?,
            Err(e) => writeln!(so, "row {id}: corrupt: {e}")?,
        }
    }
    Ok(())
}
