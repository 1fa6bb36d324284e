//! The `.etab` table file: a valid safetensors file holding one `U8` tensor
//! `pages` of shape `[n_pages, 4096]`. Rows are packed 15 per 4 KiB page
//! (15 x 264 = 3960 bytes, 136 bytes of zero slack), so a row never straddles
//! a page and one row is one aligned 4 KiB read. The JSON header is padded
//! with spaces so the data starts at a 4 KiB-aligned file offset. A second
//! tensor `page_xxh3` (`U64`, `[n_pages]`, after the pages) holds each
//! page's XXH3-64, so a reader of single pages (the SSD copy) checks every
//! page it reads; files written before it existed have only `pages` and
//! stay valid.
//!
//! This module builds and parses the header and maps row ids to offsets; it
//! does no IO. `PROTOCOL.md` documents the format byte by byte.

use std::collections::BTreeMap;

use serde::Deserialize;
use thiserror::Error;

use crate::digest::TableDigest;
use crate::encoding::RowEncoding;
use crate::row::ROW_BYTES;

/// Page size of the file layout and of one SSD read.
pub const PAGE_BYTES: u64 = 4096;
/// V4.1 rows packed into one page (15).
pub const ROWS_PER_PAGE: u64 = PAGE_BYTES / ROW_BYTES as u64;
/// Value of the `format` metadata key.
pub const FORMAT_NAME: &str = "engram-etab";
/// Value of the `format_version` metadata key.
pub const FORMAT_VERSION: u32 = 1;
/// Value of the `encoding` metadata key.
pub const ENCODING: &str = "e4m3_e8m0_32_row264";
/// Name of the rows tensor.
pub const TENSOR_NAME: &str = "pages";
/// Name of the page checksums tensor.
pub const SUMS_TENSOR_NAME: &str = "page_xxh3";
/// Bytes of one page checksum.
pub const SUM_BYTES: u64 = 8;
/// Largest JSON header accepted (bytes).
pub const MAX_HEADER_BYTES: u64 = 1 << 20;
/// Largest row count accepted (2^40 rows is 290 TB: far above any real table).
pub const MAX_ROWS: u64 = 1 << 40;
/// Longest free-text metadata value accepted.
pub const MAX_TEXT: usize = 512;

/// Why a header is not a valid `.etab` header.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EtabError {
    /// The file is shorter than its header says.
    #[error("file is {actual} bytes but its header needs {needed}")]
    Truncated {
        /// Bytes the header needs the file to hold.
        needed: u64,
        /// Bytes the file holds.
        actual: u64,
    },
    /// The header length is above the bound or leaves the data unaligned.
    #[error(
        "header length {0} is not accepted (at most {MAX_HEADER_BYTES} bytes, data 4 KiB-aligned)"
    )]
    HeaderLength(u64),
    /// The header is not JSON of the safetensors shape.
    #[error("header is not valid safetensors JSON: {0}")]
    Json(String),
    /// A required metadata key is missing or has a bad value.
    #[error("metadata key `{key}`: {reason}")]
    Metadata {
        /// The metadata key at fault.
        key: &'static str,
        /// What is wrong with its value (or `missing`).
        reason: String,
    },
    /// The tensors are not `pages` (U8) and, optionally, `page_xxh3` (U64)
    /// of the right shapes and places.
    #[error("tensor layout: {0}")]
    Tensor(String),
    /// The file size does not match the header.
    #[error("file is {actual} bytes, the header describes {expected}")]
    FileSize {
        /// File size in bytes that the header describes.
        expected: u64,
        /// File size in bytes.
        actual: u64,
    },
}

/// What a table file says about its table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableMeta {
    /// Model layer whose Engram table this is.
    pub layer: u32,
    /// Logical rows.
    pub rows: u64,
    /// BLAKE3 of the rows in order: the table's version.
    pub digest: TableDigest,
    /// Hashing preset name (for example `v41`), where known.
    pub hash_preset: Option<String>,
    /// Hashing base size (primes are taken above `base - 1`), where known.
    pub hash_base: Option<u64>,
    /// Where the rows came from (free text, for people).
    pub source: String,
    /// How the rows are encoded (V4.1's in every file written before other
    /// encodings were).
    pub encoding: RowEncoding,
    /// The table's F32 scale, as its bits, for an encoding with one
    /// ([`RowEncoding::has_tensor_scale`]); `None` otherwise.
    pub tensor_scale: Option<u32>,
}

