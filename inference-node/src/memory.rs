//! The node's Engram memory, built from the cluster config: one router per
//! table this node routes, over shared sources (one connection and one
//! breaker per donor, whichever tables it serves), each SSD copy and local
//! copy opened (and its digest checked) at startup, and a probe loop per
//! source for re-admission.
//!
//! [`Routers::reload`] applies a new config to the live routers (see
//! `reload`); startup and reload build sources through the same code
//! (`build`), a reload reusing what it already has.

mod reload;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cluster_config::{Config, ConfigError, Node, SourceRef, SsdIo, SsdIoprio, Table};
use engram_protocol::TableDigest;
use engram_store::resident::{ExpectedTable, LoadError};
use thiserror::Error;
use tokio::task::JoinHandle;

pub use reload::{ReloadReport, TableChanges};

use crate::client::{ClientOptions, TlsClient, Transport};
use crate::metrics::{NodeMetrics, SourceOnly};
use crate::router::{RouteSettings, Router, SourceHealth};
use crate::source::ssd::{SsdError, SsdOptions, SsdReader};
use crate::source::{ControlTls, DonorSource, LocalRam, RowSource, SsdSource};
use crate::tls::NodeTls;
use engram_protocol::encoding::RowEncoding;

/// Why the memory could not be set up or reloaded.
#[derive(Debug, Error)]
pub enum MemoryError {
    /// The node is not in the config.
    #[error("node {name:?} is not in the config (nodes: {known})")]
    UnknownNode {
        /// The node name asked for.
        name: String,
        /// The config's node names, comma-separated.
        known: String,
    },
    /// The credential file could not be read.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A table's SSD copy cannot be used.
    #[error("table {table}: SSD copy: {source}")]
    Ssd {
        /// The table id.
        table: u32,
        /// Why the SSD copy cannot be used.
        source: SsdError,
    },
    /// A table's local copy cannot be loaded.
    #[error("table {table}: local copy: {source}")]
    Local {
        /// The table id.
        table: u32,
        /// Why the local copy cannot be loaded.
        source: LoadError,
    },
    /// A table's copy holds rows of another encoding than the config says.
    #[error("table {table}: {path}: its rows are {found} but the config says encoding = {said:?}")]
    Encoding {
        /// The table id.
        table: u32,
        /// The copy's file.
        path: PathBuf,
        /// The copy's encoding.
        found: String,
        /// The config's.
        said: String,
    },
    /// Something failed that should not (a thread could not start).
    #[error("table {table}: {message}")]
    Internal {
        /// The table being set up.
        table: u32,
        /// What failed.
        message: String,
    },
    /// The node's certificate, key or the rack CA cannot be used.
    #[error("this node's TLS certificate ([rack.tls]): {0}")]
    Tls(#[from] cluster_config::tls::TlsError),
    /// A donor is reached over TLS or QUIC in a rack without a PKI.
    #[error("{0}")]
    NeedsTls(String),
    /// A reload would change what only a restart can (the tables routed,
    /// their versions and shapes).
    #[error("table {table}: {what}; restart the node to apply this config")]
    RestartNeeded {
        /// The table the change is about (0 when it is about no one table).
        table: u32,
        /// The change that needs a restart.
        what: String,
    },
}

/// What a donor connection was made with: a reload keeps the connection
/// (and its breaker) while all of it is unchanged.
#[derive(Debug, Clone, PartialEq)]
struct DonorSpec {
    name: String,
    transport: Transport,
    advertise: Vec<SocketAddr>,
    tls: Option<TlsClient>,
    bind: Option<std::net::IpAddr>,
    interface: Option<String>,
    control: Option<SocketAddr>,
    /// The node's certificate for the control plane, when the rack has a PKI.
    control_tls: Option<ControlTls>,
    pinned: Vec<(u32, TableDigest)>,
    connect_timeout: Duration,
    lookup_timeout: Duration,
    credential: Option<Vec<u8>>,
    /// The donor's RDMA address, when it advertises one and the link allows it.
    rdma: Option<SocketAddr>,
    /// The fabric settings of its `[donor.rdma]`, for this node's queue pairs.
    rdma_fabric: engram_rdma::verbs::Fabric,
    /// The donor's host socket, when it has one and it is on this host:
    /// its tables are mapped, not asked for.
    host: Option<PathBuf>,
}

fn pinned_tables(spec: &DonorSpec) -> String {
    let ids: Vec<String> = spec.pinned.iter().map(|p| p.0.to_string()).collect();
    ids.join(", ")
}

/// The RDMA path to a donor, when this node has a verbs provider; without
/// one, says once which routes read over the stream transport instead.
fn rdma_path(
    donor: &str,
    addr: SocketAddr,
    spec: &DonorSpec,
    tables: &str,
    metrics: &NodeMetrics,
) -> Option<crate::source::rdma::RdmaPath> {
    if spec.tls.is_none() {
        tracing::warn!(
            donor,
            "rdma://{addr} is not used: regions are learned over TLS or QUIC only, and this \
             node reaches the donor over {}",
            spec.transport
        );
        return None;
    }
    match engram_rdma::provider() {
        Ok(p) => Some(crate::source::rdma::RdmaPath::new(
            donor,
            addr,
            p,
            spec.connect_timeout,
            spec.rdma_fabric,
            crate::source::rdma::RdmaCounters::new(metrics, donor),
        )),
        Err(e) => {
            tracing::warn!(donor, "{}", rdma_unused(addr, &e, tables, spec.transport));
            None
        }
    }
}

/// What the node says at startup about a donor's RDMA address it cannot use.
fn rdma_unused(
    addr: SocketAddr,
    why: &engram_rdma::verbs::VerbsError,
    tables: &str,
    transport: Transport,
) -> String {
    format!(
        "rdma://{addr} is not used: {why}; tables {tables} read from this donor over {transport}"
    )
}

/// What a copy of a table on this node was opened with: a reload keeps
/// the copy while all of it is unchanged.
#[derive(Debug, Clone, PartialEq)]
struct CopySpec {
    table: u32,
    local: bool,
    path: PathBuf,
    /// SSD engine settings (defaults for a local copy).
    io: SsdIo,
    direct: bool,
    ioprio: SsdIoprio,
}

/// The sources the node's routes use, with what each was made from.
#[derive(Debug, Default)]
struct SourcePool {
    donors: Vec<(DonorSpec, Arc<SourceHealth>)>,
    copies: Vec<(CopySpec, Arc<SourceHealth>)>,
}

impl SourcePool {
    fn donor(&self, name: &str) -> Option<&(DonorSpec, Arc<SourceHealth>)> {
        self.donors.iter().find(|(s, _)| s.name == name)
    }

