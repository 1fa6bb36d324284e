//! A memory donor as a row source: one pipelined data-plane connection,
//! made on first use and again after it is lost. A Goodbye stops new
//! lookups at once. The probe asks the donor's control plane (when its
//! address is known; over TLS with the node's certificate when the rack
//! has a PKI) for its health (`grpc.health.v1`, SERVING) and its tables'
//! digests (`ListTables`), then makes a fresh data-plane connection (a
//! restarted donor) and installs it when the donor welcomes us with the
//! pinned versions.

use std::net::SocketAddr;
use std::sync::Arc;

use engram_protocol::TableDigest;
use engram_sync::Mutex;
use tokio::time::Instant;

use super::{FetchFuture, FetchJob, FetchSlot, ProbeFuture, RowSource, SourceError, SourceKind};
use crate::client::{ClientError, ClientOptions, DonorClient, Request};

/// The node's TLS material for donors' control planes: the rack CA and the
/// node's own certificate and key. Equal when the files held the same bytes
/// (a reload keeps the donor's source then).
#[derive(Clone)]
pub struct ControlTls(pub Arc<crate::tls::NodeTls>);

impl PartialEq for ControlTls {
    /// The same node TLS state (its material may be reloaded inside).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for ControlTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        let m = self.0.material();
        f.debug_struct("ControlTls")
            .field("identity", &m.identity)
            .field("cert", &m.files.cert)
            .finish_non_exhaustive()
    }
}

/// A donor reached over TCP.
#[derive(Debug)]
pub struct DonorSource {
    name: String,
    addrs: Vec<SocketAddr>,
    opts: ClientOptions,
    control: Option<SocketAddr>,
    control_tls: Option<ControlTls>,
    current: Mutex<Option<Arc<DonorClient>>>,
    connecting: tokio::sync::Mutex<()>,
    /// One-sided reads of the donor's registered rows, when it serves RDMA
    /// and this node can: lookups use it, and the connection above to learn
    /// regions (and for lookups while RDMA is not usable).
    rdma: Option<super::rdma::RdmaPath>,
    /// The warm-up's Pings ([`RowSource::warm`]): one task, made at the
    /// first warm-up and woken by each (nothing spawned per step).
    pinger: std::sync::OnceLock<Arc<Pinger>>,
}

/// What a warm-up hands its Ping task: the connection to ping.
#[derive(Debug, Default)]
struct Pinger {
    go: tokio::sync::Notify,
    client: Mutex<Option<Arc<DonorClient>>>,
    stop: std::sync::atomic::AtomicBool,
}

impl Pinger {
    /// The Ping task: a Ping on each connection handed over, until the
    /// source is dropped.
    async fn run(self: Arc<Self>) {
        loop {
            self.go.notified().await;
            if self.stop.load(std::sync::atomic::Ordering::Acquire) {
                return;
            }
            let client = self.client.lock().take();
            if let Some(c) = client
                && let Err(e) = c.ping().await
            {
                tracing::debug!(error = %e, "warm-up ping");
            }
        }
    }
}

impl Drop for DonorSource {
    fn drop(&mut self) {
        if let Some(p) = self.pinger.get() {
            p.stop.store(true, std::sync::atomic::Ordering::Release);
            p.go.notify_one();
        }
    }
}

impl DonorSource {
    /// A donor known by `name`, dialled at `addrs` in order, with the tables
    /// (and their pinned digests) this node routes to it in `opts`.
    pub fn new(name: impl Into<String>, addrs: Vec<SocketAddr>, opts: ClientOptions) -> Self {
        Self {
            name: name.into(),
            addrs,
            opts,
            control: None,
            control_tls: None,
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            rdma: None,
            pinger: std::sync::OnceLock::new(),
        }
    }

    /// Read rows over RDMA through `path`.
    pub fn with_rdma(mut self, path: Option<super::rdma::RdmaPath>) -> Self {
        self.rdma = path;
        self
    }

