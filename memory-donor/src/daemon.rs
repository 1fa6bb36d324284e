//! `memory-donor serve`'s wiring: the operations servers (control plane
//! and metrics, bound before loading), then, once the tables are loaded
//! (`load`, from what `spec` says), binding the data plane, the `ready`
//! line and READY=1, and the run (`supervise`: orders, watchdog, drain).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cluster_config::{Endpoint, Transport};

use crate::control::{ControlLimits, serve_control};
use crate::server::{self, Shared};
use crate::status::{DonorState, Phase};
use engram_store::resident::ResidentTable;

use crate::spec::{ServeError, ServeSpec};

/// The control-plane and metrics servers, bound and running.
#[derive(Debug)]
pub struct AdminServers {
    /// Where the control plane listens, if it does.
    pub control: Option<SocketAddr>,
    /// Where `/metrics` is served, if it is.
    pub metrics: Option<SocketAddr>,
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

async fn bind(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr), ServeError> {
    let err = |source| ServeError::Bind { addr, source };
    let l = tokio::net::TcpListener::bind(addr).await.map_err(err)?;
    let bound = l.local_addr().map_err(err)?;
    Ok((l, bound))
}

impl AdminServers {
    /// Bind the spec's control and metrics addresses and serve them from
    /// `status`; logs `ops control=ADDR metrics=ADDR` (`-` for none) once bound.
    pub async fn start(spec: &ServeSpec, status: &Arc<DonorState>) -> Result<Self, ServeError> {
        let (stop, _) = tokio::sync::watch::channel(false);
        let stopped = |stop: &tokio::sync::watch::Sender<bool>| {
            let mut rx = stop.subscribe();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };
        let mut ops = Self {
            control: None,
            metrics: None,
            stop,
            tasks: Vec::new(),
        };
        if let Some(addr) = spec.control {
            let (l, bound) = bind(addr).await?;
            let (status, stopped) = (Arc::clone(status), stopped(&ops.stop));
            ops.tasks.push(tokio::spawn(async move {
                if let Err(e) = serve_control(l, status, ControlLimits::default(), stopped).await {
                    tracing::error!(error = %e, "control plane stopped");
                }
            }));
            ops.control = Some(bound);
        }
        if let Some(addr) = spec.metrics {
            let (l, bound) = bind(addr).await?;
            let render = crate::metrics::donor_metrics(Arc::clone(status));
            let stopped = stopped(&ops.stop);
            ops.tasks
                .push(tokio::spawn(daemon_runtime::metrics::serve_metrics(
                    l, render, stopped,
                )));
            ops.metrics = Some(bound);
        }
        if ops.control.is_some() || ops.metrics.is_some() {
            // Tests read the real ports from this line (they bind port 0).
            tracing::info!(donor = %spec.server.name, "ops{}", ops.describe());
        }
        Ok(ops)
    }

    /// ` control=ADDR metrics=ADDR` (`-` for none), or nothing when neither runs.
    pub fn describe(&self) -> String {
        if self.control.is_none() && self.metrics.is_none() {
            return String::new();
        }
        let show = |a: Option<SocketAddr>| a.map_or("-".to_string(), |a| a.to_string());
        format!(
            " control={} metrics={}",
            show(self.control),
            show(self.metrics)
        )
    }

    /// Stop both servers, letting answers in flight (a Drain's) go out
    /// for at most two seconds.
    pub async fn stop(self) {
        self.stop.send_replace(true);
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
        }
    }
}

