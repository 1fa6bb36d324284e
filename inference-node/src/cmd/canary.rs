//! `inference-node canary`: token-paced random lookups through the
//! node's routers, with status lines and `/metrics`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};

#[derive(clap::Args)]
pub struct CanaryArgs {
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

pub async fn canary(args: CanaryArgs) -> Result<()> {
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
