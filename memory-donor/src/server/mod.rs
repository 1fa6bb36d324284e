//! The donor's data plane over TCP, TLS and QUIC (and the host socket,
//! `host`). Three layers: the codec (`engram_protocol`), the connection
//! (`conn`: socket <-> frames, buffers, timeouts, one OS thread per TCP or
//! TLS connection; `quic`: a task per stream) and the handler (`handler`:
//! frame -> answer). `run` accepts connections up to a bound and, when the
//! shutdown future resolves, drains: Goodbye to every client, in-flight work
//! finishes, and stragglers are closed at the drain deadline.
//!
//! What can change while serving: the tables (a hot swap replaces one under
//! a write lock; every lookup holds the read lock from its digest check to
//! its last row, so no answer mixes versions), and the configuration (new
//! connections take a snapshot of it; the connection bound can be raised).

mod conn;
mod ended;
mod handler;
pub mod host;
mod pump;
pub mod quic;

use std::collections::HashMap;
use std::future::Future;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use daemon_runtime::logging::RateLimit;
use daemon_runtime::preauth::{PreAuth, Ticket};
use engram_protocol::{Goodbye, Limits};
use engram_sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

pub use crate::stats::Stats;
use crate::tls::DonorTls;
use engram_store::resident::ResidentTable;

/// How the data plane behaves.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Name announced in Welcome.
    pub name: String,
    /// Frame, row and section caps.
    pub limits: Limits,
    /// Most open connections; further ones get `Busy` and are closed.
    pub max_connections: usize,
    /// Time a new connection has to send Hello.
    pub hello_timeout: Duration,
    /// A ready connection silent this long is closed (zero: never).
    pub idle_timeout: Duration,
    /// A write blocked this long (a client not reading) closes the connection.
    pub write_timeout: Duration,
    /// How long a drain waits for clients to finish before closing them.
    pub drain_timeout: Duration,
    /// Credential every Hello must carry, if set.
    pub credential: Option<Vec<u8>>,
    /// Busy-poll: before a connection thread sleeps in a read, it checks
    /// the socket without sleeping for up to this long (zero: off).
    pub busy_poll: Duration,
}

impl ServerConfig {
    /// Defaults for everything but the name: the cluster config's own
    /// (`cluster_config::DEFAULT_MAX_CONNECTIONS` and the timeouts beside it).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            limits: Limits::default(),
            max_connections: cluster_config::DEFAULT_MAX_CONNECTIONS,
            hello_timeout: Duration::from_millis(cluster_config::DEFAULT_HELLO_TIMEOUT_MS),
            idle_timeout: Duration::from_millis(cluster_config::DEFAULT_IDLE_TIMEOUT_MS),
            write_timeout: Duration::from_millis(cluster_config::DEFAULT_WRITE_TIMEOUT_MS),
            drain_timeout: Duration::from_millis(cluster_config::DEFAULT_DRAIN_TIMEOUT_MS),
            credential: None,
            busy_poll: Duration::ZERO,
        }
    }
}

/// How long a connection thread polls its socket, without sleeping, after
/// answering a Ping (or `busy_poll`, when longer). A node pings each
/// table's first donor a few hundred microseconds before a step that
/// needs its rows (its warm-up, `--warm-us`), so the lookup finds this
/// thread awake instead of paying for its wake-up inside the step's
/// window. The poll ends at the next byte; a client that pings without
/// looking up costs at most this much of a core per Ping.
pub const AFTER_PING_POLL: Duration = Duration::from_millis(1);

/// State shared by every connection.
#[derive(Debug)]
pub struct Shared {
    config: RwLock<Arc<ServerConfig>>,
    tables: RwLock<Vec<ResidentTable>>,
    /// Counters (shared with the control plane, which exists before the tables do).
    pub stats: Arc<Stats>,
    draining: AtomicBool,
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    next_conn: AtomicU64,
    /// One permit per authenticated connection; `permits_total` of them exist.
    permits: Arc<Semaphore>,
    /// TCP and TLS connections before they authenticate: a budget of their own.
    preauth: Arc<PreAuth>,
    permits_total: AtomicUsize,
    tls: std::sync::OnceLock<Arc<DonorTls>>,
    /// QUIC connections open (also counted in `stats.open`).
    quic_open: AtomicUsize,
    /// The open QUIC connections, by id (their sessions are re-checked).
    quic_conns: Mutex<HashMap<u64, quinn::Connection>>,
    /// The certificate chain each identity granted RDMA tokens proved, to
    /// check its queue pairs again at each recheck.
    rdma_grantees: Mutex<HashMap<String, Chain>>,
    /// The QUIC endpoints being served (a certificate reload reaches them here).
    quic_endpoints: Mutex<Vec<quinn::Endpoint>>,
    /// True once a drain started: QUIC sessions say Goodbye on their own streams.
    drain_tx: tokio::sync::watch::Sender<bool>,
    /// The RDMA region book, when the donor serves RDMA.
    rdma: std::sync::OnceLock<Arc<engram_rdma::book::RegionBook>>,
    /// Where new versions' RDMA check words are kept for the next start.
    rdma_store: std::sync::OnceLock<Arc<crate::fdstore::FdStore>>,
}