    /// Its RDMA path, if it has one.
    pub fn rdma(&self) -> Option<&super::rdma::RdmaPath> {
        self.rdma.as_ref()
    }

    /// Probe the control plane at `addr` too.
    pub fn with_control(mut self, addr: Option<SocketAddr>) -> Self {
        self.control = addr;
        self
    }

    /// Probe the control plane over TLS as `tls` proves (the donor's
    /// certificate checked against its name); plaintext when `None`.
    pub fn with_control_tls(mut self, tls: Option<ControlTls>) -> Self {
        self.control_tls = tls;
        self
    }

    /// Health SERVING and the tables' digests, from the control plane.
    async fn control_probe(
        &self,
        addr: SocketAddr,
    ) -> Result<Vec<(u32, TableDigest)>, SourceError> {
        use engram_protocol::control::ListTablesRequest;
        use engram_protocol::control::donor_control_client::DonorControlClient;
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_check_response::ServingStatus;
        use tonic_health::pb::health_client::HealthClient;
        let down = |e: String| SourceError::Unavailable(format!("control plane {addr}: {e}"));
        let t = self.opts.connect_timeout;
        let scheme = if self.control_tls.is_some() {
            "https"
        } else {
            "http"
        };
        let mut endpoint = tonic::transport::Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| down(e.to_string()))?
            .connect_timeout(t)
            .timeout(t);
        if let Some(tls) = &self.control_tls {
            endpoint = endpoint
                .tls_config(tls.0.material().grpc_client(&self.name))
                .map_err(|e| down(e.to_string()))?;
        }
        let channel = endpoint.connect().await.map_err(|e| down(e.to_string()))?;
        let health = HealthClient::new(channel.clone())
            .check(HealthCheckRequest {
                service: engram_protocol::control::SERVICE_NAME.into(),
            })
            .await
            .map_err(|e| down(e.to_string()))?
            .into_inner();
        if health.status != ServingStatus::Serving as i32 {
            return Err(down("health is not SERVING".into()));
        }
        let list = DonorControlClient::new(channel)
            .list_tables(ListTablesRequest {})
            .await
            .map_err(|e| down(e.to_string()))?
            .into_inner();
        if list.draining {
            return Err(SourceError::Draining);
        }
        Ok(list
            .tables
            .iter()
            .filter_map(|t| t.digest.parse().ok().map(|d| (t.id, d)))
            .collect())
    }

    fn live(&self) -> Option<Arc<DonorClient>> {
        let cur = self.current.lock();
        cur.as_ref()
            .filter(|c| !c.is_closed() && !c.is_draining())
            .cloned()
    }

    fn install(&self, client: Arc<DonorClient>) {
        *self.current.lock() = Some(client);
    }

    async fn dial(&self) -> Result<DonorClient, ClientError> {
        let mut last = ClientError::Disconnected("no address to dial".into());
        for &addr in &self.addrs {
            match DonorClient::connect(addr, &self.opts).await {
                Ok(c) => return Ok(c),
                // A donor at the wrong version answers the same on every address.
                Err(e @ ClientError::DigestMismatch { .. }) => return Err(e),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// The live connection, or a new one (one dial at a time).
    async fn client(&self) -> Result<Arc<DonorClient>, SourceError> {
        if let Some(c) = self.live() {
            return Ok(c);
        }
        if self.draining() {
            return Err(SourceError::Draining);
        }
        let _one = self.connecting.lock().await;
        if let Some(c) = self.live() {
            return Ok(c);
        }
        let c = Arc::new(self.dial().await?);
        self.install(c.clone());
        Ok(c)
    }

    fn forget(&self, client: &Arc<DonorClient>) {
        let mut cur = self.current.lock();
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, client)) {
            *cur = None;
        }
    }

    /// A lookup into `out`: over RDMA when this donor has a usable path,
    /// else over the connection.
    async fn fetch_into(
        &self,
        table: u32,
        rows: &[u64],
        out: &mut [u8],
        deadline: Instant,
    ) -> Result<(), SourceError> {
        let client = tokio::time::timeout_at(deadline, self.client())
            .await
            .map_err(|_| SourceError::Timeout)??;
        if let Some(path) = &self.rdma
            && let Some(&(_, pinned)) = self.opts.pinned.iter().find(|p| p.0 == table)
        {
            match path
                .fetch(&client, table, pinned, rows, out, deadline)
                .await
            {
                Ok(super::rdma::RdmaOutcome::Read) => return Ok(()),
                Ok(super::rdma::RdmaOutcome::UseStream) => {}
                Err(e) => {
                    if let SourceError::VersionMismatch { .. } = e {
                        self.forget(&client);
                    }
                    return Err(e);
                }
            }
        }
        let res = client
            .lookup_until(&[Request { table, rows }], out, deadline)
            .await
            .map_err(SourceError::from);
        match &res {
            Err(SourceError::VersionMismatch { .. }) => {
                // The Welcome this connection got is stale: the next lookup
                // or probe dials again and reads the donor's versions anew.
                self.forget(&client);
            }
            Err(e) if client.is_closed() && !client.is_draining() => self.lost(&client, e),
            _ => {}
        }
        res
    }

    /// The connection ended under a lookup: the next lookup dials again.
    /// Said once per connection, with the donor's own reason when it sent
    /// one (an error frame before it closed, a QUIC close reason).
    fn lost(&self, client: &Arc<DonorClient>, e: &SourceError) {
        let mut cur = self.current.lock();
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, client)) {
            *cur = None;
            drop(cur);
            tracing::warn!(donor = %self.name, addr = %client.addr(), error = %e, "connection to the donor lost");
        }
    }

    fn draining(&self) -> bool {
        let cur = self.current.lock();
        cur.as_ref().is_some_and(|c| c.poll_draining())
    }
}

