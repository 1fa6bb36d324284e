//! `memory-donor pack --model qwen4exp`: an `.etab` from a Qwen4Exp
//! (Qwen3.8-Flash-Next) checkpoint's n-gram table, as vLLM's loader reads
//! it (docs/models.md): the table split into `split_ngram_parts` row
//! shards, `{P}ngram_embedding.shard_{i}.weight` (FP8 E4M3 or BF16
//! `[rows, values]`, or NVFP4's packed `U8 [rows, values / 2]` beside its
//! block scales `{P}ngram_embedding.shard_{i}.weight_scale`, E4M3
//! `[rows, values / 16]`), shard `i` holding rows `[i s, i s + s)` with `s
//! = ceil(rows / parts)`, and one global F32 scale
//! (`{P}ngram_embedding.weight_scale` for FP8, `weight_scale_2` for NVFP4).
//! The table's rows are written in order in the encoding's own row layout
//! (NVFP4: a row's packed values, then its block scales), with the global
//! scale as the table's scale. Inputs are memory-mapped and streamed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use engram_protocol::TableDigest;
use engram_protocol::encoding::RowEncoding;
use engram_protocol::etab::TableMeta;
use engram_protocol::qwen4exp::{Qwen4ExpConfig, Qwen4ExpHashing};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::checkpoint::CheckpointFiles;
use crate::pack::PackError;
use crate::progress::Progress;
use crate::table_file::TableWriter;

/// vLLM's default `split_ngram_parts`.
pub const DEFAULT_PARTS: u64 = 512;
/// Most shards a table may be split into.
pub const MAX_PARTS: u64 = 1 << 20;
/// Rows packed per step.
const CHUNK_ROWS: u64 = 64 * 1024;
/// What names a shard's rows.
const SHARD: &str = "ngram_embedding.shard_";

/// What to pack.
#[derive(Debug, Clone, Default)]
pub struct NgramPackSpec {
    /// The table's layer: its 1-based decoder layer (one of the config's
    /// `ple_layer_ids`).
    pub layer: u32,
    /// What comes before `ngram_embedding.` in the tensors' names
    /// (default: the one prefix the checkpoint has, or the one naming
    /// `layers.{layer - 1}.`).
    pub tensor_prefix: Option<String>,
    /// `split_ngram_parts` (default: the config's, or 512).
    pub parts: Option<u64>,
    /// The checkpoint's `config.json` (default: the one beside it, if any).
    pub config_json: Option<PathBuf>,
}

fn bad(path: &Path, reason: String) -> PackError {
    PackError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    }
}

/// The checkpoint's tensors, each file mapped once.
struct Tensors {
    files: CheckpointFiles,
    maps: HashMap<PathBuf, Mmap>,
    checkpoint: PathBuf,
}

/// A tensor's dtype, shape and bytes.
struct View<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    data: &'a [u8],
    file: PathBuf,
}

impl Tensors {
    fn open(checkpoint: &Path) -> Result<Self, PackError> {
        Ok(Self {
            files: CheckpointFiles::open(checkpoint)?,
            maps: HashMap::new(),
            checkpoint: checkpoint.to_path_buf(),
        })
    }

    /// Every tensor name the checkpoint has.
    fn names(&mut self) -> Result<Vec<String>, PackError> {
        if let Some(names) = self.files.indexed_names() {
            return Ok(names);
        }
        let root = self.files.root().to_path_buf();
        self.load(&root)?;
        let m = &self.maps[&root];
        let st =
            SafeTensors::deserialize(m).map_err(|e| bad(&root, format!("not safetensors: {e}")))?;
        Ok(st.names().into_iter().map(str::to_string).collect())
    }

    fn load(&mut self, file: &Path) -> Result<(), PackError> {
        if !self.maps.contains_key(file) {
            let m = crate::pack::map(file)?;
            self.maps.insert(file.to_path_buf(), m);
        }
        Ok(())
    }

    /// Map the file holding tensor `name` (a no-op once mapped); `None`
    /// where the index lists no such tensor.
    fn load_for(&mut self, name: &str) -> Result<Option<PathBuf>, PackError> {
        let Some(file) = self.files.file_of(name)? else {
            return Ok(None);
        };
        self.load(&file)?;
        Ok(Some(file))
    }

    /// Tensor `name` from the files mapped so far (`load_for` first), or
    /// an error naming it.
    fn view(&self, name: &str) -> Result<View<'_>, PackError> {
        let missing = || bad(&self.checkpoint, format!("no tensor `{name}`"));
        let file = self.files.file_of(name)?.ok_or_else(missing)?;
        let m = self.maps.get(&file).ok_or_else(missing)?;
        let st =
            SafeTensors::deserialize(m).map_err(|e| bad(&file, format!("not safetensors: {e}")))?;
        match st.tensor(name) {
            Ok(t) => Ok(View {
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
                data: t.data(),
                file,
            }),
            Err(safetensors::SafeTensorError::TensorNotFound(_)) => Err(missing()),
            Err(e) => Err(bad(&file, format!("tensor `{name}`: {e}"))),
        }
    }

    /// Tensor `name`, mapping its file first.
    fn require(&mut self, name: &str) -> Result<View<'_>, PackError> {
        self.load_for(name)?;
        self.view(name)
    }
}