/// Where things are in a table file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableLayout {
    /// File offset of page 0 (a multiple of 4096).
    pub data_start: u64,
    /// Logical rows.
    pub rows: u64,
    /// Pages in the `pages` tensor.
    pub pages: u64,
    /// True when the file has the `page_xxh3` tensor.
    pub page_sums: bool,
    /// Bytes per row.
    pub row_bytes: u64,
    /// Rows per 4 KiB page.
    pub rows_per_page: u64,
}

/// The checksum of one 4 KiB page, as stored in `page_xxh3`: XXH3-64
/// (seed 0) over all 4096 bytes, slack included.
pub fn page_checksum(page: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(page)
}

/// Pages needed for `rows` V4.1 rows.
pub const fn pages_for(rows: u64) -> u64 {
    rows.div_ceil(ROWS_PER_PAGE)
}

/// Rows of `encoding` in one page: as many whole rows as fit in 4 KiB.
pub fn rows_per_page(encoding: RowEncoding) -> u64 {
    PAGE_BYTES / encoding.row_bytes() as u64
}

impl TableLayout {
    /// File offset of a row, or `None` when the row is out of range.
    pub fn row_offset(&self, row: u64) -> Option<u64> {
        (row < self.rows).then(|| {
            self.data_start
                + (row / self.rows_per_page) * PAGE_BYTES
                + (row % self.rows_per_page) * self.row_bytes
        })
    }

    /// File offset of the page holding a row, and the row's offset inside it.
    pub fn row_page(&self, row: u64) -> Option<(u64, usize)> {
        (row < self.rows).then(|| {
            (
                self.data_start + (row / self.rows_per_page) * PAGE_BYTES,
                (row % self.rows_per_page * self.row_bytes) as usize,
            )
        })
    }

    /// File offset of the `page_xxh3` tensor (right after the pages), if
    /// the file has one.
    pub fn sums_start(&self) -> Option<u64> {
        self.page_sums
            .then(|| self.data_start + self.pages * PAGE_BYTES)
    }

    /// Index of the page at file offset `offset` (a page's start).
    pub fn page_index(&self, offset: u64) -> u64 {
        (offset - self.data_start) / PAGE_BYTES
    }

    /// Total file length.
    pub fn file_len(&self) -> u64 {
        let sums = if self.page_sums {
            self.pages * SUM_BYTES
        } else {
            0
        };
        self.data_start + self.pages * PAGE_BYTES + sums
    }
}

fn metadata_json(meta: &TableMeta) -> BTreeMap<&'static str, String> {
    let mut m = BTreeMap::new();
    m.insert("format", FORMAT_NAME.to_string());
    m.insert("format_version", FORMAT_VERSION.to_string());
    // V4.1's rows keep the name every earlier file has.
    let encoding = if meta.encoding == RowEncoding::V41 {
        ENCODING.to_string()
    } else {
        meta.encoding.name()
    };
    m.insert("encoding", encoding);
    m.insert("layer", meta.layer.to_string());
    m.insert("rows", meta.rows.to_string());
    m.insert("rows_per_page", rows_per_page(meta.encoding).to_string());
    m.insert("row_bytes", meta.encoding.row_bytes().to_string());
    if let Some(bits) = meta.tensor_scale {
        m.insert("tensor_scale", f32::from_bits(bits).to_string());
    }
    m.insert("digest_blake3", meta.digest.to_hex());
    if let Some(p) = &meta.hash_preset {
        m.insert("hash_preset", p.clone());
    }
    if let Some(b) = meta.hash_base {
        m.insert("hash_base", b.to_string());
    }
    m.insert("source", meta.source.clone());
    m
}

