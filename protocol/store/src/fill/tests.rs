//! Tests of `fill`.

use super::*;
use crate::generate::test_table;

fn table(dir: &std::path::Path, rows: u64) -> TableFile {
    TableFile::open(&test_table(dir, rows)).expect("open")
}

fn sequential(file: &TableFile) -> Vec<u8> {
    let mut all = Vec::new();
    file.for_each_chunk(false, None, |_, rows| {
        all.extend_from_slice(rows);
        Ok(())
    })
    .expect("stream");
    all
}

#[test]
fn the_tree_of_segments_is_blake3_of_the_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Sizes around segment, chunk, row and page boundaries; segments
    // of one chunk up to larger than the table.
    for rows in [1u64, 3, 4, 15, 16, 31, 62, 100, 1_000, 4_097] {
        let file = table(dir.path(), rows);
        let want = sequential(&file);
        assert_eq!(TableDigest::of_rows(&want), file.meta.digest);
        for segment in [1024usize, 2048, 4096, 65_536, 1 << 22] {
            for threads in [1, 3] {
                let mut got = vec![0u8; want.len()];
                // The workers lowered, or not: the same rows and digest.
                let opts = FillOptions {
                    threads,
                    segment,
                    digest: true,
                    drop_behind: false,
                    background: (threads == 3).then_some(Background::Low),
                    skip_holes: false,
                };
                let d = fill(&file, &mut got, opts, None).expect("fill");
                assert!(got == want, "rows {rows} segment {segment}");
                assert_eq!(d, Some(file.meta.digest), "rows {rows} segment {segment}");
            }
        }
    }
}

/// The file's `pages` tensor, mapped.
fn mapped(file: &TableFile) -> memmap2::Mmap {
    let len = (file.layout.pages * PAGE_BYTES) as usize;
    // SAFETY: a test's own file, not modified while mapped.
    unsafe {
        memmap2::MmapOptions::new()
            .offset(file.layout.data_start)
            .len(len)
            .map(file.handle())
    }
    .expect("map")
}

#[test]
fn hashing_a_mapped_file_gathers_blake3_of_the_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    for rows in [1u64, 4, 15, 16, 62, 1_000, 4_097, 40_000] {
        let file = table(dir.path(), rows);
        let map = mapped(&file);
        for segment in [1024usize, 4096, 65_536, 1 << 22] {
            for threads in [1, 3] {
                let opts = FillOptions {
                    threads,
                    segment,
                    digest: true,
                    drop_behind: false,
                    background: None,
                    skip_holes: false,
                };
                let last = std::sync::Arc::new(AtomicU64::new(0));
                let l2 = std::sync::Arc::clone(&last);
                let mut p = Progress::new("x", rows, 264, Box::new(|_| {}))
                    .with_tap(move |d| l2.store(d, Ordering::Relaxed));
                let d = touch_mapped(&file, &map, opts, Some(&mut p)).expect("hash");
                assert_eq!(d, Some(file.meta.digest), "rows {rows} segment {segment}");
                let done = last.load(Ordering::Relaxed);
                assert_eq!(done, rows, "rows {rows} segment {segment}");
                let opts = FillOptions {
                    digest: false,
                    ..opts
                };
                assert_eq!(touch_mapped(&file, &map, opts, None).expect("touch"), None);
            }
        }
        // A mapping shorter than the file's pages is refused.
        let short = &map[..map.len() - 1];
        let e = touch_mapped(&file, short, FillOptions::default(), None).expect_err("short");
        assert!(e.to_string().contains("a mapping of"), "{e}");
    }
}

#[test]
fn hashing_in_parallel_is_blake3() {
    let bytes: Vec<u8> = (0..(SEGMENT_BYTES * 5 + 12_345) as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for len in [
        0,
        1,
        1024,
        SEGMENT_BYTES,
        SEGMENT_BYTES + 1,
        3 * SEGMENT_BYTES,
        bytes.len(),
    ] {
        let want = blake3::hash(&bytes[..len]);
        for threads in [1, 2, 7] {
            assert_eq!(
                hash_parallel(&bytes[..len], threads).0,
                *want.as_bytes(),
                "{len} bytes, {threads} threads"
            );
        }
    }
}

#[test]
fn progress_reaches_every_row_and_no_digest_when_not_asked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = table(dir.path(), 20_000);
    let lines = std::sync::Arc::new(Mutex::new(Vec::new()));
    let l2 = std::sync::Arc::clone(&lines);
    let mut p =
        Progress::new("x", 20_000, 264, Box::new(|_| {})).with_tap(move |d| l2.lock().push(d));
    let mut got = vec![0u8; 20_000 * ROW_BYTES];
    let opts = FillOptions {
        digest: false,
        ..FillOptions::default()
    };
    assert_eq!(
        fill(&file, &mut got, opts, Some(&mut p)).expect("fill"),
        None
    );
    assert_eq!(lines.lock().last(), Some(&20_000));
    assert!(got == sequential(&file));
}

#[test]
fn the_error_of_the_lowest_failed_segment_is_returned() {
    let err = |what: &str| TableFileError::Io {
        path: "t".into(),
        op: "read pages",
        source: std::io::Error::other(what.to_string()),
    };
    // Segment 1 fails at once, segment 0 later, segment 2 never runs
    // after either: segment 0's error, whatever the timing.
    let ran = AtomicUsize::new(0);
    let r = run_segments(
        6,
        2,
        None,
        || (),
        |_, s| {
            ran.fetch_add(1, Ordering::Relaxed);
            match s {
                0 => {
                    std::thread::sleep(Duration::from_millis(100));
                    Err(err("segment 0"))
                }
                1 => Err(err("segment 1")),
                _ => Ok((1, None)),
            }
        },
    );
    let e = r.expect_err("failed");
    assert!(e.to_string().contains("segment 0"), "{e}");
    assert!(ran.load(Ordering::Relaxed) < 6);
}

#[test]
fn a_short_file_and_a_wrong_buffer_are_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = table(dir.path(), 1_000);
    let mut small = vec![0u8; 999 * ROW_BYTES];
    let e = fill(&file, &mut small, FillOptions::default(), None).expect_err("size");
    assert!(e.to_string().contains("buffer of"), "{e}");
    // Cut the file after it was opened: the read runs out.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&file.path)
        .expect("open");
    f.set_len(file.layout.data_start + 10 * PAGE_BYTES)
        .expect("truncate");
    let mut got = vec![0u8; 1_000 * ROW_BYTES];
    let e = fill(&file, &mut got, FillOptions::default(), None).expect_err("short");
    assert!(e.to_string().contains("read pages"), "{e}");
}

#[test]
fn a_sparse_files_holes_are_skipped_and_hashed_as_zeros() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = crate::generate::test_sparse_table(dir.path());
    let file = TableFile::open(&path).expect("open");
    let want = sequential(&file);
    let map = mapped(&file);
    for segment in [1024usize, 4096, 65_536] {
        for threads in [1, 3] {
            let opts = FillOptions {
                threads,
                segment,
                digest: true,
                drop_behind: false,
                skip_holes: true,
                background: None,
            };
            let mut got = vec![0u8; want.len()];
            let d = fill(&file, &mut got, opts, None).expect("fill");
            assert!(got == want, "segment {segment}");
            assert_eq!(d, Some(file.meta.digest), "segment {segment}");
            let d = touch_mapped(&file, &map, opts, None).expect("touch");
            assert_eq!(d, Some(file.meta.digest), "mapped, segment {segment}");
        }
    }
}
