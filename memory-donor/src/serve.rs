//! `memory-donor serve`: what to serve (from flags or from the cluster
//! config), the operations servers (control plane and metrics, bound before
//! loading), loading the tables resident with their state visible (and in
//! systemd's status line), binding the data plane, the `ready` line and
//! READY=1, and the run (`supervise`: orders, watchdog, drain).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cluster_config::{Config, Endpoint, TlsFiles, Transport};
use daemon_runtime::notify::Notifier;
use engram_protocol::Limits;
use thiserror::Error;

use crate::control::{ControlLimits, serve_control};
use crate::server::{self, ServerConfig, Shared};
use crate::status::{DonorStatus, LoadState, Phase};
use crate::tls::Access;
use cluster_config::MlockMode;
use engram_store::progress::Progress;
use engram_store::resident::{Backing, ExpectedTable, LoadError, LoadOptions, ResidentTable};

use crate::fdstore::FdStore;

/// One table to serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSpec {
    /// Id to serve it under (default: its layer).
    pub id: Option<u32>,
    /// Its file.
    pub path: PathBuf,
    /// What the config says the table is, if it says.
    pub pinned: Option<ExpectedTable>,
}

impl std::str::FromStr for TableSpec {
    type Err = String;

    /// `FILE` or `ID=FILE`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            Some((id, path)) if !id.is_empty() && id.chars().all(|c| c.is_ascii_digit()) => {
                let id = id
                    .parse()
                    .map_err(|_| format!("table id {id:?} is not a 32-bit number"))?;
                Ok(Self {
                    id: Some(id),
                    path: path.into(),
                    pinned: None,
                })
            }
            _ => Ok(Self {
                id: None,
                path: s.into(),
                pinned: None,
            }),
        }
    }
}

/// Everything `serve` needs.
#[derive(Debug, Clone)]
pub struct ServeSpec {
    /// Data-plane behaviour.
    pub server: ServerConfig,
    /// Addresses to bind, each with its transport.
    pub listen: Vec<Endpoint>,
    /// The certificate files and access rules, when the rack has a PKI.
    pub tls: Option<(TlsFiles, Access)>,
    /// Tables to load.
    pub tables: Vec<TableSpec>,
    /// Skip recomputing digests at load.
    pub trust_digest: bool,
    /// Memory locking.
    pub mlock: MlockMode,
    /// Under systemd, keep tables in its fd store for the next start.
    pub fd_store: bool,
    /// Serve rows from the table files' pages ([`Backing::Mapped`]).
    pub map_files: bool,
    /// Bind the tables' memory to this NUMA node.
    pub numa_node: Option<u32>,
    /// Threads that read, place and hash a table at load (0: every core).
    pub load_threads: usize,
    /// Control-plane (gRPC) address to bind.
    pub control: Option<SocketAddr>,
    /// Prometheus `/metrics` address to bind.
    pub metrics: Option<SocketAddr>,
    /// Log filter from the config, if it sets one.
    pub log_level: Option<String>,
    /// Bytes the tables may take (`ram_gib - headroom_gib`), when configured.
    pub ram_budget: Option<u64>,
    /// The only directories a control-plane swap may load files from.
    pub table_dirs: Vec<PathBuf>,
    /// The RDMA device of an `rdma://` address.
    pub rdma: Option<cluster_config::RdmaDevice>,
    /// The host socket (`unix://PATH`), whose clients map the tables.
    pub host: Option<server::host::HostSpec>,
}

/// Serve flags that override the config (at start and on every reload).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub trust_digest: bool,
    pub no_fd_store: bool,
    /// `--map-files` (true) or `--copy-tables` (false); `None`: the
    /// config's choice.
    pub map_files: Option<bool>,
    pub load_threads: Option<usize>,
    pub busy_poll_us: Option<u64>,
    pub mlock: Option<MlockMode>,
    pub max_connections: Option<usize>,
    pub max_rows: Option<u32>,
    pub drain_timeout_ms: Option<u64>,
    pub hello_timeout_ms: Option<u64>,
    pub credential_file: Option<PathBuf>,
    pub control: Option<SocketAddr>,
    pub metrics: Option<SocketAddr>,
}

