//! Reading a table file's rows into memory on every core at once, the
//! digest computed in the same pass.
//!
//! The rows, compacted (no page slack), are cut into segments of a power
//! of two bytes (4 MiB by default). Workers claim segments in order, so the
//! file is still read front to back and the kernel's readahead keeps up.
//! For its segment a worker:
//!
//! 1. reads the rows that *start* in the segment straight into their place
//!    with `preadv` (one iovec per page's rows, the page slack into a
//!    scratch buffer): one copy, from the page cache into the table;
//! 2. hashes the segment's bytes as a BLAKE3 subtree at its offset
//!    (`blake3::hazmat`), while they are still in cache. The bytes before
//!    the first row that starts in the segment belong to a row another
//!    worker places; this worker reads those few bytes from the file
//!    itself, so no worker ever waits for another;
//! 3. tells the kernel it is done with that part of the file (optional).
//!
//! The subtrees' chaining values are then merged into the root in the
//! order BLAKE3's left-balanced tree has them, which gives the same digest
//! as hashing the rows front to back: tested below against
//! [`TableDigest::of_rows`] for sizes around every boundary.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use blake3::hazmat::{
    ChainingValue, HasherExt, Mode, merge_subtrees_non_root, merge_subtrees_root,
};
use engram_protocol::etab::{PAGE_BYTES, TableLayout};
use engram_protocol::{ROW_BYTES, TableDigest};
use engram_sync::Mutex;

use crate::background::Background;
use crate::progress::Progress;
use crate::table_file::{TableFile, TableFileError};

mod mapped;
pub(crate) use mapped::{hash_gathered, populate};
pub use mapped::{hash_parallel, touch_mapped};

/// Default segment: 4 MiB of rows (4,096 BLAKE3 chunks).
pub const SEGMENT_BYTES: usize = 4 << 20;

/// Pages per `preadv` call: two iovecs a page (rows, slack) stay within
/// the kernel's limit of 1,024.
const PAGES_PER_CALL: usize = 512;

/// How to fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillOptions {
    /// Worker threads (at least 1).
    pub threads: usize,
    /// Segment size in bytes: a power of two of at least 1,024 (one
    /// BLAKE3 chunk).
    pub segment: usize,
    /// Compute the digest.
    pub digest: bool,
    /// Tell the kernel to drop each part of the file from the page cache
    /// once placed, so a table's load does not push everything else out.
    pub drop_behind: bool,
    /// Run the workers at this background priority (the caller's thread
    /// keeps its own): a load beside serving work on the same host.
    pub background: Option<Background>,
    /// The destination is fresh zeroed memory (a new memfd or anonymous
    /// mapping): where the file has a hole ([`crate::holes`]) nothing is
    /// read or placed (the memory stays untouched, so a sparse table takes
    /// only the pages it has data in), and zeros are hashed.
    pub skip_holes: bool,
}

impl Default for FillOptions {
    fn default() -> Self {
        Self {
            threads: cores(),
            segment: SEGMENT_BYTES,
            digest: true,
            drop_behind: true,
            background: None,
            skip_holes: false,
        }
    }
}

/// The cores this process may run on.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A raw pointer to the table's memory, shared by the workers. Each worker
/// writes only the rows that start in the segments it claimed, and reads
/// only those; no two workers touch the same byte.
#[derive(Clone, Copy)]
struct Base(*mut u8);
// SAFETY: see the type's docs: workers use disjoint ranges of one buffer
// that outlives them (the scope in `fill`).
unsafe impl Send for Base {}
// SAFETY: as above.
unsafe impl Sync for Base {}