/// The file's first `data_start` bytes: the 8-byte header length, the JSON
/// header, and space padding up to the 4 KiB-aligned data start. The length
/// depends only on the metadata's text lengths, never on the digest value, so
/// a writer can put a placeholder first and rewrite it in place. With
/// `page_sums` the header also lists the `page_xxh3` tensor.
pub fn encode_header(meta: &TableMeta, page_sums: bool) -> Result<Vec<u8>, EtabError> {
    let json = header_json(meta, page_sums)?;
    let unpadded = 8 + json.len() as u64;
    pad_header(json, unpadded.div_ceil(PAGE_BYTES) * PAGE_BYTES)
}

/// The header of `meta` padded to exactly `data_start` bytes, for rewriting
/// an existing file's header in place; an error when it does not fit.
pub fn encode_header_at(
    meta: &TableMeta,
    page_sums: bool,
    data_start: u64,
) -> Result<Vec<u8>, EtabError> {
    let json = header_json(meta, page_sums)?;
    if 8 + json.len() as u64 > data_start {
        return Err(EtabError::HeaderLength(json.len() as u64));
    }
    pad_header(json, data_start)
}

fn header_json(meta: &TableMeta, page_sums: bool) -> Result<Vec<u8>, EtabError> {
    validate_meta(meta)?;
    let pages = meta.rows.div_ceil(rows_per_page(meta.encoding));
    let mut header = serde_json::json!({
        "__metadata__": metadata_json(meta),
        TENSOR_NAME: {
            "dtype": "U8",
            "shape": [pages, PAGE_BYTES],
            "data_offsets": [0, pages * PAGE_BYTES],
        },
    });
    if page_sums {
        header[SUMS_TENSOR_NAME] = serde_json::json!({
            "dtype": "U64",
            "shape": [pages],
            "data_offsets": [pages * PAGE_BYTES, pages * (PAGE_BYTES + SUM_BYTES)],
        });
    }
    serde_json::to_vec(&header).map_err(|e| EtabError::Json(e.to_string()))
}

