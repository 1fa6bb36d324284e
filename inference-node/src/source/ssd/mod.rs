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
mod queue;
#[cfg(test)]
mod tests;
mod uring;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cluster_config::{SsdIo, SsdIoprio};
use engram_protocol::TableDigest;
use engram_protocol::encoding::RowEncoding;
use engram_protocol::etab::TableLayout;
use engram_store::resident::ExpectedTable;
use engram_store::table_file::{TableFile, TableFileError};
use engram_sync::Mutex;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use thiserror::Error;
use tokio::time::Instant;

use super::{
    FetchDone, FetchFuture, FetchJob, FetchSlot, ProbeFuture, RowSource, SourceError, SourceKind,
};
use crate::metrics::SsdLabels;
use pages::{PageError, PageRead, Pages};
pub use pread::PreadPool;
use queue::{Completion, Job, Queue};
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
    Pinned {
        /// The SSD copy's file.
        path: PathBuf,
        /// What differs from the config's pin.
        what: String,
    },
    /// io_uring was required and the kernel refused it.
    #[error("io_uring is unavailable ({0}); set ssd_io = \"pread\" or \"auto\"")]
    NoUring(std::io::Error),
    /// Opening for reads failed.
    #[error("{path}: {source}")]
    Io {
        /// The SSD copy's file (or, when its reader threads could not start, words naming them).
        path: PathBuf,
        /// The OS error.
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
    encoding: RowEncoding,
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
        let table = TableFile::open_any(path)?;
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
            encoding: table.meta.encoding,
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
            encoding: self.encoding,
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

    /// How the copy's rows are encoded.
    pub fn encoding(&self) -> RowEncoding {
        self.encoding
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

    /// Read `rows` into `out` (`rows.len()` times the copy's row size), in
    /// order.
    pub fn read(&mut self, rows: &[u64], out: &mut [u8]) -> Result<(), SourceError> {
        let len = self.encoding.row_bytes();
        if out.len() != rows.len() * len {
            return Err(SourceError::BadRequest("output buffer size".into()));
        }
        for (chunk, out) in rows
            .chunks(MAX_IN_FLIGHT)
            .zip(out.chunks_mut(MAX_IN_FLIGHT * len))
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
                    len,
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
                static LIMIT: daemon_runtime::logging::RateLimit =
                    daemon_runtime::logging::RateLimit::new(1);
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

/// Completions kept for jobs (one per lookup in flight, at most this many).
const KEPT_COMPLETIONS: usize = 8;

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
    jobs: Arc<Queue>,
    /// Completions of answered jobs, for the next ones.
    completions: Mutex<Vec<Arc<Completion>>>,
}

impl Drop for SsdSource {
    fn drop(&mut self) {
        self.jobs.stop();
    }
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
        let queue = Arc::new(Queue::default());
        let first = readers
            .first()
            .ok_or_else(|| std::io::Error::other("no reader"))?;
        let digest = first.digest();
        let uring = Arc::new(AtomicBool::new(first.engine() == SsdEngine::Uring));
        for (i, reader) in readers.into_iter().enumerate() {
            let (jobs, engines, shown) = (Arc::clone(&queue), engines.clone(), Arc::clone(&uring));
            let spawned = std::thread::Builder::new()
                .name(format!("ssd-{table}-{i}"))
                .spawn(move || serve_jobs(table, reader, &jobs, &engines, &shown));
            if let Err(e) = spawned {
                queue.stop();
                return Err(e);
            }
        }
        Ok(Self {
            table,
            digest,
            engine: uring,
            jobs: queue,
            completions: Mutex::new(Vec::new()),
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

    /// A completion for the next job: one kept from an earlier job, else
    /// a new one.
    fn completion(&self) -> Arc<Completion> {
        let kept = self.completions.lock().pop();
        match kept {
            Some(c) => {
                c.reset();
                c
            }
            None => Arc::new(Completion::default()),
        }
    }

    /// Keep `c` for a later job, when nothing else holds it any more.
    fn keep(&self, c: Arc<Completion>) {
        if Arc::strong_count(&c) == 1 {
            let mut kept = self.completions.lock();
            if kept.len() < KEPT_COMPLETIONS {
                kept.push(c);
            }
        }
    }

    /// Have a reader read `job`'s rows straight into its buffer, by its
    /// deadline. The buffer comes back filled, or empty when the reader
    /// kept it (a timeout: it is dropped there).
    async fn run(&self, mut job: FetchJob) -> FetchDone {
        if job.table != self.table {
            let e = SourceError::BadRequest(format!(
                "this copy holds table {}, not {}",
                self.table, job.table
            ));
            return (Err(e), job);
        }
        let reply = self.completion();
        let sent = self.jobs.push(Job {
            rows: std::mem::take(&mut job.rows),
            buf: std::mem::take(&mut job.buf),
            reply: Some(Arc::clone(&reply)),
        });
        let stopped = || SourceError::Unavailable("the SSD reader stopped".into());
        if let Err(mut back) = sent {
            job.rows = std::mem::take(&mut back.rows);
            job.buf = std::mem::take(&mut back.buf);
            return (Err(stopped()), job);
        }
        // Stops the job if this future is dropped before the answer.
        let waiting = CancelOnDrop(Some(&reply));
        let answer =
            tokio::time::timeout_at(job.deadline, std::future::poll_fn(|cx| reply.poll_done(cx)))
                .await;
        match answer {
            Ok(Some((res, buf, rows))) => {
                waiting.disarm();
                self.keep(reply);
                job.rows = rows;
                job.buf = buf;
                (res, job)
            }
            Ok(None) => (Err(stopped()), job),
            Err(_) => (Err(SourceError::Timeout), job),
        }
    }
}

/// Cancels a job whose caller stops waiting for it.
struct CancelOnDrop<'a>(Option<&'a Completion>);

impl CancelOnDrop<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.0 {
            c.cancel();
        }
    }
}

/// One reader's thread: take the next lookup from the queue, read it, answer.
fn serve_jobs(
    table: u32,
    mut reader: SsdReader,
    jobs: &Queue,
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
        let Some(mut job) = jobs.pop() else { return };
        // A cancelled fetch (a hedge that lost) is skipped.
        let Some(reply) = job.reply.take().filter(|r| !r.is_cancelled()) else {
            continue;
        };
        let mut buf = std::mem::take(&mut job.buf);
        let res = reader.read(&job.rows, &mut buf);
        let rows = std::mem::take(&mut job.rows);
        drop(job);
        reply.complete((res, buf, rows));
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
            let job = FetchJob {
                table,
                rows: rows.to_vec(),
                buf,
                deadline,
            };
            let (res, job) = self.run(job).await;
            (res, job.buf)
        })
    }

    fn fetch_job(self: Arc<Self>, job: FetchJob, slot: &mut FetchSlot) {
        slot.set(async move { self.run(job).await });
    }

    fn probe(&self) -> ProbeFuture<'_> {
        Box::pin(async move { Ok(vec![(self.table, self.digest)]) })
    }
}