/// Read every row of `file` into `dst` (exactly `rows * row_bytes`
/// bytes, rows back to back; rows of any encoding), on `opts.threads` threads; returns the digest of the
/// rows when `opts.digest`. Progress, in rows, goes to `progress` from
/// the calling thread about every 25 ms.
pub fn fill(
    file: &TableFile,
    dst: &mut [u8],
    opts: FillOptions,
    progress: Option<&mut Progress>,
) -> Result<Option<TableDigest>, TableFileError> {
    let rows = file.layout.rows;
    let total = dst.len();
    if total as u64 != rows * file.layout.row_bytes {
        return Err(io_error(
            file,
            "fill",
            format!("buffer of {total} bytes for {rows} rows"),
        ));
    }
    let dest = Dest::Packed(Base(dst.as_mut_ptr()));
    let Some((segments, cvs)) = place(file, dest, total, opts, progress)? else {
        return Ok(None);
    };
    if segments == 1 {
        return Ok(Some(TableDigest::of_rows(dst)));
    }
    Ok(Some(root(&cvs)))
}

/// Place `total` bytes of rows (as if back to back) at `dest` in
/// segments on `opts.threads` workers: the segment count and the
/// segments' chaining values, or `None` when not hashing.
fn place(
    file: &TableFile,
    dest: Dest,
    total: usize,
    opts: FillOptions,
    progress: Option<&mut Progress>,
) -> Result<Option<(usize, Vec<ChainingValue>)>, TableFileError> {
    let segment = opts.segment.max(blake3::CHUNK_LEN).next_power_of_two();
    let segments = total.div_ceil(segment).max(1);
    let cvs = run_segments(
        segments,
        opts.threads,
        progress,
        || {
            lower(opts.background);
            Worker::new(file)
        },
        |work, s| work.segment(dest, total, segment, s, segments, opts),
    )?;
    Ok(opts.digest.then_some((segments, cvs)))
}

/// [`fill`] into a planar layout: row `r`'s 256 values to `values[r * 256..]`
/// and its 8 scale bytes to `scales[r * 8..]` (exactly `rows * 256` and at
/// least `rows * 8` bytes). The digest is the rows' (as if back to back):
/// each worker reads its segment's rows into a buffer of its own, hashes
/// them there, then scatters them.
pub fn fill_planar(
    file: &TableFile,
    values: &mut [u8],
    scales: &mut [u8],
    opts: FillOptions,
    progress: Option<&mut Progress>,
) -> Result<Option<TableDigest>, TableFileError> {
    file.require_v41("a planar table")?;
    let rows = file.layout.rows;
    if values.len() as u64 != rows * VALUES as u64 || (scales.len() as u64) < rows * SCALES as u64 {
        return Err(io_error(
            file,
            "fill",
            format!(
                "buffers of {} and {} bytes for {rows} planar rows",
                values.len(),
                scales.len()
            ),
        ));
    }
    let total = rows as usize * ROW_BYTES;
    let dest = Dest::Planar {
        values: Base(values.as_mut_ptr()),
        scales: Base(scales.as_mut_ptr()),
    };
    let Some((segments, cvs)) = place(file, dest, total, opts, progress)? else {
        return Ok(None);
    };
    if segments == 1 {
        let mut h = blake3::Hasher::new();
        for r in 0..rows as usize {
            h.update(&values[r * VALUES..][..VALUES]);
            h.update(&scales[r * SCALES..][..SCALES]);
        }
        return Ok(Some(TableDigest(*h.finalize().as_bytes())));
    }
    Ok(Some(root(&cvs)))
}

/// A row's value bytes, then its scale bytes.
const VALUES: usize = 256;
const SCALES: usize = ROW_BYTES - VALUES;

/// Where a fill places rows.
#[derive(Clone, Copy)]
enum Dest {
    /// Back to back from this address.
    Packed(Base),
    /// Values from one address, scales from another.
    Planar {
        /// Row `r`'s values at `r * 256`.
        values: Base,
        /// Row `r`'s scales at `r * 8`.
        scales: Base,
    },
}

