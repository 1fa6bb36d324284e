//! `inference-node serve`: the node daemon. Builds the node's model from
//! the cluster config (its `[model] family`'s loop: DeepSeek V4.1's or
//! Qwen4Exp's; every source opened, digests checked, donors probed), serves `engram.node.v1.EngramNode` and `grpc.health.v1` on the
//! node's `api` address and `/metrics` on its `metrics` address, then says
//! READY=1. SIGHUP re-reads the config and applies what can change live
//! (between sequences); SIGTERM drains: new sequences are refused, the
//! running one may finish until the drain deadline, then it stops after its
//! current step and the daemon exits 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use daemon_runtime::logging::LogLevel;
use daemon_runtime::notify::Notifier;
use engram_protocol::node_api::SERVICE_NAME;
use engram_protocol::node_api::engram_node_server::EngramNodeServer;
use inference_node::daemon::{Daemon, LoopContext, ServedModel};
use inference_node::metrics::NodeMetrics;
use inference_node::model::node::Backbone;
use tokio::signal::unix::{SignalKind, signal};
use tonic_health::ServingStatus;

/// Arguments of `serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The cluster config.
    #[arg(long)]
    pub config: PathBuf,
    /// This node's name in it.
    #[arg(long)]
    pub name: String,
    /// Serve the API here (default: the node's `api` key, else 127.0.0.1:7420).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Serve /metrics here (default: the node's `metrics` key, if set).
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Where the backbone's stand-in compute runs.
    #[arg(long, value_enum, default_value_t = Backbone::Cpu)]
    pub backbone: Backbone,
    /// How long a running sequence may go on after SIGTERM (milliseconds).
    #[arg(long, default_value_t = 10_000)]
    pub drain_timeout_ms: u64,
    /// API connections at once.
    #[arg(long, default_value_t = 64)]
    pub max_connections: usize,
}

/// Run the daemon.
pub async fn run(args: ServeArgs, log: LogLevel) -> Result<()> {
    // Handlers first: a SIGTERM while the sources open must stop cleanly.
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    let notifier = Arc::new(Notifier::from_env().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "systemd notifications disabled");
        Notifier::disabled()
    }));
    let config = cluster_config::Config::load(&args.config)?;
    let node = config
        .node(&args.name)
        .with_context(|| format!("node {:?} is not in {}", args.name, args.config.display()))?
        .clone();
    apply_log_level(&log, node.log_level.as_deref());
    let _ = notifier.status("opening sources");
    check_addresses(&config, &args)?;
    let metrics = Arc::new(NodeMetrics::new());
    let metrics_addr = match args.metrics.or(node.metrics) {
        Some(addr) => Some(bind_metrics(addr, &metrics).await?),
        None => None,
    };
    let (listener, bound) = bind_api(args.listen.unwrap_or(node.api)).await?;

    let nm = tokio::select! {
        nm = ServedModel::from_config(&config, &args.name, &metrics) => nm
            .with_context(|| format!("node {:?} cannot start", args.name))?,
        _ = term.recv() => return stopped_early(&notifier),
        _ = int.recv() => return stopped_early(&notifier),
    };
    nm.check_backbone(args.backbone)
        .with_context(|| format!("node {:?} cannot start", args.name))?;
    let (daemon, worker) = Daemon::start(
        nm,
        LoopContext {
            handle: tokio::runtime::Handle::current(),
            notifier: notifier.clone(),
            backbone: args.backbone,
            name: args.name.clone(),
            metrics: metrics.clone(),
        },
    )
    .context("starting the model loop")?;

    let (reporter, health) = tonic_health::server::health_reporter();
    for name in ["", SERVICE_NAME] {
        reporter
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_api(
        listener,
        daemon.clone(),
        health,
        args.max_connections,
        async {
            let _ = stop_rx.await;
        },
    ));
    announce_ready(bound, metrics_addr, &notifier);

    loop {
        tokio::select! {
            _ = hup.recv() => reload(&args, &daemon, &log, &notifier).await,
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }

    drain(&daemon, &reporter, &notifier, args.drain_timeout_ms).await;
    let _ = stop_tx.send(());
    // Streams still open end with the server.
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    drop(daemon);
    drop(worker);
    tracing::info!("stopped");
    Ok(())
}

