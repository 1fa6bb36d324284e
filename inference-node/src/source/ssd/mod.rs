//! The node's SSD copy of a table: one aligned 4 KiB read per row (a row
//! never straddles a page in an `.etab` file), every read of a batch in
//! flight at once. Two engines: io_uring (`uring`: all reads of a batch
//! submitted with one system call, completions reaped together) and a pool
//! of threads issuing `pread` (`pread`: where io_uring is unavailable or not
//! wanted). Files are opened with O_DIRECT so reads measure the device, not
//! the page cache; where the file system refuses O_DIRECT the copy is read
//! buffered, with a warning.
//!
//! Every page read is checked against the file's page checksum (its
//! `page_xxh3` tensor) before its row is used: a flipped byte on disk is a
//! corrupt answer, and the router fails over as for a corrupt donor answer.
//! Files without checksums still load, with a warning saying how to add them.
//!
//! [`SsdReader`] is synchronous (one batch at a time, buffers reused);
//! [`SsdSource`] runs one on its own thread for the router.

pub mod ioprio;
mod pages;
mod pread;
#[cfg(test)]
mod tests;
mod uring;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use cluster_config::{SsdIo, SsdIoprio};
use engram_protocol::etab::TableLayout;
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_store::resident::ExpectedTable;
use engram_store::table_file::{TableFile, TableFileError};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use thiserror::Error;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{FetchFuture, ProbeFuture, RowSource, SourceError, SourceKind};
use crate::metrics::SsdLabels;
use pages::{PageError, PageRead, Pages};
pub use pread::PreadPool;
pub use uring::{MAX_IN_FLIGHT, RingStats};
use uring::{RingFactory, UringEngine};
/// Threads of the pread pool by default: every row of a 24-row batch in flight.
pub const DEFAULT_PREAD_THREADS: usize = 24;

/// Why an SSD copy cannot be used.
#[derive(Debug, Error)]
pub enum SsdError {
    /// The file is missing, unreadable or not a table.
    #[error(transparent)]
    File(#[from] TableFileError),
    /// The file is another table or version than the config pins.
    #[error("{path}: {what}")]
    Pinned { path: PathBuf, what: String },
    /// io_uring was required and the kernel refused it.
    #[error("io_uring is unavailable ({0}); set ssd_io = \"pread\" or \"auto\"")]
    NoUring(std::io::Error),
    /// Opening for reads failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How to read a copy.
#[derive(Debug, Clone, Copy)]
pub struct SsdOptions {
    /// io_uring, pread pool, or io_uring with the pool as fallback.
    pub io: SsdIo,
    /// Open with O_DIRECT.
    pub direct: bool,
    /// Threads of the pread pool.
    pub pread_threads: usize,
    /// The I/O priority of the reads (real-time falls back to best-effort
    /// where the process may not use it).
    pub ioprio: SsdIoprio,
}

impl Default for SsdOptions {
    fn default() -> Self {
        Self {
            io: SsdIo::Auto,
            direct: true,
            pread_threads: DEFAULT_PREAD_THREADS,
            ioprio: SsdIoprio::DEFAULT,
        }
    }
}

/// Which engine reads a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SsdEngine {
    /// io_uring, every read of a batch submitted at once.
    Uring,
    /// The pread thread pool.
    Pread,
}

impl SsdEngine {
    /// `io_uring` or `pread`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Uring => "io_uring",
            Self::Pread => "pread",
        }
    }
}

enum Engine {
    Uring(Box<UringEngine>),
    Pread(PreadPool),
}

/// Reads rows of one `.etab` copy, a batch at a time.
pub struct SsdReader {
    path: PathBuf,
    file: Arc<File>,
    layout: TableLayout,
    digest: TableDigest,
    sums: Option<Arc<[u64]>>,
    direct: bool,
    pread_threads: usize,
    ioprio: SsdIoprio,
    engine: Engine,
    plan: Vec<PageRead>,
    checksum_failures: u64,
    /// What an io_uring engine given up on had seen.
    retired_ring: RingStats,
}