/// Run `work` over segments `0..segments` on `threads` workers (each with
/// its own state from `new_worker`), segments claimed in order; the first
/// error stops the others. `work` returns the rows it finished and the
/// segment's chaining value (if it hashed). Progress, in rows, goes to
/// `progress` from the calling thread about every 25 ms. Returns the
/// chaining values in segment order (zeros where none), or the error of
/// the lowest segment that failed: segments are claimed in order and no
/// new one is claimed after a failure, so every segment below a failed one
/// finishes, and the error returned is the first in the file.
pub(crate) fn run_segments<W>(
    segments: usize,
    threads: usize,
    progress: Option<&mut Progress>,
    new_worker: impl Fn() -> W + Sync,
    work: impl Fn(&mut W, usize) -> Result<(u64, Option<ChainingValue>), TableFileError> + Sync,
) -> Result<Vec<ChainingValue>, TableFileError> {
    let next = AtomicUsize::new(0);
    let done = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<(usize, TableFileError)>> = Mutex::new(None);
    let cvs: Mutex<Vec<ChainingValue>> = Mutex::new(vec![[0; 32]; segments]);
    let threads = threads.clamp(1, segments.max(1));
    let finished = AtomicUsize::new(0);
    let caller = std::thread::current();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let mut state = new_worker();
                loop {
                    if failed.load(Ordering::Relaxed) {
                        break;
                    }
                    let s = next.fetch_add(1, Ordering::Relaxed);
                    if s >= segments {
                        break;
                    }
                    match work(&mut state, s) {
                        Ok((placed, cv)) => {
                            if let Some(cv) = cv {
                                cvs.lock()[s] = cv;
                            }
                            done.fetch_add(placed, Ordering::Relaxed);
                        }
                        Err(e) => {
                            failed.store(true, Ordering::Relaxed);
                            let mut first = first_error.lock();
                            if first.as_ref().is_none_or(|(at, _)| s < *at) {
                                *first = Some((s, e));
                            }
                            break;
                        }
                    }
                }
                finished.fetch_add(1, Ordering::Release);
                caller.unpark();
            });
        }
        let mut progress = progress;
        while finished.load(Ordering::Acquire) < threads {
            std::thread::park_timeout(Duration::from_millis(25));
            if let Some(p) = progress.as_deref_mut() {
                p.update(done.load(Ordering::Relaxed));
            }
        }
        if let Some(p) = progress {
            p.update(done.load(Ordering::Relaxed));
        }
    });
    if let Some((_, e)) = first_error.into_inner() {
        return Err(e);
    }
    Ok(cvs.into_inner())
}

/// Bytes of rows in one page of a table file (15 V4.1 rows; the rest is
/// slack).
pub(crate) fn page_rows_bytes(layout: &TableLayout) -> usize {
    (layout.rows_per_page * layout.row_bytes) as usize
}

/// Lower a worker thread to `how`, when asked (a worker that cannot be
/// lowered works on at its priority).
fn lower(how: Option<Background>) {
    if let Some(how) = how
        && let Err(e) = crate::background::lower_this_thread(how)
    {
        tracing::debug!(error = %e, "a load worker stays at its priority");
    }
}

/// The root of the left-balanced tree over equal subtrees (the last may
/// be shorter): the left part holds the largest power of two of them
/// below their count, as BLAKE3's tree does over chunks.
pub(crate) fn root(cvs: &[ChainingValue]) -> TableDigest {
    let left = left_len(cvs.len());
    let hash = merge_subtrees_root(&merge(&cvs[..left]), &merge(&cvs[left..]), Mode::Hash);
    TableDigest(*hash.as_bytes())
}

fn merge(cvs: &[ChainingValue]) -> ChainingValue {
    if cvs.len() == 1 {
        return cvs[0];
    }
    let left = left_len(cvs.len());
    merge_subtrees_non_root(&merge(&cvs[..left]), &merge(&cvs[left..]), Mode::Hash)
}

/// The largest power of two below `n` (n >= 2).
fn left_len(n: usize) -> usize {
    1 << (usize::BITS - 1 - (n - 1).leading_zeros())
}

fn io_error(file: &TableFile, op: &'static str, what: String) -> TableFileError {
    TableFileError::Io {
        path: file.path.clone(),
        op,
        source: std::io::Error::other(what),
    }
}

