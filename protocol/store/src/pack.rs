//! `memory-donor pack`: build an `.etab` from a V4.1 checkpoint's
//! `layers.{L}.engram.embed.weight` (F8_E4M3 `[rows, 256]`) and
//! `layers.{L}.engram.embed.scale` (F8_E8M0 `[rows, 8]`), from one
//! safetensors file or a sharded checkpoint (`model.safetensors.index.json`).
//! Inputs are memory-mapped and streamed; nothing is held whole in RAM.

use crate::checkpoint::{CheckpointError, CheckpointFiles};
use std::fs::File;
use std::path::{Path, PathBuf};

use engram_protocol::etab::TableMeta;
use engram_protocol::row::{ROW_SCALES, ROW_VALUES};
use engram_protocol::{ROW_BYTES, TableDigest};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use thiserror::Error;

use crate::progress::Progress;
use crate::table_file::{TableFileError, TableWriter};

/// Rows packed per step.
const PACK_CHUNK_ROWS: usize = 15 * 1024;

/// Rows and hashing base of V4.1 Flash's two tables, to label packed tables.
const V41_TABLES: [(u32, u64); 2] = [(1, 384_006_168), (14, 384_016_682)];
/// V4.1's hashing base size: primes are taken above 15,999,999.
pub use engram_protocol::hashing::V41_BASE as V41_HASH_BASE;

/// Why a checkpoint could not be packed.
#[derive(Debug, Error)]
pub enum PackError {
    /// Reading the checkpoint failed.
    #[error("{path}: {what}: {source}")]
    Io {
        /// The checkpoint file being read.
        path: PathBuf,
        /// The operation that failed (`open` or `mmap`).
        what: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// The checkpoint is not what pack expects.
    #[error("{path}: {reason}")]
    Checkpoint {
        /// The checkpoint path at fault.
        path: PathBuf,
        /// What is not as expected.
        reason: String,
    },
    /// A row in the checkpoint is corrupt (NaN code or scale).
    #[error("{path}: layer {layer} row {row} is corrupt: {reason}")]
    CorruptRow {
        /// The checkpoint holding the row.
        path: PathBuf,
        /// Model layer of the table the row belongs to.
        layer: u32,
        /// Index of the corrupt row in the table.
        row: u64,
        /// Why the row does not decode.
        reason: String,
    },
    /// Writing the table failed.
    #[error(transparent)]
    Write(#[from] TableFileError),
}

/// Tensor names of one layer's Engram table.
pub fn tensor_names(layer: u32) -> (String, String) {
    (
        format!("layers.{layer}.engram.embed.weight"),
        format!("layers.{layer}.engram.embed.scale"),
    )
}

/// Which file holds each of `names`: the file itself, or via the index.
fn locate(checkpoint: &Path, names: &[&str]) -> Result<Vec<PathBuf>, PackError> {
    let files = CheckpointFiles::open(checkpoint)?;
    names
        .iter()
        .map(|n| files.require(n).map_err(PackError::from))
        .collect()
}

impl From<CheckpointError> for PackError {
    fn from(e: CheckpointError) -> Self {
        match e {
            CheckpointError::Io { path, source } => Self::Io {
                path,
                what: "read index",
                source,
            },
            CheckpointError::Layout { path, reason } => Self::Checkpoint { path, reason },
        }
    }
}

fn map(path: &Path) -> Result<Mmap, PackError> {
    let file = File::open(path).map_err(|source| PackError::Io {
        path: path.into(),
        what: "open",
        source,
    })?;
    // SAFETY: the mapping is read-only and private to this process; a checkpoint
    // modified while being packed gives wrong rows, which the digest records as they were read.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|source| PackError::Io {
        path: path.into(),
        what: "mmap",
        source,
    })?;
    let _ = mmap.advise(memmap2::Advice::Sequential);
    Ok(mmap)
}

fn tensor<'a>(
    st: &SafeTensors<'a>,
    path: &Path,
    name: &str,
    dtype: Dtype,
    width: usize,
) -> Result<(u64, &'a [u8]), PackError> {
    let ck_err = |reason: String| PackError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    let t = st
        .tensor(name)
        .map_err(|e| ck_err(format!("tensor `{name}`: {e}")))?;
    if t.dtype() != dtype {
        return Err(ck_err(format!(
            "tensor `{name}` is {:?}, expected {dtype:?}",
            t.dtype()
        )));
    }
    match t.shape() {
        [rows, w] if *w == width && *rows > 0 && t.data().len() == rows * width => {
            Ok((*rows as u64, t.data()))
        }
        s => Err(ck_err(format!(
            "tensor `{name}` has shape {s:?}, expected [rows, {width}]"
        ))),
    }
}

