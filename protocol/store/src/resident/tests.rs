//! Tests of `resident`.

use super::*;
use crate::generate::{GenSpec, generate};
use engram_protocol::synthetic::is_synthetic_row;

fn table(dir: &Path) -> (std::path::PathBuf, TableDigest) {
    let path = dir.join("t.etab");
    let spec = GenSpec::new(1, 10_000, 4);
    let meta = generate(&path, &spec, None).expect("gen");
    (path, meta.digest)
}

#[test]
fn loads_every_row_and_checks_versions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, digest) = table(dir.path());
    let pin = ExpectedTable {
        digest,
        layer: 1,
        rows: 10_000,
    };
    let (t, report) =
        ResidentTable::load(7, &path, Some(pin), false, MlockMode::Try, |_| None).expect("load");
    assert!(report.verified);
    assert_eq!((t.id, t.layer, t.rows, t.digest), (7, 1, 10_000, digest));
    for r in [0, 1, 14, 15, 9_999] {
        assert!(
            is_synthetic_row(4, 1, r, &t.row(r).expect("in range").to_vec()),
            "row {r}"
        );
    }
    assert!(t.row(10_000).is_none());
    assert!(t.row(u64::MAX).is_none());
    for wrong in [
        ExpectedTable {
            digest: TableDigest([1; 32]),
            ..pin
        },
        ExpectedTable { layer: 14, ..pin },
        ExpectedTable { rows: 9_999, ..pin },
    ] {
        assert!(matches!(
            ResidentTable::load(7, &path, Some(wrong), false, MlockMode::Off, |_| None),
            Err(LoadError::Pinned { .. })
        ));
    }
}

/// Write `byte` over the first byte of row `row` of the file at `path`.
fn set_row_byte(path: &Path, row: u64, byte: u8) {
    use std::os::unix::fs::FileExt;
    let f = TableFile::open(path).expect("open");
    let off = f.layout.row_offset(row).expect("in range");
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|w| w.write_all_at(&[byte], off))
        .expect("write");
}

#[test]
fn a_modified_row_fails_verification_unless_trusted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = table(dir.path());
    set_row_byte(&path, 5000, 0x11);
    let err =
        ResidentTable::load(1, &path, None, false, MlockMode::Off, |_| None).expect_err("corrupt");
    assert!(err.to_string().contains("rows hash to"), "{err}");
    let (t, report) =
        ResidentTable::load(1, &path, None, true, MlockMode::Off, |_| None).expect("trusted");
    assert!(!report.verified);
    assert_eq!(t.row(5000).expect("row").values()[0], 0x11);
}

/// Load `path` with `backing`.
fn load_as(
    path: &Path,
    backing: Backing,
    trust_digest: bool,
) -> Result<(ResidentTable, LoadReport), LoadError> {
    let opts = LoadOptions {
        trust_digest,
        mlock: MlockMode::Off,
        backing,
        ..LoadOptions::default()
    };
    ResidentTable::load_with(Some(3), path, &opts, |_| None)
}

#[test]
fn a_table_served_from_its_files_pages_has_the_copys_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("big.etab");
    let spec = GenSpec {
        layer: 2,
        rows: 40_000,
        seed: 5,
        hash_preset: None,
        hash_base: None,
        threads: 2,
    };
    let meta = generate(&path, &spec, None).expect("gen");
    let (copy, _) = load_as(&path, Backing::Anonymous, false).expect("copy");
    let (mapped, report) = load_as(&path, Backing::Mapped, false).expect("mapped");
    assert!(report.verified);
    assert_eq!(
        (mapped.id, mapped.rows, mapped.digest),
        (3, 40_000, meta.digest)
    );
    assert!(copy.memory().is_packed() && !mapped.memory().is_packed());
    assert!(mapped.kept().is_none());
    for r in 0..40_000 {
        assert_eq!(
            mapped.row(r).map(|x| x.to_vec()),
            copy.row(r).map(|x| x.to_vec()),
            "row {r}"
        );
    }
    assert!(mapped.row(40_000).is_none());
    // Dropped, the table still serves its rows to whoever holds its memory.
    let mem = mapped.memory();
    drop(mapped);
    let bytes: &[u8] = (*mem).as_ref();
    assert_eq!(bytes.len(), 40_000usize.div_ceil(15) * 4096);

    // A changed row: refused unless trusted, which then serves it.
    drop(mem);
    set_row_byte(&path, 31_000, 0x5a);
    let err = load_as(&path, Backing::Mapped, false).expect_err("corrupt");
    assert!(err.to_string().contains("rows hash to"), "{err}");
    let (t, report) = load_as(&path, Backing::Mapped, true).expect("trusted");
    assert!(!report.verified);
    assert_eq!(t.row(31_000).expect("row").values()[0], 0x5a);
}

