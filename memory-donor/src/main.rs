//! `memory-donor`: serve Engram tables from RAM; generate, pack, verify and inspect table files.

mod ctl;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use cluster_config::{Config, MlockMode};
use engram_protocol::{Limits, ROW_BYTES};
use memory_donor::generate::{GenSpec, generate, table_shape};
use memory_donor::pack::pack;
use memory_donor::progress::Progress;
use memory_donor::serve::{OpsServers, ServeSpec, TableSpec, load_tables, serve};
use memory_donor::server::ServerConfig;
use memory_donor::status::Phase;
use memory_donor::table_file::TableFile;

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
    Gen {
        #[arg(long)]
        layer: u32,
        /// Rows (default: the sum of the layer's primes under --hash-preset or --hash-base).
        #[arg(long, required_unless_present_any = ["hash_preset", "hash_base"])]
        rows: Option<u64>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long)]
        out: PathBuf,
        /// Hashing preset (`v41`): sizes the table and is recorded in the metadata.
        #[arg(long)]
        hash_preset: Option<String>,
        /// Hashing base size (primes above base - 1): sizes the table and is recorded.
        #[arg(long)]
        hash_base: Option<u64>,
        /// Generator threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// Build a table from a V4.1 checkpoint (a safetensors file, its directory, or model.safetensors.index.json).
    Pack {
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        layer: u32,
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        hash_preset: Option<String>,
        #[arg(long)]
        hash_base: Option<u64>,
    },
    /// Recompute a table's digest and check every row decodes.
    Verify {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Print a table's metadata.
    Inspect {
        file: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Load tables resident and serve lookups over TCP.
    Serve(ServeArgs),
    /// Ask a running donor's control plane (at ADDR, its --control address).
    Ctl {
        /// The control plane's IP:PORT (or http://IP:PORT).
        addr: String,
        #[command(subcommand)]
        cmd: ctl::CtlCmd,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Cluster config; with --name, serves that donor's tables on its addresses.
    #[arg(long, requires = "name", conflicts_with_all = ["tables", "listen"])]
    config: Option<PathBuf>,
    /// Donor name (in the config) or the name announced to clients.
    #[arg(long)]
    name: Option<String>,
    /// A table to serve: FILE, or ID=FILE (the id defaults to the table's layer).
    #[arg(long = "table", value_name = "[ID=]FILE")]
    tables: Vec<TableSpec>,
    /// Address to listen on (repeatable).
    #[arg(long, value_name = "ADDR")]
    listen: Vec<SocketAddr>,
    /// Skip recomputing digests while loading (fast restart of trusted files).
    #[arg(long)]
    trust_digest: bool,
    /// Lock table memory: try (warn if the limit is too low), require, or off.
    #[arg(long, value_enum)]
    mlock: Option<MlockMode>,
    /// Most concurrent connections.
    #[arg(long)]
    max_connections: Option<usize>,
    /// Most rows in one lookup.
    #[arg(long)]
    max_rows: Option<u32>,
    /// How long a drain (SIGTERM) waits for clients, in milliseconds.
    #[arg(long)]
    drain_timeout_ms: Option<u64>,
    /// How long a new connection has to say Hello, in milliseconds.
    #[arg(long)]
    hello_timeout_ms: Option<u64>,
    /// File holding the credential every Hello must carry.
    #[arg(long)]
    credential_file: Option<PathBuf>,
    /// Serve the gRPC control plane (health, ListTables, Stats, Drain) here.
    #[arg(long, value_name = "ADDR")]
    control: Option<SocketAddr>,
    /// Serve Prometheus metrics (GET /metrics) here.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Gen {
            layer,
            rows,
            seed,
            out,
            hash_preset,
            hash_base,
            threads: t,
        } => {
            let (rows, hash_preset, hash_base) =
                table_shape(layer, rows, hash_preset, hash_base).map_err(anyhow::Error::msg)?;
            let spec = GenSpec {
                layer,
                rows,
                seed,
                hash_preset,
                hash_base,
                threads: t.unwrap_or_else(threads),
            };
            let mut p =
                Progress::stderr(format!("generating layer {layer}"), rows, ROW_BYTES as u64);
            let meta = generate(&out, &spec, Some(&mut p))
                .with_context(|| format!("generating {}", out.display()))?;
            p.finish();
            println!(
                "{}: layer {} rows {} digest {}",
                out.display(),
                meta.layer,
                meta.rows,
                meta.digest
            );
        }
        Cmd::Pack {
            checkpoint,
            layer,
            out,
            hash_preset,
            hash_base,
        } => {
            let meta = pack(&checkpoint, layer, &out, hash_preset, hash_base, |rows| {
                Some(Progress::stderr(
                    format!("packing layer {layer}"),
                    rows,
                    ROW_BYTES as u64,
                ))
            })?;
            println!(
                "{}: layer {} rows {} digest {}",
                out.display(),
                meta.layer,
                meta.rows,
                meta.digest
            );
        }
        Cmd::Verify { files } => {
            let mut failed = 0;
            for f in &files {
                let result = TableFile::open(f).and_then(|t| {
                    let mut p = Progress::stderr(
                        format!("verifying {}", f.display()),
                        t.meta.rows,
                        ROW_BYTES as u64,
                    );
                    let d = t.verify(Some(&mut p))?;
                    p.finish();
                    Ok((t, d))
                });
                match result {
                    Ok((t, d)) => println!(
                        "{}: ok: layer {} rows {} digest {d}",
                        f.display(),
                        t.meta.layer,
                        t.meta.rows
                    ),
                    Err(e) => {
                        eprintln!("{e}");
                        failed += 1;
                    }
                }
            }
            if failed > 0 {
                bail!("{failed} of {} tables failed verification", files.len());
            }
        }
        Cmd::Inspect { file, json } => inspect(&file, json)?,
        Cmd::Ctl { addr, cmd } => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            if !rt.block_on(ctl::run(&addr, cmd))? {
                std::process::exit(1);
            }
        }
        Cmd::Serve(args) => {
            cluster_config::logging::init_logging("info");
            run_serve(args)?;
        }
    }
    Ok(())
}