fn parse_st<'a>(m: &'a Mmap, path: &Path) -> Result<SafeTensors<'a>, PackError> {
    SafeTensors::deserialize(m).map_err(|e| PackError::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("not safetensors: {e}"),
    })
}

/// Pack layer `layer` of `checkpoint` into `out`.
pub fn pack(
    checkpoint: &Path,
    layer: u32,
    out: &Path,
    hash_preset: Option<String>,
    hash_base: Option<u64>,
    mut progress: impl FnMut(u64) -> Option<Progress>,
) -> Result<TableMeta, PackError> {
    let (wname, sname) = tensor_names(layer);
    let files = locate(checkpoint, &[&wname, &sname])?;
    let (wmap, smap) = (map(&files[0])?, map(&files[1])?);
    let (wst, sst) = (parse_st(&wmap, &files[0])?, parse_st(&smap, &files[1])?);
    let (rows, weights) = tensor(&wst, &files[0], &wname, Dtype::F8_E4M3, ROW_VALUES)?;
    let (srows, scales) = tensor(&sst, &files[1], &sname, Dtype::F8_E8M0, ROW_SCALES)?;
    if rows != srows {
        return Err(PackError::Checkpoint {
            path: checkpoint.to_path_buf(),
            reason: format!("`{wname}` has {rows} rows but `{sname}` has {srows}"),
        });
    }
    let is_v41 = V41_TABLES.contains(&(layer, rows));
    let meta = TableMeta {
        layer,
        rows,
        digest: TableDigest([0; 32]),
        hash_preset: hash_preset.or_else(|| is_v41.then(|| "v41".to_string())),
        hash_base: hash_base.or_else(|| is_v41.then_some(V41_HASH_BASE)),
        source: format!(
            "checkpoint {}",
            files[0]
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ),
    };
    let mut writer = TableWriter::create(out, meta)?;
    let mut progress = progress(rows);
    let mut buf = vec![0u8; PACK_CHUNK_ROWS * ROW_BYTES];
    let mut first = 0usize;
    let rows_usize = rows as usize;
    while first < rows_usize {
        let n = PACK_CHUNK_ROWS.min(rows_usize - first);
        let w = &weights[first * ROW_VALUES..(first + n) * ROW_VALUES];
        let s = &scales[first * ROW_SCALES..(first + n) * ROW_SCALES];
        let chunk = &mut buf[..n * ROW_BYTES];
        for ((row, w), s) in chunk
            .chunks_exact_mut(ROW_BYTES)
            .zip(w.chunks_exact(ROW_VALUES))
            .zip(s.chunks_exact(ROW_SCALES))
        {
            row[..ROW_VALUES].copy_from_slice(w);
            row[ROW_VALUES..].copy_from_slice(s);
        }
        engram_protocol::row::check_rows(chunk).map_err(|(i, e)| PackError::CorruptRow {
            path: checkpoint.to_path_buf(),
            layer,
            row: (first + i) as u64,
            reason: e.to_string(),
        })?;
        writer.write_rows(chunk)?;
        first += n;
        if let Some(p) = progress.as_mut() {
            p.update(first as u64);
        }
    }
    let meta = writer.finish()?;
    if let Some(p) = progress {
        p.finish();
    }
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table_file::TableFile;
    use safetensors::tensor::TensorView;

    fn rows_data(rows: usize) -> (Vec<u8>, Vec<u8>) {
        let mut table = vec![0u8; rows * ROW_BYTES];
        engram_protocol::synthetic::synthetic_rows(2, 1, 0, &mut table);
        let w = table
            .chunks_exact(ROW_BYTES)
            .flat_map(|r| r[..ROW_VALUES].to_vec())
            .collect();
        let s = table
            .chunks_exact(ROW_BYTES)
            .flat_map(|r| r[ROW_VALUES..].to_vec())
            .collect();
        (w, s)
    }

    fn write_st(path: &Path, tensors: Vec<(&str, Dtype, Vec<usize>, &[u8])>) {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .into_iter()
            .map(|(n, d, shape, data)| {
                (
                    n.to_string(),
                    TensorView::new(d, shape, data).expect("view"),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).expect("write checkpoint");
    }

    fn packed_rows(path: &Path) -> Vec<u8> {
        let t = TableFile::open(path).expect("open");
        t.verify(None).expect("verify");
        let mut out = Vec::new();
        t.for_each_chunk(true, None, |_, r| {
            out.extend_from_slice(r);
            Ok(())
        })
        .expect("stream");
        out
    }

    #[test]
    fn packs_a_single_file_checkpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rows = 20_000;
        let (w, s) = rows_data(rows);
        let (wn, sn) = tensor_names(1);
        let other = [0u8; 4];
        let ck = dir.path().join("model.safetensors");
        write_st(
            &ck,
            vec![
                (&wn, Dtype::F8_E4M3, vec![rows, 256], &w),
                (&sn, Dtype::F8_E8M0, vec![rows, 8], &s),
                ("layers.0.attn.wq", Dtype::U8, vec![4], &other),
            ],
        );
        let out = dir.path().join("l1.etab");
        let meta = pack(dir.path(), 1, &out, None, None, |_| None).expect("pack");
        assert_eq!(meta.rows, rows as u64);
        assert_eq!(meta.hash_preset, None);
        let mut want = vec![0u8; rows * ROW_BYTES];
        engram_protocol::synthetic::synthetic_rows(2, 1, 0, &mut want);
        assert_eq!(packed_rows(&out), want);
        // The file itself works as well as its directory.
        let out2 = dir.path().join("l1b.etab");
        assert_eq!(
            pack(&ck, 1, &out2, None, None, |_| None)
                .expect("pack")
                .digest,
            meta.digest
        );
        // A layer the checkpoint lacks is a clear error.
        let err = pack(&ck, 14, &out2, None, None, |_| None).expect_err("no layer 14");
        assert!(
            err.to_string().contains("layers.14.engram.embed.weight"),
            "{err}"
        );
    }

    #[test]
    fn packs_a_sharded_checkpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rows = 1000;
        let (w, s) = rows_data(rows);
        let (wn, sn) = tensor_names(14);
        write_st(
            &dir.path().join("model-00001-of-00002.safetensors"),
            vec![(&wn, Dtype::F8_E4M3, vec![rows, 256], &w)],
        );
        write_st(
            &dir.path().join("model-00002-of-00002.safetensors"),
            vec![(&sn, Dtype::F8_E8M0, vec![rows, 8], &s)],
        );
        let index = format!(
            r#"{{"metadata":{{"total_size":1}},"weight_map":{{"{wn}":"model-00001-of-00002.safetensors","{sn}":"model-00002-of-00002.safetensors"}}}}"#
        );
        std::fs::write(dir.path().join("model.safetensors.index.json"), index).expect("index");
        let out = dir.path().join("l14.etab");
        let meta = pack(
            dir.path(),
            14,
            &out,
            Some("custom".into()),
            Some(123),
            |_| None,
        )
        .expect("pack");
        assert_eq!(meta.layer, 14);
        assert_eq!(meta.hash_base, Some(123));
        let mut want = vec![0u8; rows * ROW_BYTES];
        engram_protocol::synthetic::synthetic_rows(2, 1, 0, &mut want);
        assert_eq!(packed_rows(&out), want);
    }

    #[test]
    fn refuses_bad_checkpoints() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rows = 30;
        let (mut w, s) = rows_data(rows);
        let (wn, sn) = tensor_names(1);
        let out = dir.path().join("o.etab");
        let ck = dir.path().join("a.safetensors");
        // Wrong dtype.
        write_st(
            &ck,
            vec![
                (&wn, Dtype::U8, vec![rows, 256], &w),
                (&sn, Dtype::F8_E8M0, vec![rows, 8], &s),
            ],
        );
        assert!(
            pack(&ck, 1, &out, None, None, |_| None)
                .expect_err("dtype")
                .to_string()
                .contains("expected F8_E4M3")
        );
        // Row counts that differ.
        write_st(
            &ck,
            vec![
                (&wn, Dtype::F8_E4M3, vec![rows, 256], &w),
                (&sn, Dtype::F8_E8M0, vec![rows - 1, 8], &s[..(rows - 1) * 8]),
            ],
        );
        assert!(pack(&ck, 1, &out, None, None, |_| None).is_err());
        // A NaN code names its row.
        w[7 * 256 + 3] = 0x7F;
        write_st(
            &ck,
            vec![
                (&wn, Dtype::F8_E4M3, vec![rows, 256], &w),
                (&sn, Dtype::F8_E8M0, vec![rows, 8], &s),
            ],
        );
        match pack(&ck, 1, &out, None, None, |_| None) {
            Err(PackError::CorruptRow { row: 7, .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(!out.exists(), "a failed pack leaves no table behind");
        // An index that points outside the checkpoint.
        let index =
            format!(r#"{{"weight_map":{{"{wn}":"../x.safetensors","{sn}":"a.safetensors"}}}}"#);
        let idx = dir.path().join("model.safetensors.index.json");
        std::fs::write(&idx, index).expect("index");
        assert!(
            pack(&idx, 1, &out, None, None, |_| None)
                .expect_err("traversal")
                .to_string()
                .contains("leaves")
        );
        // Not a safetensors file at all.
        std::fs::write(&ck, b"garbage").expect("write");
        assert!(pack(&ck, 1, &out, None, None, |_| None).is_err());
    }
}
