//! A donor on the node's own host, reached at its host socket
//! (`unix://PATH`): the donor hands over a read-only descriptor of each
//! table's memory (a memfd sealed against writes, shrinking and growing),
//! the node maps it (`PROT_READ`, `MAP_SHARED`) and serves a lookup by
//! gathering the rows from the mapping: no system call and no wake-up per
//! lookup, and one physical copy for every process on the host.
//!
//! - **Pins.** A mapping is installed only when the donor's record of it
//!   names the pinned version, layer and row count; a donor that moves to
//!   another version drops it, and lookups then get `VersionMismatch`, as
//!   from a donor over the network.
//! - **Swaps.** A new generation arrives as a new descriptor (a swap, a
//!   reload, a donor restarted without its fd store). It is readied in
//!   the background ([`mapper`]: its pages mapped in at idle priority, a
//!   slice at a time, while lookups read the generation in service), then
//!   replaces the old mapping between lookups. A lookup holds the mapping
//!   it started with (an `Arc`), so no row is ever torn; the old one is
//!   unmapped by the mapper once no lookup or view holds it, never on a
//!   lookup's path.
//! - **A donor that dies costs nothing.** The mapping outlives the donor
//!   process. The watcher reconnects (every 100 ms) and counts the gap;
//!   the same generation (a restart from the fd store) keeps its mapping.
//!
//! Two threads per donor: the watcher (the socket's messages; it maps a
//! descriptor, which is quick) and the [`mapper`] (with a helper at idle
//! priority while it has pages to map in or out). The wire format is
//! PROTOCOL.md section 5.

mod mapper;

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use daemon_runtime::hostsock::{HOST_PROTOCOL, MAX_MESSAGE, connect, readable, recv};
use engram_protocol::TableDigest;
use engram_protocol::encoding::RowEncoding;
use engram_store::kept;
use engram_store::resident::{ExpectedTable, ResidentTable};
use engram_sync::{Mutex, RwLock};
use tokio::time::Instant;

use super::{
    FetchFuture, FetchJob, FetchSlot, ProbeFuture, RowSource, SourceError, SourceKind, TableView,
};

/// How often the watcher tries the socket again while the donor is away,
/// and how often it (and the mapper) look at the stop flag.
const RETRY: Duration = Duration::from_millis(100);
/// The longest a probe waits for the first exchange with the donor.
const FIRST_SYNC: Duration = Duration::from_secs(2);

/// One table as mapped from the donor.
#[derive(Debug)]
struct Mapped {
    table: Arc<ResidentTable>,
    generation: u64,
    /// Set once this mapping is neither in service nor wanted: the
    /// mapper's work on it stops (read without a lock by a thread at idle
    /// priority, which must hold none).
    done: AtomicBool,
}

impl Mapped {
    fn new(table: ResidentTable, generation: u64) -> Self {
        Self {
            table: Arc::new(table),
            generation,
            done: AtomicBool::new(false),
        }
    }
}

/// What the watcher learned, shared with the lookups.
#[derive(Debug, Default)]
struct State {
    /// The mapping of each table, when it is the pinned version.
    maps: RwLock<HashMap<u32, Arc<Mapped>>>,
    /// Tables the donor serves at another version than pinned (which,
    /// when it named a readable digest).
    other: Mutex<HashMap<u32, Option<TableDigest>>>,
    /// Why the socket is not usable now, when it is not.
    down: Mutex<Option<String>>,
    /// Whether the donor's first full list arrived since the last connect.
    synced: AtomicBool,
    /// Whether the first attempt came to something: the donor's full list
    /// arrived, or the socket failed. A probe before then waits for it.
    settled: AtomicBool,
    /// Times the donor went away while the node held its mappings.
    gaps: AtomicU64,
    /// Generations put in service (each table's first mapping included).
    generations: AtomicU64,
    /// The same two, for `/metrics`, when the source has them.
    counters: Option<HostCounters>,
    /// New generations readied, old ones let go.
    mapper: mapper::Mapper,
    /// Tables mapped at some point (only a table's very first mapping
    /// serves before its pages are mapped in).
    mapped: Mutex<std::collections::HashSet<u32>>,
    stop: AtomicBool,
}

impl State {
    fn count_gap(&self) {
        self.gaps.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = &self.counters {
            c.gaps.inc();
        }
    }

    fn count_generation(&self) {
        self.generations.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = &self.counters {
            c.generations.inc();
        }
    }
}

/// A host source's counters in `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct HostCounters {
    /// `engram_node_host_gaps_total`: times the donor went away while its
    /// tables stayed mapped.
    pub gaps: prometheus_client::metrics::counter::Counter,
    /// `engram_node_host_generations_total`: generations put in service.
    pub generations: prometheus_client::metrics::counter::Counter,
}