impl Overrides {
    /// Apply these flags over `spec`.
    pub fn apply(&self, spec: &mut ServeSpec) -> Result<(), ServeError> {
        spec.trust_digest |= self.trust_digest;
        spec.fd_store &= !self.no_fd_store;
        if let Some(m) = self.map_files {
            spec.map_files = m;
        }
        if let Some(n) = self.load_threads {
            spec.load_threads = n.min(1024);
        }
        if let Some(m) = self.mlock {
            spec.mlock = m;
        }
        if let Some(n) = self.max_connections {
            spec.server.max_connections = n.clamp(1, 65_536);
        }
        if let Some(r) = self.max_rows {
            let r = r.clamp(48, engram_protocol::frame::MAX_ROWS_CEILING);
            spec.server.limits = Limits::for_caps(r, spec.server.limits.max_sections);
        }
        if let Some(us) = self.busy_poll_us {
            spec.server.busy_poll = Duration::from_micros(us.min(10_000));
        }
        if let Some(ms) = self.drain_timeout_ms {
            spec.server.drain_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = self.hello_timeout_ms {
            spec.server.hello_timeout = Duration::from_millis(ms.max(1));
        }
        if self.control.is_some() {
            spec.control = self.control;
        }
        if self.metrics.is_some() {
            spec.metrics = self.metrics;
        }
        if let Some(f) = &self.credential_file {
            let c = cluster_config::read_credential(f)
                .map_err(|e| ServeError::Config(e.to_string()))?;
            spec.server.credential = Some(c);
        }
        Ok(())
    }
}

/// Why the donor could not start.
#[derive(Debug, Error)]
pub enum ServeError {
    /// The config does not describe this donor.
    #[error("{0}")]
    Config(String),
    /// A table failed to load.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Two tables would be served under one id.
    #[error("two tables are served under id {0}; give ids explicitly with --table ID=FILE")]
    DuplicateId(u32),
    /// An address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

impl ServeSpec {
    /// The shared state of a donor about to load this spec's tables.
    pub fn status(&self) -> Arc<DonorStatus> {
        DonorStatus::new(
            self.server.name.clone(),
            self.server.drain_timeout,
            self.tables.iter().map(|t| (t.id, t.path.clone())),
            !self.trust_digest,
        )
    }

    /// A spec from flags alone: these tables on these addresses; swaps
    /// may load files from the directories of these tables.
    pub fn from_flags(name: &str, listen: Vec<SocketAddr>, tables: Vec<TableSpec>) -> Self {
        let mut table_dirs: Vec<PathBuf> = Vec::new();
        for t in &tables {
            let dir = match t.path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if !table_dirs.contains(&dir) {
                table_dirs.push(dir);
            }
        }
        Self {
            server: ServerConfig::new(name),
            listen: listen
                .into_iter()
                .map(|a| Endpoint::new(Transport::Tcp, a))
                .collect(),
            tls: None,
            tables,
            trust_digest: false,
            mlock: MlockMode::Try,
            fd_store: true,
            // Flags give plain TCP addresses only: nothing needs a copy.
            map_files: cluster_config::pages_by_default(false, false, false),
            numa_node: None,
            load_threads: 0,
            control: None,
            metrics: None,
            log_level: None,
            ram_budget: None,
            table_dirs,
            rdma: None,
            host: None,
        }
    }