/// What applying a new configuration could not change live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotApplied(pub Vec<String>);

/// What the drain needs to reach a connection owned by another thread.
#[derive(Debug)]
struct Conn {
    id: u64,
    peer: SocketAddr,
    stream: TcpStream,
    write_lock: Mutex<()>,
    /// The TLS session of a `tls://` connection.
    tls: Option<Mutex<TlsSession>>,
}

/// A `tls://` connection's session: rustls' handshake, then records sealed
/// and opened in place (cluster_config::records) with the keys it handed
/// over, and the client's certificate chain kept for re-checks.
#[derive(Debug)]
enum TlsSession {
    Handshaking(Box<cluster_config::records::Handshake>),
    Open {
        records: Box<cluster_config::records::Records>,
        chain: Vec<rustls::pki_types::CertificateDer<'static>>,
    },
    /// The handshake failed (or is being run by the connection's thread,
    /// which holds the session meanwhile).
    Failed,
}

impl Shared {
    /// Shared state for these tables, with fresh counters.
    pub fn new(config: ServerConfig, tables: Vec<ResidentTable>) -> Arc<Self> {
        Self::with_stats(config, tables, Arc::default())
    }

    /// Shared state for these tables, counting into `stats`.
    pub fn with_stats(
        config: ServerConfig,
        tables: Vec<ResidentTable>,
        stats: Arc<Stats>,
    ) -> Arc<Self> {
        let max = config.max_connections.max(1);
        Arc::new(Self {
            config: RwLock::new(Arc::new(config)),
            tables: RwLock::new(tables),
            stats,
            draining: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            permits: Arc::new(Semaphore::new(max)),
            preauth: PreAuth::new(PREAUTH_PER_SOURCE, PREAUTH_TOTAL),
            permits_total: AtomicUsize::new(max),
            tls: std::sync::OnceLock::new(),
            rdma: std::sync::OnceLock::new(),
            rdma_store: std::sync::OnceLock::new(),
            quic_open: AtomicUsize::new(0),
            quic_conns: Mutex::new(HashMap::new()),
            rdma_grantees: Mutex::new(HashMap::new()),
            quic_endpoints: Mutex::new(Vec::new()),
            drain_tx: tokio::sync::watch::channel(false).0,
        })
    }

    fn drain_signal(&self) -> tokio::sync::watch::Receiver<bool> {
        self.drain_tx.subscribe()
    }

    /// Serve TLS and QUIC with this state (once, before `run`).
    pub fn set_tls(&self, tls: Arc<DonorTls>) {
        let _ = self.tls.set(tls);
    }

    /// After a certificate reload: new QUIC handshakes use the new
    /// material too (TLS connections take it per connection already).
    pub fn refresh_quic(&self) {
        let endpoints = self.quic_endpoints.lock().clone();
        for e in endpoints {
            match quic::server_config(self) {
                Ok(c) => e.set_server_config(Some(c)),
                Err(err) => {
                    tracing::error!(error = %err, "QUIC endpoint keeps its old certificate")
                }
            }
        }
    }

    /// Serve RDMA regions from `book` (once); new versions' check words
    /// are kept in `store`.
    pub fn set_rdma(
        &self,
        book: Arc<engram_rdma::book::RegionBook>,
        store: Option<Arc<crate::fdstore::FdStore>>,
    ) {
        let _ = self.rdma.set(book);
        if let Some(s) = store {
            let _ = self.rdma_store.set(s);
        }
    }

    /// The RDMA region book, when the donor serves RDMA.
    pub fn rdma(&self) -> Option<&Arc<engram_rdma::book::RegionBook>> {
        self.rdma.get()
    }