/// Bind the data plane, say `ready` (with `announce` appended) and
/// READY=1, and serve `tables` until a drain is requested (`status`); then
/// drain. Counters go to `status`, whose phase is `Serving` from the ready
/// line until the drain starts. Reloads, swaps and the watchdog are
/// `supervise`'s.
pub async fn serve(
    spec: ServeSpec,
    tables: Vec<ResidentTable>,
    status: &Arc<DonorState>,
    announce: &str,
    ops: crate::supervise::LoopServices,
) -> Result<Arc<Shared>, ServeError> {
    let Bound {
        mut listeners,
        mut bound,
        quic,
        rdma,
    } = bind_all(&spec).await?;
    // The host socket is bound before the ready line, like the others.
    let host = match &spec.host {
        Some(h) => Some(server::host::HostListener::bind(h.clone()).map_err(|e| {
            ServeError::Config(format!("cannot listen on unix://{}: {e}", h.path.display()))
        })?),
        None => None,
    };
    let count = tables.len();
    let shared = Shared::with_stats(spec.server.clone(), tables, Arc::clone(&status.stats));
    if let Some(tls) = status.tls.get() {
        shared.set_tls(Arc::clone(tls));
    } else if spec.listen.iter().any(|e| e.transport.is_secure()) {
        return Err(ServeError::Config(
            "a tls:// or quic:// address needs the rack's PKI ([rack.tls])".into(),
        ));
    }
    bind_quic(&shared, quic, &mut listeners, &mut bound)?;
    // Plain `IP:PORT` for TCP (what scripts have always read), URLs for the rest.
    let mut shown: Vec<String> = bound
        .iter()
        .map(|e| match e.transport {
            Transport::Tcp => e.addr.to_string(),
            _ => e.to_string(),
        })
        .collect();
    let host = match host {
        Some(h) => {
            shown.push(format!("unix://{}", h.path().display()));
            Some(h.spawn(Arc::clone(&shared)).map_err(|e| {
                ServeError::Config(format!("cannot start the host socket's thread: {e}"))
            })?)
        }
        None => None,
    };
    status.set_phase(Phase::Serving);
    // Tests and scripts wait for this exact line, never for a sleep.
    tracing::info!(donor = %spec.server.name, "ready listen={}{announce}", shown.join(","));
    // Every table is loaded and verified, every listener bound.
    if let Err(e) = ops
        .notifier
        .ready(&format!("serving {count} tables, 0 connections"))
    {
        tracing::warn!(error = %e, "sd_notify READY=1 failed");
    }
    if let Some(addr) = rdma {
        start_rdma(&shared, &spec, addr, &bound, &ops);
    }
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(server::run(listeners, Arc::clone(&shared), async move {
        let _ = stop_rx.await;
    }));
    // The watchdog's probe dials a TCP or TLS listener (QUIC has its own path).
    let first = bound
        .iter()
        .find(|e| matches!(e.transport, Transport::Tcp | Transport::Tls))
        .copied();
    crate::supervise::run(spec, Arc::clone(&shared), Arc::clone(status), first, ops).await;
    let _ = stop_tx.send(());
    if server.await.is_err() {
        tracing::error!("the data plane task failed while draining");
    }
    // It sees the drain within its watch interval, and removes its socket.
    if let Some(h) = host {
        let _ = tokio::task::spawn_blocking(move || h.join()).await;
    }
    Ok(shared)
}
/// The data plane's TCP and TLS listeners, bound; the QUIC and RDMA
/// addresses still to set up.
struct Bound {
    listeners: Vec<server::Listener>,
    bound: Vec<Endpoint>,
    quic: Vec<SocketAddr>,
    rdma: Option<SocketAddr>,
}

async fn bind_all(spec: &ServeSpec) -> Result<Bound, ServeError> {
    let mut listeners = Vec::new();
    let mut bound = Vec::new();
    let mut quic = Vec::new();
    let mut rdma = None;
    for e in &spec.listen {
        let listener = match e.transport {
            Transport::Tcp => {
                let (l, a) = bind(e.addr).await?;
                bound.push(Endpoint::new(e.transport, a));
                server::Listener::Tcp(l)
            }
            Transport::Tls => {
                let (l, a) = bind(e.addr).await?;
                bound.push(Endpoint::new(e.transport, a));
                server::Listener::Tls(l)
            }
            Transport::Quic => {
                quic.push(e.addr);
                continue;
            }
            Transport::Rdma => {
                rdma = Some(e.addr);
                continue;
            }
        };
        listeners.push(listener);
    }
    Ok(Bound {
        listeners,
        bound,
        quic,
        rdma,
    })
}

/// Bind each QUIC address (it needs the TLS state `shared` holds).
fn bind_quic(
    shared: &Arc<Shared>,
    quic: Vec<SocketAddr>,
    listeners: &mut Vec<server::Listener>,
    bound: &mut Vec<Endpoint>,
) -> Result<(), ServeError> {
    for addr in quic {
        let config = server::quic::server_config(shared).map_err(ServeError::Config)?;
        let endpoint = quinn::Endpoint::server(config, addr)
            .map_err(|source| ServeError::Bind { addr, source })?;
        let a = endpoint
            .local_addr()
            .map_err(|source| ServeError::Bind { addr, source })?;
        bound.push(Endpoint::new(Transport::Quic, a));
        listeners.push(server::Listener::Quic(endpoint));
    }
    Ok(())
}

/// RDMA is set up after READY: checking every row and registering tens
/// of GiB takes seconds to minutes, which would undo the fd store's
/// instant restart and could run past the unit's start timeout. Nodes
/// read over TLS or QUIC meanwhile; RegionQuery answers "unavailable"
/// until the book is in place, and they ask again.
fn start_rdma(
    shared: &Arc<Shared>,
    spec: &ServeSpec,
    addr: SocketAddr,
    bound: &[Endpoint],
    ops: &crate::supervise::LoopServices,
) {
    let (sh, device, name) = (
        Arc::clone(shared),
        spec.rdma.clone().unwrap_or_default(),
        spec.server.name.clone(),
    );
    let fallback: Vec<Endpoint> = bound.to_vec();
    let store = Arc::clone(&ops.fd_store);
    tokio::task::spawn_blocking(move || {
        // Taken under the tables' lock, used after it is let go: lookups
        // and swaps must not wait while every row is hashed.
        let tables = crate::rdma::snapshot(&sh.tables());
        let book = crate::rdma::start(&name, addr, &device, tables, &fallback, Some(&store));
        // Check words of versions not served now (or of tables that
        // could not be registered) go.
        store.release_checks();
        if let Some(book) = book {
            sh.set_rdma(book, Some(store));
            // A swap or reload while the tables were registered: the
            // book follows the tables as they are now.
            sh.sync_rdma();
        }
    });
}