#[test]
fn a_mark_of_the_same_unchanged_leased_file_serves_its_pages_without_reading_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = table(dir.path());
    let load = |known: Option<FileMark>, trust_digest: bool| {
        let opts = LoadOptions {
            trust_digest,
            mlock: MlockMode::Off,
            backing: Backing::Mapped,
            known_file: known,
            ..LoadOptions::default()
        };
        ResidentTable::load_with(Some(3), &path, &opts, |_| None)
    };
    let (first, report) = load(None, false).expect("load");
    assert!(report.verified && !report.reused);
    let mark = first.file_mark().expect("leased, marked");
    assert!(mark.verified);
    let row5 = first.row(5).expect("row").to_vec();
    drop(first);
    // The same file, unchanged: served on, marked verified.
    let (again, report) = load(Some(mark), false).expect("reuse");
    assert!(report.verified && report.reused && !report.locked);
    assert_eq!(again.row(5).expect("row").to_vec(), row5);
    assert_eq!(again.file_mark(), Some(mark));
    drop(again);
    // A changed row moves the change time on: read and hashed again,
    // and refused.
    set_row_byte(&path, 5, 0x5a);
    let err = load(Some(mark), false).expect_err("changed since");
    assert!(err.to_string().contains("rows hash to"), "{err}");
    // A mark taken after the change is what the pages are served on:
    // nothing is hashed (the changed row is served).
    let f = TableFile::open(&path).expect("open");
    let now = FileMark::of(f.handle(), true).expect("stat");
    let (t, report) = load(Some(now), false).expect("reuse");
    assert!(report.reused);
    assert_eq!(t.row(5).expect("row").values()[0], 0x5a);
    drop(t);
    // Never hashed: counts only for a donor that trusts digests.
    let trusted = FileMark {
        verified: false,
        ..now
    };
    assert!(load(Some(trusted), false).is_err());
    let (_, report) = load(Some(trusted), true).expect("trusted");
    assert!(report.reused && !report.verified);
    // Another file's mark counts for nothing.
    let other = FileMark {
        ino: now.ino + 1,
        ..now
    };
    let (_, report) = load(Some(other), true).expect("trusted");
    assert!(!report.reused);
}

