//! `inference-node canary`: the node's memory under a token-paced load of
//! random rows, as an operator's check that a rack serves a node: every
//! table's router is built from the cluster config exactly as the model
//! loop builds it, one lookup per table per token at the node's rate of
//! the rows a token needs (the `[model] family`'s: 24 for V4.1, 16 for
//! Qwen3.8-Flash-Next; each table's rows at its encoding's size), every
//! table at once, as a token does, with a status line each second and a
//! summary at the end. The node's `/metrics` is served
//! meanwhile when configured.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cluster_config::Config;
use daemon_runtime::latency::Latency;
use engram_protocol::synthetic::SplitMix64;
use tokio::time::Instant;

use crate::memory::{MemoryError, Routers};
use crate::metrics::NodeMetrics;
use crate::router::Router;

/// What a canary run does.
#[derive(Debug, Clone)]
pub struct CanarySpec {
    /// Tokens to run (`None`: until the shutdown future resolves).
    pub tokens: Option<u64>,
    /// Token rate (default: the node's `tokens_per_second`).
    pub tokens_per_second: Option<f64>,
    /// Seed of the random rows.
    pub seed: u64,
}

/// Per-table outcome of a canary run.
#[derive(Debug, Clone, Default)]
pub struct TableReport {
    /// Lookups made.
    pub lookups: u64,
    /// Lookups answered, by source.
    pub by_source: BTreeMap<String, u64>,
    /// Lookups answered with zeros (policy `zeros`).
    pub zeros: u64,
    /// Lookups failed (policy `fail`).
    pub failed: u64,
    /// Answers after the deadline.
    pub late: u64,
    /// Latencies of the answered lookups (for percentiles).
    pub latency: Latency,
}

impl TableReport {
    /// The `q` quantile (0..=1) of the latencies, in whole microseconds.
    pub fn quantile_us(&self, q: f64) -> u64 {
        self.latency.quantile(q).as_micros() as u64
    }
}

async fn one(router: &Router, rows: &[u64], out: &mut [u8], rep: &mut TableReport) {
    rep.lookups += 1;
    match router.fetch(rows, out).await {
        Ok(f) => {
            rep.latency.record(f.elapsed);
            rep.late += u64::from(f.late);
            match f.source {
                Some(s) => *rep.by_source.entry(s.to_string()).or_default() += 1,
                None => rep.zeros += 1,
            }
        }
        Err(e) => {
            rep.failed += 1;
            tracing::error!(table = router.table(), error = %e, "lookup failed");
        }
    }
}

/// Run the canary for node `name`; `status` gets a line each second.
pub async fn run(
    config: &Config,
    name: &str,
    spec: &CanarySpec,
    metrics: Arc<NodeMetrics>,
    mut status: impl FnMut(&str),
    shutdown: impl Future<Output = ()>,
) -> Result<Vec<(u32, TableReport)>, MemoryError> {
    let memory = Routers::from_config(config, name, &metrics).await?;
    // `from_config` found the node; its rate is the default.
    let rate = spec
        .tokens_per_second
        .or_else(|| config.node(name).map(|n| n.tokens_per_second))
        .unwrap_or(100.0);
    let token = Duration::from_secs_f64(1.0 / rate.max(1e-3));
    let per_token = config.family().rows_per_token();
    let routers: Vec<(Arc<Router>, u64)> = memory
        .routers()
        .iter()
        .filter_map(|r| config.table(r.table()).map(|t| (r.clone(), t.rows)))
        .collect();
    let mut reports: Vec<TableReport> = vec![TableReport::default(); routers.len()];
    let mut bufs: Vec<(Vec<u64>, Vec<u8>)> = routers
        .iter()
        .map(|(r, _)| {
            let size = r.settings().encoding.row_bytes();
            (vec![0; per_token], vec![0; per_token * size])
        })
        .collect();
    let mut rng = SplitMix64::new(spec.seed);
    let start = Instant::now();
    let mut last_status = start;
    tokio::pin!(shutdown);
    let mut k = 0u64;
    while spec.tokens.is_none_or(|n| k < n) {
        for ((rows, _), (_, n)) in bufs.iter_mut().zip(&routers) {
            for r in rows.iter_mut() {
                *r = rng.below(*n);
            }
        }
        let fetches = routers
            .iter()
            .zip(bufs.iter_mut())
            .zip(reports.iter_mut())
            .map(|(((router, _), (rows, out)), rep)| one(router, rows, out, rep));
        futures_util::future::join_all(fetches).await;
        k += 1;
        if last_status.elapsed() >= Duration::from_secs(1) {
            last_status = Instant::now();
            status(&line(k, start.elapsed(), &routers, &reports));
        }
        let next = start + token * (k as u32);
        tokio::select! {
            () = &mut shutdown => break,
            () = tokio::time::sleep_until(next) => {}
        }
    }
    status(&line(k, start.elapsed(), &routers, &reports));
    Ok(routers
        .iter()
        .map(|(r, _)| r.table())
        .zip(reports)
        .collect())
}

fn line(
    tokens: u64,
    elapsed: Duration,
    routers: &[(Arc<Router>, u64)],
    reports: &[TableReport],
) -> String {
    let mut s = format!(
        "{tokens} tokens in {:.1} s ({:.1}/s)",
        elapsed.as_secs_f64(),
        tokens as f64 / elapsed.as_secs_f64().max(1e-9)
    );
    for ((r, _), rep) in routers.iter().zip(reports) {
        let sources: Vec<String> = rep
            .by_source
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        s.push_str(&format!(
            " | table {}: p50 {} us p99 {} us late {} zeros {} failed {} [{}]",
            r.table(),
            rep.quantile_us(0.5),
            rep.quantile_us(0.99),
            rep.late,
            rep.zeros,
            rep.failed,
            sources.join(" ")
        ));
    }
    s
}
