//! Tests of `table_file`.

use super::*;
use engram_protocol::ROW_BYTES;
use engram_protocol::encoding::RowEncoding;
use engram_protocol::synthetic::synthetic_rows;

fn meta(rows: u64) -> TableMeta {
    TableMeta {
        layer: 1,
        rows,
        digest: TableDigest([0; 32]),
        hash_preset: None,
        hash_base: None,
        source: "test".into(),
        encoding: RowEncoding::V41,
        tensor_scale: None,
    }
}

fn write(dir: &Path, rows: u64, batch: usize) -> (PathBuf, Vec<u8>) {
    let path = dir.join("t.etab");
    let mut data = vec![0u8; rows as usize * ROW_BYTES];
    synthetic_rows(9, 1, 0, &mut data);
    let mut w = TableWriter::create(&path, meta(rows)).expect("create");
    for chunk in data.chunks(batch * ROW_BYTES) {
        w.write_rows(chunk).expect("write");
    }
    let m = w.finish().expect("finish");
    assert_eq!(m.digest, TableDigest::of_rows(&data));
    (path, data)
}

#[test]
fn written_tables_read_back_row_for_row() {
    let dir = tempfile::tempdir().expect("tempdir");
    for rows in [1u64, 15, 16, 15 * 1024 + 7, 40_000] {
        let (path, data) = write(dir.path(), rows, 333);
        let t = TableFile::open(&path).expect("open");
        assert_eq!(t.meta.rows, rows);
        let mut back = Vec::new();
        t.for_each_chunk(true, None, |first, r| {
            assert_eq!(first as usize * ROW_BYTES, back.len());
            back.extend_from_slice(r);
            Ok(())
        })
        .expect("stream");
        assert_eq!(back, data);
        assert_eq!(t.verify(None).expect("verify"), t.meta.digest);
        // Row offsets point at the row.
        let r = rows - 1;
        let mut one = [0u8; ROW_BYTES];
        let off = t.layout.row_offset(r).expect("in range");
        File::open(&path)
            .expect("open")
            .read_exact_at(&mut one, off)
            .expect("read");
        assert_eq!(&one[..], &data[r as usize * ROW_BYTES..]);
    }
}

#[test]
fn written_pages_carry_checksums_that_catch_a_flipped_byte() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, data) = write(dir.path(), 100, 7);
    let t = TableFile::open(&path).expect("open");
    assert!(t.has_page_sums() && t.page_sums_hint().is_none());
    let sums = t.read_page_sums().expect("read").expect("present");
    assert_eq!(sums.len(), 7);
    let mut page = vec![0u8; PAGE_BYTES as usize];
    for (i, &sum) in sums.iter().enumerate() {
        page.fill(0);
        let rows = &data[i * 15 * ROW_BYTES..((i + 1) * 15 * ROW_BYTES).min(data.len())];
        page[..rows.len()].copy_from_slice(rows);
        assert_eq!(sum, page_checksum(&page), "page {i}");
    }
    // One flipped bit in page 3, row bytes or slack: found and named.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .expect("open rw");
    for at in [3 * PAGE_BYTES + 100, 3 * PAGE_BYTES + 4000] {
        let off = t.layout.data_start + at;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, off).expect("read");
        f.write_all_at(&[b[0] ^ 0x10], off).expect("write");
        assert!(matches!(
            t.verify(None),
            Err(TableFileError::PageChecksum { page: 3, .. })
        ));
        f.write_all_at(&b, off).expect("restore");
        assert!(t.verify(None).is_ok());
    }
}

#[test]
fn corruption_is_found() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = write(dir.path(), 100, 100);
    // Without page checksums, so each row check is reached.
    remove_page_sums(&path).expect("strip");
    let t = TableFile::open(&path).expect("open");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open rw");
    // A NaN code in row 20.
    let off = t.layout.row_offset(20).expect("in range");
    f.write_all_at(&[0x7F], off + 3).expect("write");
    assert!(matches!(
        t.verify(None),
        Err(TableFileError::CorruptRow { row: 20, .. })
    ));
    // A valid but different value: only the digest catches it.
    f.write_all_at(&[0x01], off + 3).expect("write");
    assert!(matches!(
        t.verify(None),
        Err(TableFileError::DigestMismatch { .. })
    ));
    // Slack bytes.
    f.write_all_at(&[0x01], off + 3).expect("write");
    f.write_all_at(&[1], t.layout.data_start + 4000)
        .expect("write");
    assert!(matches!(
        t.verify(None),
        Err(TableFileError::Slack { page: 0, .. })
    ));
}

#[test]
fn truncated_and_foreign_files_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = write(dir.path(), 100, 100);
    let len = std::fs::metadata(&path).expect("stat").len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open rw");
    f.set_len(len - 1).expect("truncate");
    assert!(matches!(
        TableFile::open(&path),
        Err(TableFileError::Format { .. })
    ));
    std::fs::write(&path, b"hello").expect("write");
    assert!(matches!(
        TableFile::open(&path),
        Err(TableFileError::Format { .. })
    ));
    assert!(matches!(
        TableFile::open(&dir.path().join("missing")),
        Err(TableFileError::Io { .. })
    ));
}

#[test]
fn writer_refuses_wrong_row_counts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("x.etab");
    let mut w = TableWriter::create(&path, meta(2)).expect("create");
    assert!(w.write_rows(&[0u8; 3 * ROW_BYTES]).is_err());
    w.write_rows(&[0u8; ROW_BYTES]).expect("one row");
    assert!(w.finish().is_err());
    assert!(
        !path.exists(),
        "an unfinished table never appears under its name"
    );
    assert!(
        !dir.path().join("x.etab.partial").exists(),
        "and leaves no partial file"
    );
}

#[test]
fn a_table_of_rows_this_build_does_not_serve_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("qwen.etab");
    let fp8 = RowEncoding::Fp8PerTensor { values: 160 };
    let m = TableMeta {
        encoding: fp8,
        tensor_scale: Some(0.5f32.to_bits()),
        ..meta(100)
    };
    let mut bytes = etab::encode_header(&m, false).expect("header");
    bytes.resize(bytes.len() + 4 * PAGE_BYTES as usize, 0); // 25 rows a page
    std::fs::write(&path, &bytes).expect("write");
    let e = TableFile::open(&path).expect_err("not served");
    assert!(
        matches!(e, TableFileError::Encoding { row_bytes: 160, .. }),
        "{e}"
    );
    let shown = e.to_string();
    assert!(
        shown.contains("fp8_per_tensorx160") && shown.contains("docs/models.md"),
        "{shown}"
    );
}