#[test]
fn a_kept_copy_is_adopted_and_a_stale_or_unfinished_one_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, pin, opts) = kept_load(dir.path(), MlockMode::Off);
    let digest = pin.digest;
    let opts = LoadOptions {
        pinned: Some(pin),
        ..opts
    };
    let (t, _) = ResidentTable::load_with(None, &path, &opts, |_| None).expect("load");
    let kept = t.kept().expect("a memfd");
    assert_eq!(kept.record.id, 1, "the id defaults to the layer");
    assert_eq!((kept.record.digest, kept.record.rows), (digest, 10_000));
    assert!(kept.record.verified);
    assert_eq!(
        kept.record.name(),
        format!("etab-1-{}", &digest.to_hex()[..16])
    );
    let fd = kept.file.try_clone().expect("dup");
    let generation = kept.record.generation;
    let want: Vec<Vec<u8>> = (0..10_000)
        .map(|r| t.row(r).expect("row").to_vec())
        .collect();
    drop(t);
    // The next process: the same rows, the same generation, nothing read.
    let again = ResidentTable::adopt(1, fd.try_clone().expect("dup"), &pin, false).expect("adopt");
    assert_eq!(again.kept().expect("kept").record.generation, generation);
    for (r, row) in want.iter().enumerate() {
        assert_eq!(
            again.row(r as u64).map(|x| x.to_vec()),
            Some(row.clone()),
            "row {r}"
        );
    }
    assert_eq!(again.memory().as_ref().as_ref().len(), 10_000 * ROW_BYTES);
    again.lock().ok();
    // Another version pinned, another table id, another size: refused.
    let other = ExpectedTable {
        digest: TableDigest([7; 32]),
        ..pin
    };
    let e =
        ResidentTable::adopt(1, fd.try_clone().expect("dup"), &other, false).expect_err("stale");
    assert!(e.to_string().contains("but the config pins"), "{e}");
    let e = ResidentTable::adopt(14, fd.try_clone().expect("dup"), &pin, false).expect_err("id");
    assert!(e.to_string().contains("not table 14"), "{e}");
    let e =
        ResidentTable::adopt(1, fd, &ExpectedTable { rows: 9, ..pin }, false).expect_err("rows");
    assert!(e.to_string().contains("9 rows"), "{e}");
    // A load cut short: not sealed yet, no record.
    let (f, _, _) = kept::create(10_000, KeptLayout::Packed, false).expect("memfd");
    let e = ResidentTable::adopt(1, f, &pin, false).expect_err("unfinished");
    assert!(e.to_string().contains("not sealed"), "{e}");
    // Not sealed at all (an ordinary file).
    let plain = std::fs::File::open(&path).expect("open");
    let e = ResidentTable::adopt(1, plain, &pin, false).expect_err("plain");
    assert!(e.to_string().contains("sealable memfd"), "{e}");
}

#[test]
fn a_planar_copy_holds_every_row_and_is_adopted_as_planar() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, pin, opts) = kept_load(dir.path(), MlockMode::Off);
    // Small segments: many workers' scatters meet at segment edges.
    let opts = LoadOptions {
        planar: true,
        threads: 3,
        ..opts
    };
    let (t, report) = ResidentTable::load_with(Some(1), &path, &opts, |_| None).expect("load");
    assert!(
        report.verified,
        "the digest is the rows' as if back to back"
    );
    let scales_at = kept::planar_scales_at(10_000).expect("at") as usize;
    assert_eq!(t.memory().layout(), RowLayout::Planar { scales_at });
    assert!(!t.memory().is_packed());
    let k = t.kept().expect("kept");
    assert_eq!(k.record.layout, KeptLayout::Planar);
    let bytes = t.memory_bytes();
    for r in [0u64, 1, 14, 15, 4_999, 9_999] {
        let row = t.row(r).expect("row").to_vec();
        assert!(is_synthetic_row(4, 1, r, &row), "row {r}");
        // Where an engine's kernel reads it: values at r * 256, scales at
        // scales_at + r * 8.
        let r = r as usize;
        assert_eq!(&bytes[r * 256..r * 256 + 256], &row[..256]);
        assert_eq!(
            &bytes[scales_at + r * 8..scales_at + r * 8 + 8],
            &row[256..]
        );
    }
    let fd = k.file.try_clone().expect("dup");
    let again = ResidentTable::adopt(1, fd, &pin, false).expect("adopt");
    assert_eq!(again.memory().layout(), RowLayout::Planar { scales_at });
    for r in (0..10_000).step_by(997) {
        assert_eq!(
            again.row(r).map(|x| x.to_vec()),
            t.row(r).map(|x| x.to_vec())
        );
    }
    // A planar fill of a single segment hashes the same.
    let small = FillOptions {
        segment: 1 << 30,
        threads: 1,
        ..FillOptions::default()
    };
    let file = TableFile::open(&path).expect("open");
    let mut values = vec![0u8; 10_000 * 256];
    let mut scales = vec![0u8; 10_000 * 8];
    let d = crate::fill::fill_planar(&file, &mut values, &mut scales, small, None).expect("fill");
    assert_eq!(d, Some(pin.digest));
    let e = crate::fill::fill_planar(&file, &mut values[1..], &mut scales, small, None)
        .expect_err("short");
    assert!(e.to_string().contains("planar rows"), "{e}");
}