    fn copy(&self, spec: &CopySpec) -> Option<&Arc<SourceHealth>> {
        self.copies.iter().find(|(s, _)| s == spec).map(|(_, h)| h)
    }

    fn all(&self) -> impl Iterator<Item = &Arc<SourceHealth>> {
        self.donors
            .iter()
            .map(|(_, h)| h)
            .chain(self.copies.iter().map(|(_, h)| h))
    }

    fn holds(&self, h: &Arc<SourceHealth>) -> bool {
        self.all().any(|x| Arc::ptr_eq(x, h))
    }
}

/// A node's routes as a config describes them, over a new pool.
struct PlannedRoutes {
    pool: SourcePool,
    /// One per routed table, in the config's order.
    routes: Vec<(RouteSettings, Vec<Arc<SourceHealth>>)>,
    /// Donor sources made now (not taken from the previous pool).
    fresh: Vec<Arc<SourceHealth>>,
}

/// What a reload may replace.
#[derive(Debug)]
struct Reloadable {
    /// The node's TLS state (when the rack has a PKI), reloaded in place.
    tls: Option<Arc<NodeTls>>,
    pool: SourcePool,
    probes: Vec<JoinHandle<()>>,
    probe_interval: Duration,
    breaker_failures: u32,
}

/// Every router of one node (one per routed table), with the sources they
/// share and what a reload may replace.
#[derive(Debug)]
pub struct Routers {
    routers: Vec<Arc<Router>>,
    /// The routed tables as at startup: a reload cannot change them.
    tables: Vec<Table>,
    /// Held for a whole reload, so two never interleave.
    live: tokio::sync::Mutex<Reloadable>,
}

impl Drop for Routers {
    fn drop(&mut self) {
        for p in &self.live.get_mut().probes {
            p.abort();
        }
    }
}

impl Routers {
    /// Set up node `name` of `config`: open SSD and local copies (checking
    /// their digests unless the route trusts them), make donor sources,
    /// probe every donor once so one that is down starts excluded, and start
    /// the probe loops. Must run inside a tokio runtime.
    pub async fn from_config(
        config: &Config,
        name: &str,
        metrics: &NodeMetrics,
    ) -> Result<Self, MemoryError> {
        let node = find_node(config, name)?;
        let tls = match config.tls_files(&node.name) {
            Some(files) => Some(NodeTls::load(&files)?),
            None => None,
        };
        if let Some(tls) = &tls {
            metrics.set_certificates(&tls.material());
        }
        let built = build(config, node, metrics, &SourcePool::default(), tls.as_ref()).await?;
        // A donor that is down at startup starts excluded, not on a first lookup's time.
        for h in &built.fresh {
            h.probe_at_start().await;
        }
        let routers = built
            .routes
            .into_iter()
            .map(|(settings, sources)| Arc::new(Router::new(settings, sources, metrics)))
            .collect();
        let tables = node
            .routes
            .iter()
            .filter_map(|r| config.table(r.table))
            .cloned()
            .collect();
        let probes = spawn_probes(&built.pool, node.probe_interval);
        Ok(Self {
            routers,
            tables,
            live: tokio::sync::Mutex::new(Reloadable {
                tls,
                pool: built.pool,
                probes,
                probe_interval: node.probe_interval,
                breaker_failures: node.breaker_failures,
            }),
        })
    }

