//! `memory-donor gen`: a deterministic synthetic table. Rows come from
//! `engram_protocol::synthetic`, so anyone can check any row without the file.
//! Generator threads fill chunks in parallel; the writing thread hashes and
//! packs them in row order.

use std::path::Path;
use std::sync::mpsc;
use std::thread;

use engram_protocol::encoding::RowEncoding;
use engram_protocol::etab::TableMeta;
use engram_protocol::hashing::{HashParams, Preset};
use engram_protocol::synthetic::{synthetic_encoded_rows, synthetic_rows};
use engram_protocol::{ROW_BYTES, TableDigest};

use crate::progress::Progress;
use crate::table_file::{TableFileError, TableWriter};

/// Rows per generated chunk (16 MB).
const CHUNK_ROWS: u64 = 15 * 4096;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenSpec {
    /// Model layer (part of each row's identity).
    pub layer: u32,
    /// Number of rows.
    pub rows: u64,
    /// Seed (part of each row's identity).
    pub seed: u64,
    /// Hashing preset to record, if any.
    pub hash_preset: Option<String>,
    /// Hashing base size to record, if any.
    pub hash_base: Option<u64>,
    /// Generator threads (at least 1).
    pub threads: usize,
}

impl GenSpec {
    /// `rows` synthetic rows of `layer` from `seed`, no hashing recorded,
    /// on two threads.
    pub fn new(layer: u32, rows: u64, seed: u64) -> Self {
        Self {
            layer,
            rows,
            seed,
            hash_preset: None,
            hash_base: None,
            threads: 2,
        }
    }

    /// The metadata of the table this makes (its digest to come), its
    /// source naming the generator's seed and layer, then `note`.
    fn meta(&self, note: String) -> TableMeta {
        self.meta_as(note, RowEncoding::V41, None)
    }

    /// [`Self::meta`] for rows of `encoding`, with its table scale.
    fn meta_as(&self, note: String, encoding: RowEncoding, tensor_scale: Option<u32>) -> TableMeta {
        let named = if encoding == RowEncoding::V41 {
            String::new()
        } else {
            format!(" encoding={}", encoding.name())
        };
        TableMeta {
            layer: self.layer,
            rows: self.rows,
            digest: TableDigest([0; 32]),
            hash_preset: self.hash_preset.clone(),
            hash_base: self.hash_base,
            source: format!(
                "synthetic seed={} layer={}{named}{note}",
                self.seed, self.layer
            ),
            encoding,
            tensor_scale,
        }
    }
}

/// The row count and hashing metadata of a table to generate: `rows` as
/// given, or the sum of the layer's 24 primes when a hashing preset
/// (`v41`) or base size is given; both at once must agree.
pub fn table_shape(
    layer: u32,
    rows: Option<u64>,
    hash_preset: Option<String>,
    hash_base: Option<u64>,
) -> Result<(u64, Option<String>, Option<u64>), String> {
    let preset = match (hash_preset.as_deref(), hash_base) {
        (Some(name), base) => {
            let p: Preset = name.parse().map_err(|e| format!("--hash-preset: {e}"))?;
            if let Some(b) = base
                && b != p.base()
            {
                return Err(format!(
                    "--hash-base {b} contradicts --hash-preset {name} (base {})",
                    p.base()
                ));
            }
            Some(p)
        }
        (None, Some(b)) => Some(Preset::from_base(b).map_err(|e| format!("--hash-base: {e}"))?),
        (None, None) => None,
    };
    let Some(preset) = preset else {
        let rows = rows.ok_or("give --rows, --hash-preset v41 or --hash-base N")?;
        return Ok((rows, None, None));
    };
    let params = HashParams::new(preset).map_err(|e| e.to_string())?;
    let want = params.layer(layer).map_err(|e| e.to_string())?.rows;
    match rows {
        Some(r) if r != want => Err(format!(
            "--rows {r} differs from the {} rows that {preset} gives layer {layer}",
            want
        )),
        _ => Ok((want, preset.name().map(str::to_string), Some(preset.base()))),
    }
}

/// Write the synthetic table `spec` to `path`; returns the metadata written.
pub fn generate(
    path: &Path,
    spec: &GenSpec,
    progress: Option<&mut Progress>,
) -> Result<TableMeta, TableFileError> {
    generate_as(path, spec, RowEncoding::V41, None, progress)
}

