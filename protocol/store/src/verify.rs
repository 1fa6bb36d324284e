//! Verifying a table file on every core: the digest of its rows, every
//! page against its checksum (where the file has them), every slack byte
//! zero and every row decodable, in one pass over the file.
//!
//! The rows are cut into segments of the same power-of-two size as a load
//! ([`crate::fill`]), so the digest is BLAKE3's tree over the segments'
//! chaining values. A worker reads the pages its segment's rows lie in
//! with one large read, checks the pages whose first row starts in the
//! segment (so every page is checked exactly once), gathers the segment's
//! rows from the pages into a buffer in cache and hashes them, then tells
//! the kernel to drop those pages from the page cache (a 94 GiB file must
//! not push everything else out). Segments are claimed in file order and
//! the error of the lowest segment wins, so a file with several faults is
//! reported at the first, as a front-to-back pass would.

use blake3::hazmat::HasherExt;
use engram_protocol::TableDigest;
use engram_protocol::etab::{PAGE_BYTES, SUM_BYTES, page_checksum};

use crate::fill::{hash_gathered, page_rows_bytes, read_exact_at, root, run_segments};
use crate::progress::Progress;
use std::path::Path;

use engram_protocol::etab::TableMeta;

use crate::table_file::{TableFile, TableFileError, TableWriter};

/// Threads a verification uses unless told: every core, at most 16. Each
/// holds about 4.3 MB of buffers, and 16 cores hash faster than any one
/// disk reads.
pub fn default_threads() -> usize {
    crate::fill::cores().min(16)
}

impl TableFile {
    /// Recompute the digest and check every row decodes, every slack byte is
    /// zero and every page matches its checksum (where the file has them),
    /// on every core up to 16 (this module); the first fault in the
    /// file is the error.
    pub fn verify(&self, progress: Option<&mut Progress>) -> Result<TableDigest, TableFileError> {
        self.verify_on(default_threads(), progress)
    }

    /// [`Self::verify`] on `threads` threads.
    pub fn verify_on(
        &self,
        threads: usize,
        progress: Option<&mut Progress>,
    ) -> Result<TableDigest, TableFileError> {
        verify(self, threads, crate::fill::SEGMENT_BYTES, progress)
    }
}

/// Rewrite a table file made before page checksums existed with its
/// `page_xxh3` tensor: every row is checked and the digest recomputed on
/// the way (the file is verified), the new file is written beside the old
/// one and moves into its place only once complete, synced and matching the
/// old digest. Needs free space for one more copy of the table.
pub fn add_page_sums(
    path: &Path,
    progress: Option<&mut Progress>,
) -> Result<TableMeta, TableFileError> {
    let table = TableFile::open_any(path)?;
    if table.has_page_sums() {
        table.verify(progress)?;
        return Ok(table.meta);
    }
    let mut writer = TableWriter::create(path, table.meta.clone())?;
    table.for_each_chunk(true, progress, |first_row, rows| {
        table.check_rows(first_row, rows)?;
        writer.write_rows(rows)
    })?;
    writer.finish_expecting(table.meta.digest)
}

/// Rows gathered per hash update (in cache, wide for BLAKE3's SIMD).
const GATHER_BYTES: usize = 64 << 10;

/// Verify `file` on `threads` threads with segments of `segment` bytes of
/// rows (rounded up to a power of two of at least 1 KiB); returns the
/// digest, which is checked against the header's. Progress, in rows, goes
/// to `progress`.
pub fn verify(
    file: &TableFile,
    threads: usize,
    segment: usize,
    progress: Option<&mut Progress>,
) -> Result<TableDigest, TableFileError> {
    let rows = file.layout.rows;
    let total = usize::try_from(rows.saturating_mul(file.layout.row_bytes)).map_err(|_| {
        TableFileError::Io {
            path: file.path.clone(),
            op: "verify",
            source: std::io::Error::other("larger than the address space"),
        }
    })?;
    let segment = segment.max(blake3::CHUNK_LEN).next_power_of_two();
    let segments = total.div_ceil(segment).max(1);
    let cvs = run_segments(
        segments,
        threads,
        progress,
        || Worker::new(segment, page_rows_bytes(&file.layout)),
        |w, s| w.segment(file, s * segment, ((s + 1) * segment).min(total), segments),
    )?;
    let actual = if segments == 1 {
        TableDigest(cvs[0])
    } else {
        root(&cvs)
    };
    if actual != file.meta.digest {
        return Err(TableFileError::DigestMismatch {
            path: file.path.clone(),
            expected: file.meta.digest,
            actual,
        });
    }
    Ok(actual)
}