/// Say where the node serves: one line on stderr (what scripts and tests
/// wait for), the log, and systemd's READY.
fn announce_ready(bound: SocketAddr, metrics: Option<SocketAddr>, notifier: &Notifier) {
    let mut announce = format!("ready listen={bound}");
    if let Some(m) = metrics {
        announce.push_str(&format!(" metrics={m}"));
    }
    eprintln!("{announce}");
    tracing::info!(api = %bound, "serving");
    if let Err(e) = notifier.ready(&format!("serving on {bound}")) {
        tracing::debug!(error = %e, "sd_notify READY=1");
    }
}

/// Serve `/metrics` at `addr`; where it is bound.
async fn bind_metrics(addr: SocketAddr, metrics: &Arc<NodeMetrics>) -> Result<SocketAddr> {
    let (bound, _task) = inference_node::memory::serve_metrics(addr, Arc::clone(metrics))
        .await
        .with_context(|| format!("binding the metrics address {addr}"))?;
    Ok(bound)
}

/// The node API's listener, and where it is bound.
async fn bind_api(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the API address {addr}"))?;
    let bound = listener.local_addr()?;
    Ok((listener, bound))
}

/// The loopback rule, as `check` applies it to the config's addresses.
fn check_addresses(config: &cluster_config::Config, args: &ServeArgs) -> Result<()> {
    if let Some(addr) = args.metrics {
        config
            .plaintext_bind("--metrics: /metrics", addr)
            .map_err(anyhow::Error::msg)?;
    }
    if let Some(addr) = args.listen {
        config
            .plaintext_bind("--listen: the node API (gRPC, no TLS)", addr)
            .map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

/// The node API and its health service, until `stop`.
async fn serve_api(
    listener: tokio::net::TcpListener,
    daemon: Daemon,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    max_connections: usize,
    stop: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .concurrency_limit_per_connection(32)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .http2_max_header_list_size(16 << 10)
        .add_service(health)
        .add_service(
            EngramNodeServer::new(daemon)
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(16 << 20),
        )
        .serve_with_incoming_shutdown(
            daemon_runtime::accept::bounded_incoming(listener, max_connections),
            stop,
        )
        .await
}

/// Drain: refuse new work, let the running sequence finish until the
/// deadline, then stop it.
async fn drain(
    daemon: &Daemon,
    reporter: &tonic_health::server::HealthReporter,
    notifier: &Notifier,
    drain_timeout_ms: u64,
) {
    tracing::info!("draining");
    let _ = notifier.stopping("draining");
    daemon.drain();
    for name in ["", SERVICE_NAME] {
        reporter
            .set_service_status(name, ServingStatus::NotServing)
            .await;
    }
    let deadline = Instant::now() + Duration::from_millis(drain_timeout_ms);
    while daemon.busy() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if daemon.busy() {
        tracing::warn!("drain deadline reached: stopping the running sequence");
        daemon.abort();
        while daemon.busy() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

fn stopped_early(notifier: &Notifier) -> Result<()> {
    tracing::info!("stop requested while starting: exiting");
    let _ = notifier.stopping("stopping while starting");
    Ok(())
}

fn apply_log_level(log: &LogLevel, level: Option<&str>) {
    if std::env::var_os("RUST_LOG").is_some() {
        return;
    }
    if let Err(e) = log.set(level.unwrap_or("info")) {
        tracing::warn!(level = ?level, error = %e, "log_level not applied");
    }
}

async fn reload(args: &ServeArgs, daemon: &Daemon, log: &LogLevel, notifier: &Notifier) {
    tracing::info!("SIGHUP: reloading {}", args.config.display());
    let _ = notifier.reloading();
    let config = match cluster_config::Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("SIGHUP: the new config is not valid; keeping the old one:\n{e}");
            let _ = notifier.ready("reload refused: invalid config");
            return;
        }
    };
    let level = config.node(&args.name).and_then(|n| n.log_level.clone());
    match daemon.reload(config).await {
        Ok(changes) => {
            apply_log_level(log, level.as_deref());
            tracing::info!(changes = %changes, "SIGHUP: config applied");
            let _ = notifier.ready("serving (config reloaded)");
        }
        Err(e) => {
            tracing::error!(error = %e, "SIGHUP: reload refused; keeping the old config");
            let _ = notifier.ready("reload refused");
        }
    }
}