/// [`generate`] with rows of `encoding`
/// ([`engram_protocol::synthetic::synthetic_encoded_row`]) and, for an
/// encoding with one, the table scale `tensor_scale` (an F32's bits;
/// refused for an encoding without one, required for one with one).
pub fn generate_as(
    path: &Path,
    spec: &GenSpec,
    encoding: RowEncoding,
    tensor_scale: Option<u32>,
    mut progress: Option<&mut Progress>,
) -> Result<TableMeta, TableFileError> {
    if encoding.has_tensor_scale() != tensor_scale.is_some() {
        return Err(TableFileError::Io {
            path: path.to_path_buf(),
            op: "generate",
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{} {} a table scale",
                    encoding.name(),
                    if encoding.has_tensor_scale() {
                        "needs"
                    } else {
                        "has no"
                    }
                ),
            ),
        });
    }
    let row_bytes = encoding.row_bytes();
    let meta = spec.meta_as(String::new(), encoding, tensor_scale);
    let mut writer = TableWriter::create(path, meta)?;
    let chunks = spec.rows.div_ceil(CHUNK_ROWS);
    let threads = spec.threads.clamp(1, 64) as u64;
    thread::scope(|s| {
        // One channel pair per generator: chunk k goes to generator k % threads,
        // so receiving round-robin yields chunks in order with no reordering.
        let mut filled_rx = Vec::new();
        let mut empty_tx = Vec::new();
        for t in 0..threads {
            let (ftx, frx) = mpsc::sync_channel::<Vec<u8>>(1);
            let (etx, erx) = mpsc::sync_channel::<Vec<u8>>(2);
            filled_rx.push(frx);
            empty_tx.push(etx);
            let (seed, layer, rows) = (spec.seed, spec.layer, spec.rows);
            s.spawn(move || {
                let mut chunk = t;
                while chunk < chunks {
                    let Ok(mut buf) = erx.recv() else { return };
                    let first = chunk * CHUNK_ROWS;
                    let n = CHUNK_ROWS.min(rows - first) as usize;
                    buf.resize(n * row_bytes, 0);
                    synthetic_encoded_rows(encoding, seed, layer, first, &mut buf);
                    if ftx.send(buf).is_err() {
                        return;
                    }
                    chunk += threads;
                }
            });
        }
        for tx in &empty_tx {
            for _ in 0..2 {
                // Cannot fail: the generator holds the receiver until it is done.
                let _ = tx.send(Vec::with_capacity(CHUNK_ROWS as usize * row_bytes));
            }
        }
        for chunk in 0..chunks {
            let t = (chunk % threads) as usize;
            let Ok(buf) = filled_rx[t].recv() else { break };
            writer.write_rows(&buf)?;
            let _ = empty_tx[t].send(buf);
            if let Some(p) = progress.as_deref_mut() {
                p.update(writer.rows_written());
            }
        }
        drop(empty_tx);
        Ok::<(), TableFileError>(())
    })?;
    writer.finish()
}

/// Most pages a sparse table may hold data in (16 GiB of them).
pub const MAX_SPARSE_PAGES: usize = 1 << 22;

/// Parse `--sparse-rows`: row ids and ranges `A..B` (B excluded),
/// separated by commas; at most [`MAX_SPARSE_PAGES`] x 15 rows in all.
pub fn parse_rows(s: &str) -> Result<Vec<u64>, String> {
    let max = MAX_SPARSE_PAGES as u64 * 15;
    let mut rows = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let num = |t: &str| {
            t.trim()
                .replace('_', "")
                .parse::<u64>()
                .map_err(|_| format!("{item:?} is not a row id or a range A..B"))
        };
        let (a, b) = match item.split_once("..") {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let a = num(item)?;
                (a, a.saturating_add(1))
            }
        };
        if b <= a || b - a > max - rows.len() as u64 {
            return Err(format!(
                "{item:?}: an empty range, or more than {max} rows in all"
            ));
        }
        rows.extend(a..b);
    }
    if rows.is_empty() {
        return Err("no rows given".into());
    }
    Ok(rows)
}

/// Write the synthetic table `spec` to `path` as a sparse file: only the
/// pages holding a row of `touched` carry their synthetic rows, every
/// other page is a hole that reads as zero rows. The page checksums and
/// the digest are those of exactly that table (zero rows included), so it
/// is a valid table that verifies; a full-size V4.1 table made so takes a
/// few MB of disk per page touched plus 1/512 of its size for the
/// checksums. Returns the metadata written.
pub fn generate_sparse(
    path: &Path,
    spec: &GenSpec,
    touched: &[u64],
    mut progress: Option<&mut Progress>,
) -> Result<TableMeta, TableFileError> {
    let bad = |what: String| TableFileError::Io {
        path: path.to_path_buf(),
        op: "generate a sparse table",
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, what),
    };
    if let Some(r) = touched.iter().find(|&&r| r >= spec.rows) {
        return Err(bad(format!("row {r} is not below {} rows", spec.rows)));
    }
    let pages: std::collections::BTreeSet<u64> = touched.iter().map(|r| r / 15).collect();
    if pages.len() > MAX_SPARSE_PAGES {
        return Err(bad(format!(
            "{} pages touched, more than the {MAX_SPARSE_PAGES} accepted",
            pages.len()
        )));
    }
    let note = format!(
        " sparse: {} pages hold rows, the rest are zero",
        pages.len()
    );
    let mut writer = TableWriter::create(path, spec.meta(note))?;
    let total = engram_protocol::etab::pages_for(spec.rows);
    let mut next = 0u64;
    let mut buf = vec![0u8; 15 * ROW_BYTES];
    for p in pages.into_iter().chain(std::iter::once(total)) {
        writer.write_zero_pages(p - next)?;
        if p == total {
            break;
        }
        let first = p * 15;
        let n = (spec.rows - first).min(15) as usize;
        synthetic_rows(spec.seed, spec.layer, first, &mut buf[..n * ROW_BYTES]);
        writer.write_rows(&buf[..n * ROW_BYTES])?;
        next = p + 1;
        if let Some(pr) = progress.as_deref_mut() {
            pr.update(writer.rows_written());
        }
    }
    if let Some(pr) = progress {
        pr.update(writer.rows_written());
    }
    writer.finish()
}

