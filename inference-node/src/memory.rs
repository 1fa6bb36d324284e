//! The node's Engram memory, built from the cluster config: one router per
//! table this node routes, over shared sources (one connection and one
//! breaker per donor, whichever tables it serves), each SSD copy and local
//! copy opened (and its digest checked) at startup, and a probe loop per
//! source for re-admission.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use cluster_config::{Config, ConfigError, SourceRef};
use memory_donor::resident::{LoadError, Pin};
use thiserror::Error;
use tokio::task::JoinHandle;

use crate::client::ClientOptions;
use crate::metrics::{NodeMetrics, SourceOnly};
use crate::router::{RouteSettings, Router, SourceHealth};
use crate::source::ssd::{SsdError, SsdOptions, SsdReader};
use crate::source::{DonorSource, LocalRam, RowSource, SsdSource};

/// Why the memory could not be set up.
#[derive(Debug, Error)]
pub enum MemoryError {
    /// The node is not in the config.
    #[error("node {name:?} is not in the config (nodes: {known})")]
    UnknownNode { name: String, known: String },
    /// The credential file could not be read.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A table's SSD copy cannot be used.
    #[error("table {table}: SSD copy: {source}")]
    Ssd { table: u32, source: SsdError },
    /// A table's local copy cannot be loaded.
    #[error("table {table}: local copy: {source}")]
    Local { table: u32, source: LoadError },
    /// Something failed that should not (a thread could not start).
    #[error("table {table}: {message}")]
    Internal { table: u32, message: String },
}

/// Every router of one node.
#[derive(Debug)]
pub struct Memory {
    routers: Vec<Arc<Router>>,
    probes: Vec<JoinHandle<()>>,
}

impl Drop for Memory {
    fn drop(&mut self) {
        for p in &self.probes {
            p.abort();
        }
    }
}