/// A donor on this host, read through its shared memory.
#[derive(Debug)]
pub struct HostSource {
    name: String,
    path: PathBuf,
    state: Arc<State>,
}

impl HostSource {
    /// Donor `name`'s host socket at `path`, for the tables (and pinned
    /// versions) in `pinned`; watched from a thread of its own from now on.
    pub fn new(
        name: impl Into<String>,
        path: PathBuf,
        pinned: Vec<(u32, ExpectedTable)>,
    ) -> io::Result<Self> {
        Self::with_counters(name, path, pinned, None)
    }

    /// [`Self::new`], each gap and generation also counted in `counters`.
    pub fn with_counters(
        name: impl Into<String>,
        path: PathBuf,
        pinned: Vec<(u32, ExpectedTable)>,
        counters: Option<HostCounters>,
    ) -> io::Result<Self> {
        let name = name.into();
        let state = Arc::new(State {
            counters,
            ..State::default()
        });
        *state.down.lock() = Some("not connected yet".into());
        let (st, n) = (Arc::clone(&state), name.clone());
        std::thread::Builder::new()
            .name(format!("map-{name}"))
            .spawn(move || mapper::run(&n, &st))?;
        let (st, p, n) = (Arc::clone(&state), path.clone(), name.clone());
        let watcher = std::thread::Builder::new()
            .name(format!("host-{name}"))
            .spawn(move || watch(&n, &p, &pinned, &st));
        if let Err(e) = watcher {
            state.stop.store(true, Ordering::Relaxed);
            return Err(e);
        }
        Ok(Self { name, path, state })
    }

    /// Its socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Times the donor went away while its memory kept being served.
    pub fn gaps(&self) -> u64 {
        self.state.gaps.load(Ordering::Relaxed)
    }

    /// Generations put in service, each table's first mapping included.
    pub fn generations(&self) -> u64 {
        self.state.generations.load(Ordering::Relaxed)
    }

    /// Whether table `table` is mapped now, at its pinned version.
    pub fn is_mapped(&self, table: u32) -> bool {
        self.state.maps.read().contains_key(&table)
    }

    /// The generation of table `table`'s mapping, if mapped.
    pub fn generation(&self, table: u32) -> Option<u64> {
        self.state.maps.read().get(&table).map(|m| m.generation)
    }

    /// Copy rows out of the mapping; no await point.
    pub fn read(&self, table: u32, rows: &[u64], out: &mut [u8]) -> Result<(), SourceError> {
        let Some(m) = self.state.maps.read().get(&table).cloned() else {
            return Err(self.why_not(table));
        };
        super::gather_rows(&m.table, rows, out)
    }

    fn why_not(&self, table: u32) -> SourceError {
        if let Some(d) = self.state.other.lock().get(&table) {
            let detail = match d {
                Some(d) => format!("the donor's host socket serves digest {d}"),
                None => "the donor's host socket serves another version".into(),
            };
            return SourceError::VersionMismatch { table, detail };
        }
        let down = self.state.down.lock().clone();
        SourceError::Unavailable(format!(
            "table {table} is not mapped from {}'s host socket {}{}",
            self.name,
            self.path.display(),
            down.map(|d| format!(": {d}")).unwrap_or_default()
        ))
    }
}

impl Drop for HostSource {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
    }
}

impl super::Gather for HostSource {
    fn gather(&self, table: u32, rows: &[u64], out: &mut [u8]) -> Result<(), SourceError> {
        self.read(table, rows, out)
    }
}

impl RowSource for HostSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> SourceKind {
        SourceKind::Donor
    }

    fn fetch<'a>(
        &'a self,
        table: u32,
        rows: &'a [u64],
        buf: Vec<u8>,
        _deadline: Instant,
    ) -> FetchFuture<'a> {
        super::gather_fetch(self, table, rows, buf)
    }

    fn fetch_job(self: Arc<Self>, job: FetchJob, slot: &mut FetchSlot) {
        super::gather_job(&*self, job, slot);
    }

    fn view(&self, table: u32) -> Option<TableView> {
        self.state
            .maps
            .read()
            .get(&table)
            .map(|m| TableView::new(Arc::clone(&m.table), Some(m.generation), true))
    }

    fn may_view(&self, table: u32) -> bool {
        // Asked of the routers the source is in: each routes a table this
        // donor's socket may hand over.
        let _ = table;
        true
    }

    fn probe(&self) -> ProbeFuture<'_> {
        Box::pin(async move {
            // The node's first probe comes as the source is made: give the
            // watcher its first exchange (milliseconds) rather than call a
            // donor that is there unusable.
            let until = Instant::now() + FIRST_SYNC;
            while !self.state.settled.load(Ordering::Acquire) && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let maps = self.state.maps.read();
            let mut tables: Vec<(u32, TableDigest)> =
                maps.iter().map(|(id, m)| (*id, m.table.digest)).collect();
            drop(maps);
            // Another version, as a donor over the network would say it.
            for (id, d) in self.state.other.lock().iter() {
                if let Some(d) = d {
                    tables.push((*id, *d));
                }
            }
            if tables.is_empty() {
                let down = self.state.down.lock().clone().unwrap_or_default();
                return Err(SourceError::Unavailable(format!(
                    "nothing mapped from {} yet: {down}",
                    self.path.display()
                )));
            }
            Ok(tables)
        })
    }
}