/// A generated table of `rows` rows (layer 1, seed 9) in `dir`, for tests.
#[cfg(test)]
pub(crate) fn test_table(dir: &Path, rows: u64) -> std::path::PathBuf {
    let path = dir.join(format!("t{rows}.etab"));
    let spec = GenSpec {
        layer: 1,
        rows,
        seed: 9,
        hash_preset: None,
        hash_base: None,
        threads: 2,
    };
    generate(&path, &spec, None).expect("gen");
    path
}

/// A table of `rows` rows of `encoding`, random bytes with bit 0 clear
/// (so no byte is an E4M3 NaN code), written by the table writer.
#[cfg(test)]
pub(crate) fn write_encoded(
    path: &Path,
    encoding: RowEncoding,
    rows: u64,
    seed: u64,
) -> (TableMeta, Vec<u8>) {
    let mut data = vec![0u8; rows as usize * encoding.row_bytes()];
    let mut g = engram_protocol::synthetic::SplitMix64::new(seed);
    for b in data.chunks_mut(8) {
        let x = g.next_u64().to_le_bytes();
        b.copy_from_slice(&x[..b.len()]);
    }
    data.iter_mut().for_each(|b| *b &= 0xFE);
    let m = TableMeta {
        encoding,
        tensor_scale: encoding.has_tensor_scale().then(|| 0.25f32.to_bits()),
        layer: 1,
        rows,
        digest: TableDigest([0; 32]),
        hash_preset: None,
        hash_base: None,
        source: "test".into(),
    };
    let mut w = TableWriter::create(path, m).expect("create");
    for chunk in data.chunks(777 * encoding.row_bytes()) {
        w.write_rows(chunk).expect("write");
    }
    (w.finish().expect("finish"), data)
}