/// Scatter `rows` (back to back; the first is row `r0`) into a planar
/// table's values and scales.
fn scatter(rows: &[u8], r0: usize, values: Base, scales: Base) {
    for (i, r) in rows.chunks_exact(ROW_BYTES).enumerate() {
        // SAFETY: row r0 + i lies inside both regions (checked against the
        // row count in `fill_planar`), and only this worker places it.
        unsafe {
            let v = values.0.add((r0 + i) * VALUES);
            std::ptr::copy_nonoverlapping(r.as_ptr(), v, VALUES);
            let sc = scales.0.add((r0 + i) * SCALES);
            std::ptr::copy_nonoverlapping(r.as_ptr().add(VALUES), sc, SCALES);
        }
    }
}

/// One worker's buffers.
struct Worker<'a> {
    file: &'a TableFile,
    slack: Vec<u8>,
    head: Vec<u8>,
    iov: Vec<libc::iovec>,
    /// A planar fill's rows, read and hashed here before they are scattered.
    scratch: Vec<u8>,
}

impl<'a> Worker<'a> {
    fn new(file: &'a TableFile) -> Self {
        Self {
            file,
            slack: vec![0; PAGE_BYTES as usize],
            head: vec![0; file.layout.row_bytes as usize],
            iov: Vec::with_capacity(2 * PAGES_PER_CALL),
            scratch: Vec::new(),
        }
    }

    /// Place the rows that start in segment `s` and hash the segment;
    /// returns the rows placed and the segment's chaining value.
    fn segment(
        &mut self,
        dest: Dest,
        total: usize,
        size: usize,
        s: usize,
        segments: usize,
        opts: FillOptions,
    ) -> Result<(u64, Option<ChainingValue>), TableFileError> {
        let row = self.file.layout.row_bytes as usize;
        let a = s * size;
        let b = (a + size).min(total);
        let r0 = a.div_ceil(row);
        let r1 = b.div_ceil(row).min(total / row);
        let n = r1.max(r0) - r0;
        let mut scratch = std::mem::take(&mut self.scratch);
        let mine: &mut [u8] = match dest {
            // SAFETY: rows r0..r1 lie inside the buffer (r1 * 264 <= total)
            // and start in segment s, which only this worker claimed.
            Dest::Packed(base) => unsafe {
                std::slice::from_raw_parts_mut(base.0.add(r0 * row), n * row)
            },
            Dest::Planar { .. } => {
                scratch.resize(n * row, 0);
                &mut scratch[..]
            }
        };
        let span = self.span(r0 as u64, r1 as u64);
        let hole = opts.skip_holes
            && span.is_some_and(|(off, len)| crate::holes::is_hole(self.file.std_file(), off, len));
        let cv = if hole {
            self.hash_segment(None, (a, b), (r0, segments), opts)
        } else {
            let read = self.read_rows(r0 as u64, r1 as u64, mine);
            read.and_then(|()| self.hash_segment(Some(mine), (a, b), (r0, segments), opts))
        };
        if let (Ok(_), false, Dest::Planar { values, scales }) = (&cv, hole, dest) {
            scatter(mine, r0, values, scales);
        }
        self.scratch = scratch;
        let cv = cv?;
        if opts.drop_behind
            && !hole
            && let Some((off, len)) = span
        {
            advise(self.file, off, len, libc::POSIX_FADV_DONTNEED);
        }
        Ok((n as u64, cv))
    }

    /// The chaining value of a segment (bytes `a..b` of the rows back to
    /// back), whose rows from `r0` on are in `mine` (zeros where `None`:
    /// a hole); `None` when not hashing or when the segment is the whole
    /// table.
    fn hash_segment(
        &mut self,
        mine: Option<&[u8]>,
        (a, b): (usize, usize),
        (r0, segments): (usize, usize),
        opts: FillOptions,
    ) -> Result<Option<ChainingValue>, TableFileError> {
        let row = self.file.layout.row_bytes as usize;
        if !opts.digest || segments <= 1 {
            return Ok(None);
        }
        let mut h = blake3::Hasher::new();
        h.set_input_offset(a as u64);
        let head = (r0 * row).min(b) - a;
        if head > 0 {
            let prev = r0 as u64 - 1;
            let off = self.file.layout.row_offset(prev).unwrap_or_default();
            read_exact_at(self.file, &mut self.head, off)?;
            h.update(&self.head[row - (r0 * row - a)..][..head]);
        }
        let body = b.saturating_sub(r0 * row);
        match mine {
            Some(mine) => {
                h.update(&mine[..body]);
            }
            None => crate::holes::hash_zeros(&mut h, body),
        }
        Ok(Some(h.finalize_non_root()))
    }

