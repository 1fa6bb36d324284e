//! Reading and writing `.etab` files: open and check a header, stream the
//! logical rows in order (for verify and for loading), read the page
//! checksums, and write a table from rows in order (for gen and pack),
//! digest and page checksums included; [`crate::verify::add_page_sums`] rewrites a file
//! made before page checksums existed.

use std::fs::File;
use std::io::{self, Seek, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use engram_protocol::encoding::RowEncoding;
use engram_protocol::etab::{
    self, EtabError, PAGE_BYTES, SUM_BYTES, TableLayout, TableMeta, page_checksum,
};
use engram_protocol::{DigestBuilder, RowError, TableDigest};
use thiserror::Error;

use crate::progress::Progress;

/// Pages read or written per IO call: 4 MiB, 15,360 rows.
pub const CHUNK_PAGES: u64 = 1024;

/// A failure reading or writing a table file, naming the file.
#[derive(Debug, Error)]
pub enum TableFileError {
    /// The OS refused an operation.
    #[error("{path}: {op}: {source}")]
    Io {
        /// The file operated on.
        path: PathBuf,
        /// The operation that failed.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The header is not a valid `.etab` header.
    #[error("{path}: not a valid .etab table: {source}")]
    Format {
        /// The table file.
        path: PathBuf,
        /// Why the header is not valid.
        source: EtabError,
    },
    /// A valid table of rows the reader does not take.
    #[error(
        "{path}: its rows are {encoding} ({row_bytes} bytes): {reader} takes V4.1's 264-byte rows only (docs/models.md)"
    )]
    Encoding {
        /// The table file.
        path: PathBuf,
        /// What refused it.
        reader: &'static str,
        /// The rows' encoding, by name.
        encoding: String,
        /// Bytes per row.
        row_bytes: usize,
    },
    /// A row does not decode.
    #[error("{path}: row {row} is corrupt: {source}")]
    CorruptRow {
        /// The table file.
        path: PathBuf,
        /// Index of the corrupt row.
        row: u64,
        /// Why the row does not decode.
        source: RowError,
    },
    /// A row of another encoding than V4.1's does not decode.
    #[error("{path}: row {row} is corrupt ({encoding}): {source}")]
    CorruptEncodedRow {
        /// The table file.
        path: PathBuf,
        /// Index of the corrupt row.
        row: u64,
        /// The rows' encoding, by name.
        encoding: String,
        /// Why the row does not decode.
        source: engram_protocol::encoding::EncodingError,
    },
    /// A page does not hash to its checksum in `page_xxh3`.
    #[error(
        "{path}: page {page} hashes to {actual:016x} but its checksum is {expected:016x}: the file is corrupt"
    )]
    PageChecksum {
        /// The table file.
        path: PathBuf,
        /// Index of the page.
        page: u64,
        /// The page's XXH3-64 as stored in `page_xxh3`.
        expected: u64,
        /// The XXH3-64 the page's bytes hash to.
        actual: u64,
    },
    /// Bytes between rows that must be zero are not.
    #[error("{path}: page {page} has non-zero slack bytes (a writer bug or corruption)")]
    Slack {
        /// The table file.
        path: PathBuf,
        /// Index of the page.
        page: u64,
    },
    /// The rows hash to another digest than the header's.
    #[error(
        "{path}: rows hash to {actual} but the header says {expected}: the file is corrupt or was modified"
    )]
    DigestMismatch {
        /// The table file.
        path: PathBuf,
        /// The digest the rows should hash to: the header's, or the one a writer was told to expect.
        expected: TableDigest,
        /// The digest the rows hash to.
        actual: TableDigest,
    },
}

fn io_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(io::Error) -> TableFileError + 'a {
    move |source| TableFileError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// Open `path` for reading, non-blocking, so that a FIFO or a device named
/// as a table opens at once (and is refused by the header check) instead
/// of waiting for a writer.
fn open_file(path: &Path) -> Result<File, TableFileError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io_err(path, "open"))
}