    /// Bring the RDMA regions in line with the tables served now (after a
    /// swap): new versions registered, old ones deregistered. Computes
    /// check words: call it off the async threads.
    pub fn sync_rdma(&self) {
        if let Some(book) = self.rdma.get() {
            let tables = crate::rdma::snapshot(&self.tables());
            crate::rdma::sync_kept(book, tables, self.rdma_store.get().map(|s| &**s));
        }
    }

    /// The TLS state, when the donor has one.
    pub fn tls(&self) -> Option<&Arc<DonorTls>> {
        self.tls.get()
    }

    /// The configuration now (a connection keeps the one it started with).
    pub fn config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.config.read())
    }

    /// Apply `new` to connections accepted from now on. The name cannot
    /// change, and the connection bound can only be raised live; what was
    /// not applied is returned.
    pub fn set_config(&self, mut new: ServerConfig) -> NotApplied {
        let old = self.config();
        let mut kept = Vec::new();
        if new.name != old.name {
            kept.push(format!(
                "name {:?} -> {:?} (restart to rename)",
                old.name, new.name
            ));
            new.name.clone_from(&old.name);
        }
        let total = self.permits_total.load(Ordering::Relaxed);
        let want = new.max_connections.max(1);
        if want > total {
            self.permits.add_permits(want - total);
            self.permits_total.store(want, Ordering::Relaxed);
        } else if want < total {
            kept.push(format!(
                "max_connections {total} -> {want} (lowering takes effect at restart)"
            ));
            new.max_connections = total;
        }
        *self.config.write() = Arc::new(new);
        NotApplied(kept)
    }

    /// The tables, read-locked: hold the guard for as long as one answer
    /// must see one version of them.
    pub fn tables(&self) -> RwLockReadGuard<'_, Vec<ResidentTable>> {
        self.tables.read()
    }

    /// The tables, write-locked (a swap). Lookups wait while it is held:
    /// keep it to a pointer swap, and drop replaced tables after releasing it.
    pub fn tables_mut(&self) -> RwLockWriteGuard<'_, Vec<ResidentTable>> {
        self.tables.write()
    }

    fn conns(&self) -> MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        self.conns.lock()
    }

    /// Open connections (TCP, TLS and QUIC).
    pub fn open_connections(&self) -> usize {
        self.conns().len() + self.quic_open.load(Ordering::Relaxed)
    }

    /// Re-check every live TLS and QUIC session against the TLS state of
    /// now (the CA loaded, the certificate's validity at this moment, the
    /// access rules) and cut each that no longer passes: Goodbye then the
    /// close over TLS, CONNECTION_CLOSE (code 8, `unauthorized`, with the
    /// reason) over QUIC. Logged and counted (`reason="revoked"`); returns
    /// how many were cut. Blocking (a Goodbye may wait for a write lock).
    pub fn recheck_sessions(&self) -> usize {
        use crate::tls::Plane;
        let Some(tls) = self.tls() else {
            return 0;
        };
        let mut cut = 0;
        let conns: Vec<Arc<Conn>> = self.conns().values().cloned().collect();
        for c in conns {
            let Some(session) = &c.tls else { continue };
            let chain: Option<Vec<rustls::pki_types::CertificateDer<'static>>> =
                match &*session.lock() {
                    TlsSession::Open { chain, .. } => Some(chain.clone()),
                    _ => None,
                };
            let Some(chain) = chain else { continue };
            if let Err(why) = tls.still_admits(&chain, Plane::Data) {
                tracing::warn!(conn = c.id, peer = %c.peer, "TLS session cut: {why}");
                self.stats.refusal("data", "revoked");
                let mut bye = Vec::new();
                Goodbye { grace_ms: 0 }.encode(&mut bye);
                send_goodbye(
                    &c,
                    &bye,
                    std::time::Instant::now() + Duration::from_millis(100),
                );
                let _ = c.stream.shutdown(std::net::Shutdown::Both);
                cut += 1;
            }
        }
        let quic: Vec<(u64, quinn::Connection)> = self
            .quic_conns
            .lock()
            .iter()
            .map(|(id, c)| (*id, c.clone()))
            .collect();
        cut += self.recheck_rdma(tls);
        for (id, c) in quic {
            let chain = c
                .peer_identity()
                .and_then(|any| {
                    any.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                        .ok()
                })
                .map(|b| *b)
                .unwrap_or_default();
            if let Err(why) = tls.still_admits(&chain, Plane::Data) {
                tracing::warn!(conn = id, peer = %c.remote_address(), "QUIC session cut: {why}");
                self.stats.refusal("data", "revoked");
                let code = engram_protocol::ErrorCode::Unauthorized.to_u16();
                c.close(quinn::VarInt::from_u32(u32::from(code)), why.as_bytes());
                cut += 1;
            }
        }
        cut
    }

    /// Remember that `identity` (proved by `chain`) was granted an RDMA
    /// token, so its queue pairs are checked again with the sessions.
    pub fn rdma_granted(&self, identity: &str, chain: &Chain) {
        let mut g = self.rdma_grantees.lock();
        if g.get(identity) != Some(chain) {
            g.insert(identity.to_owned(), Arc::clone(chain));
        }
    }

    /// Disconnect the RDMA queue pairs (and drop the tokens) of every
    /// identity whose certificate no longer passes; returns how many queue
    /// pairs were cut.
    fn recheck_rdma(&self, tls: &DonorTls) -> usize {
        let Some(book) = self.rdma() else { return 0 };
        let mut cut = 0;
        for owner in book.owners() {
            let chain = self.rdma_grantees.lock().get(&*owner).cloned();
            let verdict = match &chain {
                Some(chain) => tls.still_admits(chain, crate::tls::Plane::Data).map(|_| ()),
                None => Err("no certificate on record".to_string()),
            };
            if let Err(why) = verdict {
                let qps = book.revoke(&owner);
                self.rdma_grantees.lock().remove(&*owner);
                tracing::warn!(identity = %owner, queue_pairs = qps, "RDMA access cut: {why}");
                self.stats.refusal("rdma", "revoked");
                cut += qps;
            }
        }
        cut
    }

    /// True once a drain started.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// One of the `max_connections` slots, for a connection that has
    /// authenticated; `None` at the bound.
    fn served_slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        Arc::clone(&self.permits).try_acquire_owned().ok()
    }

    /// The bound on authenticated connections now.
    fn max_connections(&self) -> usize {
        self.permits_total.load(Ordering::Relaxed)
    }
}