impl std::fmt::Debug for SsdReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdReader")
            .field("path", &self.path)
            .field("engine", &self.engine_name())
            .field("direct", &self.direct)
            .field("page_sums", &self.sums.is_some())
            .finish()
    }
}

impl SsdReader {
    /// Open a copy. With `pin`, it must be that table at that version; the
    /// digest is recomputed over every row unless `trust_digest`.
    pub fn open(
        path: &Path,
        pin: Option<ExpectedTable>,
        trust_digest: bool,
        opts: SsdOptions,
    ) -> Result<Self, SsdError> {
        Self::open_with(path, pin, trust_digest, opts, Box::new(uring::real_ring))
    }

    /// [`open`](Self::open) with the io_uring rings made by `new_ring`.
    fn open_with(
        path: &Path,
        pin: Option<ExpectedTable>,
        trust_digest: bool,
        opts: SsdOptions,
        new_ring: RingFactory,
    ) -> Result<Self, SsdError> {
        let table = TableFile::open(path)?;
        if let Some(pin) = pin
            && let Some(what) = pin.mismatch(&table.meta)
        {
            return Err(SsdError::Pinned {
                path: path.to_path_buf(),
                what,
            });
        }
        if !trust_digest {
            table.verify(None)?;
        }
        if let Some(hint) = table.page_sums_hint() {
            tracing::warn!("{hint}");
        }
        let sums = table.read_page_sums()?.map(Arc::from);
        let io_err = |source| SsdError::Io {
            path: path.to_path_buf(),
            source,
        };
        let (file, direct) = open_for_reads(path, opts.direct, &table.layout).map_err(io_err)?;
        let file = Arc::new(file);
        let ioprio = ioprio::effective(opts.ioprio);
        let pool = || PreadPool::new(file.clone(), opts.pread_threads, ioprio).map_err(io_err);
        let uring = |new_ring| UringEngine::new(new_ring, ioprio::value(ioprio));
        let engine = match opts.io {
            SsdIo::Pread => Engine::Pread(pool()?),
            SsdIo::Uring => Engine::Uring(Box::new(uring(new_ring).map_err(SsdError::NoUring)?)),
            SsdIo::Auto => match uring(new_ring) {
                Ok(e) => Engine::Uring(Box::new(e)),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "io_uring unavailable; reading the SSD copy with a pread pool");
                    Engine::Pread(pool()?)
                }
            },
        };
        Ok(Self {
            path: path.to_path_buf(),
            file,
            layout: table.layout,
            digest: table.meta.digest,
            sums,
            direct,
            pread_threads: opts.pread_threads,
            ioprio,
            engine,
            plan: Vec::with_capacity(MAX_IN_FLIGHT),
            checksum_failures: 0,
            retired_ring: RingStats::default(),
        })
    }

    /// Another reader of the same copy, with its own engine of the same
    /// kind (its own ring and buffers, or its own pread pool) and the
    /// checksums shared: a second batch can be read while this one's is.
    pub fn another(&self) -> Result<Self, SsdError> {
        let io_err = |source| SsdError::Io {
            path: self.path.clone(),
            source,
        };
        let engine = match self.engine {
            Engine::Uring(_) => Engine::Uring(Box::new(
                UringEngine::new(Box::new(uring::real_ring), ioprio::value(self.ioprio))
                    .map_err(SsdError::NoUring)?,
            )),
            Engine::Pread(_) => Engine::Pread(
                PreadPool::new(self.file.clone(), self.pread_threads, self.ioprio)
                    .map_err(io_err)?,
            ),
        };
        Ok(Self {
            path: self.path.clone(),
            file: self.file.clone(),
            layout: self.layout,
            digest: self.digest,
            sums: self.sums.clone(),
            direct: self.direct,
            pread_threads: self.pread_threads,
            ioprio: self.ioprio,
            engine,
            plan: Vec::with_capacity(MAX_IN_FLIGHT),
            checksum_failures: 0,
            retired_ring: RingStats::default(),
        })
    }

    /// The engine reading now.
    pub fn engine(&self) -> SsdEngine {
        match self.engine {
            Engine::Uring(_) => SsdEngine::Uring,
            Engine::Pread(_) => SsdEngine::Pread,
        }
    }

    /// `io_uring` or `pread`.
    pub fn engine_name(&self) -> &'static str {
        self.engine().name()
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The I/O priority the reads have.
    pub fn ioprio(&self) -> SsdIoprio {
        self.ioprio
    }

    /// The pread pool's thread ids (none for io_uring), to read their I/O
    /// priority back from the kernel.
    pub fn pread_thread_ids(&self) -> Vec<libc::pid_t> {
        match &self.engine {
            Engine::Pread(pool) => pool.thread_ids().to_vec(),
            Engine::Uring(_) => Vec::new(),
        }
    }

    /// Whether each page read is checked against its checksum.
    pub fn checks_pages(&self) -> bool {
        self.sums.is_some()
    }

    /// The copy's digest (its version).
    pub fn digest(&self) -> TableDigest {
        self.digest
    }

    /// The copy's row count.
    pub fn rows(&self) -> u64 {
        self.layout.rows
    }

    /// Pages that did not match their checksum so far.
    pub fn checksum_failures(&self) -> u64 {
        self.checksum_failures
    }

    /// What the io_uring engine has seen go wrong (for the pread pool: what
    /// the io_uring engine it replaced had seen, if any).
    pub fn ring_stats(&self) -> RingStats {
        match &self.engine {
            Engine::Uring(u) => u.stats(),
            Engine::Pread(_) => self.retired_ring,
        }
    }

    /// Read `rows` into `out` (`rows.len() * 264` bytes), in order.
    pub fn read(&mut self, rows: &[u64], out: &mut [u8]) -> Result<(), SourceError> {
        if out.len() != rows.len() * ROW_BYTES {
            return Err(SourceError::BadRequest("output buffer size".into()));
        }
        for (chunk, out) in rows
            .chunks(MAX_IN_FLIGHT)
            .zip(out.chunks_mut(MAX_IN_FLIGHT * ROW_BYTES))
        {
            self.plan.clear();
            for &r in chunk {
                let (offset, in_page) = self.layout.row_page(r).ok_or_else(|| {
                    SourceError::BadRequest(format!(
                        "row {r} is out of range ({} rows)",
                        self.layout.rows
                    ))
                })?;
                let page = self.layout.page_index(offset);
                let sum = self.sums.as_ref().map(|s| s[page as usize]);
                self.plan.push(PageRead {
                    offset,
                    page,
                    in_page,
                    sum,
                });
            }
            self.read_plan(out).map_err(|e| self.source_error(e))?;
        }
        Ok(())
    }

    fn read_plan(&mut self, out: &mut [u8]) -> Result<(), PageError> {
        let res = match &mut self.engine {
            Engine::Pread(pool) => return pool.read(&self.plan, out),
            Engine::Uring(ring) => ring.read(self.file.as_raw_fd(), &self.plan, out),
        };
        if let Engine::Uring(ring) = &self.engine
            && ring.is_broken()
        {
            match PreadPool::new(self.file.clone(), self.pread_threads, self.ioprio) {
                Ok(pool) => {
                    self.retired_ring = ring.stats();
                    tracing::error!(path = %self.path.display(), "io_uring keeps failing; reading the SSD copy with a pread pool from now on");
                    self.engine = Engine::Pread(pool);
                }
                Err(e) => {
                    tracing::error!(path = %self.path.display(), error = %e, "io_uring keeps failing and no pread pool could start");
                }
            }
        }
        res
    }

    fn source_error(&mut self, e: PageError) -> SourceError {
        let msg = format!("{}: {e}", self.path.display());
        match e {
            PageError::Io(_) => SourceError::Failed(msg),
            PageError::Checksum { page, .. } => {
                self.checksum_failures += 1;
                static LIMIT: cluster_config::daemon::logging::RateLimit =
                    cluster_config::daemon::logging::RateLimit::new(1);
                if let Some(suppressed) = LIMIT.allow() {
                    tracing::error!(path = %self.path.display(), page, suppressed, "SSD copy: a page does not match its checksum; its rows are not used");
                }
                SourceError::Corrupt(msg)
            }
        }
    }
}