/// An open table file whose header has been checked.
#[derive(Debug)]
pub struct TableFile {
    /// Where it is.
    pub path: PathBuf,
    /// What the header says.
    pub meta: TableMeta,
    /// Where the pages are.
    pub layout: TableLayout,
    file: File,
}

impl TableFile {
    /// The open file.
    pub fn handle(&self) -> &File {
        &self.file
    }

    /// Open a table file of V4.1's rows and check its header against its
    /// size ([`Self::open_any`] for rows of any encoding).
    pub fn open(path: &Path) -> Result<Self, TableFileError> {
        Self::from_file(open_file(path)?, path)
    }

    /// A table file's header, of any row encoding (what `inspect` shows;
    /// [`open`](Self::open) refuses the encodings this build does not
    /// serve). Checks the header against the file's size.
    pub fn read_meta(path: &Path) -> Result<(TableMeta, TableLayout), TableFileError> {
        Self::header_of(&open_file(path)?, path)
    }

    fn header_of(file: &File, path: &Path) -> Result<(TableMeta, TableLayout), TableFileError> {
        let meta = file.metadata().map_err(io_err(path, "stat"))?;
        if !meta.is_file() {
            return Err(TableFileError::Io {
                path: path.to_path_buf(),
                op: "open",
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "not a regular file (a table is a regular .etab file)",
                ),
            });
        }
        etab::read_header(meta.len(), |buf, off| file.read_exact_at(buf, off)).map_err(
            |e| match e {
                etab::ReadHeaderError::Io(source) => TableFileError::Io {
                    path: path.to_path_buf(),
                    op: "read header",
                    source,
                },
                etab::ReadHeaderError::Format(source) => TableFileError::Format {
                    path: path.to_path_buf(),
                    source,
                },
            },
        )
    }

    /// A table from a file already open (a swap opens its file once, by
    /// descriptor, beneath the table directory): checks that it is a
    /// regular file and its header against its size; `path` names it in
    /// errors and logs.
    pub fn from_file(file: File, path: &Path) -> Result<Self, TableFileError> {
        let table = Self::from_file_any(file, path)?;
        table.require_v41("this reader")?;
        Ok(table)
    }

    /// [`Self::from_file`] for a reader of rows of any encoding (the
    /// donor's packed load, `verify`): the rows' size and rows per page
    /// are the file's own ([`TableLayout::row_bytes`]).
    pub fn from_file_any(file: File, path: &Path) -> Result<Self, TableFileError> {
        let (meta, layout) = Self::header_of(&file, path)?;
        Ok(Self {
            path: path.to_path_buf(),
            meta,
            layout,
            file,
        })
    }

    /// [`Self::open`] for a reader of rows of any encoding.
    pub fn open_any(path: &Path) -> Result<Self, TableFileError> {
        Self::from_file_any(open_file(path)?, path)
    }

    /// Refuse a table whose rows are not V4.1's, naming its encoding and
    /// `reader` (what refuses it): for the readers that handle V4.1's
    /// rows only.
    pub fn require_v41(&self, reader: &'static str) -> Result<(), TableFileError> {
        if self.meta.encoding == RowEncoding::V41 {
            return Ok(());
        }
        Err(TableFileError::Encoding {
            path: self.path.clone(),
            reader,
            encoding: self.meta.encoding.name(),
            row_bytes: self.meta.encoding.row_bytes(),
        })
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.meta.encoding.row_bytes()
    }

    /// Check rows `first_row..` (whole rows, back to back) by the table's
    /// encoding: the first that does not decode is the error.
    pub fn check_rows(&self, first_row: u64, rows: &[u8]) -> Result<(), TableFileError> {
        if self.meta.encoding == RowEncoding::V41 {
            return engram_protocol::row::check_rows(rows).map_err(|(i, source)| {
                TableFileError::CorruptRow {
                    path: self.path.clone(),
                    row: first_row + i as u64,
                    source,
                }
            });
        }
        self.meta.encoding.check_rows(rows).map_err(|(i, source)| {
            TableFileError::CorruptEncodedRow {
                path: self.path.clone(),
                row: first_row + i as u64,
                encoding: self.meta.encoding.name(),
                source,
            }
        })
    }

    /// The open file.
    pub fn std_file(&self) -> &File {
        &self.file
    }

    /// The open file's descriptor.
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.file.as_raw_fd()
    }

    /// True when the file carries page checksums (`page_xxh3`).
    pub fn has_page_sums(&self) -> bool {
        self.layout.page_sums
    }

    /// For a file without page checksums: a warning that says how to add them.
    pub fn page_sums_hint(&self) -> Option<String> {
        (!self.layout.page_sums).then(|| {
            format!(
                "{}: no page checksums: reads of single pages (the SSD copy) cannot be checked; \
                 add them with `memory-donor verify --write-page-checksums {}`",
                self.path.display(),
                self.path.display()
            )
        })
    }

    /// The page checksums (one per page), or `None` for a file without them.
    pub fn read_page_sums(&self) -> Result<Option<Vec<u64>>, TableFileError> {
        let Some(start) = self.layout.sums_start() else {
            return Ok(None);
        };
        // The header check tied the file's size to the page count, so this
        // is 1/512 of a file that exists.
        let mut sums = Vec::with_capacity(self.layout.pages as usize);
        let mut buf = vec![0u8; (CHUNK_PAGES * SUM_BYTES) as usize];
        let mut page = 0;
        while page < self.layout.pages {
            let n = CHUNK_PAGES.min(self.layout.pages - page);
            let buf = &mut buf[..(n * SUM_BYTES) as usize];
            self.file
                .read_exact_at(buf, start + page * SUM_BYTES)
                .map_err(io_err(&self.path, "read page checksums"))?;
            sums.extend(
                buf.chunks_exact(SUM_BYTES as usize)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8-byte chunks"))),
            );
            page += n;
        }
        Ok(Some(sums))
    }

    /// Stream the logical rows in order, `CHUNK_PAGES` pages at a time:
    /// `f(first_row, rows)` gets whole rows, compacted (no page slack).
    /// With `check`, non-zero slack bytes and pages that do not match their
    /// checksum (where the file has them) are errors.
    pub fn for_each_chunk(
        &self,
        check: bool,
        progress: Option<&mut Progress>,
        mut f: impl FnMut(u64, &[u8]) -> Result<(), TableFileError>,
    ) -> Result<(), TableFileError> {
        let mut progress = progress;
        let mut sums_buf = vec![0u8; (CHUNK_PAGES * SUM_BYTES) as usize];
        let mut pages_buf = vec![0u8; (CHUNK_PAGES * PAGE_BYTES) as usize];
        let (row, per_page) = (self.layout.row_bytes as usize, self.layout.rows_per_page);
        let mut rows_buf = vec![0u8; (CHUNK_PAGES * per_page) as usize * row];
        let mut page = 0u64;
        while page < self.layout.pages {
            let n_pages = CHUNK_PAGES.min(self.layout.pages - page);
            let buf = &mut pages_buf[..(n_pages * PAGE_BYTES) as usize];
            let offset = self.layout.data_start + page * PAGE_BYTES;
            self.file
                .read_exact_at(buf, offset)
                .map_err(io_err(&self.path, "read pages"))?;
            let sums = match self.layout.sums_start() {
                Some(start) if check => {
                    let sums = &mut sums_buf[..(n_pages * SUM_BYTES) as usize];
                    self.file
                        .read_exact_at(sums, start + page * SUM_BYTES)
                        .map_err(io_err(&self.path, "read page checksums"))?;
                    Some(&*sums)
                }
                _ => None,
            };
            let first_row = page * per_page;
            let n_rows = (n_pages * per_page).min(self.layout.rows - first_row) as usize;
            for (i, p) in buf.chunks_exact(PAGE_BYTES as usize).enumerate() {
                let in_page = (n_rows - i * per_page as usize).min(per_page as usize);
                let used = in_page * row;
                let dst = i * per_page as usize * row;
                rows_buf[dst..dst + used].copy_from_slice(&p[..used]);
                if let Some(sums) = sums {
                    let at = i * SUM_BYTES as usize;
                    let expected = u64::from_le_bytes(
                        sums[at..at + SUM_BYTES as usize]
                            .try_into()
                            .expect("8-byte slice"),
                    );
                    let actual = page_checksum(p);
                    if actual != expected {
                        return Err(TableFileError::PageChecksum {
                            path: self.path.clone(),
                            page: page + i as u64,
                            expected,
                            actual,
                        });
                    }
                }
                if check && p[used..].iter().any(|&b| b != 0) {
                    return Err(TableFileError::Slack {
                        path: self.path.clone(),
                        page: page + i as u64,
                    });
                }
            }
            f(first_row, &rows_buf[..n_rows * row])?;
            drop_cache(&self.file, offset, n_pages * PAGE_BYTES);
            page += n_pages;
            if let Some(p) = progress.as_deref_mut() {
                p.update(first_row + n_rows as u64);
            }
        }
        Ok(())
    }
}