impl Memory {
    /// Set up node `name` of `config`: open SSD and local copies (checking
    /// their digests unless the route trusts them), make donor sources,
    /// probe every donor once so one that is down starts excluded, and start
    /// the probe loops. Must run inside a tokio runtime.
    pub async fn from_config(
        config: &Config,
        name: &str,
        metrics: &NodeMetrics,
    ) -> Result<Self, MemoryError> {
        let node = config.node(name).ok_or_else(|| MemoryError::UnknownNode {
            name: name.into(),
            known: config
                .nodes
                .iter()
                .map(|n| n.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })?;
        let credential = config.credential()?;
        let gauge = |source: &str| {
            metrics
                .breaker_state
                .get_or_create(&SourceOnly {
                    source: source.to_string(),
                })
                .clone()
        };

        // One source (and breaker) per donor, pinned to every table routed to it.
        let mut donors: HashMap<String, Arc<SourceHealth>> = HashMap::new();
        for d in &config.donors {
            let pinned: Vec<_> = node
                .routes
                .iter()
                .filter(|r| r.sources.contains(&SourceRef::Donor(d.name.clone())))
                .filter_map(|r| config.table(r.table).map(|t| (t.id, t.digest)))
                .collect();
            if pinned.is_empty() {
                continue;
            }
            let mut opts = ClientOptions::new(node.name.clone(), pinned.clone());
            opts.credential = credential.clone();
            opts.connect_timeout = node.connect_timeout;
            opts.lookup_timeout = node.lookup_timeout;
            let src: Arc<dyn RowSource> = Arc::new(
                DonorSource::new(d.name.clone(), d.advertise.clone(), opts)
                    .with_control(d.control_endpoint()),
            );
            let h = SourceHealth::new(src, pinned, node.breaker_failures, gauge(&d.name));
            donors.insert(d.name.clone(), Arc::new(h));
        }

        let mut routers = Vec::new();
        let mut all: Vec<Arc<SourceHealth>> = donors.values().cloned().collect();
        for route in &node.routes {
            let Some(table) = config.table(route.table) else {
                continue;
            };
            let pin = Pin {
                digest: table.digest,
                layer: table.layer,
                rows: table.rows,
            };
            let mut sources = Vec::new();
            for s in &route.sources {
                let health = match s {
                    SourceRef::Donor(d) => match donors.get(d) {
                        Some(h) => h.clone(),
                        None => continue,
                    },
                    SourceRef::Ssd => {
                        let path = route.ssd_path.clone();
                        let opts = SsdOptions {
                            io: node.ssd_io,
                            direct: node.ssd_direct,
                            ..SsdOptions::default()
                        };
                        let trust = route.trust_digest;
                        let reader = blocking(table.id, move || {
                            SsdReader::open(&path, Some(pin), trust, opts)
                        })
                        .await?
                        .map_err(|source| MemoryError::Ssd {
                            table: table.id,
                            source,
                        })?;
                        tracing::info!(table = table.id, path = %route.ssd_path.display(), engine = reader.engine_name(), direct = reader.is_direct(), "SSD copy ready");
                        let src = SsdSource::new(table.id, reader).map_err(|e| {
                            MemoryError::Internal {
                                table: table.id,
                                message: format!("starting the SSD reader: {e}"),
                            }
                        })?;
                        let src: Arc<dyn RowSource> = Arc::new(src);
                        let h = SourceHealth::new(
                            src,
                            vec![(table.id, table.digest)],
                            node.breaker_failures,
                            gauge("ssd"),
                        );
                        Arc::new(h)
                    }
                    SourceRef::Local => {
                        let path = route.ssd_path.clone();
                        let trust = route.trust_digest;
                        let id = table.id;
                        let local = blocking(id, move || LocalRam::load(id, &path, pin, trust))
                            .await?
                            .map_err(|source| MemoryError::Local { table: id, source })?;
                        tracing::info!(table = id, path = %route.ssd_path.display(), "local copy loaded");
                        let src: Arc<dyn RowSource> = Arc::new(local);
                        let h = SourceHealth::new(
                            src,
                            vec![(table.id, table.digest)],
                            node.breaker_failures,
                            gauge("local"),
                        );
                        Arc::new(h)
                    }
                };
                if !matches!(s, SourceRef::Donor(_)) {
                    all.push(health.clone());
                }
                sources.push(health);
            }
            let settings = RouteSettings {
                table: table.id,
                window: node.window(config, table.id).unwrap_or_default(),
                grace: route.grace,
                hard_timeout: route.hard_timeout,
                hedge: route.hedge,
                policy: route.policy,
                precise_timers: true,
            };
            routers.push(Arc::new(Router::new(settings, sources, metrics)));
        }

        // A donor that is down at startup starts excluded, not on a first lookup's time.
        for h in donors.values() {
            h.probe_at_start().await;
        }
        let probes = all
            .into_iter()
            .map(|h| tokio::spawn(h.probe_loop(node.probe_interval)))
            .collect();
        Ok(Self { routers, probes })
    }

    /// The router of a table.
    pub fn router(&self, table: u32) -> Option<&Arc<Router>> {
        self.routers.iter().find(|r| r.table() == table)
    }

    /// Every router, in the config's route order.
    pub fn routers(&self) -> &[Arc<Router>] {
        &self.routers
    }
}

/// Serve the node's Prometheus `/metrics` on `addr` (the node's `metrics`
/// key); returns the bound address and the server task.
pub async fn serve_metrics(
    addr: SocketAddr,
    metrics: Arc<NodeMetrics>,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let render: cluster_config::ops::Render = Arc::new(move || metrics.render());
    let task = tokio::spawn(cluster_config::ops::serve_metrics_with(
        listener,
        render,
        cluster_config::ops::HttpLimits {
            content_type: "text/plain; version=0.0.4; charset=utf-8",
            ..Default::default()
        },
        std::future::pending(),
    ));
    Ok((bound, task))
}

async fn blocking<T: Send + 'static>(
    table: u32,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, MemoryError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| MemoryError::Internal {
            table,
            message: format!("loading thread failed: {e}"),
        })
}