/// `table`'s file, its pin, and the options of a load into a memfd.
fn kept_load(dir: &Path, mlock: MlockMode) -> (std::path::PathBuf, ExpectedTable, LoadOptions) {
    let (path, digest) = table(dir);
    let pin = ExpectedTable {
        digest,
        layer: 1,
        rows: 10_000,
    };
    let opts = LoadOptions {
        backing: Backing::Memfd,
        mlock,
        ..LoadOptions::default()
    };
    (path, pin, opts)
}

#[test]
fn a_flipped_record_byte_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, pin, opts) = kept_load(dir.path(), MlockMode::Off);
    let (t, _) = ResidentTable::load_with(Some(1), &path, &opts, |_| None).expect("load");
    let loaded = t.kept().expect("kept").file.try_clone().expect("dup");
    let record = t.kept().expect("kept").record;
    drop(t);
    // A loaded copy is sealed against writes: not even a writable
    // mapping of it can be made.
    assert!(kept::is_sealed_read_only(&loaded));
    let len = loaded.metadata().expect("stat").len() as usize;
    // SAFETY: a test's own memfd; the mapping must be refused.
    assert!(unsafe { memmap2::MmapOptions::new().len(len).map_mut(&loaded) }.is_err());
    // So the flipped byte goes into a fresh memfd with the same record.
    let (f, len, _) = kept::create(record.rows, KeptLayout::Packed, false).expect("memfd");
    let len = len as usize;
    // Through a mapping: hugetlbfs has no write(2).
    // SAFETY: a test's own memfd, mapped while nothing else uses it.
    let mut map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&f) }.expect("map");
    kept::finish(&f, &mut map, &record).expect("record");
    map[len - 4096 + 70] ^= 0xff;
    drop(map);
    let e = ResidentTable::adopt(1, f, &pin, false).expect_err("bad record");
    assert!(e.to_string().contains("checksum"), "{e}");
}

#[test]
fn pages_populated_and_released_in_slices_keep_a_memfds_rows_and_no_others_are_released() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = table(dir.path());
    let all: Vec<u64> = (0..10_000).collect();
    let rows_ok = |t: &ResidentTable| {
        all.iter()
            .all(|&r| is_synthetic_row(4, 1, r, &t.row(r).expect("in range").to_vec()))
    };
    let (memfd, _) = load_as(&path, Backing::Memfd, true).expect("load");
    let len = memfd.memory_bytes().len();
    for range in crate::background::slices(len, 8192) {
        memfd.populate_range(range.clone());
        assert!(memfd.release_range(range), "a memfd's pages are released");
    }
    // Out of range: nothing done; the rows were kept by the memfd.
    memfd.populate_range(len..len + 4096);
    assert!(!memfd.release_range(len..len + 4096));
    assert!(rows_ok(&memfd));
    // Anonymous memory and a file's pages would lose rows or cost a
    // reread: never released.
    for backing in [Backing::Anonymous, Backing::Mapped] {
        let (t, _) = load_as(&path, backing, true).expect("load");
        assert!(!t.release_range(0..4096), "{backing:?}");
        assert!(rows_ok(&t), "{backing:?}");
    }
}