    /// The router of a table.
    pub fn router(&self, table: u32) -> Option<&Arc<Router>> {
        self.routers.iter().find(|r| r.table() == table)
    }

    /// Every router, in the config's route order at startup.
    pub fn routers(&self) -> &[Arc<Router>] {
        &self.routers
    }

    /// Whether any source of `table` may give a view of it
    /// ([`crate::source::RowSource::may_view`]).
    pub fn may_view(&self, table: u32) -> bool {
        self.router(table)
            .is_some_and(|r| r.sources().iter().any(|h| h.source.may_view(table)))
    }

    /// Table `table`'s memory as this process maps it, at its pinned
    /// version: a host-local donor's (one copy for the host) before the
    /// node's own `local` copy; `None` when neither holds it now (it is
    /// routed only to donors over the network or the SSD, or the host
    /// socket has not handed it over yet).
    pub fn table_view(&self, table: u32) -> Option<crate::source::TableView> {
        let sources = self.router(table)?.sources();
        let views = sources.iter().filter_map(|h| h.source.view(table));
        let (shared, own): (Vec<_>, Vec<_>) = views.partition(crate::source::TableView::shared);
        shared.into_iter().chain(own).next()
    }
}

fn find_node<'a>(config: &'a Config, name: &str) -> Result<&'a Node, MemoryError> {
    config.node(name).ok_or_else(|| MemoryError::UnknownNode {
        name: name.into(),
        known: config
            .nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// The sources and route settings of `node`, taking every source `old`
/// already has with the same spec and making the others: donor sources
/// (not yet probed), SSD and local copies (opened and checked). Changes
/// nothing outside what it returns, so a failure leaves `old` as it was.
async fn build(
    config: &Config,
    node: &Node,
    metrics: &NodeMetrics,
    old: &SourcePool,
    tls: Option<&Arc<NodeTls>>,
) -> Result<PlannedRoutes, MemoryError> {
    let credential = config.credential()?;
    // The node's TLS state, reloaded in place: a renewed certificate keeps
    // the donor sources (and their breakers); new connections use it.
    let control_tls = tls.map(|t| ControlTls(Arc::clone(t)));
    let mut pool = SourcePool::default();
    let mut fresh = Vec::new();

    // One source (and breaker) per donor, pinned to every table routed to it.
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
        let link = node.link(&d.name);
        // RDMA rides beside a stream transport (where regions are learned):
        // the link's, or the donor's most secure one.
        let stream = link.transport.filter(|t| t.is_stream());
        let endpoints = d.endpoints(stream);
        let transport = endpoints.first().map_or(Transport::Tcp, |e| e.transport);
        let rdma = match (link.transport, d.rdma_endpoint()) {
            (None | Some(Transport::Rdma), Some(e)) => Some(e.addr),
            _ => None,
        };
        let tls = match (transport.is_secure(), tls) {
            (false, _) => None,
            (true, Some(t)) => Some(TlsClient {
                tls: Arc::clone(t),
                server_name: cluster_config::tls::server_name(&d.name)?,
            }),
            (true, None) => {
                return Err(MemoryError::NeedsTls(format!(
                    "donor {} is reached over {transport}, which needs [rack.tls]",
                    d.name
                )));
            }
        };
        let spec = DonorSpec {
            name: d.name.clone(),
            transport,
            tls,
            bind: link.bind,
            interface: link.interface.clone(),
            advertise: endpoints.iter().map(|e| e.addr).collect(),
            control: d.control_endpoint(),
            control_tls: control_tls.clone(),
            pinned,
            connect_timeout: node.connect_timeout,
            lookup_timeout: node.lookup_timeout,
            credential: credential.clone(),
            rdma,
            rdma_fabric: d.rdma.as_ref().map_or_else(Default::default, |r| {
                engram_rdma::verbs::Fabric {
                    ack_timeout: r.ack_timeout,
                    retry_count: r.retry_count,
                    traffic_class: r.traffic_class,
                }
            }),
            // On this host when its socket is here (a donor elsewhere
            // names a path this host does not have).
            host: d.host_socket.clone().filter(|p| {
                std::fs::symlink_metadata(p)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
            }),
        };
        let health = match old.donor(&d.name) {
            Some((s, h)) if *s == spec => h.clone(),
            _ => {
                let mut opts = ClientOptions::new(node.name.clone(), spec.pinned.clone());
                opts.credential = spec.credential.clone();
                opts.connect_timeout = spec.connect_timeout;
                opts.lookup_timeout = spec.lookup_timeout;
                opts.transport = spec.transport;
                opts.tls = spec.tls.clone();
                opts.bind = spec.bind;
                opts.interface = spec.interface.clone();
                // Version 1 while every pinned table has V4.1's rows (any
                // donor answers it); version 2 for a table of another
                // encoding, which only a donor speaking it can serve.
                if spec.pinned.iter().any(|&(id, _)| {
                    config
                        .table(id)
                        .is_some_and(|t| t.encoding != RowEncoding::V41)
                }) {
                    opts.version = engram_protocol::PROTOCOL_VERSION;
                }
                let rdma = spec.rdma.and_then(|addr| {
                    rdma_path(&d.name, addr, &spec, &pinned_tables(&spec), metrics)
                });
                let src: Arc<dyn RowSource> = match &spec.host {
                    Some(path) => {
                        let pins = spec
                            .pinned
                            .iter()
                            .filter_map(|&(id, _)| {
                                config.table(id).map(|t| {
                                    let want = ExpectedTable {
                                        digest: t.digest,
                                        layer: t.layer,
                                        rows: t.rows,
                                    };
                                    (id, want)
                                })
                            })
                            .collect();
                        tracing::info!(donor = %d.name, socket = %path.display(), "the donor is on this host: its tables are mapped from its host socket");
                        let source = SourceOnly {
                            source: d.name.clone(),
                        };
                        let counters = crate::source::HostCounters {
                            gaps: metrics.host_gaps.get_or_create(&source).clone(),
                            generations: metrics.host_generations.get_or_create(&source).clone(),
                        };
                        let host = crate::source::HostSource::with_counters(
                            d.name.clone(),
                            path.clone(),
                            pins,
                            Some(counters),
                        )
                        .map_err(|e| MemoryError::Internal {
                            table: spec.pinned.first().map_or(0, |p| p.0),
                            message: format!("cannot watch donor {}'s host socket: {e}", d.name),
                        })?;
                        Arc::new(host)
                    }
                    None => Arc::new(
                        DonorSource::new(d.name.clone(), spec.advertise.clone(), opts)
                            .with_control(spec.control)
                            .with_control_tls(spec.control_tls.clone())
                            .with_rdma(rdma),
                    ),
                };
                let h = Arc::new(SourceHealth::new(
                    src,
                    spec.pinned.clone(),
                    node.breaker_failures,
                    breaker_gauge(metrics, &d.name),
                ));
                fresh.push(h.clone());
                h
            }
        };
        pool.donors.push((spec, health));
    }

    let mut routes = Vec::new();
    for route in &node.routes {
        let Some(table) = config.table(route.table) else {
            continue;
        };
        let mut sources = Vec::new();
        for s in &route.sources {
            let local = match s {
                SourceRef::Donor(d) => {
                    if let Some((_, h)) = pool.donor(d) {
                        sources.push(h.clone());
                    }
                    continue;
                }
                SourceRef::Ssd => false,
                SourceRef::Local => true,
            };
            let spec = CopySpec {
                table: table.id,
                local,
                path: route.ssd_path.clone(),
                io: if local { SsdIo::default() } else { node.ssd_io },
                direct: !local && node.ssd_direct,
                ioprio: route.ssd_ioprio,
            };
            let health = match pool.copy(&spec).or_else(|| old.copy(&spec)) {
                Some(h) => h.clone(),
                None => open_copy(&spec, table, route.trust_digest, node, metrics).await?,
            };
            if pool.copy(&spec).is_none() {
                pool.copies.push((spec, health.clone()));
            }
            sources.push(health);
        }
        let window = node.window(config, table.id).unwrap_or_default();
        let labels = crate::metrics::TableLabels {
            table: table.id.to_string(),
        };
        metrics
            .table_window_seconds
            .get_or_create(&labels)
            .set(window.as_secs_f64());
        let settings = RouteSettings {
            table: table.id,
            encoding: table.encoding,
            window,
            grace: route.grace,
            hard_timeout: route.hard_timeout,
            hedge: route.hedge,
            policy: route.policy,
            precise_timers: true,
        };
        routes.push((settings, sources));
    }
    Ok(PlannedRoutes {
        pool,
        routes,
        fresh,
    })
}

/// Open (SSD) or load (local RAM) a table's copy, checking it is the pinned table.
async fn open_copy(
    spec: &CopySpec,
    table: &Table,
    trust: bool,
    node: &Node,
    metrics: &NodeMetrics,
) -> Result<Arc<SourceHealth>, MemoryError> {
    let pin = ExpectedTable {
        digest: table.digest,
        layer: table.layer,
        rows: table.rows,
    };
    let id = table.id;
    let path = spec.path.clone();
    let src: Arc<dyn RowSource> = if spec.local {
        let local = blocking(id, move || LocalRam::load(id, &path, pin, trust))
            .await?
            .map_err(|source| MemoryError::Local { table: id, source })?;
        check_copy_encoding(table, &spec.path, local.encoding())?;
        tracing::info!(table = id, path = %spec.path.display(), "local copy loaded");
        Arc::new(local)
    } else {
        let opts = SsdOptions {
            io: spec.io,
            direct: spec.direct,
            ioprio: spec.ioprio,
            ..SsdOptions::default()
        };
        let reader = blocking(id, move || SsdReader::open(&path, Some(pin), trust, opts))
            .await?
            .map_err(|source| MemoryError::Ssd { table: id, source })?;
        check_copy_encoding(table, &spec.path, reader.encoding())?;
        tracing::info!(table = id, path = %spec.path.display(), engine = reader.engine_name(), direct = reader.is_direct(), page_checksums = reader.checks_pages(), ioprio = %reader.ioprio(), "SSD copy ready");
        let src = SsdSource::new(id, reader, metrics.ssd_engine.clone())
            .map_err(|source| MemoryError::Ssd { table: id, source })?;
        Arc::new(src)
    };
    let name = src.name().to_string();
    Ok(Arc::new(SourceHealth::new(
        src,
        vec![(id, table.digest)],
        node.breaker_failures,
        breaker_gauge(metrics, &name),
    )))
}

/// A copy's rows must be of the encoding the config declares for its
/// table (the router sizes and checks rows by it).
fn check_copy_encoding(
    table: &Table,
    path: &std::path::Path,
    found: RowEncoding,
) -> Result<(), MemoryError> {
    if found == table.encoding {
        return Ok(());
    }
    Err(MemoryError::Encoding {
        table: table.id,
        path: path.to_path_buf(),
        found: found.name(),
        said: table.encoding.name(),
    })
}

fn breaker_gauge(metrics: &NodeMetrics, source: &str) -> prometheus_client::metrics::gauge::Gauge {
    metrics
        .breaker_state
        .get_or_create(&SourceOnly {
            source: source.to_string(),
        })
        .clone()
}

/// A probe loop per source, for re-admission, and a tend loop, so what a
/// source sends unasked (a donor's Goodbye) is read whatever its breaker.
fn spawn_probes(pool: &SourcePool, interval: Duration) -> Vec<JoinHandle<()>> {
    pool.all()
        .flat_map(|h| {
            [
                tokio::spawn(h.clone().probe_loop(interval)),
                tokio::spawn(h.clone().tend_loop(crate::source::TEND_INTERVAL)),
            ]
        })
        .collect()
}

/// Serve the node's Prometheus `/metrics` on `addr` (the node's `metrics`
/// key); returns the bound address and the server task.
pub async fn serve_metrics(
    addr: SocketAddr,
    metrics: Arc<NodeMetrics>,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let render: daemon_runtime::metrics::Render = Arc::new(move || metrics.render());
    let task = tokio::spawn(daemon_runtime::metrics::serve_metrics_with(
        listener,
        render,
        daemon_runtime::metrics::HttpLimits {
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
