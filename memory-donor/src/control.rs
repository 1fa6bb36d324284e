//! The donor's control plane over gRPC (tonic): the standard
//! `grpc.health.v1` service and `engram.control.v1.DonorControl`
//! (ListTables, Stats, Drain), answered from [`DonorStatus`]. It is bound
//! and served before the tables load, so a node sees NOT_SERVING and the
//! load's progress instead of a refused connection.
//!
//! Bounds: a fixed number of control connections (more are closed at
//! once), requests per connection, a per-request timeout, small request
//! messages, and a maximum connection age, so a misbehaving client costs at
//! most its own connection.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use engram_protocol::control as pb;
use engram_protocol::control::donor_control_server::{DonorControl, DonorControlServer};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::status::{DonorStatus, LoadState, Order, Phase};
use crate::swap::{SwapError, SwapRequest};

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
}

impl Default for ControlLimits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            per_connection: 16,
            request_timeout: Duration::from_secs(10),
            max_request: 4 << 10,
            max_connection_age: Duration::from_secs(300),
        }
    }
}

/// `DonorControl` over the donor's status.
#[derive(Debug, Clone)]
pub struct ControlService {
    status: Arc<DonorStatus>,
    health: HealthReporter,
}

impl ControlService {
    /// A service answering from `status` and keeping `health` in step with it.
    pub fn new(status: Arc<DonorStatus>, health: HealthReporter) -> Self {
        Self { status, health }
    }
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
        let started = self.status.request_drain();
        // Before answering: whoever gets this answer then sees NOT_SERVING.
        publish(&self.health, self.status.phase()).await;
        tracing::info!(
            peer = ?request.remote_addr(),
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
        let peer = request.remote_addr();
        let r = request.into_inner();
        let expected = if r.expected_digest.is_empty() {
            None
        } else {
            Some(
                r.expected_digest
                    .parse()
                    .map_err(|e| Status::invalid_argument(format!("expected_digest: {e}")))?,
            )
        };
        if r.path.is_empty() {
            return Err(Status::invalid_argument("path is empty"));
        }
        if self.status.phase() != Phase::Serving {
            return Err(swap_status(&SwapError::NotServing));
        }
        let req = SwapRequest {
            table: r.table_id,
            path: r.path.into(),
            expected,
            in_place: r.in_place,
        };
        tracing::info!(peer = ?peer, table = req.table, path = %req.path.display(), in_place = req.in_place, "swap requested over the control plane");
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.status.order(Order::Swap(req, tx)).is_err() {
            return Err(Status::unavailable("too many orders waiting; try again"));
        }
        let accepted = rx
            .await
            .map_err(|_| Status::unavailable("the donor stopped before answering"))?
            .map_err(|e| swap_status(&e))?;
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
        SwapError::Load(_) => Status::internal(msg),
    }
}

/// Serve health and `DonorControl` on `listener` until `shutdown` resolves.
/// Health follows the donor's phase: SERVING only while [`Phase::Serving`].
pub async fn serve_control(
    listener: TcpListener,
    status: Arc<DonorStatus>,
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
    let control = DonorControlServer::new(ControlService::new(status, reporter))
        .max_decoding_message_size(limits.max_request)
        .max_encoding_message_size(16 << 20);
    tonic::transport::Server::builder()
        .concurrency_limit_per_connection(limits.per_connection)
        .max_concurrent_streams(u32::try_from(limits.per_connection).unwrap_or(u32::MAX))
        .timeout(limits.request_timeout)
        .max_connection_age(limits.max_connection_age)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .http2_max_header_list_size(16 << 10)
        .add_service(health)
        .add_service(control)
        .serve_with_incoming_shutdown(
            cluster_config::daemon::accept::bounded_incoming(listener, limits.max_connections),
            shutdown,
        )
        .await
}