fn pad_header(mut json: Vec<u8>, data_start: u64) -> Result<Vec<u8>, EtabError> {
    json.resize((data_start - 8) as usize, b' ');
    let mut out = Vec::with_capacity(data_start as usize);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

fn validate_meta(meta: &TableMeta) -> Result<(), EtabError> {
    if meta.rows == 0 || meta.rows > MAX_ROWS {
        return Err(EtabError::Metadata {
            key: "rows",
            reason: format!("{} is not in 1..={MAX_ROWS}", meta.rows),
        });
    }
    if meta.source.len() > MAX_TEXT {
        return Err(EtabError::Metadata {
            key: "source",
            reason: format!("longer than {MAX_TEXT} bytes"),
        });
    }
    if let Some(p) = &meta.hash_preset
        && (p.is_empty()
            || p.len() > 64
            || !p
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
    {
        return Err(EtabError::Metadata {
            key: "hash_preset",
            reason: format!("{p:?} is not 1..=64 letters, digits, '-' or '_'"),
        });
    }
    let e = meta.encoding;
    if let Err(err) = e.new() {
        return Err(EtabError::Metadata {
            key: "encoding",
            reason: err.to_string(),
        });
    }
    if e.row_bytes() as u64 > PAGE_BYTES {
        return Err(EtabError::Metadata {
            key: "encoding",
            reason: format!(
                "{}: rows of {} bytes do not fit a {PAGE_BYTES}-byte page",
                e.name(),
                e.row_bytes()
            ),
        });
    }
    match (e.has_tensor_scale(), meta.tensor_scale.map(f32::from_bits)) {
        (true, Some(x)) if x.is_finite() && x > 0.0 => {}
        (true, got) => {
            return Err(EtabError::Metadata {
                key: "tensor_scale",
                reason: format!(
                    "{}: a positive finite scale is needed, got {got:?}",
                    e.name()
                ),
            });
        }
        (false, None) => {}
        (false, Some(_)) => {
            return Err(EtabError::Metadata {
                key: "tensor_scale",
                reason: format!("{} rows have no table scale", e.name()),
            });
        }
    }
    Ok(())
}

/// The JSON header's length from the file's first 8 bytes, bounded and
/// checked for alignment before anything is read or allocated.
pub fn header_len(first8: [u8; 8]) -> Result<u64, EtabError> {
    let n = u64::from_le_bytes(first8);
    if n > MAX_HEADER_BYTES || !(8 + n).is_multiple_of(PAGE_BYTES) {
        return Err(EtabError::HeaderLength(n));
    }
    Ok(n)
}

/// Why a header could not be read through a caller's reader.
#[derive(Debug, Error)]
pub enum ReadHeaderError {
    /// The caller's reader failed.
    #[error("reading the header: {0}")]
    Io(#[from] std::io::Error),
    /// The bytes are not a valid header.
    #[error(transparent)]
    Format(#[from] EtabError),
}

/// Read and check a table file's header through `read_at(buf, offset)`,
/// which must fill `buf` from `offset` (the caller does the IO, so this works
/// for files, O_DIRECT readers and test buffers alike). At most 8 bytes plus
/// the bounded header length are read.
pub fn read_header(
    file_len: u64,
    mut read_at: impl FnMut(&mut [u8], u64) -> std::io::Result<()>,
) -> Result<(TableMeta, TableLayout), ReadHeaderError> {
    if file_len < 8 {
        return Err(EtabError::Truncated {
            needed: 8,
            actual: file_len,
        }
        .into());
    }
    let mut first8 = [0u8; 8];
    read_at(&mut first8, 0)?;
    let n = header_len(first8)?;
    if file_len < 8 + n {
        return Err(EtabError::Truncated {
            needed: 8 + n,
            actual: file_len,
        }
        .into());
    }
    // n <= MAX_HEADER_BYTES (1 MiB), checked by header_len.
    let mut json = vec![0u8; n as usize];
    read_at(&mut json, 8)?;
    Ok(parse_header(&json, file_len)?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TensorInfo {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

fn meta_str<'a>(m: &'a BTreeMap<String, String>, key: &'static str) -> Result<&'a str, EtabError> {
    m.get(key).map(String::as_str).ok_or(EtabError::Metadata {
        key,
        reason: "missing".into(),
    })
}

fn meta_num<T: std::str::FromStr>(
    m: &BTreeMap<String, String>,
    key: &'static str,
) -> Result<T, EtabError> {
    let s = meta_str(m, key)?;
    s.parse().map_err(|_| EtabError::Metadata {
        key,
        reason: format!("{s:?} is not a number"),
    })
}

fn expect_eq(m: &BTreeMap<String, String>, key: &'static str, want: &str) -> Result<(), EtabError> {
    let got = meta_str(m, key)?;
    if got != want {
        return Err(EtabError::Metadata {
            key,
            reason: format!("{got:?}, expected {want:?}"),
        });
    }
    Ok(())
}

fn check_tensor(
    name: &str,
    value: serde_json::Value,
    dtype: &str,
    shape: &[u64],
    offsets: [u64; 2],
) -> Result<(), EtabError> {
    let t: TensorInfo =
        serde_json::from_value(value).map_err(|e| EtabError::Tensor(format!("{name}: {e}")))?;
    if t.dtype != dtype {
        return Err(EtabError::Tensor(format!(
            "{name}: dtype {}, expected {dtype}",
            t.dtype
        )));
    }
    if t.shape != shape {
        return Err(EtabError::Tensor(format!(
            "{name}: shape {:?}, expected {shape:?}",
            t.shape
        )));
    }
    if t.data_offsets != offsets {
        return Err(EtabError::Tensor(format!(
            "{name}: data_offsets {:?}, expected {offsets:?}",
            t.data_offsets
        )));
    }
    Ok(())
}

/// Parse and check a header: `json` is the `header_len` bytes after the
/// first 8, `file_len` the file's size. Every field is checked, and the file
/// size must be exactly what the header describes.
pub fn parse_header(json: &[u8], file_len: u64) -> Result<(TableMeta, TableLayout), EtabError> {
    let data_start = 8 + json.len() as u64;
    if json.len() as u64 > MAX_HEADER_BYTES || !data_start.is_multiple_of(PAGE_BYTES) {
        return Err(EtabError::HeaderLength(json.len() as u64));
    }
    let mut top: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(json).map_err(|e| EtabError::Json(e.to_string()))?;
    let metadata = top.remove("__metadata__").ok_or(EtabError::Metadata {
        key: "__metadata__",
        reason: "missing".into(),
    })?;
    let meta = parse_metadata(metadata)?;
    validate_meta(&meta)?;

    let per_page = rows_per_page(meta.encoding);
    let pages = meta.rows.div_ceil(per_page);
    let pages_value = top
        .remove(TENSOR_NAME)
        .ok_or_else(|| EtabError::Tensor(format!("expected tensor `{TENSOR_NAME}`")))?;
    check_tensor(
        TENSOR_NAME,
        pages_value,
        "U8",
        &[pages, PAGE_BYTES],
        [0, pages * PAGE_BYTES],
    )?;
    let page_sums = match top.remove(SUMS_TENSOR_NAME) {
        Some(v) => {
            let end = pages * (PAGE_BYTES + SUM_BYTES);
            check_tensor(
                SUMS_TENSOR_NAME,
                v,
                "U64",
                &[pages],
                [pages * PAGE_BYTES, end],
            )?;
            true
        }
        None => false,
    };
    if let Some(other) = top.keys().next() {
        return Err(EtabError::Tensor(format!(
            "unexpected tensor `{other}` (a table has `{TENSOR_NAME}` and, optionally, `{SUMS_TENSOR_NAME}`)"
        )));
    }
    let layout = TableLayout {
        data_start,
        rows: meta.rows,
        pages,
        page_sums,
        row_bytes: meta.encoding.row_bytes() as u64,
        rows_per_page: per_page,
    };
    if file_len != layout.file_len() {
        return Err(EtabError::FileSize {
            expected: layout.file_len(),
            actual: file_len,
        });
    }
    Ok((meta, layout))
}

/// The `__metadata__` object: the format, its version and encoding
/// checked, the table's own fields read.
fn parse_metadata(metadata: serde_json::Value) -> Result<TableMeta, EtabError> {
    let m: BTreeMap<String, String> = serde_json::from_value(metadata)
        .map_err(|e| EtabError::Json(format!("__metadata__: {e}")))?;
    expect_eq(&m, "format", FORMAT_NAME)?;
    let version: u32 = meta_num(&m, "format_version")?;
    if version != FORMAT_VERSION {
        return Err(EtabError::Metadata {
            key: "format_version",
            reason: format!("{version} is not supported (this build reads {FORMAT_VERSION})"),
        });
    }
    let name = meta_str(&m, "encoding")?;
    let encoding = if name == ENCODING {
        RowEncoding::V41
    } else {
        RowEncoding::parse(name).map_err(|e| EtabError::Metadata {
            key: "encoding",
            reason: e.to_string(),
        })?
    };
    if encoding.row_bytes() as u64 > PAGE_BYTES {
        return Err(EtabError::Metadata {
            key: "encoding",
            reason: format!("{name}: rows larger than a page"),
        });
    }
    expect_eq(&m, "rows_per_page", &rows_per_page(encoding).to_string())?;
    expect_eq(&m, "row_bytes", &encoding.row_bytes().to_string())?;
    let tensor_scale = match m.get("tensor_scale") {
        Some(s) => Some(
            s.parse::<f32>()
                .map_err(|_| EtabError::Metadata {
                    key: "tensor_scale",
                    reason: format!("{s:?} is not a number"),
                })?
                .to_bits(),
        ),
        None => None,
    };
    let meta = TableMeta {
        layer: meta_num(&m, "layer")?,
        rows: meta_num(&m, "rows")?,
        digest: meta_str(&m, "digest_blake3")?.parse().map_err(
            |e: crate::digest::DigestParseError| EtabError::Metadata {
                key: "digest_blake3",
                reason: e.to_string(),
            },
        )?,
        hash_preset: m.get("hash_preset").cloned(),
        hash_base: match m.get("hash_base") {
            Some(_) => Some(meta_num(&m, "hash_base")?),
            None => None,
        },
        source: m.get("source").cloned().unwrap_or_default(),
        encoding,
        tensor_scale,
    };
    Ok(meta)
}

#[cfg(test)]
mod tests;
