//! A donor's RDMA path: one-sided READs of its registered rows, beside its
//! data-plane connection. The connection (TLS or QUIC) is the authenticated
//! channel: the node learns each table's region and a queue-pair token
//! there (RegionQuery, PROTOCOL.md 3.10), connects a queue pair with the
//! token, and reads a lookup's rows and their check words in one doorbell.
//!
//! What happens when:
//! - the donor offers no RDMA (`unavailable`), or the queue pair cannot be
//!   connected: lookups go over the connection, as without RDMA; RDMA is
//!   tried again after a backoff (50 ms doubling to 2 s) or, for a donor
//!   without RDMA, after [`UNAVAILABLE_RETRY`];
//! - a READ fails (remote access error after a swap or restart, retries
//!   exceeded, a flushed queue pair) or gets no completion by the deadline:
//!   the fetch fails like any source's, so the router fails over; the queue
//!   pair is dropped and the next fetch learns the region again;
//! - a row fails its check word: the rows are discarded (a corrupt answer)
//!   and the region is learned again;
//! - the region holds another version than the node pins: a version
//!   mismatch, never a row of it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use engram_protocol::{ErrorCode, ROW_BYTES, TableDigest};
use engram_rdma::plan::{Fault, Outcome};
use engram_rdma::reader::{DEFAULT_SLOT_ROWS, Reader, Session, StartError, Step, qp_options};
use engram_rdma::verbs::{Fabric, Provider};
use engram_sync::{Mutex, MutexGuard};
use tokio::time::Instant;

use super::SourceError;
use crate::client::{ClientError, DonorClient};

/// How long a node reads over the connection after a donor said it serves
/// no RDMA, before it asks again.
pub const UNAVAILABLE_RETRY: Duration = Duration::from_secs(5);

/// Polling without sleeping for this long before sleeping between polls.
const SPIN: Duration = Duration::from_micros(100);
/// Sleep between polls after the spin.
const NAP: Duration = Duration::from_micros(20);

/// A read in flight that its fetch may abandon by being dropped (the
/// router moves on when another source answers first): the reader frees
/// its slot when its completion comes.
struct Orphan<'a> {
    path: &'a RdmaPath,
    read: Option<engram_rdma::reader::Read>,
}

impl Drop for Orphan<'_> {
    fn drop(&mut self) {
        if let Some(read) = self.read.take()
            && let Some(r) = self.path.state().reader.as_mut()
        {
            r.orphan(read);
        }
    }
}

/// What a fetch over RDMA came to.
#[derive(Debug)]
pub enum RdmaOutcome {
    /// The rows are in the caller's buffer.
    Read,
    /// RDMA is not usable now: read over the connection instead.
    UseStream,
}

#[derive(Debug, Default)]
struct State {
    session: Session,
    reader: Option<Reader>,
    unavailable_until: Option<std::time::Instant>,
    warned: bool,
}

/// Where an RDMA path counts its lookups and faults.
#[derive(Debug, Clone)]
pub struct RdmaCounters {
    read: prometheus_client::metrics::counter::Counter,
    stream: prometheus_client::metrics::counter::Counter,
    faults: prometheus_client::metrics::family::Family<
        crate::metrics::RdmaLabels,
        prometheus_client::metrics::counter::Counter,
    >,
}

impl RdmaCounters {
    /// Counters of donor `source` in `m`.
    pub fn new(m: &crate::metrics::NodeMetrics, source: &str) -> Self {
        let label = |kind: &str| crate::metrics::RdmaLabels {
            source: source.to_string(),
            kind: kind.to_string(),
        };
        // One statement each: a family's guard lives to the end of its
        // statement, and a second `get_or_create` meanwhile would wait on it.
        let read = m.rdma_lookups.get_or_create(&label("rdma")).clone();
        let stream = m.rdma_lookups.get_or_create(&label("stream")).clone();
        Self {
            read,
            stream,
            faults: m.rdma_faults.clone(),
        }
    }
}

/// Tear a queue pair's reader down off the async workers (and after the
/// path's lock is let go): destroying a queue pair and deregistering its
/// buffer block in the driver. Outside a runtime, here.
fn retire(reader: Option<Reader>) {
    let Some(r) = reader else { return };
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn_blocking(move || drop(r));
        }
        Err(_) => drop(r),
    }
}

/// A donor's RDMA path.
#[derive(Debug)]
pub struct RdmaPath {
    counters: RdmaCounters,
    donor: String,
    addr: SocketAddr,
    provider: Arc<dyn Provider>,
    connect_timeout: Duration,
    /// The donor's fabric settings, for each queue pair made to it.
    fabric: Fabric,
    state: Mutex<State>,
    connecting: tokio::sync::Mutex<()>,
}