/// Tell the kernel we are done with a range of the file, so streaming a
/// 94 GiB table does not push everything else out of the page cache.
fn drop_cache(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(off), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return;
    };
    // SAFETY: posix_fadvise only reads its integer arguments; the fd is open for the call's duration.
    // Its result is advisory, so a failure changes nothing but cache residency.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), off, len, libc::POSIX_FADV_DONTNEED);
    }
}

/// Writes a table file from rows fed in order; the digest is computed on the
/// way and written into the header at the end, and each page's checksum
/// into the `page_xxh3` tensor as the page is written.
#[derive(Debug)]
pub struct TableWriter {
    path: PathBuf,
    tmp_path: PathBuf,
    /// `None` once finished; an unfinished file is removed on drop.
    file: Option<io::BufWriter<File>>,
    /// The same file, for positional writes of the checksums.
    sums_file: File,
    sums_start: u64,
    sums: Vec<u8>,
    pages_summed: u64,
    meta: TableMeta,
    digest: DigestBuilder,
    rows_written: u64,
    page: Vec<u8>,
    rows_in_page: usize,
    /// Bytes of a row in the table's encoding.
    row_bytes: usize,
    /// Rows a page holds in the table's encoding.
    rows_per_page: usize,
}

impl TableWriter {
    /// Start writing `meta.rows` rows to `path` (the digest in `meta` is ignored).
    /// The file appears under its name only once finished and synced.
    pub fn create(path: &Path, meta: TableMeta) -> Result<Self, TableFileError> {
        let fmt = |source| TableFileError::Format {
            path: path.to_path_buf(),
            source,
        };
        let header = etab::encode_header(&meta, true).map_err(fmt)?;
        let row_bytes = meta.encoding.row_bytes();
        let rows_per_page = etab::rows_per_page(meta.encoding) as usize;
        let pages = meta.rows.div_ceil(rows_per_page as u64);
        let sums_start = header.len() as u64 + pages * PAGE_BYTES;
        let mut name = path
            .file_name()
            .map(|n| n.to_os_string())
            .unwrap_or_default();
        name.push(".partial");
        let tmp_path = path.with_file_name(name);
        let file = File::create(&tmp_path).map_err(io_err(&tmp_path, "create"))?;
        let sums_file = file.try_clone().map_err(io_err(&tmp_path, "create"))?;
        let mut file = io::BufWriter::with_capacity(8 << 20, file);
        file.write_all(&header)
            .map_err(io_err(&tmp_path, "write header"))?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp_path,
            file: Some(file),
            sums_file,
            sums_start,
            sums: Vec::with_capacity((CHUNK_PAGES * SUM_BYTES) as usize),
            pages_summed: 0,
            meta,
            digest: DigestBuilder::new(),
            rows_written: 0,
            page: vec![0u8; PAGE_BYTES as usize],
            rows_in_page: 0,
            row_bytes,
            rows_per_page,
        })
    }

    /// Rows written so far.
    pub fn rows_written(&self) -> u64 {
        self.rows_written
    }

    /// Append whole rows (of the table's encoding), in row order.
    pub fn write_rows(&mut self, rows: &[u8]) -> Result<(), TableFileError> {
        let rb = self.row_bytes;
        let n = (rows.len() / rb) as u64;
        if !rows.len().is_multiple_of(rb) || self.rows_written + n > self.meta.rows {
            return Err(TableFileError::Io {
                path: self.tmp_path.clone(),
                op: "write rows",
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "more rows than the header declares",
                ),
            });
        }
        self.digest.update(rows);
        for row in rows.chunks_exact(rb) {
            let at = self.rows_in_page * rb;
            self.page[at..at + rb].copy_from_slice(row);
            self.rows_in_page += 1;
            if self.rows_in_page == self.rows_per_page {
                self.flush_page()?;
            }
        }
        self.rows_written += n;
        Ok(())
    }

    /// Append `pages` whole pages of zero rows as a hole: nothing is
    /// written (the file system reads them back as zeros), while the
    /// digest and the page checksums count them as written. Only between
    /// whole pages; the last page may be the table's partial one.
    pub fn write_zero_pages(&mut self, pages: u64) -> Result<(), TableFileError> {
        if pages == 0 {
            return Ok(());
        }
        let left = self.meta.rows - self.rows_written;
        let rpp = self.rows_per_page as u64;
        let rows = pages.saturating_mul(rpp).min(left);
        if self.rows_in_page != 0 || pages > left.div_ceil(rpp) {
            return Err(TableFileError::Io {
                path: self.tmp_path.clone(),
                op: "write zero pages",
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "not at a page boundary, or more pages than the header declares",
                ),
            });
        }
        let mut bytes = rows * self.row_bytes as u64;
        while bytes > 0 {
            let n = bytes.min(crate::holes::ZEROS.len() as u64) as usize;
            self.digest.update(&crate::holes::ZEROS[..n]);
            bytes -= n as u64;
        }
        let zero = crate::holes::zero_page_checksum().to_le_bytes();
        for _ in 0..pages {
            self.sums.extend_from_slice(&zero);
            if self.sums.len() == self.sums.capacity() {
                self.flush_sums()?;
            }
        }
        let Some(file) = self.file.as_mut() else {
            return Err(TableFileError::Io {
                path: self.tmp_path.clone(),
                op: "write zero pages",
                source: io::Error::other("writer already finished"),
            });
        };
        // Seeking flushes what is buffered; the sums, written after the
        // pages, give the file its length.
        let skip = i64::try_from(pages * PAGE_BYTES).map_err(|_| TableFileError::Io {
            path: self.tmp_path.clone(),
            op: "write zero pages",
            source: io::Error::other("too many pages"),
        })?;
        file.seek(io::SeekFrom::Current(skip))
            .map_err(io_err(&self.tmp_path, "seek past zero pages"))?;
        self.rows_written += rows;
        Ok(())
    }

    fn flush_page(&mut self) -> Result<(), TableFileError> {
        // Slack after the last row stays zero: rows only ever overwrite their own slots.
        let Some(file) = self.file.as_mut() else {
            return Err(TableFileError::Io {
                path: self.tmp_path.clone(),
                op: "write page",
                source: io::Error::other("writer already finished"),
            });
        };
        file.write_all(&self.page)
            .map_err(io_err(&self.tmp_path, "write page"))?;
        self.sums
            .extend_from_slice(&page_checksum(&self.page).to_le_bytes());
        if self.sums.len() == self.sums.capacity() {
            self.flush_sums()?;
        }
        self.page[..self.rows_in_page * self.row_bytes].fill(0);
        self.rows_in_page = 0;
        Ok(())
    }

    fn flush_sums(&mut self) -> Result<(), TableFileError> {
        let at = self.sums_start + self.pages_summed * SUM_BYTES;
        self.sums_file
            .write_all_at(&self.sums, at)
            .map_err(io_err(&self.tmp_path, "write page checksums"))?;
        self.pages_summed += self.sums.len() as u64 / SUM_BYTES;
        self.sums.clear();
        Ok(())
    }

    /// Write the last page and the digest, sync, and move the file into place.
    pub fn finish(self) -> Result<TableMeta, TableFileError> {
        self.finish_inner(None)
    }

    /// Like [`finish`](Self::finish), but the rows must hash to `expected`;
    /// otherwise nothing is moved into place.
    pub fn finish_expecting(self, expected: TableDigest) -> Result<TableMeta, TableFileError> {
        self.finish_inner(Some(expected))
    }

    fn finish_inner(mut self, expected: Option<TableDigest>) -> Result<TableMeta, TableFileError> {
        if self.rows_written != self.meta.rows {
            return Err(TableFileError::Io {
                path: self.tmp_path.clone(),
                op: "finish",
                source: io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "{} rows written, header declares {}",
                        self.rows_written, self.meta.rows
                    ),
                ),
            });
        }
        if self.rows_in_page > 0 {
            self.flush_page()?;
        }
        self.flush_sums()?;
        self.meta.digest = self.digest.clone().finish();
        if let Some(expected) = expected
            && expected != self.meta.digest
        {
            return Err(TableFileError::DigestMismatch {
                path: self.path.clone(),
                expected,
                actual: self.meta.digest,
            });
        }
        let header =
            etab::encode_header(&self.meta, true).map_err(|source| TableFileError::Format {
                path: self.tmp_path.clone(),
                source,
            })?;
        let Some(file) = self.file.take() else {
            return Err(TableFileError::Io {
                path: self.tmp_path.clone(),
                op: "finish",
                source: io::Error::other("writer already finished"),
            });
        };
        let done = (|| {
            let file = file.into_inner().map_err(|e| TableFileError::Io {
                path: self.tmp_path.clone(),
                op: "flush",
                source: e.into_error(),
            })?;
            file.write_all_at(&header, 0)
                .map_err(io_err(&self.tmp_path, "rewrite header"))?;
            file.sync_all().map_err(io_err(&self.tmp_path, "sync"))?;
            std::fs::rename(&self.tmp_path, &self.path)
                .map_err(io_err(&self.path, "rename into place"))?;
            // The rename is durable only once the directory is synced.
            let dir = self
                .path
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io_err(dir, "sync directory"))
        })();
        if done.is_err() {
            let _ = std::fs::remove_file(&self.tmp_path);
        }
        done?;
        Ok(self.meta.clone())
    }
}

/// Remove a file's page checksums in place (the header loses `page_xxh3`,
/// the file its last `pages x 8` bytes): the file as builds that predate
/// page checksums wrote it, for those builds to read, and for tests of how
/// such files are handled.
pub fn remove_page_sums(path: &Path) -> Result<(), TableFileError> {
    let table = TableFile::open_any(path)?;
    if !table.has_page_sums() {
        return Ok(());
    }
    let header =
        etab::encode_header_at(&table.meta, false, table.layout.data_start).map_err(|source| {
            TableFileError::Format {
                path: path.to_path_buf(),
                source,
            }
        })?;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err(path, "open for writing"))?;
    let layout = TableLayout {
        page_sums: false,
        ..table.layout
    };
    file.write_all_at(&header, 0)
        .map_err(io_err(path, "rewrite header"))?;
    file.set_len(layout.file_len())
        .map_err(io_err(path, "truncate"))?;
    file.sync_all().map_err(io_err(path, "sync"))
}

impl Drop for TableWriter {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            // An unfinished table must not be mistaken for a table later.
            let _ = std::fs::remove_file(&self.tmp_path);
        }
    }
}

#[cfg(test)]
mod tests;
