//! The node's SSD copy of a table: one aligned 4 KiB read per row (a row
//! never straddles a page in an `.etab` file), every read of a batch in
//! flight at once. Two engines: io_uring (all reads of a batch submitted
//! with one system call, completions reaped together) and a pool of threads
//! issuing `pread` (where io_uring is unavailable or not wanted). Files are
//! opened with O_DIRECT so reads measure the device, not the page cache;
//! where the file system refuses O_DIRECT the copy is read buffered, with a
//! warning.
//!
//! [`SsdReader`] is synchronous (one batch at a time, buffers reused);
//! [`SsdSource`] runs one on its own thread for the router.

use std::alloc::Layout;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use cluster_config::SsdIo;
use engram_protocol::etab::{PAGE_BYTES, TableLayout};
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_store::resident::ExpectedTable;
use engram_store::table_file::{TableFile, TableFileError};
use thiserror::Error;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{FetchFuture, ProbeFuture, RowSource, SourceError, SourceKind};

const PAGE: usize = PAGE_BYTES as usize;
/// Reads in flight at once (a larger batch goes in chunks of this many).
pub const MAX_IN_FLIGHT: usize = 256;
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
}

impl Default for SsdOptions {
    fn default() -> Self {
        Self {
            io: SsdIo::Auto,
            direct: true,
            pread_threads: DEFAULT_PREAD_THREADS,
        }
    }
}

/// A page-aligned buffer of whole pages (O_DIRECT needs aligned memory).
struct Pages {
    ptr: std::ptr::NonNull<u8>,
    pages: usize,
}

// SAFETY: `Pages` owns its allocation exclusively, like a `Box<[u8]>`.
unsafe impl Send for Pages {}

impl Pages {
    fn new(pages: usize) -> Self {
        let layout = Self::layout(pages);
        // SAFETY: the layout has a non-zero size (at least one page).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, pages }
    }

    fn layout(pages: usize) -> Layout {
        Layout::from_size_align(pages.max(1) * PAGE, PAGE)
            .expect("page multiples are valid layouts")
    }

    fn page_mut(&mut self, i: usize) -> &mut [u8] {
        assert!(i < self.pages);
        // SAFETY: in bounds of the allocation (checked above), uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(i * PAGE), PAGE) }
    }

    fn page_ptr(&mut self, i: usize) -> *mut u8 {
        self.page_mut(i).as_mut_ptr()
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this same layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.pages)) }
    }
}

impl std::fmt::Debug for Pages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pages({})", self.pages)
    }
}

/// A pool of threads, each reading the pages handed to it with pread. A
/// batch is queued whole; free threads take the next read, so with as many
/// threads as rows every read is in flight at once, and with 4 threads for
/// 24 rows each thread reads about 6 in turn.
#[derive(Debug)]
pub struct PreadPool {
    jobs: Option<mpsc::Sender<PreadJob>>,
    done_rx: mpsc::Receiver<(usize, std::io::Result<Box<[u8; ROW_BYTES]>>)>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

struct PreadJob {
    index: usize,
    page: u64,
    in_page: usize,
}

impl PreadPool {
    /// Start `threads` readers of `file`.
    pub fn new(file: Arc<File>, threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<PreadJob>();
        let rx = Arc::new(Mutex::new(rx));
        let (done_tx, done_rx) = mpsc::channel();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let done = done_tx.clone();
            let file = file.clone();
            let h = std::thread::Builder::new()
                .name(format!("ssd-pread-{i}"))
                .spawn(move || {
                    let mut page = Pages::new(1);
                    loop {
                        let job = match rx.lock().map(|r| r.recv()) {
                            Ok(Ok(job)) => job,
                            _ => return,
                        };
                        let buf = page.page_mut(0);
                        let res = read_page(&file, buf, job.page, job.in_page).map(|()| {
                            let mut row = Box::new([0u8; ROW_BYTES]);
                            row.copy_from_slice(&buf[job.in_page..job.in_page + ROW_BYTES]);
                            row
                        });
                        if done.send((job.index, res)).is_err() {
                            return;
                        }
                    }
                })?;
            handles.push(h);
        }
        Ok(Self {
            jobs: Some(tx),
            done_rx,
            threads: handles,
        })
    }