fn fault_error(donor: &str, f: Fault) -> SourceError {
    match f {
        Fault::Timeout => SourceError::Timeout,
        Fault::PeerGone => SourceError::Unavailable(format!("rdma to {donor}: {f}")),
        Fault::Corrupt { .. } => SourceError::Corrupt(format!("rdma from {donor}: {f}")),
        Fault::Revoked | Fault::Rejected | Fault::Local => {
            SourceError::Failed(format!("rdma from {donor}: {f}"))
        }
    }
}

impl RdmaPath {
    /// The path to `donor`'s RDMA listener at `addr`, through `provider`,
    /// counting into `counters`.
    pub fn new(
        donor: impl Into<String>,
        addr: SocketAddr,
        provider: Arc<dyn Provider>,
        connect_timeout: Duration,
        fabric: Fabric,
        counters: RdmaCounters,
    ) -> Self {
        Self {
            counters,
            donor: donor.into(),
            addr,
            provider,
            connect_timeout,
            fabric,
            state: Mutex::new(State::default()),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// The listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Work requests, doorbells and signalled requests posted on the
    /// current queue pair (none when there is none).
    pub fn counts(&self) -> Option<engram_rdma::reader::Counts> {
        self.state().reader.as_ref().map(Reader::counts)
    }

    fn use_stream(&self, why: &str) -> Result<RdmaOutcome, SourceError> {
        let mut st = self.state();
        if !st.warned {
            st.warned = true;
            tracing::warn!(
                donor = %self.donor,
                "rdma://{}: {why}; reading over the data-plane connection meanwhile",
                self.addr
            );
        }
        Ok(RdmaOutcome::UseStream)
    }

    /// Fetch `rows` of `table` (pinned at `pinned`) into `out` by
    /// `deadline`, learning regions over `client`.
    pub async fn fetch(
        &self,
        client: &DonorClient,
        table: u32,
        pinned: TableDigest,
        rows: &[u64],
        out: &mut [u8],
        deadline: Instant,
    ) -> Result<RdmaOutcome, SourceError> {
        let r = self
            .fetch_inner(client, table, pinned, rows, out, deadline)
            .await;
        match &r {
            Ok(RdmaOutcome::Read) => {
                self.counters.read.inc();
            }
            Ok(RdmaOutcome::UseStream) => {
                self.counters.stream.inc();
            }
            Err(_) => {}
        }
        r
    }

    async fn fetch_inner(
        &self,
        client: &DonorClient,
        table: u32,
        pinned: TableDigest,
        rows: &[u64],
        out: &mut [u8],
        deadline: Instant,
    ) -> Result<RdmaOutcome, SourceError> {
        // Rows of another encoding than V4.1's are not offered over RDMA
        // (docs/models.md): such a table's lookups take the stream.
        if client.row_bytes(table) != ROW_BYTES {
            return Ok(RdmaOutcome::UseStream);
        }
        if out.len() != rows.len() * ROW_BYTES {
            return Err(SourceError::BadRequest(format!(
                "output buffer is {} bytes, {} rows need {}",
                out.len(),
                rows.len(),
                rows.len() * ROW_BYTES
            )));
        }
        loop {
            let now = std::time::Instant::now();
            let step = {
                let st = self.state();
                if st.unavailable_until.is_some_and(|t| t > now) {
                    return Ok(RdmaOutcome::UseStream);
                }
                st.session.step(table, now)
            };
            match step {
                Step::Backoff(_) => return Ok(RdmaOutcome::UseStream),
                Step::Learn => {
                    if let Some(done) = self.learn(client, table, pinned, deadline).await {
                        return done;
                    }
                }
                Step::Connect(token) => {
                    if let Some(done) = self.connect_queue_pair(token, deadline).await {
                        return done;
                    }
                }
                Step::Read(layout) => {
                    return self.read_rows(table, &layout, rows, out, deadline).await;
                }
            }
        }
    }

    /// Ask the donor for the table's region over the stream: `None` when
    /// learned (read next), else what the lookup ends with (the stream, or
    /// a version mismatch).
    async fn learn(
        &self,
        client: &DonorClient,
        table: u32,
        pinned: TableDigest,
        deadline: Instant,
    ) -> Option<Result<RdmaOutcome, SourceError>> {
        match client.region(table, deadline).await {
            Ok(region) => {
                let mut st = self.state();
                st.unavailable_until = None;
                if let Err(w) = st.session.learned(&region, &pinned) {
                    return Some(Err(SourceError::VersionMismatch {
                        table,
                        detail: format!(
                            "its RDMA region holds digest {}, not the pinned {}",
                            w.region, w.pinned
                        ),
                    }));
                }
            }
            Err(ClientError::Donor {
                code: ErrorCode::Unavailable | ErrorCode::Unauthorized,
                message,
            }) => {
                self.state().unavailable_until =
                    Some(std::time::Instant::now() + UNAVAILABLE_RETRY);
                return Some(self.use_stream(&message));
            }
            Err(e) => return Some(Err(e.into())),
        }
        None
    }

    /// Connect a queue pair presenting `token` (one connect at a time):
    /// `None` once connected, else the stream (connecting failed).
    async fn connect_queue_pair(
        &self,
        token: [u8; 16],
        deadline: Instant,
    ) -> Option<Result<RdmaOutcome, SourceError>> {
        let _one = self.connecting.lock().await;
        if self.state().session.is_connected() {
            return None;
        }
        let (provider, addr) = (Arc::clone(&self.provider), self.addr);
        let budget = deadline
            .saturating_duration_since(Instant::now())
            .min(self.connect_timeout);
        let opts = qp_options(budget, self.fabric);
        let made = tokio::task::spawn_blocking(move || provider.connect(addr, &token, &opts)).await;
        match made {
            Ok(Ok(qp)) => {
                let mut st = self.state();
                let old = st.reader.replace(Reader::new(qp, DEFAULT_SLOT_ROWS));
                st.session.connected();
                st.warned = false;
                drop(st);
                retire(old);
                tracing::info!(donor = %self.donor, "rdma://{addr}: queue pair connected");
            }
            Ok(Err(e)) => {
                self.state()
                    .session
                    .connect_failed(std::time::Instant::now());
                return Some(self.use_stream(&format!("connecting a queue pair: {e}")));
            }
            Err(e) => {
                self.state()
                    .session
                    .connect_failed(std::time::Instant::now());
                return Some(self.use_stream(&format!("connecting a queue pair: {e}")));
            }
        }
        None
    }

    /// Read `rows` over RDMA with `layout`, a slot's worth at a time, into
    /// `out`; a fault is counted, kills the queue pair where it must, and
    /// fails the lookup over.
    async fn read_rows(
        &self,
        table: u32,
        layout: &engram_rdma::plan::Layout,
        rows: &[u64],
        out: &mut [u8],
        deadline: Instant,
    ) -> Result<RdmaOutcome, SourceError> {
        let per = self
            .state()
            .reader
            .as_ref()
            .map_or(DEFAULT_SLOT_ROWS, Reader::slot_rows);
        for (chunk, dst) in rows.chunks(per).zip(out.chunks_mut(per * ROW_BYTES)) {
            if let Err(f) = self.read(chunk, layout, dst, deadline).await {
                let mut st = self.state();
                st.session.fault(table, f);
                let dead = if f.kills_queue_pair() {
                    st.reader.take()
                } else {
                    None
                };
                drop(st);
                retire(dead);
                tracing::debug!(donor = %self.donor, table, "rdma read failed: {f}");
                self.counters
                    .faults
                    .get_or_create(&crate::metrics::RdmaLabels {
                        source: self.donor.clone(),
                        kind: f.name().into(),
                    })
                    .inc();
                return Err(fault_error(&self.donor, f));
            }
        }
        Ok(RdmaOutcome::Read)
    }

    /// One read of at most a slot's rows: start it (waiting for a free
    /// slot), poll until it completes or the deadline passes, then check
    /// and copy the rows.
    async fn read(
        &self,
        rows: &[u64],
        layout: &engram_rdma::plan::Layout,
        out: &mut [u8],
        deadline: Instant,
    ) -> Result<(), Fault> {
        let began = Instant::now();
        let mut read = Orphan {
            path: self,
            read: None,
        };
        read.read = Some(loop {
            let started = {
                let mut st = self.state();
                let Some(r) = st.reader.as_mut() else {
                    return Err(Fault::PeerGone);
                };
                r.poll();
                r.start(rows, layout)
            };
            match started {
                Ok(read) => break read,
                Err(StartError::Busy) if Instant::now() < deadline => {
                    tokio::task::yield_now().await;
                }
                Err(StartError::Busy) => return Err(Fault::Timeout),
                Err(StartError::Dead(f)) => return Err(f),
                Err(StartError::Plan(_)) => return Err(Fault::Local),
                Err(StartError::Post(_)) => return Err(Fault::PeerGone),
            }
        });
        loop {
            {
                let mut st = self.state();
                let Some(r) = st.reader.as_mut() else {
                    return Err(Fault::PeerGone);
                };
                r.poll();
                let Some(this) = read.read.as_ref() else {
                    return Err(Fault::Local);
                };
                match r.outcome(this) {
                    Outcome::Pending if Instant::now() >= deadline => {
                        if let Some(this) = read.read.take() {
                            r.abandon(this);
                        }
                        return Err(Fault::Timeout);
                    }
                    Outcome::Pending => {}
                    Outcome::Done => {
                        return match read.read.take() {
                            Some(this) => r.finish(this, rows, layout, out),
                            None => Err(Fault::Local),
                        };
                    }
                    Outcome::Failed(f) => {
                        if let Some(this) = read.read.take() {
                            r.release(this);
                        }
                        return Err(f);
                    }
                }
            }
            if began.elapsed() < SPIN {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(NAP.min(deadline.saturating_duration_since(Instant::now())))
                    .await;
            }
        }
    }
}