/// Open for reads, with O_DIRECT when asked and the file system allows it
/// (checked with one real read, since some accept the flag and fail reads).
fn open_for_reads(
    path: &Path,
    direct: bool,
    layout: &TableLayout,
) -> std::io::Result<(File, bool)> {
    if direct {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path);
        match f {
            Ok(f) => {
                let mut page = Pages::new(1);
                match pread::read_page(&f, page.page_mut(0), layout.data_start) {
                    Ok(_) => return Ok((f, true)),
                    Err(PageError::Io(e)) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    Err(PageError::Io(e)) => return Err(e),
                    Err(e) => return Err(std::io::Error::other(e.to_string())),
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
        tracing::warn!(path = %path.display(), "the file system refuses O_DIRECT; reading the SSD copy through the page cache");
    }
    Ok((File::open(path)?, false))
}

/// A lookup for a reader: the rows (a buffer of the source's, reused),
/// the caller's buffer to read them into, and where both go back.
struct Job {
    rows: Vec<u64>,
    buf: Vec<u8>,
    reply: oneshot::Sender<Done>,
}

/// A job's outcome, with its buffers.
type Done = (Result<(), SourceError>, Vec<u8>, Vec<u64>);

/// Row lists kept for jobs (one per lookup in flight, at most this many).
const KEPT_ROW_LISTS: usize = 8;

/// Readers per copy, each on its own thread: a lookup can start while an
/// earlier batch (a hedge nobody waits for any more, on a busy drive) is
/// still being read.
pub const READERS: usize = 2;

/// An SSD copy as a row source: [`READERS`] readers, each on its own
/// thread, taking lookups from one queue.
#[derive(Debug)]
pub struct SsdSource {
    table: u32,
    digest: TableDigest,
    engine: Arc<AtomicBool>,
    jobs: Mutex<mpsc::Sender<Job>>,
    /// Row lists that came back from jobs, for the next ones.
    row_lists: Mutex<Vec<Vec<u64>>>,
}

impl SsdSource {
    /// Serve table `table` from `reader` and [`READERS`]` - 1` more of the
    /// same copy; `engines` shows which engine reads it (1 for each in use),
    /// kept up to date if it ever changes.
    pub fn new(
        table: u32,
        reader: SsdReader,
        engines: Family<SsdLabels, Gauge>,
    ) -> Result<Self, SsdError> {
        let mut readers = Vec::with_capacity(READERS);
        for _ in 1..READERS {
            readers.push(reader.another()?);
        }
        readers.insert(0, reader);
        Self::with_readers(table, readers, engines).map_err(|source| SsdError::Io {
            path: PathBuf::from(format!("the SSD reader threads of table {table}")),
            source,
        })
    }

    /// Serve table `table` from `readers` (at least one, of one copy).
    fn with_readers(
        table: u32,
        readers: Vec<SsdReader>,
        engines: Family<SsdLabels, Gauge>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let first = readers
            .first()
            .ok_or_else(|| std::io::Error::other("no reader"))?;
        let digest = first.digest();
        let uring = Arc::new(AtomicBool::new(first.engine() == SsdEngine::Uring));
        for (i, reader) in readers.into_iter().enumerate() {
            let (rx, engines, shown) = (Arc::clone(&rx), engines.clone(), Arc::clone(&uring));
            std::thread::Builder::new()
                .name(format!("ssd-{table}-{i}"))
                .spawn(move || serve_jobs(table, reader, &rx, &engines, &shown))?;
        }
        Ok(Self {
            table,
            digest,
            engine: uring,
            jobs: Mutex::new(tx),
            row_lists: Mutex::new(Vec::new()),
        })
    }

    /// The engine reading now.
    pub fn engine(&self) -> SsdEngine {
        if self.engine.load(Ordering::Relaxed) {
            SsdEngine::Uring
        } else {
            SsdEngine::Pread
        }
    }
}

/// One reader's thread: take the next lookup from the queue, read it, answer.
fn serve_jobs(
    table: u32,
    mut reader: SsdReader,
    jobs: &Mutex<mpsc::Receiver<Job>>,
    engines: &Family<SsdLabels, Gauge>,
    shown: &AtomicBool,
) {
    let labels = |r: &SsdReader, engine: SsdEngine| SsdLabels {
        table: table.to_string(),
        engine: engine.name().to_string(),
        direct: r.is_direct().to_string(),
        page_checksums: r.checks_pages().to_string(),
        ioprio: r.ioprio().to_string(),
    };
    let mut engine = reader.engine();
    engines.get_or_create(&labels(&reader, engine)).set(1);
    loop {
        let job = match jobs.lock().map(|q| q.recv()) {
            Ok(Ok(job)) => job,
            _ => return,
        };
        // A cancelled fetch (a hedge that lost) is skipped.
        if job.reply.is_closed() {
            continue;
        }
        let mut buf = job.buf;
        let res = reader.read(&job.rows, &mut buf);
        let _ = job.reply.send((res, buf, job.rows));
        if reader.engine() != engine {
            engines.get_or_create(&labels(&reader, engine)).set(0);
            engine = reader.engine();
            engines.get_or_create(&labels(&reader, engine)).set(1);
            shown.store(engine == SsdEngine::Uring, Ordering::Relaxed);
        }
    }
}

impl RowSource for SsdSource {
    fn name(&self) -> &str {
        "ssd"
    }

    fn kind(&self) -> SourceKind {
        SourceKind::Ssd
    }

    fn fetch<'a>(
        &'a self,
        table: u32,
        rows: &'a [u64],
        buf: Vec<u8>,
        deadline: Instant,
    ) -> FetchFuture<'a> {
        Box::pin(async move {
            if table != self.table {
                let e = SourceError::BadRequest(format!(
                    "this copy holds table {}, not {table}",
                    self.table
                ));
                return (Err(e), buf);
            }
            // The reader reads straight into the caller's buffer, and hands
            // it back with the row list.
            let mut list = self
                .row_lists
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop()
                .unwrap_or_default();
            list.clear();
            list.extend_from_slice(rows);
            let (reply, rx) = oneshot::channel();
            let sent = self
                .jobs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .send(Job {
                    rows: list,
                    buf,
                    reply,
                });
            let stopped = || SourceError::Unavailable("the SSD reader stopped".into());
            if let Err(mpsc::SendError(job)) = sent {
                return (Err(stopped()), job.buf);
            }
            match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok((res, buf, list))) => {
                    let mut lists = self.row_lists.lock().unwrap_or_else(|p| p.into_inner());
                    if lists.len() < KEPT_ROW_LISTS {
                        lists.push(list);
                    }
                    (res, buf)
                }
                // The buffer stays with the reader (it is dropped there).
                Ok(Err(_)) => (Err(stopped()), Vec::new()),
                Err(_) => (Err(SourceError::Timeout), Vec::new()),
            }
        })
    }

    fn probe(&self) -> ProbeFuture<'_> {
        Box::pin(async move { Ok(vec![(self.table, self.digest)]) })
    }
}
