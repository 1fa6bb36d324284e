//! `inference-node engines`: the host's one rack client for its engine
//! processes (every GPU rank of vLLM or SGLang on the host): opens the
//! node's Engram memory once (a rack of another model family than V4.1:
//! its tables, host-local ones handed over) and serves the engine socket
//! (`inference_node::engines`). Says `ready engines=PATH` on stderr and
//! READY=1 to systemd once the socket is bound; SIGTERM or SIGINT stops it
//! (every ring it serves then says its client is gone, and each engine's
//! waits end at their GPU deadline).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use cluster_config::model::Family;
use daemon_runtime::notify::Notifier;
use inference_node::embed::{EmbeddedNode, MetricsAt, NodeTables, OpenOptions};
use inference_node::engines::{EngineAccess, EngineListener, EngineMemory};
use inference_node::ring::RingOptions;

/// Arguments of `engines`.
#[derive(clap::Args, Debug)]
pub struct EnginesArgs {
    /// The cluster config.
    #[arg(long)]
    pub config: PathBuf,
    /// This node's name in it.
    #[arg(long)]
    pub name: String,
    /// The engine socket's path.
    #[arg(long, default_value = "/run/engram-rack/engines.sock")]
    pub socket: PathBuf,
    /// User ids allowed on the socket (default: this process's user and group).
    #[arg(long = "allow-uid")]
    pub uids: Vec<u32>,
    /// Group ids allowed on the socket.
    #[arg(long = "allow-gid")]
    pub gids: Vec<u32>,
    /// Give up on a ring request this long after it is seen (zeros, status
    /// late), in milliseconds; capped below each ring's GPU deadline.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub deadline_ms: u64,
    /// Keep a ring's thread spinning this long after its last request
    /// before it naps, in microseconds.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub idle_spin_us: u64,
    /// Serve /metrics here ("off" for none; default: the node's `metrics`).
    #[arg(long)]
    pub metrics: Option<String>,
}

/// Run it until SIGTERM or SIGINT.
pub async fn run(args: EnginesArgs) -> Result<()> {
    let metrics = match args.metrics.as_deref() {
        None => MetricsAt::Config,
        Some("off") => MetricsAt::Off,
        Some(a) => MetricsAt::Addr(a.parse().with_context(|| format!("--metrics {a}"))?),
    };
    let config = args.config.clone();
    let name = args.name.clone();
    // V4.1's memory (its rings too), or any other family's tables.
    let family = cluster_config::Config::load(&args.config)
        .map(|c| c.family())
        .unwrap_or_default();
    let mem = tokio::task::spawn_blocking(move || {
        let opts = OpenOptions { metrics };
        match family {
            Family::DeepseekV41 => EmbeddedNode::open_with(&config, &name, &opts)
                .map(|m| EngineMemory::V41(Arc::new(m))),
            _ => NodeTables::open(&config, &name, &opts).map(|t| EngineMemory::Tables(Arc::new(t))),
        }
    })
    .await?
    .with_context(|| format!("node {:?} cannot start", args.name))?;
    if let Some(dir) = args.socket.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let ring = RingOptions {
        deadline: Duration::from_millis(args.deadline_ms),
        idle_spin: Duration::from_micros(args.idle_spin_us),
        ..RingOptions::default()
    };
    let access = EngineAccess {
        uids: args.uids.clone(),
        gids: args.gids.clone(),
    };
    let listener = EngineListener::bind(&args.socket, access, ring)
        .with_context(|| format!("binding the engine socket {}", args.socket.display()))?;
    let stop = Arc::new(AtomicBool::new(false));
    super::stop_on_signals(Arc::clone(&stop));
    super::ignore_hangups("inference-node engines");
    eprintln!("ready engines={}", listener.path().display());
    tracing::info!(socket = %listener.path().display(), node = args.name, "serving engines");
    let notifier = Notifier::from_env().unwrap_or_else(|_| Notifier::disabled());
    let _ = notifier.ready(&format!("serving engines on {}", listener.path().display()));
    let m = mem.clone();
    let s = Arc::clone(&stop);
    // WATCHDOG=1 at half the interval systemd set, while the ring thread
    // keeps making passes.
    let every = notifier.watchdog().map(|w| w / 2);
    let last = std::sync::Mutex::new(std::time::Instant::now());
    let ping = move || {
        let (Some(every), Ok(mut at)) = (every, last.lock()) else {
            return;
        };
        if at.elapsed() >= every {
            *at = std::time::Instant::now();
            let _ = notifier.watchdog_ping();
        }
    };
    tokio::task::spawn_blocking(move || listener.run(&m, &s, &ping))
        .await?
        .context("serving engines")?;
    stop.store(true, Ordering::Relaxed);
    mem.close(Duration::from_secs(2));
    tracing::info!("stopped");
    Ok(())
}