/// Connect, take in what the donor sends, and connect again when it goes
/// away, until the source is dropped.
fn watch(name: &str, path: &Path, pinned: &[(u32, ExpectedTable)], st: &State) {
    let mut was_up = false;
    while !st.stop.load(Ordering::Relaxed) {
        let ended = match connect(path) {
            Ok(sock) => {
                if was_up {
                    tracing::info!(donor = name, "host socket: the donor is back");
                }
                session(name, &sock, pinned, st)
            }
            Err(e) => Err(format!("cannot connect to {}: {e}", path.display())),
        };
        if let Err(why) = ended {
            let mapped = !st.maps.read().is_empty();
            let was_synced = st.synced.swap(false, Ordering::Relaxed);
            if was_synced && mapped {
                st.count_gap();
                tracing::warn!(donor = name, why = %why, "host socket: the donor went away; its memory keeps being served from the mappings");
            } else if was_synced {
                tracing::warn!(donor = name, why = %why, "host socket lost");
            }
            was_up |= was_synced;
            *st.down.lock() = Some(why);
            st.settled.store(true, Ordering::Release);
        }
        std::thread::sleep(RETRY);
    }
}

/// One connection's messages, until it ends (always an `Err`: why).
fn session(
    name: &str,
    sock: &OwnedFd,
    pinned: &[(u32, ExpectedTable)],
    st: &State,
) -> Result<(), String> {
    let mut buf = vec![0u8; MAX_MESSAGE + 1];
    let mut welcomed = false;
    while !st.stop.load(Ordering::Relaxed) {
        if !readable(sock.as_raw_fd(), RETRY) {
            continue;
        }
        let (n, fd) = recv(sock.as_raw_fd(), &mut buf).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("the donor closed the host socket".into());
        }
        if n > MAX_MESSAGE {
            return Err(format!("a message over {MAX_MESSAGE} bytes"));
        }
        let msg: serde_json::Value =
            serde_json::from_slice(&buf[..n]).map_err(|e| format!("an unreadable message: {e}"))?;
        let field = |k: &str| msg.get(k);
        if let Some(why) = field("refused").and_then(|v| v.as_str()) {
            return Err(format!("refused by donor {name}: {why}"));
        }
        if let Some(v) = field("engram_host") {
            if v.as_u64() != Some(u64::from(HOST_PROTOCOL)) {
                return Err(format!(
                    "host protocol {v}, this node speaks {HOST_PROTOCOL}"
                ));
            }
            welcomed = true;
            *st.down.lock() = None;
            continue;
        }
        if !welcomed {
            return Err("no welcome from the donor".into());
        }
        if field("synced").is_some() {
            st.synced.store(true, Ordering::Relaxed);
            st.settled.store(true, Ordering::Release);
            continue;
        }
        table_message(name, &msg, fd, pinned, st)?;
    }
    Err("stopped".into())
}

/// Serve table `table` (`generation`) from its new mapping `t`: once the
/// mapper has readied it, or at once for the table's very first mapping
/// (the node starting: nothing of it was served from here yet), whose
/// pages are then mapped in while it serves.
fn install(name: &str, table: u32, generation: u64, t: ResidentTable, st: &State) {
    let m = Arc::new(Mapped::new(t, generation));
    let serving = st.maps.read().get(&table).map(|m| m.generation);
    let first = serving.is_none() && st.mapped.lock().insert(table);
    if !first {
        // Lookups read the generation in service meanwhile or, with none
        // (after another version), go to the route's other sources as
        // they did while that version was served.
        tracing::info!(
            donor = name,
            table,
            generation,
            serving,
            "host socket: new generation mapped; in service once its pages are mapped"
        );
        st.mapper.ready(table, m);
        return;
    }
    tracing::info!(donor = name, table, generation, "host socket: table mapped");
    st.mapper.forget(table);
    let old = {
        // Counted under the maps' lock: whoever sees the mapping also
        // sees it counted.
        let mut maps = st.maps.write();
        st.count_generation();
        maps.insert(table, Arc::clone(&m))
    };
    // Only once the pinned version is mapped: a lookup in
    // between still hears of the other one.
    st.other.lock().remove(&table);
    if let Some(old) = old {
        st.mapper.retire(old);
    }
    st.mapper.warm(m);
}

