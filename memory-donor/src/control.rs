//! The donor's control plane over gRPC (tonic): the standard
//! `grpc.health.v1` service and `engram.control.v1.DonorControl`
//! (ListTables, Stats, Drain, SwapTable), answered from [`DonorState`]. It
//! is bound and served before the tables load, so a node sees NOT_SERVING
//! and the load's progress instead of a refused connection.
//!
//! When the rack has a PKI the control plane speaks TLS 1.3 only, with
//! client certificates required and chained to the rack CA; the
//! configuration is taken afresh for each connection, so a SIGHUP's new
//! certificate applies to the next one. Every call then passes the rules
//! of `gate` (who may call what). A SwapTable also names the digest the
//! new file must have, and the file must lie under one of the donor's table
//! directories (checked by the serving loop, `swap::confine`).
//!
//! Bounds: a fixed number of control connections (more are closed at
//! once), a TLS handshake deadline, requests per connection, a per-request
//! timeout, small request messages, and a maximum connection age, so a
//! misbehaving client costs at most its own connection. Over TLS a
//! connection takes one of those slots only once its handshake (with a
//! rack certificate) is done: before that it is in a pre-auth budget of
//! its own ([`PREAUTH_PER_SOURCE`], [`PREAUTH_TOTAL`], the oldest evicted
//! when full, the deadline shrinking as it fills), so silent strangers
//! never keep an operator or a node's probe out.

pub mod gate;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use daemon_runtime::accept::bounded_incoming;
use daemon_runtime::logging::RateLimit;
use engram_protocol::TableDigest;
use engram_protocol::control as pb;
use engram_protocol::control::donor_control_server::{DonorControl, DonorControlServer};
use tokio::net::TcpListener;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::orders::{Order, SwapError, SwapRequest};
use crate::stats::Stats;
use crate::status::{DonorState, LoadState, Phase};
use crate::tls::DonorTls;
use gate::{Caller, Gate, Refusal, Rpc, Rules};

/// Bounds of the control server.
#[derive(Debug, Clone)]
pub struct ControlLimits {
    /// Control connections at once; more are closed on accept.
    pub max_connections: usize,
    /// Requests in flight on one connection.
    pub per_connection: usize,
    /// Longest a request may take.
    pub request_timeout: Duration,
    /// Largest request message.
    pub max_request: usize,
    /// A connection is closed (gracefully) after this long.
    pub max_connection_age: Duration,
    /// A TLS handshake not done within this is abandoned.
    pub handshake_timeout: Duration,
}

impl Default for ControlLimits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            per_connection: 16,
            request_timeout: Duration::from_secs(10),
            max_request: 4 << 10,
            max_connection_age: Duration::from_secs(300),
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// Control connections before their TLS handshake, from one source address.
pub const PREAUTH_PER_SOURCE: usize = 8;
/// Control connections before their TLS handshake, in all.
pub const PREAUTH_TOTAL: usize = 64;

/// `DonorControl` over the donor's status.
#[derive(Debug, Clone)]
pub struct ControlService {
    status: Arc<DonorState>,
    health: HealthReporter,
    rules: Arc<Rules>,
}

impl ControlService {
    /// A service answering from `status` and keeping `health` in step with
    /// it; `rules` name callers in the log.
    pub fn new(status: Arc<DonorState>, health: HealthReporter, rules: Arc<Rules>) -> Self {
        Self {
            status,
            health,
            rules,
        }
    }

    /// Refuse a SwapTable: logged, counted, and the status to answer.
    fn refuse_swap(&self, caller: &Caller, reason: &'static str, status: Status) -> Status {
        let r = Refusal {
            reason,
            message: status.message().to_string(),
        };
        gate::refused(&self.status.stats, caller, Rpc::SwapTable, &r);
        status
    }
}

/// The digest a SwapTable names: required, 64 hex digits.
fn expected_digest(hex: &str) -> Result<TableDigest, Status> {
    if hex.is_empty() {
        return Err(Status::invalid_argument(
            "expected_digest is required: the new file's digest, 64 hex digits \
             (`memory-donor inspect FILE` prints it)",
        ));
    }
    hex.parse()
        .map_err(|e| Status::invalid_argument(format!("expected_digest {hex:?}: {e}")))
}

/// Report `phase` as the health of the donor ("") and of `DonorControl`.
async fn publish(health: &HealthReporter, phase: Phase) {
    let now = if phase == Phase::Serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for name in ["", pb::SERVICE_NAME] {
        health.set_service_status(name, now).await;
    }
}

fn load_state(s: LoadState) -> pb::LoadState {
    match s {
        LoadState::Loading => pb::LoadState::Loading,
        LoadState::Verifying => pb::LoadState::Verifying,
        LoadState::Ready => pb::LoadState::Ready,
        LoadState::Failed => pb::LoadState::Failed,
    }
}

