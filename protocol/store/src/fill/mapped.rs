//! Going over a table file mapped in memory (`map_files`): reading its
//! pages in, and hashing its rows where they lie, on every core.

use engram_protocol::TableDigest;
use engram_protocol::etab::PAGE_BYTES;
use engram_sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use blake3::hazmat::{ChainingValue, HasherExt};

use super::{FillOptions, SEGMENT_BYTES, io_error, page_rows_bytes, root, run_segments};
use crate::progress::Progress;
use crate::table_file::{TableFile, TableFileError};

/// Rows gathered per hash update when hashing a mapped file: 64 KiB, in
/// cache, wide enough for BLAKE3 to hash many chunks at once.
const GATHER_BYTES: usize = 64 << 10;

/// Go over a table file's pages mapped in memory (`pages`: the file's
/// `pages` tensor, 4 KiB pages of 15 rows and their slack) on
/// `opts.threads` threads, segment by segment as [`fill`] does, so that
/// every page is read in (and locked, when the mapping was locked on
/// fault); returns the digest of the rows when `opts.digest`. Nothing is
/// placed: the rows stay where they are. To hash, each segment's rows are
/// gathered 64 KiB at a time into a buffer in cache, since hashing the
/// 3,960 bytes of each page on their own would keep BLAKE3 from hashing
/// many chunks at once (measured here: twice as slow). Without a digest
/// the pages are read in with `MADV_POPULATE_READ`.
pub fn touch_mapped(
    file: &TableFile,
    pages: &[u8],
    opts: FillOptions,
    progress: Option<&mut Progress>,
) -> Result<Option<TableDigest>, TableFileError> {
    let rows = file.layout.rows;
    let page_rows = page_rows_bytes(&file.layout);
    let total = usize::try_from(rows * file.layout.row_bytes).unwrap_or(usize::MAX);
    let need = file.layout.pages.saturating_mul(PAGE_BYTES);
    if (pages.len() as u64) < need || (total as u64) > file.layout.pages * page_rows as u64 {
        return Err(io_error(
            file,
            "map",
            format!("a mapping of {} bytes for {rows} rows", pages.len()),
        ));
    }
    let segment = opts.segment.max(blake3::CHUNK_LEN).next_power_of_two();
    let segments = total.div_ceil(segment).max(1);
    if segments == 1 {
        populate(pages);
        let digest = opts.digest.then(|| {
            let mut h = blake3::Hasher::new();
            let mut buf = vec![0; GATHER_BYTES];
            hash_gathered(pages, page_rows, (0, total), &mut buf, &mut h);
            TableDigest(*h.finalize().as_bytes())
        });
        if let Some(p) = progress {
            p.update(rows);
        }
        return Ok(digest);
    }
    let row = file.layout.row_bytes as usize;
    let cvs = run_segments(
        segments,
        opts.threads,
        progress,
        || {
            super::lower(opts.background);
            vec![0u8; GATHER_BYTES]
        },
        |buf, s| {
            let a = s * segment;
            let b = (a + segment).min(total);
            let started = (b.div_ceil(row).min(total / row) - a.div_ceil(row)) as u64;
            let first = a / page_rows * PAGE_BYTES as usize;
            let last = (b.div_ceil(page_rows) * PAGE_BYTES as usize).min(pages.len());
            // A hole reads as zeros: nothing to read in (faulting it would
            // fill the page cache with zeros), zeros to hash.
            let at = file.layout.data_start + first as u64;
            let hole = crate::holes::is_hole(file.std_file(), at, (last - first) as u64);
            if !opts.digest {
                if !hole {
                    populate(&pages[first..last]);
                }
                return Ok((started, None));
            }
            let mut h = blake3::Hasher::new();
            h.set_input_offset(a as u64);
            if hole {
                crate::holes::hash_zeros(&mut h, b - a);
            } else {
                hash_gathered(pages, page_rows, (a, b), buf, &mut h);
            }
            Ok((started, Some(h.finalize_non_root())))
        },
    )?;
    Ok(opts.digest.then(|| root(&cvs)))
}

/// Feed bytes `a..b` of the rows (back to back) to `h`, gathered from
/// `pages` (the file's pages, `page_rows` bytes of rows in each) through
/// `buf`.
pub(crate) fn hash_gathered(
    pages: &[u8],
    page_rows: usize,
    (a, b): (usize, usize),
    buf: &mut [u8],
    h: &mut blake3::Hasher,
) {
    let page = PAGE_BYTES as usize;
    let mut x = a;
    while x < b {
        let want = (b - x).min(buf.len());
        let mut n = 0;
        while n < want {
            let at = x + n;
            let off = at % page_rows;
            let k = (page_rows - off).min(want - n);
            let src = at / page_rows * page + off;
            buf[n..n + k].copy_from_slice(&pages[src..src + k]);
            n += k;
        }
        h.update(&buf[..want]);
        x += want;
    }
}

/// Read `bytes` (part of a mapping) into memory: `MADV_POPULATE_READ`,
/// or one read a page where the kernel lacks it (before 5.14).
pub(crate) fn populate(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    // SAFETY: advice over memory this mapping owns; populating only reads.
    let r = unsafe {
        libc::madvise(
            bytes.as_ptr().cast_mut().cast(),
            bytes.len(),
            libc::MADV_POPULATE_READ,
        )
    };
    if r != 0 {
        for p in bytes.iter().step_by(PAGE_BYTES as usize) {
            // SAFETY: a read of a byte inside the slice.
            unsafe { std::ptr::read_volatile(p) };
        }
    }
}

/// BLAKE3 of `bytes` on `threads` threads: subtrees of [`SEGMENT_BYTES`]
/// hashed in parallel and merged (what `b3sum` does over a mapped file).
/// The floor of a verified load: hashing alone, nothing read or placed.
pub fn hash_parallel(bytes: &[u8], threads: usize) -> TableDigest {
    let segments = bytes.len().div_ceil(SEGMENT_BYTES).max(1);
    if segments == 1 {
        return TableDigest(*blake3::hash(bytes).as_bytes());
    }
    let next = AtomicUsize::new(0);
    let cvs: Mutex<Vec<ChainingValue>> = Mutex::new(vec![[0; 32]; segments]);
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, segments) {
            scope.spawn(|| {
                loop {
                    let s = next.fetch_add(1, Ordering::Relaxed);
                    if s >= segments {
                        break;
                    }
                    let a = s * SEGMENT_BYTES;
                    let b = (a + SEGMENT_BYTES).min(bytes.len());
                    let cv = blake3::Hasher::new()
                        .set_input_offset(a as u64)
                        .update(&bytes[a..b])
                        .finalize_non_root();
                    cvs.lock()[s] = cv;
                }
            });
        }
    });
    root(&cvs.into_inner())
}