/// A message about one table: its mapping (made, kept, or removed), or
/// why the node cannot use it (another version, not shared).
fn table_message(
    name: &str,
    msg: &serde_json::Value,
    fd: Option<File>,
    pinned: &[(u32, ExpectedTable)],
    st: &State,
) -> Result<(), String> {
    let field = |k: &str| msg.get(k);
    let table = field("table")
        .and_then(serde_json::Value::as_u64)
        .and_then(|t| u32::try_from(t).ok())
        .ok_or("a message without a table")?;
    let Some((_, want)) = pinned.iter().find(|(id, _)| *id == table) else {
        return Ok(()); // Not routed here.
    };
    if field("gone").is_some() {
        remove(st, table);
        st.other.lock().remove(&table);
        return Ok(());
    }
    let digest = field("digest").and_then(|v| v.as_str()).unwrap_or_default();
    if digest != want.digest.to_string() {
        // Said before the mapping goes, so that a lookup that finds no
        // mapping finds why: another version, never "unavailable".
        st.other.lock().insert(table, digest.parse().ok());
        remove(st, table);
        return Ok(());
    }
    if let Some(why) = field("unshared").and_then(|v| v.as_str()) {
        remove(st, table);
        st.other.lock().remove(&table);
        tracing::warn!(donor = name, table, why, "host socket: table not shared");
        return Ok(());
    }
    let generation = field("generation")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or_default();
    let Some(file) = fd else {
        return Err(format!("table {table}'s message carries no descriptor"));
    };
    if st
        .maps
        .read()
        .get(&table)
        .is_some_and(|m| m.generation == generation)
    {
        // The same memory (a donor restarted from its fd store): whatever
        // was being readied is not wanted any more.
        st.mapper.forget(table);
        st.other.lock().remove(&table);
        return Ok(());
    }
    if st.mapper.readying(table, generation) {
        return Ok(()); // Being readied already.
    }
    let layout = field("layout").and_then(|v| v.as_str()).unwrap_or("packed");
    let encoding = field("encoding").and_then(|v| v.as_str());
    match map_table(table, file, want, layout, encoding) {
        Ok(t) => install(name, table, generation, t, st),
        Err(e) => {
            remove(st, table);
            st.other.lock().remove(&table);
            tracing::warn!(donor = name, table, error = %e, "host socket: table refused");
        }
    }
    Ok(())
}

/// Take table `table` out of service (and stop readying a generation of
/// it); the mapper unmaps it once the last lookup or view holding it ends.
fn remove(st: &State, table: u32) {
    st.mapper.forget(table);
    let old = st.maps.write().remove(&table);
    if let Some(old) = old {
        st.mapper.retire(old);
    }
}

/// Map a table's descriptor: only a memfd sealed against writes, shrinking
/// and growing, whose record names the pinned version.
/// The message's `layout` (and `encoding`, for rows of another encoding
/// than V4.1's) must be one this build reads and the one the memfd's own
/// record names.
fn map_table(
    table: u32,
    file: File,
    want: &ExpectedTable,
    layout: &str,
    encoding: Option<&str>,
) -> Result<ResidentTable, String> {
    if !kept::is_sealed_read_only(&file) {
        return Err("its memory is not sealed against writes and resizing".into());
    }
    let said = kept::KeptLayout::parse(layout)
        .ok_or_else(|| format!("layout {layout:?} (this build reads packed and planar)"))?;
    let said_encoding = match encoding {
        None => RowEncoding::V41,
        Some(name) => RowEncoding::parse(name).map_err(|e| e.to_string())?,
    };
    let t = ResidentTable::adopt(table, file, want, false).map_err(|e| e.to_string())?;
    let record = t.kept().map(|k| k.record.layout);
    let matches = match record {
        Some(kept::KeptLayout::Encoded { encoding, .. }) => {
            said == kept::KeptLayout::Packed && said_encoding == encoding
        }
        Some(r) => r == said && said_encoding == RowEncoding::V41,
        None => false,
    };
    if !matches {
        let named = |l: Option<kept::KeptLayout>, e: RowEncoding| match l {
            Some(l) => format!("{} rows of {}", l.name(), e.name()),
            None => "none".into(),
        };
        return Err(format!(
            "the message says {} but the memory's record says {}",
            named(Some(said), said_encoding),
            named(record, t.encoding)
        ));
    }
    Ok(t)
}