#[tonic::async_trait]
impl DonorControl for ControlService {
    async fn list_tables(
        &self,
        _: Request<pb::ListTablesRequest>,
    ) -> Result<Response<pb::ListTablesResponse>, Status> {
        let tables = self
            .status
            .tables
            .iter()
            .map(|t| {
                let v = t.view();
                pb::TableStatus {
                    id: v.id,
                    layer: v.layer,
                    rows: v.rows,
                    digest: v.digest.map(|d| d.to_hex()).unwrap_or_default(),
                    state: load_state(v.state).into(),
                    bytes_done: v.bytes_done,
                    bytes_total: v.bytes_total,
                    verify: v.verify,
                    path: v.path.display().to_string(),
                    error: v.error.unwrap_or_default(),
                }
            })
            .collect();
        Ok(Response::new(pb::ListTablesResponse {
            donor: self.status.name.clone(),
            tables,
            draining: self.status.phase() == Phase::Draining,
        }))
    }

    async fn stats(
        &self,
        _: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        let s = self.status.stats.snapshot();
        let t = &s.service;
        let count = t.count();
        let us = |ns: f64| ns / 1e3;
        Ok(Response::new(pb::StatsResponse {
            lookups: s.lookups,
            rows: s.rows,
            bytes: s.bytes,
            errors: s
                .errors_seen()
                .map(|(code, count)| pb::ErrorCount {
                    code: u32::from(code.to_u16()),
                    name: code.name().to_string(),
                    count,
                })
                .collect(),
            connections: Some(pb::Connections {
                open: s.open,
                accepted: s.connections,
                refused: s.refused,
            }),
            service_time: Some(pb::ServiceTime {
                count,
                p50_us: us(t.quantile_ns(0.5)),
                p90_us: us(t.quantile_ns(0.9)),
                p99_us: us(t.quantile_ns(0.99)),
                p999_us: us(t.quantile_ns(0.999)),
                max_us: us(t.max_ns() as f64),
                mean_us: if count == 0 {
                    0.0
                } else {
                    us(t.sum_ns as f64 / count as f64)
                },
            }),
            uptime_seconds: self.status.started.elapsed().as_secs_f64(),
        }))
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        let caller = self.rules.caller(request.extensions());
        let started = self.status.request_drain();
        // Before answering: whoever gets this answer then sees NOT_SERVING.
        publish(&self.health, self.status.phase()).await;
        tracing::info!(
            caller = %caller,
            started,
            "drain requested over the control plane"
        );
        Ok(Response::new(pb::DrainResponse {
            started,
            grace_ms: u64::try_from(self.status.drain_timeout().as_millis()).unwrap_or(u64::MAX),
        }))
    }

    async fn swap_table(
        &self,
        request: Request<pb::SwapTableRequest>,
    ) -> Result<Response<pb::SwapTableResponse>, Status> {
        let caller = self.rules.caller(request.extensions());
        let r = request.into_inner();
        let expected = expected_digest(&r.expected_digest)
            .map_err(|s| self.refuse_swap(&caller, "swap_digest", s))?;
        if r.path.is_empty() {
            return Err(Status::invalid_argument("path is empty"));
        }
        if self.status.phase() != Phase::Serving {
            return Err(swap_status(&SwapError::NotServing));
        }
        let req = SwapRequest {
            table: r.table_id,
            path: r.path.into(),
            expected: Some(expected),
            in_place: r.in_place,
        };
        tracing::info!(caller = %caller, table = req.table, path = %req.path.display(), expected = %expected, in_place = req.in_place, "swap requested over the control plane");
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.status.order(Order::Swap(req, tx)).is_err() {
            return Err(Status::unavailable("too many orders waiting; try again"));
        }
        let accepted = rx
            .await
            .map_err(|_| Status::unavailable("the donor stopped before answering"))?
            .map_err(|e| match e {
                SwapError::NotAllowed(_) => self.refuse_swap(&caller, "swap_path", swap_status(&e)),
                SwapError::WrongVersion { .. } => {
                    self.refuse_swap(&caller, "swap_digest", swap_status(&e))
                }
                _ => swap_status(&e),
            })?;
        Ok(Response::new(pb::SwapTableResponse {
            old_digest: accepted.old.to_hex(),
            new_digest: accepted.new.to_hex(),
            bytes: accepted.bytes,
            in_place: accepted.in_place,
        }))
    }
}

fn swap_status(e: &SwapError) -> Status {
    let msg = e.to_string();
    match e {
        SwapError::NotServing | SwapError::Busy => Status::unavailable(msg),
        SwapError::UnknownTable(_) => Status::not_found(msg),
        SwapError::BadFile(_) => Status::invalid_argument(msg),
        SwapError::WrongVersion { .. } | SwapError::AlreadyServed { .. } => {
            Status::failed_precondition(msg)
        }
        SwapError::NoRoom(_) => Status::resource_exhausted(msg),
        SwapError::NotAllowed(_) => Status::permission_denied(msg),
        SwapError::Load(_) => Status::internal(msg),
    }
}