    fn read(&mut self, pages: &[(u64, usize)], out: &mut [u8]) -> std::io::Result<()> {
        let jobs = self
            .jobs
            .as_ref()
            .ok_or_else(|| std::io::Error::other("pool stopped"))?;
        for (index, &(page, in_page)) in pages.iter().enumerate() {
            jobs.send(PreadJob {
                index,
                page,
                in_page,
            })
            .map_err(|_| std::io::Error::other("pread pool is gone"))?;
        }
        let mut first_err = None;
        for _ in 0..pages.len() {
            let (i, res) = self
                .done_rx
                .recv()
                .map_err(|_| std::io::Error::other("pread pool is gone"))?;
            match res {
                Ok(row) => out[i * ROW_BYTES..(i + 1) * ROW_BYTES].copy_from_slice(&row[..]),
                Err(e) => first_err = first_err.or(Some(e)),
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for PreadPool {
    fn drop(&mut self) {
        self.jobs = None;
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

fn read_page(file: &File, buf: &mut [u8], page: u64, in_page: usize) -> std::io::Result<()> {
    let n = file.read_at(buf, page)?;
    if n < in_page + ROW_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("short read at {page}: {n} bytes"),
        ));
    }
    Ok(())
}

enum Engine {
    Uring(Box<io_uring::IoUring>),
    Pread(PreadPool),
}

/// Reads rows of one `.etab` copy, a batch at a time.
pub struct SsdReader {
    path: PathBuf,
    file: Arc<File>,
    layout: TableLayout,
    digest: TableDigest,
    direct: bool,
    engine: Engine,
    pages: Pages,
    plan: Vec<(u64, usize)>,
}

impl std::fmt::Debug for SsdReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdReader")
            .field("path", &self.path)
            .field("engine", &self.engine_name())
            .field("direct", &self.direct)
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
        let io_err = |source| SsdError::Io {
            path: path.to_path_buf(),
            source,
        };
        let (file, direct) = open_for_reads(path, opts.direct, &table.layout).map_err(io_err)?;
        let file = Arc::new(file);
        let engine = match opts.io {
            SsdIo::Pread => {
                Engine::Pread(PreadPool::new(file.clone(), opts.pread_threads).map_err(io_err)?)
            }
            SsdIo::Uring => Engine::Uring(Box::new(
                io_uring::IoUring::new(MAX_IN_FLIGHT as u32).map_err(SsdError::NoUring)?,
            )),
            SsdIo::Auto => match io_uring::IoUring::new(MAX_IN_FLIGHT as u32) {
                Ok(r) => Engine::Uring(Box::new(r)),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "io_uring unavailable; reading the SSD copy with a pread pool");
                    Engine::Pread(PreadPool::new(file.clone(), opts.pread_threads).map_err(io_err)?)
                }
            },
        };
        Ok(Self {
            path: path.to_path_buf(),
            file,
            layout: table.layout,
            digest: table.meta.digest,
            direct,
            engine,
            pages: Pages::new(24),
            plan: Vec::with_capacity(MAX_IN_FLIGHT),
        })
    }

    /// `io_uring` or `pread`.
    pub fn engine_name(&self) -> &'static str {
        match self.engine {
            Engine::Uring(_) => "io_uring",
            Engine::Pread(_) => "pread",
        }
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The copy's digest (its version).
    pub fn digest(&self) -> TableDigest {
        self.digest
    }

    /// The copy's row count.
    pub fn rows(&self) -> u64 {
        self.layout.rows
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
                let p = self.layout.row_page(r).ok_or_else(|| {
                    SourceError::BadRequest(format!(
                        "row {r} is out of range ({} rows)",
                        self.layout.rows
                    ))
                })?;
                self.plan.push(p);
            }
            self.read_plan(out)
                .map_err(|e| SourceError::Failed(format!("{}: {e}", self.path.display())))?;
        }
        Ok(())
    }

    fn read_plan(&mut self, out: &mut [u8]) -> std::io::Result<()> {
        let n = self.plan.len();
        let ring = match &mut self.engine {
            Engine::Pread(pool) => return pool.read(&self.plan, out),
            Engine::Uring(ring) => ring,
        };
        if self.pages.pages < n {
            self.pages = Pages::new(n.next_power_of_two().min(MAX_IN_FLIGHT));
        }
        let fd = io_uring::types::Fd(self.file.as_raw_fd());
        for (i, &(page, _)) in self.plan.iter().enumerate() {
            let sqe = io_uring::opcode::Read::new(fd, self.pages.page_ptr(i), PAGE as u32)
                .offset(page)
                .build()
                .user_data(i as u64);
            // SAFETY: the buffer stays alive and untouched until its
            // completion is reaped below (we wait for all `n`).
            unsafe { ring.submission().push(&sqe) }
                .map_err(|_| std::io::Error::other("submission queue full"))?;
        }
        let mut done = 0;
        let mut first_err = None;
        while done < n {
            ring.submit_and_wait(n - done)?;
            for cqe in ring.completion() {
                done += 1;
                let i = cqe.user_data() as usize;
                let res = cqe.result();
                let Some(&(page, in_page)) = self.plan.get(i) else {
                    continue;
                };
                if res < 0 {
                    first_err = first_err.or(Some(std::io::Error::from_raw_os_error(-res)));
                } else if (res as usize) < in_page + ROW_BYTES {
                    first_err = first_err.or(Some(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("short read at {page}: {res} bytes"),
                    )));
                } else {
                    let src = &self.pages.page_mut(i)[in_page..in_page + ROW_BYTES];
                    out[i * ROW_BYTES..(i + 1) * ROW_BYTES].copy_from_slice(src);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
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
                match f.read_at(page.page_mut(0), layout.data_start) {
                    Ok(_) => return Ok((f, true)),
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    Err(e) => return Err(e),
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
        tracing::warn!(path = %path.display(), "the file system refuses O_DIRECT; reading the SSD copy through the page cache");
    }
    Ok((File::open(path)?, false))
}

struct Job {
    rows: Vec<u64>,
    reply: oneshot::Sender<Result<Vec<u8>, SourceError>>,
}

/// An SSD copy as a row source: an [`SsdReader`] on its own thread.
#[derive(Debug)]
pub struct SsdSource {
    table: u32,
    digest: TableDigest,
    engine: &'static str,
    jobs: Mutex<mpsc::Sender<Job>>,
}

impl SsdSource {
    /// Serve table `table` from `reader`.
    pub fn new(table: u32, mut reader: SsdReader) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let digest = reader.digest();
        let engine = reader.engine_name();
        std::thread::Builder::new()
            .name(format!("ssd-{table}"))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    // A cancelled fetch (a hedge that lost) is skipped.
                    if job.reply.is_closed() {
                        continue;
                    }
                    let mut out = vec![0u8; job.rows.len() * ROW_BYTES];
                    let res = reader.read(&job.rows, &mut out).map(|()| out);
                    let _ = job.reply.send(res);
                }
            })?;
        Ok(Self {
            table,
            digest,
            engine,
            jobs: Mutex::new(tx),
        })
    }

    /// `io_uring` or `pread`.
    pub fn engine_name(&self) -> &'static str {
        self.engine
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
        out: &'a mut [u8],
        deadline: Instant,
    ) -> FetchFuture<'a> {
        Box::pin(async move {
            if table != self.table {
                return Err(SourceError::BadRequest(format!(
                    "this copy holds table {}, not {table}",
                    self.table
                )));
            }
            let (reply, rx) = oneshot::channel();
            self.jobs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .send(Job {
                    rows: rows.to_vec(),
                    reply,
                })
                .map_err(|_| SourceError::Unavailable("the SSD reader stopped".into()))?;
            let rows = tokio::time::timeout_at(deadline, rx)
                .await
                .map_err(|_| SourceError::Timeout)?
                .map_err(|_| SourceError::Unavailable("the SSD reader stopped".into()))??;
            if rows.len() != out.len() {
                return Err(SourceError::BadRequest("output buffer size".into()));
            }
            out.copy_from_slice(&rows);
            Ok(())
        })
    }

    fn probe(&self) -> ProbeFuture<'_> {
        Box::pin(async move { Ok(vec![(self.table, self.digest)]) })
    }
}
