//! `memory-donor serve`: the donor daemon's start, from flags or the
//! cluster config, to its drain.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use cluster_config::{Config, MlockMode};
use daemon_runtime::notify::Notifier;
use memory_donor::daemon::{AdminServers, serve};
use memory_donor::fdstore::FdStore;
use memory_donor::load::load_tables;
use memory_donor::orders::Order;
use memory_donor::reload::ReloadSource;
use memory_donor::spec::{Overrides, ServeSpec, TableSpec};
use memory_donor::status::{DonorState, Phase};
use memory_donor::supervise::LoopServices;

#[derive(clap::Args)]
pub struct ServeArgs {
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

/// `memory-donor serve`.
pub fn run(args: ServeArgs) -> Result<()> {
    let overrides = overrides(&args);
    let (mut spec, reload) = spec(&args, &overrides)?;
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
    let run = LoopServices {
        notifier,
        log_level,
        reload,
        fd_store,
    };
    let result = rt.block_on(start_and_serve(spec, run));
    // A swap still loading in a blocking thread is abandoned, not waited for.
    rt.shutdown_timeout(Duration::from_secs(1));
    result
}

/// What the command line changes of the config (or of the defaults).
fn overrides(args: &ServeArgs) -> Overrides {
    Overrides {
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
    }
}

/// What to serve, from the config or the flags; with a config, where a
/// reload reads it again.
fn spec(args: &ServeArgs, overrides: &Overrides) -> Result<(ServeSpec, Option<ReloadSource>)> {
    Ok(if let Some(path) = &args.config {
        let config = Config::load(path)?;
        plaintext_overrides(Some(&config), args)?;
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
        plaintext_overrides(None, args)?;
        let name = args.name.as_deref().unwrap_or("memory-donor");
        let spec = ServeSpec::from_flags(name, args.listen.clone(), args.tables.clone());
        (spec, None)
    })
}

/// Signals, TLS, the operations servers, the load (a drain meanwhile
/// exits), then serving until the drain.
async fn start_and_serve(spec: ServeSpec, run: LoopServices) -> Result<()> {
    let (notifier, fd_store) = (Arc::clone(&run.notifier), Arc::clone(&run.fd_store));
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
    let ops = AdminServers::start(&spec, &status).await?;
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
    serve(spec, tables, &status, &announce, run).await?;
    ops.stop().await;
    Ok::<(), anyhow::Error>(())
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
    async fn forward(mut self, status: Arc<DonorState>) {
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