/// Serve health and `DonorControl` on `listener` until `shutdown` resolves:
/// over TLS when `status.tls` is set, else in plaintext. Health follows the
/// donor's phase: SERVING only while [`Phase::Serving`].
pub async fn serve_control(
    listener: TcpListener,
    status: Arc<DonorState>,
    limits: ControlLimits,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let mut phases = status.watch_phase();
    // Set before the first connection is accepted: the reporter starts at SERVING.
    let now = *phases.borrow_and_update();
    publish(&reporter, now).await;
    let follower = reporter.clone();
    tokio::spawn(async move {
        while phases.changed().await.is_ok() {
            let now = *phases.borrow_and_update();
            publish(&follower, now).await;
        }
    });
    let tls = status.tls.get().cloned();
    let rules = Arc::new(Rules {
        donor: status.name.clone(),
        stats: Arc::clone(&status.stats),
        tls: tls.clone(),
    });
    let stats = Arc::clone(&status.stats);
    let control =
        DonorControlServer::new(ControlService::new(status, reporter, Arc::clone(&rules)))
            .max_decoding_message_size(limits.max_request)
            .max_encoding_message_size(16 << 20);
    let router = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(limits.per_connection)
        .max_concurrent_streams(u32::try_from(limits.per_connection).unwrap_or(u32::MAX))
        .timeout(limits.request_timeout)
        .max_connection_age(limits.max_connection_age)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .http2_max_header_list_size(16 << 10)
        .add_service(Gate::new(health, Arc::clone(&rules)))
        .add_service(Gate::new(control, rules));
    match tls {
        Some(tls) => {
            let incoming = handshakes(listener, tls, stats, &limits);
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        None => {
            let incoming = bounded_incoming(listener, limits.max_connections);
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
    }
}

/// A connection holding one of the control plane's served slots.
#[derive(Debug)]
pub struct Held<T> {
    io: T,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl<T: Connected> Connected for Held<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Held<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Held<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Accept on `listener`; each connection's TLS handshake runs in its own
/// task, in the pre-auth budget (the oldest evicted when it is full,
/// counted `preauth_evicted`), within `limits.handshake_timeout` shrunk as
/// the budget fills, with the configuration of the moment. A connection
/// whose handshake completes takes one of `limits.max_connections` served
/// slots (none left: closed, `busy`) and goes to tonic. Failures are
/// logged at a bounded rate and counted (`handshake_failed`,
/// `handshake_timeout`).
fn handshakes(
    listener: TcpListener,
    tls: Arc<DonorTls>,
    stats: Arc<Stats>,
    limits: &ControlLimits,
) -> ReceiverStream<std::io::Result<Held<TlsStream<tokio::net::TcpStream>>>> {
    static FAILED: RateLimit = RateLimit::new(5);
    static ACCEPT: RateLimit = RateLimit::new(1);
    let full = limits.handshake_timeout;
    let budget = daemon_runtime::preauth::PreAuth::new(PREAUTH_PER_SOURCE, PREAUTH_TOTAL);
    let served = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let (tx, rx) = tokio::sync::mpsc::channel(limits.max_connections.max(1));
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                () = tx.closed() => return,
                a = listener.accept() => match a {
                    Ok(x) => x,
                    Err(e) => {
                        if let Some(suppressed) = ACCEPT.allow() {
                            tracing::warn!(error = %e, suppressed, "control plane: accept failed");
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Some((stream, ticket, evicted)) = budget.admit_async(peer.ip(), stream) else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            if evicted > 0 {
                stats.refusal("control", "preauth_evicted");
            }
            let deadline = budget.deadline(full);
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.control_config());
            let (tx, stats, served) = (tx.clone(), Arc::clone(&stats), Arc::clone(&served));
            tokio::spawn(async move {
                let done = tokio::time::timeout(deadline, acceptor.accept(stream)).await;
                drop(ticket);
                let (reason, error) = match done {
                    Ok(Ok(io)) => {
                        let Ok(permit) = served.try_acquire_owned() else {
                            stats.refusal("control", "busy");
                            tracing::debug!(%peer, "control plane: at its connection bound; closing");
                            return;
                        };
                        let _ = tx
                            .send(Ok(Held {
                                io,
                                _permit: permit,
                            }))
                            .await;
                        return;
                    }
                    Ok(Err(e)) => ("handshake_failed", e.to_string()),
                    Err(_) => (
                        "handshake_timeout",
                        format!("not done within {} ms", deadline.as_millis()),
                    ),
                };
                stats.refusal("control", reason);
                if let Some(suppressed) = FAILED.allow() {
                    tracing::warn!(
                        %peer,
                        error = %error,
                        suppressed,
                        "control plane: TLS handshake failed (it speaks TLS only and wants a \
                         certificate from the rack CA)"
                    );
                }
            });
        }
    });
    ReceiverStream::new(rx)
}
