//! `memory-donor`: serve Engram tables from RAM; generate, pack, verify and inspect table files.

mod ctl;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use cluster_config::{Config, MlockMode};
use daemon_runtime::notify::Notifier;
use engram_protocol::ROW_BYTES;
use engram_store::generate::{GenSpec, generate, table_shape};
use engram_store::pack::pack;
use engram_store::progress::Progress;
use engram_store::table_file::TableFile;
use engram_store::verify::add_page_sums;
use memory_donor::fdstore::FdStore;
use memory_donor::load::load_tables;
use memory_donor::orders::Order;
use memory_donor::reload::ReloadSource;
use memory_donor::serve::{OpsServers, serve};
use memory_donor::spec::{Overrides, ServeSpec, TableSpec};
use memory_donor::status::{DonorStatus, Phase};
use memory_donor::supervise::Ops;

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
    /// Recompute a table's digest and check every row decodes and every
    /// page matches its checksum.
    Verify {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Give files made before page checksums existed their `page_xxh3`
        /// tensor (verifying them on the way; needs room for one more copy
        /// of the file while it is rewritten).
        #[arg(long)]
        write_page_checksums: bool,
        /// Threads that read, check and hash (default: every core, at most
        /// 16; fewer leave cores to a donor serving on the same machine).
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
        threads: Option<u16>,
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
    /// Address to listen on (repeatable; plain TCP: loopback unless
    /// --allow-plaintext).
    #[arg(long, value_name = "ADDR")]
    listen: Vec<SocketAddr>,
    /// Without --config: accept plaintext (--listen, --control, --metrics)
    /// on non-loopback addresses, as `rack.plaintext = "allow"` does.
    #[arg(long, conflicts_with = "config")]
    allow_plaintext: bool,
    /// Skip recomputing digests while loading (fast restart of trusted files).
    #[arg(long)]
    trust_digest: bool,
    /// Lock table memory: try (warn if the limit is too low), require, or off.
    #[arg(long, value_enum)]
    mlock: Option<MlockMode>,
    /// Under systemd, do not keep tables in its fd store (every start then
    /// reads the table files).
    #[arg(long)]
    no_fd_store: bool,
    /// Serve rows from the table files' own pages in the page cache, not a
    /// copy: a load costs about a hash of the file. Those tables are not
    /// offered over RDMA, and their files must be replaced by renaming,
    /// never rewritten in place (docs/donor.md). The default unless the
    /// config gives the donor an rdma:// address, a host socket or a
    /// numa_node, or says `map_files = false`.
    #[arg(long, conflicts_with = "copy_tables")]
    map_files: bool,
    /// Serve a copy of the rows in the donor's own memory (what RDMA, a
    /// host socket and numa_node need): a load copies the file on top of
    /// hashing it; the rows take 3.3% less memory than the file's pages.
    #[arg(long)]
    copy_tables: bool,
    /// Threads that read, place and hash a table at load (default: every core).
    #[arg(long, value_name = "N")]
    load_threads: Option<usize>,
    /// Busy-poll: connection threads check their socket without sleeping
    /// for up to this many microseconds before a blocking read (at most
    /// 10,000; default 0: off). Costs a core while lookups keep coming.
    #[arg(long, value_name = "US")]
    busy_poll_us: Option<u64>,
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
        Cmd::Verify {
            files,
            write_page_checksums,
            threads,
        } => {
            let threads = threads.map_or_else(engram_store::verify::default_threads, usize::from);
            let mut failed = 0;
            for f in &files {
                let result = TableFile::open(f).and_then(|t| {
                    let what = if write_page_checksums && !t.has_page_sums() {
                        "adding page checksums to"
                    } else {
                        "verifying"
                    };
                    let mut p = Progress::stderr(
                        format!("{what} {}", f.display()),
                        t.meta.rows,
                        ROW_BYTES as u64,
                    );
                    let d = if write_page_checksums {
                        add_page_sums(f, Some(&mut p))?.digest
                    } else {
                        t.verify_on(threads, Some(&mut p))?
                    };
                    p.finish();
                    let t = TableFile::open(f)?;
                    Ok((t, d))
                });
                match result {
                    Ok((t, d)) => {
                        let sums = if t.has_page_sums() {
                            "page checksums ok"
                        } else {
                            "no page checksums (add them with --write-page-checksums)"
                        };
                        println!(
                            "{}: ok: layer {} rows {} digest {d}; {sums}",
                            f.display(),
                            t.meta.layer,
                            t.meta.rows
                        );
                    }
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
        Cmd::Serve(args) => run_serve(args)?,
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
            "page_checksums": t.has_page_sums().then_some("xxh3_64"),
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
        println!(
            "checksums:   {}",
            if t.has_page_sums() {
                "XXH3-64 per page (page_xxh3)"
            } else {
                "none (add with `memory-donor verify --write-page-checksums`)"
            }
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

/// The loopback rule for what the command line adds, as `check` applies it
/// to the config: a control plane without TLS, /metrics, and (without a
/// config) plain TCP listeners bind loopback only, unless the rack's
/// `plaintext = "allow"` (or, without a config, --allow-plaintext) says so.
fn plaintext_overrides(config: Option<&Config>, args: &ServeArgs) -> Result<()> {
    let rule = |what: &str, addr: SocketAddr| -> Result<()> {
        match config {
            Some(c) => c.plaintext_bind(what, addr).map_err(anyhow::Error::msg),
            None if addr.ip().is_loopback() || args.allow_plaintext => Ok(()),
            None => bail!(
                "{what} {addr} would be plaintext and unauthenticated on a non-loopback address; \
                 bind loopback, serve from a rack config with [rack.tls], or pass \
                 --allow-plaintext to accept it"
            ),
        }
    };
    if let Some(addr) = args.control
        && config.is_none_or(|c| c.tls.is_none())
    {
        rule("--control: the control plane", addr)?;
    }
    if let Some(addr) = args.metrics {
        rule("--metrics: /metrics", addr)?;
    }
    if config.is_none() {
        for &addr in &args.listen {
            rule("--listen: plain TCP", addr)?;
        }
    }
    Ok(())
}

fn run_serve(args: ServeArgs) -> Result<()> {
    let overrides = Overrides {
        trust_digest: args.trust_digest,
        no_fd_store: args.no_fd_store,
        map_files: if args.map_files {
            Some(true)
        } else if args.copy_tables {
            Some(false)
        } else {
            None
        },
        load_threads: args.load_threads,
        busy_poll_us: args.busy_poll_us,
        mlock: args.mlock,
        max_connections: args.max_connections,
        max_rows: args.max_rows,
        drain_timeout_ms: args.drain_timeout_ms,
        hello_timeout_ms: args.hello_timeout_ms,
        credential_file: args.credential_file.clone(),
        control: args.control,
        metrics: args.metrics,
    };
    let (mut spec, reload) = if let Some(path) = &args.config {
        let config = Config::load(path)?;
        plaintext_overrides(Some(&config), &args)?;
        let name = args.name.as_deref().context("--config needs --name")?;
        let spec = ServeSpec::from_config(&config, name)?;
        let reload = ReloadSource {
            path: path.clone(),
            name: name.to_string(),
            overrides: overrides.clone(),
        };
        (spec, Some(reload))
    } else {
        if args.tables.is_empty() || args.listen.is_empty() {
            bail!("give --config FILE --name DONOR, or at least one --table and one --listen");
        }
        plaintext_overrides(None, &args)?;
        let name = args.name.as_deref().unwrap_or("memory-donor");
        let spec = ServeSpec::from_flags(name, args.listen.clone(), args.tables.clone());
        (spec, None)
    };
    overrides.apply(&mut spec)?;
    let log_level = daemon_runtime::logging::init_logging("info");
    if std::env::var_os("RUST_LOG").is_none()
        && let Some(level) = &spec.log_level
        && let Err(e) = log_level.set(level)
    {
        tracing::warn!(level = %level, error = %e, "log_level not applied");
    }
    let notifier = Arc::new(Notifier::from_env().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "systemd notifications disabled");
        Notifier::disabled()
    }));
    // Before anything else opens a descriptor: the ones systemd passed.
    let fd_store = Arc::new(FdStore::from_env(Arc::clone(&notifier), spec.fd_store));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(async move {
        // Handlers first: a SIGTERM during a minutes-long load, or right after
        // the ready line, must stop the donor cleanly, not kill it.
        let signals = Signals::install()?;
        // Then the control plane and metrics, so load progress and
        // NOT_SERVING are visible while the tables load.
        let status = spec.status();
        if let Some((files, access)) = &spec.tls {
            let tls = memory_donor::tls::DonorTls::load(files, access.clone())
                .context("loading the donor's TLS certificate ([rack.tls])")?;
            tracing::info!(identity = %tls.material().identity, cert = %files.cert.display(), "TLS material loaded");
            let _ = status.tls.set(tls);
        }
        tokio::spawn(signals.forward(Arc::clone(&status)));
        let _ = notifier.status("loading tables");
        let ops = OpsServers::start(&spec, &status).await?;
        let loading = tokio::task::spawn_blocking({
            let (spec, status, notifier, store) = (
                spec.clone(),
                Arc::clone(&status),
                Arc::clone(&notifier),
                Arc::clone(&fd_store),
            );
            move || load_tables(&spec, &status, &notifier, &store)
        });
        let tables = tokio::select! {
            loaded = loading => match loaded? {
                Ok(t) => t,
                Err(e) => {
                    status.set_phase(Phase::Failed);
                    let _ = notifier.status(&format!("failed: {e}"));
                    ops.stop().await;
                    return Err(e.into());
                }
            },
            () = status.drain_requested() => {
                tracing::info!("stop requested while loading: exiting");
                let _ = notifier.stopping("stopping while loading");
                ops.stop().await;
                // The loading thread cannot be interrupted; nothing is served yet.
                std::process::exit(0);
            }
        };
        let announce = ops.describe();
        let run = Ops {
            notifier,
            log_level,
            reload,
            fd_store,
        };
        serve(spec, tables, &status, &announce, run).await?;
        ops.stop().await;
        Ok::<(), anyhow::Error>(())
    });
    // A swap still loading in a blocking thread is abandoned, not waited for.
    rt.shutdown_timeout(Duration::from_secs(1));
    result
}

/// The signals the donor acts on.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    /// SIGIO: a read lease on a table file served from its pages broke
    /// (a reload or swap may turn `map_files` on, so always handled).
    io: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        let io = signal(SignalKind::io()).context("installing the SIGIO handler")?;
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            hup: signal(SignalKind::hangup()).context("installing the SIGHUP handler")?,
            io,
        })
    }

    /// SIGTERM and SIGINT request a drain; SIGHUP orders a reload (carried
    /// out once the tables are loaded, when it comes during the load).
    async fn forward(mut self, status: Arc<DonorStatus>) {
        loop {
            let why = tokio::select! {
                _ = self.term.recv() => "SIGTERM",
                _ = self.int.recv() => "SIGINT",
                _ = self.io.recv() => {
                    // A table's file is being opened for writing or
                    // truncated; the writer waits for this process to let
                    // go of its lease. Rows from a file that changes under
                    // them must not be served: stop at once.
                    tracing::error!(
                        "SIGIO: a table file served from its pages (map_files) is being opened for writing or truncated by another process; exiting so that no row of a changing file is served (a restart loads and verifies it again; replace table files by renaming them)"
                    );
                    std::process::exit(3);
                }
                _ = self.hup.recv() => {
                    tracing::info!("SIGHUP: reloading the config");
                    if status.order(Order::Reload).is_err() {
                        tracing::warn!("SIGHUP: too many orders waiting; ignored");
                    }
                    continue;
                }
            };
            if status.request_drain() {
                tracing::info!("{why}: draining");
            } else {
                tracing::info!("{why}: already draining");
            }
        }
    }
}