fn inspect(file: &std::path::Path, json: bool) -> Result<()> {
    let t = TableFile::open(file)?;
    let m = &t.meta;
    if json {
        let v = serde_json::json!({
            "path": file.display().to_string(),
            "format_version": engram_protocol::etab::FORMAT_VERSION,
            "encoding": engram_protocol::etab::ENCODING,
            "layer": m.layer,
            "rows": m.rows,
            "pages": t.layout.pages,
            "data_start": t.layout.data_start,
            "file_len": t.layout.file_len(),
            "digest": m.digest.to_hex(),
            "digest_prefix": format!("{:016x}", m.digest.prefix()),
            "hash_preset": m.hash_preset,
            "hash_base": m.hash_base,
            "source": m.source,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("file:        {}", file.display());
        println!(
            "format:      {} v{} ({})",
            engram_protocol::etab::FORMAT_NAME,
            engram_protocol::etab::FORMAT_VERSION,
            engram_protocol::etab::ENCODING
        );
        println!("layer:       {}", m.layer);
        println!(
            "rows:        {} ({:.2} GiB of rows)",
            m.rows,
            (m.rows * ROW_BYTES as u64) as f64 / (1u64 << 30) as f64
        );
        println!(
            "pages:       {} x 4096 bytes from offset {}",
            t.layout.pages, t.layout.data_start
        );
        println!("digest:      {}", m.digest);
        println!(
            "hashing:     preset {} base {}",
            m.hash_preset.as_deref().unwrap_or("-"),
            m.hash_base.map_or("-".into(), |b| b.to_string())
        );
        println!("source:      {}", m.source);
    }
    Ok(())
}

fn run_serve(args: ServeArgs) -> Result<()> {
    let mut spec = if let Some(path) = &args.config {
        let config = Config::load(path)?;
        let name = args.name.as_deref().context("--config needs --name")?;
        ServeSpec::from_config(&config, name)?
    } else {
        if args.tables.is_empty() || args.listen.is_empty() {
            bail!("give --config FILE --name DONOR, or at least one --table and one --listen");
        }
        ServeSpec {
            server: ServerConfig::new(args.name.clone().unwrap_or_else(|| "memory-donor".into())),
            listen: args.listen.clone(),
            tables: args.tables.clone(),
            trust_digest: false,
            mlock: MlockMode::Try,
            control: None,
            metrics: None,
        }
    };
    // Flags override the config.
    spec.trust_digest |= args.trust_digest;
    if let Some(m) = args.mlock {
        spec.mlock = m;
    }
    if let Some(n) = args.max_connections {
        spec.server.max_connections = n.clamp(1, 65_536);
    }
    if let Some(r) = args.max_rows {
        let r = r.clamp(48, engram_protocol::frame::MAX_ROWS_CEILING);
        spec.server.limits = Limits::for_caps(r, spec.server.limits.max_sections);
    }
    if let Some(ms) = args.drain_timeout_ms {
        spec.server.drain_timeout = Duration::from_millis(ms);
    }
    if let Some(ms) = args.hello_timeout_ms {
        spec.server.hello_timeout = Duration::from_millis(ms.max(1));
    }
    if args.control.is_some() {
        spec.control = args.control;
    }
    if args.metrics.is_some() {
        spec.metrics = args.metrics;
    }
    if let Some(f) = &args.credential_file {
        let c = cluster_config::read_credential(f)?;
        spec.server.credential = Some(c);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        // Handlers first: a SIGTERM during a minutes-long load, or right after
        // the ready line, must stop the donor cleanly, not kill it.
        let mut signals = Signals::install()?;
        // Then the control plane and metrics, so load progress and
        // NOT_SERVING are visible while the tables load.
        let status = spec.status();
        let ops = OpsServers::start(&spec, &status).await?;
        let loading = tokio::task::spawn_blocking({
            let (spec, status) = (spec.clone(), Arc::clone(&status));
            move || load_tables(&spec, &status)
        });
        let tables = tokio::select! {
            loaded = loading => match loaded? {
                Ok(t) => t,
                Err(e) => {
                    status.set_phase(Phase::Failed);
                    ops.stop().await;
                    return Err(e.into());
                }
            },
            why = signals.stop() => {
                tracing::info!("{why} while loading: exiting");
                // The loading thread cannot be interrupted; nothing is served yet.
                std::process::exit(0);
            }
            () = status.drain_requested() => {
                tracing::info!("drain requested while loading: exiting");
                status.set_phase(Phase::Draining);
                ops.stop().await;
                std::process::exit(0);
            }
        };
        let drain_status = Arc::clone(&status);
        serve(&spec, tables, &status, &ops.describe(), async move {
            tokio::select! {
                why = signals.stop() => tracing::info!("{why}: draining"),
                () = drain_status.drain_requested() => tracing::info!("drain requested: draining"),
            }
        })
        .await?;
        ops.stop().await;
        Ok::<(), anyhow::Error>(())
    })?;
    Ok(())
}

/// The signals the donor acts on.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            hup: signal(SignalKind::hangup()).context("installing the SIGHUP handler")?,
        })
    }

    /// Wait for SIGTERM or SIGINT; SIGHUP is logged and ignored.
    async fn stop(&mut self) -> &'static str {
        loop {
            tokio::select! {
                _ = self.term.recv() => return "SIGTERM",
                _ = self.int.recv() => return "SIGINT",
                _ = self.hup.recv() => tracing::warn!("SIGHUP: reloading is not implemented in this version; ignoring"),
            }
        }
    }
}