#[test]
fn a_sparse_table_loads_verified_in_every_backing_and_its_copy_stays_sparse() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sparse.etab");
    let rows = 400_000u64;
    let spec = GenSpec {
        layer: 14,
        rows,
        seed: 6,
        hash_preset: None,
        hash_base: None,
        threads: 1,
    };
    let touched = [3, 150_000, 150_014, rows - 1];
    crate::generate::generate_sparse(&path, &spec, &touched, None).expect("sparse");
    let planar = LoadOptions {
        backing: Backing::Memfd,
        planar: true,
        mlock: MlockMode::Off,
        ..LoadOptions::default()
    };
    let mut loaded = Vec::new();
    for backing in [Backing::Anonymous, Backing::Memfd, Backing::Mapped] {
        loaded.push(load_as(&path, backing, false).expect("verified load").0);
    }
    loaded.push(
        ResidentTable::load_with(Some(3), &path, &planar, |_| None)
            .expect("planar")
            .0,
    );
    for t in &loaded {
        for r in [
            0,
            3,
            14,
            15,
            149_999,
            150_000,
            150_014,
            150_015,
            300_000,
            rows - 1,
        ] {
            let row = t.row(r).expect("in range").to_vec();
            if touched.iter().any(|x| x / 15 == r / 15) {
                assert!(is_synthetic_row(6, 14, r, &row), "row {r}");
            } else {
                assert!(row.iter().all(|&b| b == 0), "row {r} is zero");
            }
        }
        let Some(k) = t.kept() else { continue };
        // Only the pages the touched rows were copied to exist in the memfd.
        let len = k.file.metadata().expect("stat").len();
        let data: u64 = crate::holes::data_extents(&k.file, 0..len)
            .iter()
            .map(|e| e.end - e.start)
            .sum();
        if data < len {
            assert!(data <= 16 << 20, "{data} of {len} bytes hold data");
        } else {
            eprintln!("note: this kernel's memfd reports no holes");
        }
    }
}

/// A table of another encoding is held packed at its own row size: in a
/// memfd the next process adopts (record version 3, its encoding and
/// scale with it) where a copy or the file's pages were asked for, planar
/// or not; in private memory where that was asked for.
#[test]
fn rows_of_another_encoding_load_packed_at_their_size_and_are_adopted() {
    use engram_protocol::encoding::RowEncoding;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("nvfp4.etab");
    let e = RowEncoding::Nvfp4 { values: 160 };
    let (m, data) = crate::generate::write_encoded(&path, e, 2_000, 5);
    let layout = KeptLayout::Encoded {
        encoding: e,
        tensor_scale: m.tensor_scale,
    };
    let rows_ok = |t: &ResidentTable| {
        for r in [0u64, 44, 45, 1_999] {
            let row = t.row(r).expect("in range").to_vec();
            assert_eq!(row, data[r as usize * 90..][..90], "row {r}");
        }
        assert!(t.row(2_000).is_none());
        assert_eq!((t.encoding, t.tensor_scale), (e, m.tensor_scale));
        assert_eq!(t.row_bytes(), 90);
        assert_eq!(t.memory().layout(), RowLayout::Encoded { row_bytes: 90 });
        let info = t.info();
        assert_eq!((info.encoding, info.tensor_scale), (e, m.tensor_scale));
    };
    for (backing, planar) in [
        (Backing::Anonymous, false),
        (Backing::Memfd, false),
        (Backing::Memfd, true),
        (Backing::Mapped, false),
    ] {
        let opts = LoadOptions {
            backing,
            planar,
            threads: 2,
            ..LoadOptions::default()
        };
        let (t, report) = ResidentTable::load_with(Some(3), &path, &opts, |_| None).expect("load");
        assert!(report.verified);
        assert_eq!((t.id, t.rows, t.digest), (3, 2_000, m.digest));
        assert_eq!(t.bytes(), 2_000 * 90);
        assert!(t.file_mark().is_none(), "not its file's pages");
        rows_ok(&t);
        let Some(k) = t.kept() else {
            assert_eq!(backing, Backing::Anonymous);
            continue;
        };
        assert_eq!(k.record.layout, layout, "{backing:?}");
        // The next process adopts it, encoding and scale included.
        let f = k.file.try_clone().expect("dup");
        let pin = ExpectedTable {
            digest: m.digest,
            layer: 1,
            rows: 2_000,
        };
        drop(t);
        let again = ResidentTable::adopt(3, f, &pin, false).expect("adopt");
        rows_ok(&again);
        assert_eq!(again.kept().expect("kept").record.layout, layout);
    }
}