/// The first of `pages` (a table file's pages, 4 KiB each, as mapped)
/// whose checksum is not the file's `sums` entry for it; `None` when all
/// match. Pages beyond `sums` are not checked.
pub fn first_bad_page(pages: &[u8], sums: &[u64]) -> Option<u64> {
    pages
        .chunks_exact(PAGE_BYTES as usize)
        .zip(sums)
        .position(|(p, &sum)| page_checksum(p) != sum)
        .map(|p| p as u64)
}

/// One worker's buffers.
struct Worker {
    pages: Vec<u8>,
    sums: Vec<u8>,
    gather: Vec<u8>,
    /// Bytes of rows in a page.
    page_rows: usize,
}

impl Worker {
    fn new(segment: usize, page_rows: usize) -> Self {
        // A segment's rows lie in at most this many pages.
        let pages = segment / page_rows + 2;
        Self {
            page_rows,
            pages: vec![0; pages * PAGE_BYTES as usize],
            sums: vec![0; pages * SUM_BYTES as usize],
            gather: vec![0; GATHER_BYTES],
        }
    }

    /// Check and hash bytes `a..b` of the rows (back to back); returns
    /// the rows that start there and the segment's chaining value (the
    /// root hash when it is the only segment).
    fn segment(
        &mut self,
        file: &TableFile,
        a: usize,
        b: usize,
        segments: usize,
    ) -> Result<(u64, Option<[u8; 32]>), TableFileError> {
        let layout = &file.layout;
        let page = PAGE_BYTES as usize;
        let page_rows = self.page_rows;
        // The pages the bytes lie in, and those whose first row starts here.
        let p0 = a / page_rows;
        let p1 = (b.max(a + 1) - 1) / page_rows + 1;
        let owned = a.div_ceil(page_rows)..b.div_ceil(page_rows).min(p1);
        let buf = &mut self.pages[..(p1 - p0) * page];
        let offset = layout.data_start + (p0 * page) as u64;
        let hole = crate::holes::is_hole(file.std_file(), offset, buf.len() as u64);
        if !hole {
            read_exact_at(file, buf, offset)?;
        }
        let sums = match layout.sums_start() {
            Some(start) if !owned.is_empty() => {
                let sums = &mut self.sums[..owned.len() * SUM_BYTES as usize];
                read_exact_at(file, sums, start + owned.start as u64 * SUM_BYTES)?;
                Some(&*sums)
            }
            _ => None,
        };
        let row = layout.row_bytes as usize;
        let started = b.div_ceil(row).min(total_rows(file)) - a.div_ceil(row);
        if hole {
            // Zero pages: their rows decode and their slack is zero, so only
            // their checksums are checked; zeros are hashed.
            check_zero_sums(file, owned.start as u64, sums)?;
            let mut h = blake3::Hasher::new();
            if segments > 1 {
                h.set_input_offset(a as u64);
            }
            crate::holes::hash_zeros(&mut h, b - a);
            let cv = if segments > 1 {
                h.finalize_non_root()
            } else {
                *h.finalize().as_bytes()
            };
            return Ok((started as u64, Some(cv)));
        }
        for (i, p) in owned.clone().enumerate() {
            let bytes = &buf[(p - p0) * page..][..page];
            let first = p as u64 * layout.rows_per_page;
            let used = (layout.rows - first).min(layout.rows_per_page) as usize * row;
            if let Some(sums) = sums {
                let at = i * SUM_BYTES as usize;
                let expected = u64::from_le_bytes(
                    sums[at..at + SUM_BYTES as usize]
                        .try_into()
                        .unwrap_or_default(),
                );
                let actual = page_checksum(bytes);
                if actual != expected {
                    return Err(TableFileError::PageChecksum {
                        path: file.path.clone(),
                        page: p as u64,
                        expected,
                        actual,
                    });
                }
            }
            if bytes[used..].iter().any(|&x| x != 0) {
                return Err(TableFileError::Slack {
                    path: file.path.clone(),
                    page: p as u64,
                });
            }
            file.check_rows(first, &bytes[..used])?;
        }
        let mut h = blake3::Hasher::new();
        if segments > 1 {
            h.set_input_offset(a as u64);
        }
        // `buf` starts at page p0, whose rows start p0 pages of rows in.
        let base = p0 * page_rows;
        hash_gathered(
            buf,
            page_rows,
            (a - base, b - base),
            &mut self.gather,
            &mut h,
        );
        let cv = if segments > 1 {
            h.finalize_non_root()
        } else {
            *h.finalize().as_bytes()
        };
        crate::fill::advise(file, offset, buf.len() as u64, libc::POSIX_FADV_DONTNEED);
        Ok((started as u64, Some(cv)))
    }
}