/// The model's config as `config.json` says (its `text_config` where the
/// n-gram fields are there), or `None` with no config.
fn read_config(
    checkpoint: &Path,
    spec: &NgramPackSpec,
) -> Result<Option<serde_json::Value>, PackError> {
    let Some(path) = crate::checkpoint::config_to_check(checkpoint, spec.config_json.as_deref())
    else {
        return Ok(None);
    };
    let io = |source| PackError::Io {
        path: path.clone(),
        what: "read config",
        source,
    };
    let len = std::fs::metadata(&path).map_err(io)?.len();
    if len > engram_protocol::model_config::MAX_CONFIG_BYTES {
        return Err(bad(&path, format!("{len} bytes: too large for a config")));
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).map_err(io)?)
        .map_err(|e| bad(&path, format!("not JSON: {e}")))?;
    let text = v
        .get("text_config")
        .filter(|t| t.get("ngram_vocab_size_base").is_some());
    Ok(Some(text.cloned().unwrap_or(v)))
}

fn uint(c: &serde_json::Value, key: &str) -> Option<u64> {
    c.get(key).and_then(serde_json::Value::as_u64)
}

/// The rows the config's hashing addresses for layer `layer` (padded as
/// the model stores them), where the config says enough.
fn config_rows(c: &serde_json::Value, layer: u32) -> Result<Option<u64>, String> {
    let (Some(ngram), Some(heads), Some(vocab), Some(base), Some(div)) = (
        uint(c, "ngram_size"),
        uint(c, "heads_per_ngram"),
        uint(c, "vocab_size"),
        uint(c, "ngram_vocab_size_base"),
        uint(c, "make_ngram_vocab_size_divisible_by"),
    ) else {
        return Ok(None);
    };
    let ids: BTreeSet<u64> = c
        .get("ple_layer_ids")
        .and_then(serde_json::Value::as_array)
        .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
        .unwrap_or_default();
    let Some(index) = ids.iter().position(|&l| l == u64::from(layer)) else {
        return Err(format!(
            "layer {layer} is not one of the config's ple_layer_ids {ids:?}"
        ));
    };
    let config = Qwen4ExpConfig {
        ngram_size: ngram as usize,
        heads_per_ngram: heads as usize,
        vocab,
        base,
        seed: uint(c, "seed").unwrap_or(engram_protocol::qwen4exp::DEFAULT_SEED),
        eos: uint(c, "eos_token_id").filter(|&e| e < vocab).unwrap_or(0),
        divisible_by: div,
        layer_index: index as u64,
    };
    let h = Qwen4ExpHashing::new(config).map_err(|e| e.to_string())?;
    Ok(Some(h.padded_rows))
}

/// The one prefix of the shards' names to pack.
fn choose_prefix(
    found: &BTreeMap<String, BTreeSet<u64>>,
    spec: &NgramPackSpec,
    checkpoint: &Path,
) -> Result<String, PackError> {
    if let Some(p) = &spec.tensor_prefix {
        return if found.contains_key(p) {
            Ok(p.clone())
        } else {
            Err(bad(
                checkpoint,
                format!("no tensor `{p}{SHARD}0.weight` (--tensor-prefix)"),
            ))
        };
    }
    match found.len() {
        0 => Err(bad(
            checkpoint,
            format!("no n-gram table: no tensor named `...{SHARD}<i>.weight`"),
        )),
        1 => Ok(found.keys().next().cloned().unwrap_or_default()),
        _ => {
            let here = format!("layers.{}.", spec.layer.saturating_sub(1));
            let mine: Vec<&String> = found.keys().filter(|p| p.contains(&here)).collect();
            match mine.as_slice() {
                [p] => Ok((*p).clone()),
                _ => Err(bad(
                    checkpoint,
                    format!(
                        "{} n-gram tables ({}); name one with --tensor-prefix",
                        found.len(),
                        found.keys().take(8).cloned().collect::<Vec<_>>().join(", ")
                    ),
                )),
            }
        }
    }
}