    /// The spec of donor `name` in a cluster config.
    pub fn from_config(config: &Config, name: &str) -> Result<Self, ServeError> {
        let d = config.donor(name).ok_or_else(|| {
            let names: Vec<&str> = config.donors.iter().map(|d| d.name.as_str()).collect();
            ServeError::Config(format!(
                "{}: no donor named {name:?} (donors: {})",
                config.path.display(),
                names.join(", ")
            ))
        })?;
        let mut server = ServerConfig::new(&d.name);
        server.limits = Limits::for_rows(d.max_rows);
        server.max_connections = d.max_connections;
        server.hello_timeout = d.hello_timeout;
        server.idle_timeout = d.idle_timeout;
        server.write_timeout = d.write_timeout;
        server.drain_timeout = d.drain_timeout;
        server.busy_poll = d.busy_poll;
        server.credential = config
            .credential()
            .map_err(|e| ServeError::Config(e.to_string()))?;
        let tables = d
            .tables
            .iter()
            .filter_map(|id| config.table(*id))
            .map(|t| TableSpec {
                id: Some(t.id),
                path: t.path.clone(),
                pinned: Some(ExpectedTable {
                    digest: t.digest,
                    layer: t.layer,
                    rows: t.rows,
                }),
            })
            .collect();
        Ok(Self {
            server,
            listen: d.listen.clone(),
            tls: config
                .tls_files(name)
                .map(|f| (f, Access::from_config(config, name))),
            tables,
            trust_digest: d.trust_digest,
            mlock: d.mlock,
            fd_store: d.fd_store,
            map_files: d.map_files,
            numa_node: d.numa_node,
            load_threads: d.load_threads,
            control: d.control,
            metrics: d.metrics,
            log_level: d.log_level.clone(),
            ram_budget: Some(d.table_budget_bytes()),
            table_dirs: d.table_dirs.clone(),
            rdma: d.rdma.clone(),
            host: d.host_socket.clone().map(|path| server::host::HostSpec {
                path,
                access: server::host::HostAccess {
                    uids: d.host_uids.clone(),
                    gids: d.host_gids.clone(),
                },
            }),
        })
    }
}

/// The control-plane and metrics servers, bound and running.
#[derive(Debug)]
pub struct OpsServers {
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

impl OpsServers {
    /// Bind the spec's control and metrics addresses and serve them from
    /// `status`; logs `ops control=ADDR metrics=ADDR` (`-` for none) once bound.
    pub async fn start(spec: &ServeSpec, status: &Arc<DonorStatus>) -> Result<Self, ServeError> {
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

fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct we pass.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } == 0;
    ok.then_some(r.rlim_cur)
}

/// How much more time a load that is making progress asks systemd for.
const LOAD_EXTEND: Duration = Duration::from_secs(120);

/// Load every table resident, with progress in the log, in `status` (one
/// entry per table of `spec`, in order) and in systemd's status line (each
/// percent also extends the start timeout: a slow load that moves is fine,
/// a stuck one times out).
pub fn load_tables(
    spec: &ServeSpec,
    status: &Arc<DonorStatus>,
    notifier: &Arc<Notifier>,
    store: &FdStore,
) -> Result<Vec<ResidentTable>, ServeError> {
    let mut tables: Vec<ResidentTable> = Vec::new();
    let mut unlocked = 0u64;
    for (i, st) in status.tables.iter().enumerate().take(spec.tables.len()) {
        let loaded = load_one(spec, i, status, notifier, store).and_then(|(table, report)| {
            if tables.iter().any(|x| x.id == table.id) {
                return Err(ServeError::DuplicateId(table.id));
            }
            Ok((table, report))
        });
        let (table, report) = match loaded {
            Ok(x) => x,
            Err(e) => {
                st.failed(e.to_string());
                return Err(e);
            }
        };
        st.set_state(LoadState::Ready);
        if !report.adopted {
            store.keep(&table);
        }
        tracing::info!(
            table = table.id,
            layer = table.layer,
            rows = table.rows,
            digest = %table.digest,
            verified = report.verified,
            locked = report.locked,
            adopted = report.adopted,
            file_pages = !table.memory().is_packed(),
            "table resident"
        );
        if !report.locked && spec.mlock != MlockMode::Off {
            unlocked += table.bytes();
        }
        tables.push(table);
    }
    store.release_rest();
    if spec.rdma.is_none() {
        // No RDMA now: check words kept for it are of no use.
        store.release_checks();
    }
    if unlocked > 0 {
        let limit = memlock_limit().map_or("unknown".to_string(), |l| {
            if l == libc::RLIM_INFINITY {
                "unlimited".into()
            } else {
                format!("{l} bytes")
            }
        });
        tracing::warn!(
            bytes = unlocked,
            "table memory is not locked (memlock limit: {limit}): it may be swapped out under memory pressure; \
             set LimitMEMLOCK=infinity in the systemd unit or raise `ulimit -l`"
        );
    }
    Ok(tables)
}

/// Whether tables kept in a memfd get a writable view for RDMA: when the
/// donor serves RDMA on a kernel that registers shared memory only through
/// a writable mapping (before Linux 6.2; docs/rdma.md).
pub(crate) fn rdma_view(serves_rdma: bool) -> bool {
    serves_rdma && engram_store::kept::writable_view_needed()
}

/// Where a table loaded now lives: its file's pages (`map_files`), or a
/// copy in memory the fd store can keep; a memfd whenever the donor has a
/// host socket (`host`), whose clients map it.
pub(crate) fn backing(map_files: bool, host: bool, store: &FdStore) -> Backing {
    if map_files {
        Backing::Mapped
    } else if host {
        Backing::Memfd
    } else {
        store.backing()
    }
}

/// The store's locking mode for the config's `mlock`.
pub(crate) fn lock_mode(mode: MlockMode) -> engram_store::resident::MlockMode {
    use engram_store::resident::MlockMode as Store;
    match mode {
        MlockMode::Try => Store::Try,
        MlockMode::Require => Store::Require,
        MlockMode::Off => Store::Off,
    }
}

/// How a table came to be resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loaded {
    /// The digest was recomputed at this load (or at the load that made an
    /// adopted copy).
    pub verified: bool,
    /// The memory is locked (an adopted copy: being locked in the background).
    pub locked: bool,
    /// Taken from systemd's fd store: nothing was read.
    pub adopted: bool,
}

/// What table `t` must be: the config's pin, else its file's header.
fn expected(t: &TableSpec) -> Option<ExpectedTable> {
    t.pinned.or_else(|| {
        let f = engram_store::table_file::TableFile::open(&t.path).ok()?;
        Some(ExpectedTable {
            digest: f.meta.digest,
            layer: f.meta.layer,
            rows: f.meta.rows,
        })
    })
}

/// Take table `i` of `spec` from the fd store if a copy of exactly its
/// version is there; else load it, reporting into `status.tables[i]`.
fn load_one(
    spec: &ServeSpec,
    i: usize,
    status: &Arc<DonorStatus>,
    notifier: &Arc<Notifier>,
    store: &FdStore,
) -> Result<(ResidentTable, Loaded), ServeError> {
    let t = &spec.tables[i];
    // What the previous process left of a table served from its file's
    // pages: the file's mark, and its name in the store.
    let mut known: Option<(engram_store::resident::FileMark, String)> = None;
    // The file's header is read for its version only when there is a copy
    // to compare it with.
    if let Some(want) = store.may_hold().then(|| expected(t)).flatten() {
        let id = t.id.unwrap_or(want.layer);
        if spec.map_files {
            known = store.take_file(id, &want, !spec.trust_digest);
        } else if let Some(table) = store.take(
            id,
            &want,
            !spec.trust_digest,
            rdma_view(spec.rdma.is_some()),
        ) {
            let record = table.kept().map(|k| k.record);
            status.tables[i].opened(id, table.layer, table.rows, table.digest);
            status.tables[i].progress(table.rows, table.rows);
            let age_s = record.map_or(0, |r| {
                engram_store::kept::unix_ms().saturating_sub(r.loaded_unix_ms) / 1000
            });
            tracing::info!(
                table = id,
                generation = record.map_or(0, |r| r.generation),
                loaded_s_ago = age_s,
                pages = table.kept().map_or("-", |k| k.pages.name()),
                "table adopted from the fd store: serving the copy the previous process loaded, file not read"
            );
            let locked = lock_adopted(&table, spec.mlock)?;
            let verified = record.is_some_and(|r| r.verified);
            return Ok((
                table,
                Loaded {
                    verified,
                    locked,
                    adopted: true,
                },
            ));
        }
    }
    let progress = |f: &engram_store::table_file::TableFile| {
        let m = &f.meta;
        let id = t.id.unwrap_or(m.layer);
        status.tables[i].opened(id, m.layer, m.rows, m.digest);
        let what = format!("loading {}", t.path.display());
        let (status, total, notifier) = (Arc::clone(status), m.rows, Arc::clone(notifier));
        let mut last_pct = u64::MAX;
        Some(
            Progress::log(what, total, engram_protocol::ROW_BYTES as u64).with_tap(move |done| {
                status.tables[i].progress(done, total);
                let pct = done * 100 / total.max(1);
                if pct != last_pct {
                    last_pct = pct;
                    let line = format!("loading table {id}: {pct}%");
                    if let Err(e) = notifier.extend_timeout(LOAD_EXTEND, &line) {
                        tracing::debug!(error = %e, "sd_notify");
                    }
                }
            }),
        )
    };
    let opts = LoadOptions {
        pinned: t.pinned,
        trust_digest: spec.trust_digest,
        mlock: lock_mode(spec.mlock),
        backing: backing(spec.map_files, spec.host.is_some(), store),
        threads: load_threads(spec.load_threads),
        known_file: known.as_ref().map(|(mark, _)| *mark),
        numa_node: spec.numa_node,
        rdma_view: rdma_view(spec.rdma.is_some()),
    };
    let (table, report) = ResidentTable::load_with(t.id, &t.path, &opts, progress)?;
    if report.reused {
        status.tables[i].progress(table.rows, table.rows);
        tracing::info!(
            table = table.id,
            "table adopted from the fd store: serving the file's pages as the previous process left them (the file unchanged since), not read or hashed"
        );
        let locked = lock_adopted(&table, spec.mlock)?;
        if let Some((_, name)) = known {
            check_reused_pages(&table, &t.path, store.forgetter(name));
        }
        return Ok((
            table,
            Loaded {
                verified: report.verified,
                locked,
                adopted: true,
            },
        ));
    }
    if let Some((_, stale)) = &known {
        // Replaced by the mark of this load.
        store.forget(stale);
    }
    Ok((
        table,
        Loaded {
            verified: report.verified,
            locked: report.locked,
            adopted: false,
        },
    ))
}

/// Load threads for a configured count (0: every core).
pub(crate) fn load_threads(n: usize) -> usize {
    if n == 0 {
        engram_store::fill::cores()
    } else {
        n
    }
}

/// Lock an adopted table's memory: with `require`, now (a pass over its
/// pages before serving); with `try`, in the background while it serves.
fn lock_adopted(table: &ResidentTable, mode: MlockMode) -> Result<bool, ServeError> {
    match mode {
        MlockMode::Off => Ok(false),
        MlockMode::Require => {
            table.lock().map_err(|source| {
                ServeError::Load(LoadError::Mlock {
                    path: format!("table {} (adopted)", table.id),
                    bytes: table.bytes(),
                    source,
                })
            })?;
            Ok(true)
        }
        MlockMode::Try => {
            let (memory, id) = (table.memory(), table.id);
            let spawned = std::thread::Builder::new()
                .name(format!("lock-{id}"))
                .spawn(move || {
                    let began = std::time::Instant::now();
                    match memory.lock() {
                        Ok(()) => tracing::info!(
                            table = id,
                            took_ms = began.elapsed().as_millis() as u64,
                            "adopted table's memory locked"
                        ),
                        Err(e) => tracing::warn!(
                            table = id,
                            "adopted table's memory not locked ({e}); raise LimitMEMLOCK"
                        ),
                    }
                });
            Ok(spawned.is_ok())
        }
    }
}

/// A table served on from its file's pages without being read: check
/// every page against the file's page checksums, in the background (pages
/// the kernel dropped while no donor held the file are read from the disk
/// again). A page that does not match means the file changed on disk
/// without its change time moving: the donor says so, removes the mark
/// from the fd store (`forget`), so that the next start reads and verifies
/// the file, and exits with code 3, as when the file is opened for writing.
fn check_reused_pages(table: &ResidentTable, shown: &Path, forget: impl FnOnce() + Send + 'static) {
    use std::os::fd::AsRawFd;
    let (memory, id, shown) = (table.memory(), table.id, shown.display().to_string());
    // The served file itself, whatever the path names by now.
    let Some(served) = memory
        .file()
        .map(|f| PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd())))
    else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name(format!("check-{id}"))
        .spawn(move || {
            let began = std::time::Instant::now();
            let sums = engram_store::table_file::TableFile::open(&served)
                .and_then(|f| f.read_page_sums());
            let sums = match sums {
                Ok(Some(sums)) => sums,
                Ok(None) => {
                    tracing::info!(table = id, file = shown, "no page checksums: the pages of a table served on from its file are not checked");
                    return;
                }
                Err(e) => {
                    tracing::warn!(table = id, file = shown, "cannot read the page checksums to check a table served on from its file: {e}");
                    return;
                }
            };
            match engram_store::verify::first_bad_page((*memory).as_ref(), &sums) {
                None => tracing::info!(
                    table = id,
                    pages = sums.len(),
                    took_ms = began.elapsed().as_millis() as u64,
                    "the pages of a table served on from its file match the file's page checksums"
                ),
                Some(page) => {
                    tracing::error!(
                        table = id,
                        page,
                        file = shown,
                        "a page of a table served on from its file does not match its checksum: the file changed on disk without its change time moving; its mark is removed from the fd store and the donor exits (the next start reads and verifies the file)"
                    );
                    forget();
                    std::process::exit(3);
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(
            table = id,
            "cannot start checking the pages of a table served on from its file: {e}"
        );
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
    status: &Arc<DonorStatus>,
    announce: &str,
    ops: crate::supervise::Ops,
) -> Result<Arc<Shared>, ServeError> {
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
    for addr in quic {
        let config = server::quic::server_config(&shared).map_err(ServeError::Config)?;
        let endpoint = quinn::Endpoint::server(config, addr)
            .map_err(|source| ServeError::Bind { addr, source })?;
        let a = endpoint
            .local_addr()
            .map_err(|source| ServeError::Bind { addr, source })?;
        bound.push(Endpoint::new(Transport::Quic, a));
        listeners.push(server::Listener::Quic(endpoint));
    }
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
    // RDMA is set up after READY: checking every row and registering tens
    // of GiB takes seconds to minutes, which would undo the fd store's
    // instant restart and could run past the unit's start timeout. Nodes
    // read over TLS or QUIC meanwhile; RegionQuery answers "unavailable"
    // until the book is in place, and they ask again.
    if let Some(addr) = rdma {
        let (sh, device, name) = (
            Arc::clone(&shared),
            spec.rdma.clone().unwrap_or_default(),
            spec.server.name.clone(),
        );
        let fallback: Vec<Endpoint> = bound.clone();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_specs_parse_with_and_without_ids() {
        assert_eq!(
            "7=/x/a.etab".parse::<TableSpec>(),
            Ok(TableSpec {
                id: Some(7),
                path: "/x/a.etab".into(),
                pinned: None
            })
        );
        assert_eq!("a=b.etab".parse::<TableSpec>().map(|t| t.id), Ok(None));
        assert_eq!("/x/a.etab".parse::<TableSpec>().map(|t| t.id), Ok(None));
        assert!("99999999999=a".parse::<TableSpec>().is_err());
    }

    #[test]
    fn from_flags_swaps_may_load_from_the_directories_of_the_tables() {
        let tables = ["1=/a/x.etab", "/a/y.etab", "/b/z.etab", "w.etab"]
            .iter()
            .map(|t| t.parse().expect("table"))
            .collect();
        let s = ServeSpec::from_flags("d", vec![], tables);
        let want: Vec<PathBuf> = ["/a", "/b", "."].iter().map(PathBuf::from).collect();
        assert_eq!(s.table_dirs, want);
    }
}