/// Pages from `first` on, which are zeros (a hole), against their stored
/// checksums `sums` (none for a file without them).
fn check_zero_sums(
    file: &TableFile,
    first: u64,
    sums: Option<&[u8]>,
) -> Result<(), TableFileError> {
    let zero = crate::holes::zero_page_checksum();
    for (i, s) in sums
        .unwrap_or_default()
        .chunks_exact(SUM_BYTES as usize)
        .enumerate()
    {
        let expected = u64::from_le_bytes(s.try_into().unwrap_or_default());
        if expected != zero {
            return Err(TableFileError::PageChecksum {
                path: file.path.clone(),
                page: first + i as u64,
                expected,
                actual: zero,
            });
        }
    }
    Ok(())
}

fn total_rows(file: &TableFile) -> usize {
    usize::try_from(file.layout.rows).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;
    use std::path::Path;

    use super::*;
    use crate::table_file::remove_page_sums;
    use engram_protocol::encoding::RowEncoding;

    use crate::generate::test_table as table;

    fn poke(path: &Path, at: u64, byte: u8) -> u8 {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .expect("open rw");
        let mut old = [0u8; 1];
        f.read_exact_at(&mut old, at).expect("read");
        f.write_all_at(&[byte], at).expect("write");
        old[0]
    }

    #[test]
    fn a_sparse_files_holes_verify_as_zeros() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = crate::generate::test_sparse_table(dir.path());
        let file = TableFile::open(&path).expect("open");
        for segment in [1024usize, 4096, 65_536] {
            for threads in [1, 3] {
                let v = verify(&file, threads, segment, None).expect("verify");
                assert_eq!(v, file.meta.digest, "segment {segment}, {threads} threads");
            }
        }
    }

    /// Every segmenting and thread count, on small segments.
    fn each_way(path: &Path, check: impl Fn(Result<TableDigest, TableFileError>)) {
        let file = TableFile::open(path).expect("open");
        for segment in [1 << 10, 4 << 10, 64 << 10, 4 << 20] {
            for threads in [1, 3] {
                check(verify(&file, threads, segment, None));
            }
        }
    }

    #[test]
    fn every_segmenting_gives_the_header_digest_with_or_without_page_sums() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Sizes around page, chunk and segment boundaries.
        for rows in [1u64, 3, 4, 15, 16, 31, 62, 100, 1_000, 4_097] {
            let path = table(dir.path(), rows);
            let want = TableFile::open(&path).expect("open").meta.digest;
            each_way(&path, |r| {
                assert_eq!(r.expect("verifies"), want, "{rows} rows")
            });
            remove_page_sums(&path).expect("strip");
            each_way(&path, |r| {
                assert_eq!(r.expect("verifies"), want, "{rows} rows")
            });
        }
        // Progress reaches every row.
        let path = table(dir.path(), 2_000);
        let file = TableFile::open(&path).expect("open");
        let last = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let l2 = std::sync::Arc::clone(&last);
        let mut p = Progress::new(
            "verify",
            2_000,
            engram_protocol::ROW_BYTES as u64,
            Box::new(|_| {}),
        )
        .with_tap(move |d| l2.store(d, std::sync::atomic::Ordering::Relaxed));
        verify(&file, 2, 4 << 10, Some(&mut p)).expect("verifies");
        assert_eq!(last.load(std::sync::atomic::Ordering::Relaxed), 2_000);
    }

    #[test]
    fn a_holes_checksum_is_checked_without_reading_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sparse.etab");
        let spec = crate::generate::GenSpec {
            layer: 1,
            rows: 200_000,
            seed: 1,
            hash_preset: None,
            hash_base: None,
            threads: 1,
        };
        crate::generate::generate_sparse(&path, &spec, &[0, 199_999], None).expect("gen");
        let file = TableFile::open(&path).expect("open");
        let at = file.layout.sums_start().expect("sums") + 9_000 * SUM_BYTES;
        drop(file);
        poke(&path, at, 0x5a);
        each_way(&path, |r| match r {
            Err(TableFileError::PageChecksum { page, .. }) => assert_eq!(page, 9_000),
            other => panic!("expected page 9000 to fail, got {other:?}"),
        });
    }

    #[test]
    fn the_first_page_off_its_checksum_is_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = table(dir.path(), 2_000);
        let file = TableFile::open(&path).expect("open");
        let sums = file.read_page_sums().expect("read").expect("has sums");
        let bytes = std::fs::read(&path).expect("read");
        let start = file.layout.data_start as usize;
        let mut pages = bytes[start..start + sums.len() * PAGE_BYTES as usize].to_vec();
        assert_eq!(first_bad_page(&pages, &sums), None);
        pages[90 * PAGE_BYTES as usize + 17] ^= 1;
        pages[120 * PAGE_BYTES as usize + 4000] ^= 1;
        assert_eq!(first_bad_page(&pages, &sums), Some(90));
        assert_eq!(
            first_bad_page(&pages[..90 * PAGE_BYTES as usize], &sums),
            None
        );
    }

    #[test]
    fn each_fault_is_found_and_the_first_in_the_file_is_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = table(dir.path(), 2_000);
        let layout = TableFile::open(&path).expect("open").layout;
        let page_at = |p: u64, off: u64| layout.data_start + p * PAGE_BYTES + off;
        // A flipped row byte in page 100: its checksum.
        let old = poke(&path, page_at(100, 7), 0x11);
        each_way(&path, |r| {
            assert!(
                matches!(r, Err(TableFileError::PageChecksum { page: 100, .. })),
                "{r:?}"
            );
        });
        // And another in page 40 (in another segment): page 40, always.
        let old40 = poke(&path, page_at(40, 3999), 0x22);
        each_way(&path, |r| {
            assert!(
                matches!(r, Err(TableFileError::PageChecksum { page: 40, .. })),
                "{r:?}"
            );
        });
        poke(&path, page_at(100, 7), old);
        poke(&path, page_at(40, 3999), old40);
        each_way(&path, |r| assert!(r.is_ok(), "{r:?}"));
        // Without page checksums each row and slack check is reached.
        remove_page_sums(&path).expect("strip");
        let layout = TableFile::open(&path).expect("open").layout;
        // Row 992 straddles the segment boundary at 256 KiB (992 x 264 <
        // 262,144 < 993 x 264), and its page's first row (990) starts in
        // the segment before.
        for row in [20u64, 992, 1_999] {
            let at = layout.row_offset(row).expect("in range") + 3;
            let old = poke(&path, at, 0x7F);
            each_way(&path, |r| {
                assert!(
                    matches!(&r, Err(TableFileError::CorruptRow { row: r, .. }) if *r == row),
                    "row {row}: {r:?}"
                );
            });
            // A valid but different value: only the digest catches it.
            poke(&path, at, 0x01);
            each_way(&path, |r| {
                assert!(
                    matches!(r, Err(TableFileError::DigestMismatch { .. })),
                    "{r:?}"
                );
            });
            poke(&path, at, old);
        }
        // Slack in page 77, and in the last page.
        for page in [77u64, layout.pages - 1] {
            let old = poke(&path, page_at(page, 4000), 1);
            each_way(&path, |r| {
                assert!(
                    matches!(&r, Err(TableFileError::Slack { page: p, .. }) if *p == page),
                    "page {page}: {r:?}"
                );
            });
            poke(&path, page_at(page, 4000), old);
        }
        each_way(&path, |r| assert!(r.is_ok(), "{r:?}"));
    }

    #[test]
    fn old_files_gain_page_checksums_and_keep_their_digest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = table(dir.path(), 1000);
        let want = TableFile::open(&path).expect("open").meta.digest;
        let with_len = std::fs::metadata(&path).expect("stat").len();
        remove_page_sums(&path).expect("strip");
        let old = TableFile::open(&path).expect("an old file still opens");
        assert!(!old.has_page_sums());
        assert_eq!(old.read_page_sums().expect("read"), None);
        let hint = old.page_sums_hint().expect("a hint");
        assert!(hint.contains("--write-page-checksums"), "{hint}");
        assert_eq!(old.verify(None).expect("verifies"), want);
        let meta = add_page_sums(&path, None).expect("add");
        assert_eq!(meta, old.meta);
        let new = TableFile::open(&path).expect("open");
        assert!(new.has_page_sums());
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), with_len);
        assert_eq!(new.verify(None).expect("verifies"), old.meta.digest);
        // A second run only verifies.
        assert_eq!(add_page_sums(&path, None).expect("again"), meta);
    }

    #[test]
    fn a_corrupt_old_file_is_left_as_it_was() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = table(dir.path(), 100);
        remove_page_sums(&path).expect("strip");
        let t = TableFile::open(&path).expect("open");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open rw");
        f.write_all_at(&[0x01], t.layout.row_offset(20).expect("row") + 3)
            .expect("write");
        let before = std::fs::read(&path).expect("read");
        let e = add_page_sums(&path, None).expect_err("digest differs");
        assert!(matches!(e, TableFileError::DigestMismatch { .. }), "{e}");
        assert_eq!(std::fs::read(&path).expect("read"), before);
        assert!(!dir.path().join("t100.etab.partial").exists());
    }

    /// Every encoding's rows: the file reads back row for row, verifies on
    /// segments that cut rows and pages anywhere, and fills memory whole.
    #[test]
    fn tables_of_every_encoding_read_verify_and_fill() {
        let dir = tempfile::tempdir().expect("tempdir");
        let encodings = [
            RowEncoding::V41,
            RowEncoding::Fp8PerTensor { values: 160 },
            RowEncoding::Bf16 { values: 160 },
            RowEncoding::Nvfp4 { values: 160 },
        ];
        for (k, e) in encodings.into_iter().enumerate() {
            let path = dir.path().join(format!("t{k}.etab"));
            let rows = 3_001;
            let (m, data) = crate::generate::write_encoded(&path, e, rows, k as u64);
            assert_eq!(m.digest, TableDigest::of_rows(&data), "{}", e.name());
            let t = TableFile::open_any(&path).expect("open any");
            assert_eq!(t.row_bytes(), e.row_bytes());
            assert_eq!(t.layout.rows_per_page, 4096 / e.row_bytes() as u64);
            let mut back = Vec::new();
            t.for_each_chunk(true, None, |first, rows| {
                assert_eq!(first as usize * e.row_bytes(), back.len());
                back.extend_from_slice(rows);
                Ok(())
            })
            .expect("stream");
            assert_eq!(back, data, "{}", e.name());
            for segment in [1024, 4096, 1 << 20] {
                let d = verify(&t, 3, segment, None).expect("verify");
                assert_eq!(d, m.digest, "{} segment {segment}", e.name());
                let opts = crate::fill::FillOptions {
                    threads: 3,
                    segment,
                    ..Default::default()
                };
                let mut dst = vec![0u8; data.len()];
                let got = crate::fill::fill(&t, &mut dst, opts, None).expect("fill");
                assert_eq!(got, Some(m.digest), "{} segment {segment}", e.name());
                assert_eq!(dst, data, "{} segment {segment}", e.name());
            }
            if e != RowEncoding::V41 {
                assert!(matches!(
                    TableFile::open(&path),
                    Err(TableFileError::Encoding { .. })
                ));
            }
        }
    }

    /// A NaN code in a row of another encoding is found by verify, at its row.
    #[test]
    fn verify_names_the_corrupt_row_of_any_encoding() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("fp8.etab");
        let e = RowEncoding::Fp8PerTensor { values: 160 };
        crate::generate::write_encoded(&path, e, 500, 3);
        let at = {
            let t = TableFile::open_any(&path).expect("open");
            t.layout.row_offset(321).expect("row") + 9
        };
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open rw");
        f.write_all_at(&[0x7F], at).expect("poke");
        let t = TableFile::open_any(&path).expect("open");
        match verify(&t, 2, 1024, None) {
            Err(TableFileError::PageChecksum { .. }) => {}
            other => panic!("a page checksum catches it first: {other:?}"),
        }
        remove_page_sums(&path).expect("drop sums");
        let t = TableFile::open_any(&path).expect("open");
        match verify(&t, 2, 1024, None) {
            Err(e @ TableFileError::CorruptEncodedRow { row: 321, .. }) => {
                assert!(e.to_string().contains("fp8_per_tensorx160"), "{e}");
            }
            other => panic!("row 321 is corrupt: {other:?}"),
        }
    }
}