/// The encoding shard 0's tensors give.
fn encoding_of(t: &mut Tensors, prefix: &str) -> Result<RowEncoding, PackError> {
    let name = format!("{prefix}{SHARD}0.weight");
    let w = t.require(&name)?;
    let (dtype, shape, file) = (w.dtype, w.shape.clone(), w.file.clone());
    let width = match shape.as_slice() {
        [_, w] => *w as u32,
        s => {
            return Err(bad(
                &file,
                format!("`{name}` has shape {s:?}, expected [rows, values]"),
            ));
        }
    };
    let e = match dtype {
        Dtype::F8_E4M3 => RowEncoding::Fp8PerTensor { values: width },
        Dtype::BF16 => RowEncoding::Bf16 { values: width },
        Dtype::U8 => RowEncoding::Nvfp4 { values: 2 * width },
        d => {
            return Err(bad(
                &file,
                format!("`{name}` is {d:?}: FP8 (F8_E4M3), BF16 or NVFP4 (U8) rows are packed"),
            ));
        }
    };
    e.new()
        .map_err(|err| bad(&file, format!("`{name}`: {err}")))
}

/// The table's global scale, for encodings that have one.
fn global_scale(t: &mut Tensors, prefix: &str, e: RowEncoding) -> Result<Option<f32>, PackError> {
    let leaf = match e {
        RowEncoding::Fp8PerTensor { .. } => "weight_scale",
        RowEncoding::Nvfp4 { .. } => "weight_scale_2",
        _ => return Ok(None),
    };
    let name = format!("{prefix}ngram_embedding.{leaf}");
    let s = t.require(&name)?;
    if s.dtype != Dtype::F32 || s.data.len() != 4 {
        return Err(bad(
            &s.file,
            format!(
                "`{name}` is {:?} {:?}: one F32 is expected",
                s.dtype, s.shape
            ),
        ));
    }
    let v = f32::from_le_bytes([s.data[0], s.data[1], s.data[2], s.data[3]]);
    if !(v.is_finite() && v > 0.0) {
        return Err(bad(
            &s.file,
            format!("`{name}` is {v}: the checkpoint is missing its global scale"),
        ));
    }
    Ok(Some(v))
}

/// True where a row holds a NaN code (E4M3's `S.1111.111`): FP8 values,
/// or NVFP4's block scales.
fn nan_in(e: RowEncoding, row: &[u8]) -> bool {
    let nan = |b: &u8| b & 0x7F == 0x7F;
    match e {
        RowEncoding::Fp8PerTensor { .. } => row.iter().any(nan),
        RowEncoding::Nvfp4 { values } => row[values as usize / 2..].iter().any(nan),
        _ => false,
    }
}