/// Where a TCP or TLS connection stands against the donor's bounds: in the
/// pre-auth budget until it authenticates, then in a served slot.
#[derive(Debug)]
enum Slot {
    /// Held for its place in the budget (dropping it frees the place).
    PreAuth { _ticket: Ticket },
    /// Held for the served slot (counted in `connections_open` meanwhile).
    Served { _slot: ServedSlot },
}

/// A served slot: its permit, and its count in `stats.open` while held.
#[derive(Debug)]
struct ServedSlot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    stats: Arc<Stats>,
}

impl ServedSlot {
    fn new(permit: tokio::sync::OwnedSemaphorePermit, stats: &Arc<Stats>) -> Self {
        stats.open.fetch_add(1, Ordering::Relaxed);
        Self {
            _permit: permit,
            stats: Arc::clone(stats),
        }
    }
}

impl Drop for ServedSlot {
    fn drop(&mut self) {
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Slot {
    /// Move an authenticated connection to a served slot (a no-op once
    /// there); false when the donor is at `max_connections`.
    fn promote(&mut self, shared: &Shared) -> bool {
        if matches!(self, Self::Served { .. }) {
            return true;
        }
        match shared.served_slot() {
            Some(p) => {
                *self = Self::Served {
                    _slot: ServedSlot::new(p, &shared.stats),
                };
                true
            }
            None => false,
        }
    }
}

/// Data-plane connections before authentication from one source address
/// at once (see [`daemon_runtime::preauth`]).
pub const PREAUTH_PER_SOURCE: usize = 16;
/// Data-plane connections before authentication at once, from every source.
pub const PREAUTH_TOTAL: usize = 128;

/// A client's certificate chain, as it presented it.
pub type Chain = Arc<[rustls::pki_types::CertificateDer<'static>]>;

/// How often live sessions are checked again against the TLS state.
pub const RECHECK_EVERY: Duration = Duration::from_secs(1);

/// Per-connection warnings: a flood of connections must not flood the journal.
static CONN_WARN: RateLimit = RateLimit::new(5);
static ACCEPT_WARN: RateLimit = RateLimit::new(1);

fn spawn_connection(
    shared: &Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    slot: Slot,
    tls: bool,
) {
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let tls = match (tls, shared.tls()) {
        (false, _) => None,
        (true, Some(t)) => match cluster_config::records::Handshake::server(t.data_config()) {
            Ok(s) => Some(Mutex::new(TlsSession::Handshaking(Box::new(s)))),
            Err(e) => {
                if let Some(suppressed) = CONN_WARN.allow() {
                    tracing::warn!(%peer, error = %e, suppressed, "cannot start a TLS session; dropping connection");
                }
                return;
            }
        },
        (true, None) => {
            tracing::error!(%peer, "a TLS listener without TLS material; dropping connection");
            return;
        }
    };
    let write_half = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            if let Some(suppressed) = CONN_WARN.allow() {
                tracing::warn!(%peer, error = %e, suppressed, "cannot clone accepted socket; dropping connection");
            }
            return;
        }
    };
    let conn = Arc::new(Conn {
        id,
        peer,
        stream: write_half,
        write_lock: Mutex::new(()),
        tls,
    });
    shared.conns().insert(id, Arc::clone(&conn));
    shared.stats.connections.fetch_add(1, Ordering::Relaxed);
    let shared2 = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name(format!("conn-{id}"))
        .spawn(move || {
            // The slot is freed inside, before the peer sees the close: a
            // client that saw it and reconnects at once finds room.
            conn::serve(stream, Arc::clone(&conn), Arc::clone(&shared2), slot);
            shared2.conns().remove(&id);
            // Close now, whoever else holds the socket (a drain in progress).
            let _ = conn.stream.shutdown(std::net::Shutdown::Both);
        });
    if let Err(e) = spawned {
        if let Some(suppressed) = CONN_WARN.allow() {
            tracing::warn!(conn = id, %peer, error = %e, suppressed, "cannot start a connection thread; dropping connection");
        }
        shared.conns().remove(&id);
    }
}

/// A bound data-plane listener.
#[derive(Debug)]
pub enum Listener {
    /// Plain TCP.
    Tcp(TcpListener),
    /// TLS 1.3 over TCP (needs [`Shared::set_tls`]).
    Tls(TcpListener),
    /// QUIC (needs [`Shared::set_tls`]; see [`quic::server_config`]).
    Quic(quinn::Endpoint),
}

/// Accept and serve on `listeners` until `shutdown` resolves, then drain.
pub async fn run(
    listeners: Vec<Listener>,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::clone(&shared.permits);
    let sweeper = tokio::spawn(recheck_every_second(Arc::clone(&shared)));
    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut accepters = Vec::new();
    let mut quic = Vec::new();
    for listener in listeners {
        let (listener, tls) = match listener {
            Listener::Tcp(l) => (l, false),
            Listener::Tls(l) => (l, true),
            Listener::Quic(endpoint) => {
                quic.push(endpoint.clone());
                shared.quic_endpoints.lock().push(endpoint.clone());
                accepters.push(tokio::spawn(quic::accept_loop(
                    endpoint,
                    Arc::clone(&shared),
                    Arc::clone(&permits),
                    stop_tx.subscribe(),
                )));
                continue;
            }
        };
        accepters.push(tokio::spawn(accept_loop(
            listener,
            tls,
            Arc::clone(&shared),
            stop_tx.subscribe(),
        )));
    }
    shutdown.await;
    sweeper.abort();
    let _ = stop_tx.send(());
    for a in accepters {
        let _ = a.await;
    }
    drain(&shared, &quic).await;
    for endpoint in quic {
        endpoint.close(quinn::VarInt::from_u32(0), b"donor stopped");
    }
}

/// Every second, live TLS and QUIC sessions are checked again: a
/// certificate's expiry ends its sessions then, and a reload's new CA or
/// access rules reach the open ones (SIGHUP also sweeps at once).
async fn recheck_every_second(shared: Arc<Shared>) {
    let mut every = tokio::time::interval(RECHECK_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let sh = Arc::clone(&shared);
        let _ = tokio::task::spawn_blocking(move || sh.recheck_sessions()).await;
    }
}

/// Accept TCP (or, `tls`, TLS) connections until `stop`: each to a thread
/// of its own, counted against the pre-auth budget until it authenticates.
async fn accept_loop(
    listener: TcpListener,
    tls: bool,
    shared: Arc<Shared>,
    mut stop: tokio::sync::broadcast::Receiver<()>,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.recv() => return,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                if let Some(suppressed) = ACCEPT_WARN.allow() {
                    tracing::warn!(error = %e, suppressed, "accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Before authentication a connection counts against the
        // pre-auth budget only (a full one evicts its oldest); it
        // takes a served slot once it proves who it is.
        let Ok(stream) = stream.into_std() else {
            continue;
        };
        let _ = stream.set_nonblocking(false);
        let Ok(handle) = stream.try_clone() else {
            continue;
        };
        let (ticket, evicted) = shared.preauth.admit(peer.ip(), handle);
        if evicted > 0 {
            shared.stats.refusal("data", "preauth_evicted");
        }
        spawn_connection(
            &shared,
            stream,
            peer,
            Slot::PreAuth { _ticket: ticket },
            tls,
        );
    }
}

/// `m`'s lock, tried every millisecond until `deadline`; `None` if it
/// stayed taken.
fn lock_until<T>(m: &Mutex<T>, deadline: std::time::Instant) -> Option<MutexGuard<'_, T>> {
    loop {
        if let Some(g) = m.try_lock() {
            return Some(g);
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Send Goodbye without ever blocking: take the connection's write lock
/// only if free (retrying until `deadline`), and send without waiting for
/// buffer space. A Goodbye that cannot go out whole closes the connection,
/// which keeps the stream framed; the client sees a lost connection instead.
fn send_goodbye(c: &Conn, bye: &[u8], deadline: std::time::Instant) {
    use std::os::fd::AsRawFd;
    let guard = lock_until(&c.write_lock, deadline);
    // Over TLS the Goodbye is a record of the session (never waiting for it
    // either: a connection thread holds it only while bytes move through it).
    let mut sealed = Vec::new();
    let bye = match &c.tls {
        None => bye,
        Some(session) => {
            // A handshake holds the session throughout: such a connection
            // is simply closed.
            let locked = lock_until(session, deadline);
            let (Some(mut s), Some(_)) = (locked, guard.as_ref()) else {
                let _ = c.stream.shutdown(std::net::Shutdown::Both);
                return;
            };
            let TlsSession::Open { records, .. } = &mut *s else {
                drop(s);
                let _ = c.stream.shutdown(std::net::Shutdown::Both);
                return;
            };
            if records.seal(bye, &mut sealed).is_err() {
                drop(s);
                let _ = c.stream.shutdown(std::net::Shutdown::Both);
                return;
            }
            &sealed[..]
        }
    };
    // SAFETY: send(2) reads `bye` and nothing else; the socket stays open while `c` lives.
    let sent = guard.map(|_g| unsafe {
        libc::send(
            c.stream.as_raw_fd(),
            bye.as_ptr().cast(),
            bye.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    });
    if sent != Some(bye.len() as isize) {
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
    }
}

async fn drain(shared: &Arc<Shared>, quic: &[quinn::Endpoint]) {
    shared.draining.store(true, Ordering::Relaxed);
    shared.drain_tx.send_replace(true);
    let permits = &shared.permits;
    let max = shared.permits_total.load(Ordering::Relaxed);
    let grace = shared.config().drain_timeout;
    let deadline = std::time::Instant::now() + grace;
    let conns: Vec<Arc<Conn>> = shared.conns().values().cloned().collect();
    tracing::info!(
        connections = conns.len(),
        grace_ms = grace.as_millis() as u64,
        "draining: sending Goodbye"
    );
    let mut bye = Vec::new();
    Goodbye {
        grace_ms: u32::try_from(grace.as_millis()).unwrap_or(u32::MAX),
    }
    .encode(&mut bye);
    // Off the runtime thread: a connection thread may hold its write lock.
    let sending = tokio::task::spawn_blocking(move || {
        for c in &conns {
            send_goodbye(c, &bye, deadline);
        }
    });
    let _ = tokio::time::timeout_at(deadline.into(), sending).await;
    // Every permit back means every connection thread has ended.
    let all = u32::try_from(max).unwrap_or(u32::MAX);
    if tokio::time::timeout_at(deadline.into(), permits.acquire_many(all))
        .await
        .is_err()
    {
        let left: Vec<Arc<Conn>> = shared.conns().values().cloned().collect();
        tracing::warn!(
            connections = left.len(),
            "drain deadline passed; closing remaining connections"
        );
        for c in left {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        for endpoint in quic {
            endpoint.close(quinn::VarInt::from_u32(0), b"drain deadline passed");
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), permits.acquire_many(all)).await;
    }
    let s = &shared.stats;
    tracing::info!(
        lookups = s.lookups.load(Ordering::Relaxed),
        rows = s.rows.load(Ordering::Relaxed),
        connections = s.connections.load(Ordering::Relaxed),
        refused = s.refused.load(Ordering::Relaxed),
        "drained"
    );
}
