//! `memory-donor pack`: build an `.etab` from a V4.1 checkpoint's
//! `layers.{L}.engram.embed.weight` (F8_E4M3 `[rows, 256]`) and
//! `layers.{L}.engram.embed.scale` (F8_E8M0 `[rows, 8]`), from one
//! safetensors file or a sharded checkpoint (`model.safetensors.index.json`).
//! Inputs are memory-mapped and streamed; nothing is held whole in RAM.

use crate::checkpoint::{CheckpointError, CheckpointFiles};
use std::fs::File;
use std::path::{Path, PathBuf};

use engram_protocol::encoding::RowEncoding;
use engram_protocol::etab::TableMeta;
use engram_protocol::hashing::{HashParams, Preset};
use engram_protocol::model_config::{ModelConfig, ModelConfigError, expect};
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

pub(crate) fn map(path: &Path) -> Result<Mmap, PackError> {
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

/// How to label and check a packed table.
#[derive(Debug, Clone, Default)]
pub struct PackSpec {
    /// Hashing preset to record (default: the one `config.json` or the
    /// table's size implies).
    pub hash_preset: Option<String>,
    /// Hashing base size to record (default: `config.json`'s
    /// `engram_vocab_size`, or V4.1's for a table of V4.1's size).
    pub hash_base: Option<u64>,
    /// The checkpoint's `config.json` (default: the one in the
    /// checkpoint's directory, where there is one).
    pub config_json: Option<PathBuf>,
}

/// The `config.json` `spec` names, or the one beside `checkpoint` (none
/// when there is none there); an error when one is named and missing.
fn model_config(checkpoint: &Path, spec: &PackSpec) -> Result<Option<ModelConfig>, PackError> {
    let Some(path) = crate::checkpoint::config_to_check(checkpoint, spec.config_json.as_deref())
    else {
        return Ok(None);
    };
    Ok(Some(crate::checkpoint::read_model_config(&path)?))
}

/// Check layer `layer`'s `rows` against `config.json` (the table's rows,
/// and the hashing they come from), and the recorded hashing against it;
/// returns the hashing to record.
fn check_config(
    config: &ModelConfig,
    layer: u32,
    rows: u64,
    spec: &PackSpec,
) -> Result<(Option<String>, Option<u64>), ModelConfigError> {
    let preset = if config.base == V41_HASH_BASE {
        Preset::V41
    } else {
        Preset::from_base(config.base).map_err(|e| ModelConfigError::Mismatch {
            field: "engram_vocab_size",
            config: config.base.to_string(),
            ours: e.to_string(),
            what: "the hashing this build computes".into(),
        })?
    };
    // A preset from an accepted base always has its parameters.
    if let Ok(params) = HashParams::new(preset) {
        config.check_hashing(&params)?;
    }
    let ours = config.rows_of(layer);
    expect(
        "engram_num_embeddings",
        ours,
        Some(rows),
        format!("layer {layer}'s table in the checkpoint"),
    )?;
    if let Some(b) = spec.hash_base {
        expect("engram_vocab_size", config.base, b, "--hash-base")?;
    }
    let name = spec
        .hash_preset
        .clone()
        .or_else(|| preset.name().map(str::to_string));
    Ok((name, Some(config.base)))
}

/// Pack layer `layer` of `checkpoint` into `out`, checked against the
/// checkpoint's `config.json` where there is one.
pub fn pack(
    checkpoint: &Path,
    layer: u32,
    out: &Path,
    spec: &PackSpec,
    mut progress: impl FnMut(u64) -> Option<Progress>,
) -> Result<TableMeta, PackError> {
    let config = model_config(checkpoint, spec)?;
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
    let (hash_preset, hash_base) = match &config {
        Some(c) => check_config(c, layer, rows, spec).map_err(|e| PackError::Checkpoint {
            path: spec
                .config_json
                .clone()
                .unwrap_or_else(|| crate::checkpoint::config_beside(checkpoint)),
            reason: e.to_string(),
        })?,
        None => (
            spec.hash_preset
                .clone()
                .or_else(|| is_v41.then(|| "v41".to_string())),
            spec.hash_base.or_else(|| is_v41.then_some(V41_HASH_BASE)),
        ),
    };
    let meta = TableMeta {
        layer,
        rows,
        digest: TableDigest([0; 32]),
        hash_preset,
        hash_base,
        source: format!(
            "checkpoint {}",
            files[0]
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ),
        encoding: RowEncoding::V41,
        tensor_scale: None,
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
mod tests;