/// Pack the Qwen4Exp n-gram table of `checkpoint` into `out`;
/// `progress(rows, row_bytes)` may report on the way.
pub fn pack_ngram(
    checkpoint: &Path,
    out: &Path,
    spec: &NgramPackSpec,
    mut progress: impl FnMut(u64, u64) -> Option<Progress>,
) -> Result<TableMeta, PackError> {
    let config = read_config(checkpoint, spec)?;
    let mut t = Tensors::open(checkpoint)?;
    let mut found: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    for name in t.names()? {
        let Some(stem) = name.strip_suffix(".weight") else {
            continue;
        };
        if let Some((prefix, i)) = stem.rsplit_once(SHARD)
            && let Ok(i) = i.parse::<u64>()
        {
            found.entry(prefix.to_string()).or_default().insert(i);
        }
    }
    let prefix = choose_prefix(&found, spec, checkpoint)?;
    let parts = spec
        .parts
        .or_else(|| config.as_ref().and_then(|c| uint(c, "split_ngram_parts")))
        .unwrap_or(DEFAULT_PARTS);
    if !(1..=MAX_PARTS).contains(&parts) {
        return Err(bad(
            checkpoint,
            format!("split_ngram_parts {parts}: 1 to {MAX_PARTS}"),
        ));
    }
    let shards = &found[&prefix];
    if let Some(&i) = shards.iter().find(|&&i| i >= parts) {
        return Err(bad(
            checkpoint,
            format!("shard {i} of `{prefix}`: split_ngram_parts is {parts}"),
        ));
    }
    let encoding = encoding_of(&mut t, &prefix)?;
    let scale = global_scale(&mut t, &prefix, encoding)?;
    // Each shard's rows, then the table's, then each shard against the split.
    let mut rows_of = Vec::with_capacity(shards.len());
    for &i in shards {
        let name = format!("{prefix}{SHARD}{i}.weight");
        let w = t.require(&name)?;
        let rows = match w.shape.as_slice() {
            [r, _] => *r as u64,
            s => return Err(bad(&w.file, format!("`{name}` has shape {s:?}"))),
        };
        rows_of.push((i, rows));
    }
    let rows: u64 = rows_of.iter().map(|&(_, r)| r).sum();
    if rows == 0 {
        return Err(bad(checkpoint, format!("`{prefix}`'s shards hold no rows")));
    }
    let per = rows.div_ceil(parts);
    let expected = |i: u64| rows.saturating_sub(i * per).min(per);
    let mut have = rows_of.iter().copied().peekable();
    for i in 0..parts {
        let got = match have.peek() {
            Some(&(j, r)) if j == i => {
                have.next();
                r
            }
            _ => 0,
        };
        if got != expected(i) {
            return Err(bad(
                checkpoint,
                format!(
                    "shard {i} of `{prefix}` has {got} rows; {parts} shards of a {rows}-row \
                     table hold {} there",
                    expected(i)
                ),
            ));
        }
    }
    if let Some(c) = &config {
        let cfg_path = || {
            spec.config_json
                .clone()
                .unwrap_or_else(|| crate::checkpoint::config_beside(checkpoint))
        };
        match config_rows(c, spec.layer) {
            Ok(Some(want)) if want != rows => {
                return Err(bad(
                    &cfg_path(),
                    format!(
                        "the config's hashing addresses {want} rows (padded) in layer {}'s \
                         table; the checkpoint's shards hold {rows}",
                        spec.layer
                    ),
                ));
            }
            Ok(_) => {}
            Err(e) => return Err(bad(&cfg_path(), e)),
        }
    }
    let meta = TableMeta {
        layer: spec.layer,
        rows,
        digest: TableDigest([0; 32]),
        hash_preset: Some("qwen4exp".into()),
        hash_base: config
            .as_ref()
            .and_then(|c| uint(c, "ngram_vocab_size_base")),
        source: format!("checkpoint {prefix}ngram_embedding ({parts} shards)"),
        encoding,
        tensor_scale: scale.map(f32::to_bits),
    };
    // Every file a shard lives in, mapped before the rows are read.
    let nvfp4 = matches!(encoding, RowEncoding::Nvfp4 { .. });
    for &(i, _) in &rows_of {
        t.load_for(&format!("{prefix}{SHARD}{i}.weight"))?;
        if nvfp4 {
            t.load_for(&format!("{prefix}{SHARD}{i}.weight_scale"))?;
        }
    }
    let rb = encoding.row_bytes();
    // Bytes of a row's values, and of its block scales (NVFP4).
    let sw = if nvfp4 { encoding.values() / 16 } else { 0 };
    let vw = rb - sw;
    let dtype = row_dtype(encoding);
    let mut writer = TableWriter::create(out, meta)?;
    let mut progress = progress(rows, rb as u64);
    let mut buf = vec![0u8; CHUNK_ROWS as usize * rb];
    let mut done = 0u64;
    for &(i, n) in &rows_of {
        let name = format!("{prefix}{SHARD}{i}.weight");
        let v = t.view(&name)?;
        if v.dtype != dtype || v.data.len() as u64 != n * vw as u64 {
            return Err(bad(
                &v.file,
                format!(
                    "`{name}` is {:?} {:?}: expected {dtype:?} [{n}, {}]",
                    v.dtype,
                    v.shape,
                    vw * 8 / dtype.bitsize()
                ),
            ));
        }
        let scales = if nvfp4 {
            let sname = format!("{prefix}{SHARD}{i}.weight_scale");
            let s = t.view(&sname)?;
            if s.dtype != Dtype::F8_E4M3 || s.shape != [n as usize, sw] {
                return Err(bad(
                    &s.file,
                    format!(
                        "`{sname}` is {:?} {:?}: expected F8_E4M3 [{n}, {sw}]",
                        s.dtype, s.shape
                    ),
                ));
            }
            s.data
        } else {
            &[]
        };
        let mut first = 0usize;
        let n = n as usize;
        while first < n {
            let k = (CHUNK_ROWS as usize).min(n - first);
            let chunk = &mut buf[..k * rb];
            for (r, row) in chunk.chunks_exact_mut(rb).enumerate() {
                let at = first + r;
                row[..vw].copy_from_slice(&v.data[at * vw..(at + 1) * vw]);
                row[vw..].copy_from_slice(&scales[at * sw..(at + 1) * sw]);
                if nan_in(encoding, row) {
                    return Err(PackError::CorruptRow {
                        path: v.file.clone(),
                        layer: spec.layer,
                        row: done + at as u64,
                        reason: "a NaN code".into(),
                    });
                }
            }
            writer.write_rows(chunk)?;
            first += k;
            if let Some(p) = progress.as_mut() {
                p.update(done + first as u64);
            }
        }
        done += n as u64;
    }
    let meta = writer.finish()?;
    if let Some(p) = progress {
        p.finish();
    }
    Ok(meta)
}

/// The dtype of an encoding's row tensor.
fn row_dtype(e: RowEncoding) -> Dtype {
    match e {
        RowEncoding::Bf16 { .. } => Dtype::BF16,
        RowEncoding::Nvfp4 { .. } => Dtype::U8,
        _ => Dtype::F8_E4M3,
    }
}

#[cfg(test)]
mod tests;