/// A sparse generated table of 5,000 rows (layer 1, seed 2) in `dir` whose
/// only written rows are 14, 15, 2,000 and 4,999: the rest are holes.
#[cfg(test)]
pub(crate) fn test_sparse_table(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("sparse.etab");
    let spec = GenSpec {
        threads: 1,
        ..GenSpec::new(1, 5_000, 2)
    };
    generate_sparse(&path, &spec, &[14, 15, 2_000, 4_999], None).expect("gen");
    path
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table_file::TableFile;
    use engram_protocol::synthetic::is_synthetic_row;

    /// A generated table of another encoding holds that encoding's
    /// synthetic rows and its table scale, and verifies; a scale where the
    /// encoding has none (or none where it has one) is refused.
    #[test]
    fn tables_of_any_encoding_are_generated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let spec = GenSpec::new(2, 70_000, 5);
        let e = RowEncoding::Nvfp4 { values: 160 };
        let path = dir.path().join("nv.etab");
        let scale = Some(0.5f32.to_bits());
        let m = generate_as(&path, &spec, e, scale, None).expect("gen");
        assert_eq!((m.encoding, m.tensor_scale, m.rows), (e, scale, 70_000));
        assert!(
            m.source.contains("encoding=nvfp4_e4m3_16x160"),
            "{}",
            m.source
        );
        let t = TableFile::open_any(&path).expect("open");
        assert_eq!(t.verify_on(2, None).expect("verifies"), m.digest);
        let mut want = vec![0u8; 70_000 * 90];
        synthetic_encoded_rows(e, 5, 2, 0, &mut want);
        let mut got = Vec::new();
        t.for_each_chunk(false, None, |_, rows| {
            got.extend_from_slice(rows);
            Ok(())
        })
        .expect("rows");
        assert_eq!(got, want);
        let bf16 = RowEncoding::Bf16 { values: 160 };
        assert!(generate_as(&path, &spec, bf16, scale, None).is_err());
        assert!(generate_as(&path, &spec, e, None, None).is_err());
        // V4.1's rows through the same path are `generate`'s, byte for byte.
        let a = generate(&dir.path().join("a.etab"), &spec, None).expect("gen");
        let b = generate_as(
            &dir.path().join("b.etab"),
            &spec,
            RowEncoding::V41,
            None,
            None,
        )
        .expect("gen");
        assert_eq!(a, b);
    }

    #[test]
    fn table_shape_follows_the_preset() {
        assert_eq!(table_shape(1, Some(7), None, None), Ok((7, None, None)));
        assert!(table_shape(1, None, None, None).is_err());
        assert_eq!(
            table_shape(14, None, Some("v41".into()), None),
            Ok((384_016_682, Some("v41".into()), Some(16_000_000)))
        );
        let small = HashParams::new(Preset::Base(1000)).unwrap().layers[0].rows;
        assert_eq!(
            table_shape(1, Some(small), None, Some(1000)),
            Ok((small, None, Some(1000)))
        );
        assert!(table_shape(1, Some(small + 1), None, Some(1000)).is_err());
        assert!(table_shape(2, None, None, Some(1000)).is_err());
        assert!(table_shape(1, None, Some("v4".into()), None).is_err());
        assert!(table_shape(1, None, Some("v41".into()), Some(1000)).is_err());
        assert!(table_shape(1, None, None, Some(0)).is_err());
    }

    #[test]
    fn sparse_row_lists_parse_and_are_bounded() {
        assert_eq!(parse_rows("1, 5..8,1_000"), Ok(vec![1, 5, 6, 7, 1000]));
        assert!(parse_rows("").is_err());
        assert!(parse_rows("x").is_err());
        assert!(parse_rows("5..5").is_err());
        assert!(parse_rows("9..3").is_err());
        assert!(parse_rows("0..18446744073709551615").is_err());
        assert!(parse_rows("18446744073709551614").is_ok());
    }

    #[test]
    fn sparse_tables_hold_the_touched_pages_and_zeros_and_verify() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rows = 3 * CHUNK_ROWS + 7;
        let spec = GenSpec {
            layer: 1,
            rows,
            seed: 3,
            hash_preset: None,
            hash_base: None,
            threads: 1,
        };
        let touched = [0, 16, 17, CHUNK_ROWS * 2 + 5, rows - 1];
        let path = dir.path().join("s.etab");
        let meta = generate_sparse(&path, &spec, &touched, None).expect("sparse");
        let t = TableFile::open(&path).expect("open");
        assert_eq!(t.meta, meta);
        assert_eq!(
            t.layout.file_len(),
            std::fs::metadata(&path).expect("stat").len()
        );
        let pages: Vec<u64> = touched.iter().map(|r| r / 15).collect();
        let mut zero = vec![0u8; ROW_BYTES];
        t.for_each_chunk(true, None, |first, chunk| {
            for (i, row) in chunk.chunks_exact(ROW_BYTES).enumerate() {
                let r = first + i as u64;
                if pages.contains(&(r / 15)) {
                    assert!(is_synthetic_row(3, 1, r, row), "row {r}");
                } else {
                    zero.copy_from_slice(row);
                    assert!(zero.iter().all(|&b| b == 0), "row {r}");
                }
            }
            Ok(())
        })
        .expect("every page matches its checksum");
        assert_eq!(t.verify(None).expect("verify"), meta.digest);
        // The digest is the table's: the same rows written densely hash alike.
        let mut dense = engram_protocol::DigestBuilder::new();
        t.for_each_chunk(false, None, |_, chunk| {
            dense.update(chunk);
            Ok(())
        })
        .expect("stream");
        assert_eq!(dense.finish(), meta.digest);
        assert!(generate_sparse(&path, &spec, &[rows], None).is_err());
    }

    #[test]
    fn generated_tables_hold_the_synthetic_rows_for_any_thread_count() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rows = 2 * CHUNK_ROWS + 123;
        let mut digests = Vec::new();
        for threads in [1, 3] {
            let path = dir.path().join(format!("t{threads}.etab"));
            let spec = GenSpec {
                layer: 14,
                rows,
                seed: 5,
                hash_preset: None,
                hash_base: Some(100),
                threads,
            };
            let meta = generate(&path, &spec, None).expect("generate");
            let t = TableFile::open(&path).expect("open");
            assert_eq!(t.meta, meta);
            assert_eq!(t.verify(None).expect("verify"), meta.digest);
            t.for_each_chunk(false, None, |first, chunk| {
                for (i, row) in chunk.chunks_exact(ROW_BYTES).enumerate() {
                    assert!(
                        is_synthetic_row(5, 14, first + i as u64, row),
                        "row {}",
                        first + i as u64
                    );
                }
                Ok(())
            })
            .expect("stream");
            digests.push(meta.digest);
        }
        assert_eq!(
            digests[0], digests[1],
            "thread count does not change the table"
        );
    }
}
