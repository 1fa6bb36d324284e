//! `inference-node`: the engram-rack inference node's tools: `fetch` rows
//! from a donor, `addresses` of a token sequence, `token-map` from a
//! tokenizer, and `gpu-check` (GPU fusion against the CPU path).

mod cmd;

use std::fs::File;
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use cluster_config::model::TokenMapSource;
use engram_protocol::etab::{TableLayout, read_header};
use engram_protocol::hashing::{HashParams, Preset, V41_COMPRESSED_VOCAB, V41_PAD_RAW_ID};
use engram_protocol::row::{ROW_VALUES, dequantize_row_f32};
use engram_protocol::{ROW_BYTES, RowBytes, TableDigest};
use inference_node::engram::TokenMap;
use inference_node::engram::addresses::{
    addresses as engram_addresses, compress, parse_ids, to_json, to_table,
};
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
    /// Print the Engram row ids of a sequence of tokens (24 per layer per position).
    Addresses(AddressArgs),
    /// Build the compressed-vocabulary map from a tokenizer.json and write it as a map file.
    TokenMap(TokenMapArgs),
    /// The node daemon: gRPC API (submit sequences, stream per-token records, table state), health, /metrics, systemd notify.
    Serve(cmd::serve::ServeArgs),
    /// Run the model loop over an input at a token rate: trace, status lines, summary vs seed 000's formula.
    Run(cmd::run::RunArgs),
    /// Compare GPU fusion with the CPU path and measure its throughput (needs --features cuda).
    GpuCheck(GpuCheckArgs),
}