    /// The whole pages of the file that rows `r0..r1` lie in (offset,
    /// length), or `None` when there are no such rows.
    fn span(&self, r0: u64, r1: u64) -> Option<(u64, u64)> {
        if r1 <= r0 {
            return None;
        }
        let (first, _) = self.file.layout.row_page(r0)?;
        let (last, _) = self.file.layout.row_page(r1 - 1)?;
        Some((first, last + PAGE_BYTES - first))
    }

    /// Read rows `r0..r1` into `dst` (their bytes, back to back).
    fn read_rows(&mut self, r0: u64, r1: u64, dst: &mut [u8]) -> Result<(), TableFileError> {
        let per_page = self.file.layout.rows_per_page;
        let row = self.file.layout.row_bytes as usize;
        let mut r = r0;
        let mut at = 0usize;
        while r < r1 {
            let Some(offset) = self.file.layout.row_offset(r) else {
                return Err(io_error(
                    self.file,
                    "read rows",
                    format!("row {r} out of range"),
                ));
            };
            self.iov.clear();
            let mut pages = 0;
            let mut want = 0usize;
            while r < r1 && pages < PAGES_PER_CALL {
                let page_end = (r / per_page + 1) * per_page;
                let run = (page_end.min(r1) - r) as usize * row;
                self.iov.push(libc::iovec {
                    iov_base: dst[at..].as_mut_ptr().cast(),
                    iov_len: run,
                });
                at += run;
                want += run;
                r += (run / row) as u64;
                pages += 1;
                if r < r1 && r == page_end {
                    let slack = PAGE_BYTES as usize - per_page as usize * row;
                    self.iov.push(libc::iovec {
                        iov_base: self.slack.as_mut_ptr().cast(),
                        iov_len: slack,
                    });
                    want += slack;
                }
            }
            preadv_all(self.file, &mut self.iov, offset, want)?;
        }
        Ok(())
    }
}

/// `preadv` until all `want` bytes are in, across short reads.
fn preadv_all(
    file: &TableFile,
    iov: &mut [libc::iovec],
    mut offset: u64,
    mut want: usize,
) -> Result<(), TableFileError> {
    let fd = file.raw_fd();
    let mut first = 0;
    while want > 0 {
        let count = (iov.len() - first).min(1024) as libc::c_int;
        // SAFETY: every iovec points into a live buffer of its length (the
        // table's rows this worker owns, or its scratch), and the fd is open.
        let n = unsafe { libc::preadv(fd, iov[first..].as_ptr(), count, offset as libc::off_t) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(TableFileError::Io {
                path: file.path.clone(),
                op: "read pages",
                source: e,
            });
        }
        if n == 0 {
            return Err(TableFileError::Io {
                path: file.path.clone(),
                op: "read pages",
                source: std::io::ErrorKind::UnexpectedEof.into(),
            });
        }
        let mut n = n as usize;
        want -= n;
        offset += n as u64;
        while n > 0 && first < iov.len() {
            let v = &mut iov[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: advancing within the same buffer by less than its length.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }
    Ok(())
}

pub(crate) fn read_exact_at(
    file: &TableFile,
    buf: &mut [u8],
    offset: u64,
) -> Result<(), TableFileError> {
    use std::os::unix::fs::FileExt;
    file.std_file()
        .read_exact_at(buf, offset)
        .map_err(|source| TableFileError::Io {
            path: file.path.clone(),
            op: "read pages",
            source,
        })
}

/// `posix_fadvise` on a range of the file (advisory: errors are ignored).
pub(crate) fn advise(file: &TableFile, offset: u64, len: u64, advice: libc::c_int) {
    let (Ok(off), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return;
    };
    // SAFETY: posix_fadvise only reads its integer arguments; the fd is open.
    unsafe { libc::posix_fadvise(file.std_file().as_raw_fd(), off, len, advice) };
}

#[cfg(test)]
mod tests;