impl RowSource for DonorSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> SourceKind {
        SourceKind::Donor
    }

    fn accepting(&self) -> bool {
        !self.draining()
    }

    fn tend(&self) {
        // Reads a Goodbye waiting on the idle connection; a drained
        // connection is closed at once, so the donor's drain can end.
        let _ = self.draining();
    }

    fn fetch<'a>(
        &'a self,
        table: u32,
        rows: &'a [u64],
        mut buf: Vec<u8>,
        deadline: Instant,
    ) -> FetchFuture<'a> {
        Box::pin(async move {
            let res = self.fetch_into(table, rows, &mut buf, deadline).await;
            (res, buf)
        })
    }

    fn fetch_job(self: Arc<Self>, mut job: FetchJob, slot: &mut FetchSlot) {
        slot.set(async move {
            let res = self
                .fetch_into(job.table, &job.rows, &mut job.buf, job.deadline)
                .await;
            (res, job)
        });
    }

    fn warm(&self) {
        // Only a connection already made: a dial is a lookup's to make.
        if let Some(c) = self.live() {
            let pinger = self.pinger.get_or_init(|| {
                let p = Arc::new(Pinger::default());
                tokio::spawn(Arc::clone(&p).run());
                p
            });
            *pinger.client.lock() = Some(c);
            pinger.go.notify_one();
        }
    }

    fn probe(&self) -> ProbeFuture<'_> {
        Box::pin(async move {
            let advertised = match self.control {
                Some(addr) => Some(self.control_probe(addr).await?),
                None => None,
            };
            // Always a fresh connection: it reads the donor's versions anew
            // and proves it accepts clients now (a restarted donor).
            let fresh = Arc::new(self.dial().await?);
            fresh.ping().await?;
            let tables: Vec<(u32, TableDigest)> = advertised.unwrap_or_else(|| {
                fresh
                    .tables()
                    .iter()
                    .map(|t| (t.table_id, t.digest))
                    .collect()
            });
            // A probe runs only while the source is in trouble (breaker not
            // closed, excluded, draining): the connection lookups used may
            // be the trouble (stuck in retransmission after a partition), so
            // the one just proven takes its place. Lookups still on the old
            // one finish or time out on it.
            self.install(fresh);
            Ok(tables)
        })
    }
}