#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["compressed_ids", "token_ids"]))]
struct AddressArgs {
    /// Hashing preset: `v41`.
    #[arg(long, conflicts_with_all = ["hash_base", "config"])]
    preset: Option<String>,
    /// Small preset: primes above N - 1, V4.1's multipliers.
    #[arg(long, conflicts_with = "config")]
    hash_base: Option<u64>,
    /// Take the preset, token map, expected size and pad from this rack config's [model].
    #[arg(long)]
    config: Option<PathBuf>,
    /// Compressed ids, comma-separated; -1 is DEAD.
    #[arg(long, allow_hyphen_values = true)]
    compressed_ids: Option<String>,
    /// Raw token ids, comma-separated (-1 is DEAD); needs --tokenizer, --token-map or --config.
    #[arg(long, allow_hyphen_values = true)]
    token_ids: Option<String>,
    /// Build the token map from this tokenizer.json.
    #[arg(long, conflicts_with_all = ["token_map", "config"])]
    tokenizer: Option<PathBuf>,
    /// Load a precomputed token map (one compressed id per line).
    #[arg(long, conflicts_with = "config")]
    token_map: Option<PathBuf>,
    /// Compressed vocabulary size the map must have (default 99092 under v41).
    #[arg(long, conflicts_with = "config")]
    compressed_vocab: Option<u32>,
    /// Compressed id of the pad (default: the map's id of raw token 2, else 2).
    #[arg(long, allow_hyphen_values = true)]
    pad_id: Option<i64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct TokenMapArgs {
    /// The model's tokenizer.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Where to write the map.
    #[arg(long)]
    out: PathBuf,
    /// Refuse a map of another compressed size (V4.1: 99092).
    #[arg(long)]
    expect: Option<u32>,
}

#[derive(clap::Args)]
struct GpuCheckArgs {
    /// Hidden size.
    #[arg(long, default_value_t = 5120)]
    hidden: usize,
    /// Residual streams.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Positions fused on the GPU per timed call.
    #[arg(long, default_value_t = 256)]
    positions: usize,
    /// Positions also fused on the CPU for the comparison.
    #[arg(long, default_value_t = 8)]
    cpu_positions: usize,
    /// Timed calls.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
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
    let log = daemon_runtime::logging::init_logging("warn");
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let res = match cli.cmd {
        Cmd::Fetch(args) => rt.block_on(fetch(args)),
        Cmd::Canary(args) => rt.block_on(canary(args)),
        Cmd::Run(args) => rt.block_on(cmd::run::run(args)),
        Cmd::Serve(args) => rt.block_on(cmd::serve::run(args, log)),
        Cmd::Addresses(args) => addresses(args),
        Cmd::TokenMap(args) => token_map(args),
        Cmd::GpuCheck(args) => gpu_check(&args),
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

fn load_map(
    tokenizer: Option<&Path>,
    map: Option<&Path>,
    expect: Option<u32>,
) -> Result<Option<TokenMap>> {
    let m = match (tokenizer, map) {
        (Some(t), _) => TokenMap::from_tokenizer_file(t)?,
        (None, Some(m)) => TokenMap::load(m)?,
        (None, None) => return Ok(None),
    };
    if let Some(n) = expect {
        m.check_size(n)?;
    }
    Ok(Some(m))
}

fn addresses(args: AddressArgs) -> Result<()> {
    let (preset, map) = match &args.config {
        Some(path) => {
            let c = cluster_config::Config::load(path)?;
            let m = c
                .model
                .with_context(|| format!("{} has no [model] table", path.display()))?;
            let (t, f) = match &m.token_map {
                TokenMapSource::Tokenizer(t) => (Some(t.as_path()), None),
                TokenMapSource::Map(f) => (None, Some(f.as_path())),
                TokenMapSource::None => (None, None),
            };
            let map = load_map(t, f, m.compressed_vocab)?;
            let pad = map.as_ref().and_then(|mp| mp.get(m.pad_token));
            (m.hashing, map.map(|mp| (mp, pad)))
        }
        None => {
            let preset = match (&args.preset, args.hash_base) {
                (_, Some(b)) => Preset::from_base(b)?,
                (Some(p), None) if p == "v41" => Preset::V41,
                (Some(p), None) => {
                    bail!("--preset {p:?}: the known preset is v41 (or give --hash-base N)")
                }
                (None, None) => Preset::V41,
            };
            let expect = args
                .compressed_vocab
                .or((preset == Preset::V41).then_some(V41_COMPRESSED_VOCAB));
            let map = load_map(args.tokenizer.as_deref(), args.token_map.as_deref(), expect)?;
            let pad = map.as_ref().and_then(|m| m.get(V41_PAD_RAW_ID));
            (preset, map.map(|m| (m, pad)))
        }
    };
    let params = HashParams::new(preset)?;
    let ids = match (&args.compressed_ids, &args.token_ids) {
        (Some(list), _) => parse_ids(list)?,
        (None, Some(list)) => {
            let Some((map, _)) = &map else {
                bail!("--token-ids needs --tokenizer FILE, --token-map FILE or --config FILE");
            };
            compress(map, &parse_ids(list)?)?
        }
        (None, None) => bail!("give --compressed-ids or --token-ids"),
    };
    let map_pad = map.as_ref().and_then(|(_, p)| *p).map(i64::from);
    let pad = args.pad_id.or(map_pad).unwrap_or(2);
    let rows = engram_addresses(&params, pad, &ids)?;
    let mut so = std::io::stdout().lock();
    if args.json {
        writeln!(so, "{}", to_json(&ids, &rows))?;
    } else {
        write!(so, "{}", to_table(&params, pad, &ids, &rows))?;
    }
    Ok(())
}

fn token_map(args: TokenMapArgs) -> Result<()> {
    let map = TokenMap::from_tokenizer_file(&args.tokenizer)?;
    if let Some(n) = args.expect {
        map.check_size(n)?;
    }
    let f = File::create(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    map.write(std::io::BufWriter::new(f))
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "{}: {} raw ids -> {} compressed ids",
        args.out.display(),
        map.raw_len(),
        map.compressed_len()
    );
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn gpu_check(_: &GpuCheckArgs) -> Result<()> {
    bail!("this build has no GPU support: build with --features cuda")
}

#[cfg(feature = "cuda")]
fn gpu_check(a: &GpuCheckArgs) -> Result<()> {
    use inference_node::engram::fusion::{CpuFusion, Fusion, POSITION_ROW_BYTES};
    use inference_node::engram::gpu::{CHUNK, GpuFusion};
    use inference_node::engram::{FusionShape, FusionWeights};
    use std::sync::Arc;
    use std::time::Instant;

    let shape = FusionShape::new(a.hidden, a.streams)?;
    // Fail fast, before building gigabytes of weights, where no GPU is usable.
    inference_node::engram::gpu::probe()?;
    let positions = a.positions.clamp(1, CHUNK);
    println!(
        "seeded weights, hidden {} streams {}; building...",
        a.hidden, a.streams
    );
    let w = Arc::new(FusionWeights::from_seed(1, shape));
    let mut gpu = GpuFusion::new(&w, 0)?;
    let mut rows = vec![0u8; positions * POSITION_ROW_BYTES];
    engram_protocol::synthetic::synthetic_rows(7, 1, 0, &mut rows);
    let live = vec![true; positions];
    let h0: Vec<f32> = (0..positions * shape.state_len())
        .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 300.0)
        .collect();
    let n = a.cpu_positions.clamp(1, positions);
    let state = shape.state_len();
    for layer in [1u32, 14] {
        let mut cpu_h = h0[..n * state].to_vec();
        CpuFusion::new(Arc::clone(&w)).fuse(
            layer,
            &rows[..n * POSITION_ROW_BYTES],
            &live[..n],
            &mut cpu_h,
        )?;
        let mut gpu_h = h0.clone();
        gpu.fuse(layer, &rows, &live, &mut gpu_h)?;
        let (mut max_abs, mut max_rel) = (0f64, 0f64);
        for (g, c) in gpu_h.iter().zip(&cpu_h) {
            let d = f64::from((g - c).abs());
            max_abs = max_abs.max(d);
            max_rel = max_rel.max(d / f64::from(c.abs()).max(1e-3));
        }
        println!(
            "layer {layer}: GPU vs CPU over {n} positions x {state} values: max |diff| {max_abs:.3e}, max relative {max_rel:.3e}"
        );
    }
    let mut h = h0.clone();
    gpu.fuse(1, &rows, &live, &mut h)?;
    let t = Instant::now();
    for _ in 0..a.rounds {
        h.copy_from_slice(&h0);
        gpu.fuse(1, &rows, &live, &mut h)?;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "GPU fusion: {:.0} positions/s per layer ({} calls of {positions} positions, {:.2} ms per call, host copies included)",
        (a.rounds * positions) as f64 / secs,
        a.rounds,
        secs * 1e3 / a.rounds as f64
    );
    Ok(())
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
