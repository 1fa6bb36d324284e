//! The fusion weights of the two Engram layers (docs/ENGRAM.md section 5), held
//! in f32: `wkv` [(S+1)*H x 6144] and `w = q_weight .* k_weight` [S x H].
//!
//! From a checkpoint (a safetensors file, its directory, or
//! `model.safetensors.index.json`), tensors `layers.{L}.engram.wkv.weight`,
//! `layers.{L}.engram.q_weight` and `layers.{L}.engram.k_weight`, in BF16,
//! F16 or F32; `wkv` may also be F8_E4M3 with a block-scale tensor named
//! `layers.{L}.engram.wkv.weight_scale_inv` or `layers.{L}.engram.wkv.scale`
//! (F32, BF16 or F8_E8M0) of shape [ceil(rows/br), ceil(cols/bc)] for any
//! block shape br x bc (128 x 128 in DeepSeek checkpoints); a value is
//! `e4m3(code) * scale[block]`. `q_weight`/`k_weight` are [S, H] or [S*H].
//! Or generated from a seed (tests and demos): deterministic, bf16-valued.

use engram_protocol::synthetic::SplitMix64;
use engram_store::checkpoint::{CheckpointError, CheckpointFiles};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use engram_protocol::hashing::{COLUMNS, ENGRAM_LAYERS};
use engram_protocol::row::ue8m0_to_f32;
use engram_protocol::row::{ROW_VALUES, bf16_bits_to_f32, e4m3_to_f32, f32_to_bf16_bits};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use thiserror::Error;

/// Values of one position's Engram input: 24 rows of 256.
pub const ENGRAM_DIM: usize = COLUMNS * ROW_VALUES;
/// Largest fusion matrix accepted, in f32 bytes per layer.
const MAX_WKV_BYTES: u64 = cluster_config::model::MAX_WKV_BYTES;

/// Why fusion weights cannot be had.
#[derive(Debug, Error)]
pub enum WeightsError {
    /// A file could not be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The checkpoint lacks a tensor or holds one of the wrong kind.
    #[error("{path}: {reason}")]
    Checkpoint {
        /// The checkpoint file (or the root of a sharded one) at fault.
        path: PathBuf,
        /// What is missing or wrong.
        reason: String,
    },
    /// The shape asked for is not accepted.
    #[error("fusion shape: {0}")]
    Shape(String),
}

/// Hidden size and residual streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusionShape {
    /// Hidden size H.
    pub hidden: usize,
    /// Streams S.
    pub streams: usize,
}

impl FusionShape {
    /// A shape, checked against the config's bounds.
    pub fn new(hidden: usize, streams: usize) -> Result<Self, WeightsError> {
        let s = Self { hidden, streams };
        let max_h = cluster_config::model::MAX_HIDDEN as usize;
        let max_s = cluster_config::model::MAX_STREAMS as usize;
        if !(1..=max_h).contains(&hidden) || !(1..=max_s).contains(&streams) {
            return Err(WeightsError::Shape(format!(
                "hidden {hidden} and streams {streams} must be in 1..={max_h} and 1..={max_s}"
            )));
        }
        if s.kv_len() as u64 * ENGRAM_DIM as u64 * 4 > MAX_WKV_BYTES {
            return Err(WeightsError::Shape(format!(
                "a ({streams} + 1) x {hidden} x {ENGRAM_DIM} matrix is over {MAX_WKV_BYTES} bytes"
            )));
        }
        Ok(s)
    }

    /// Rows of `wkv`: (S + 1) * H.
    pub fn kv_len(&self) -> usize {
        (self.streams + 1) * self.hidden
    }

    /// Values of one position's hidden state: S * H.
    pub fn state_len(&self) -> usize {
        self.streams * self.hidden
    }
}

/// One layer's weights.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights {
    /// [(S+1)*H x ENGRAM_DIM], row-major.
    pub wkv: Vec<f32>,
    /// `q_weight .* k_weight`, [S x H].
    pub w: Vec<f32>,
}

/// Both Engram layers' weights (layers 1 and 14, in that order).
#[derive(Debug, Clone, PartialEq)]
pub struct FusionWeights {
    /// Shapes.
    pub shape: FusionShape,
    /// Layers 1 and 14.
    pub layers: [LayerWeights; 2],
}

/// A uniform value in [-1, 1) rounded to bf16.
fn uniform_bf16(rng: &mut SplitMix64) -> f32 {
    let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
    bf16_bits_to_f32(f32_to_bf16_bits(2.0 * u - 1.0))
}

impl FusionWeights {
    /// Deterministic weights of model-like scale: `wkv` uniform with
    /// standard deviation about 1/sqrt(6144 * 3), `q_weight` and `k_weight`
    /// near 1; every value a bf16 value.
    pub fn from_seed(seed: u64, shape: FusionShape) -> Self {
        let scale = 1.0 / (ENGRAM_DIM as f32).sqrt();
        let layers = ENGRAM_LAYERS.map(|layer| {
            let mut st = SplitMix64::new(seed ^ (u64::from(layer) << 56));
            let wkv = (0..shape.kv_len() * ENGRAM_DIM)
                .map(|_| bf16_bits_to_f32(f32_to_bf16_bits(uniform_bf16(&mut st) * scale)))
                .collect();
            let w = (0..shape.state_len())
                .map(|_| {
                    let q = bf16_bits_to_f32(f32_to_bf16_bits(1.0 + 0.25 * uniform_bf16(&mut st)));
                    let k = bf16_bits_to_f32(f32_to_bf16_bits(1.0 + 0.25 * uniform_bf16(&mut st)));
                    q * k
                })
                .collect();
            LayerWeights { wkv, w }
        });
        Self { shape, layers }
    }

    /// Load both layers from a checkpoint (see the module docs).
    pub fn from_checkpoint(checkpoint: &Path, shape: FusionShape) -> Result<Self, WeightsError> {
        let mut ck = Checkpoint::open(checkpoint)?;
        let mut load = |layer: u32| -> Result<LayerWeights, WeightsError> {
            let p = format!("layers.{layer}.engram");
            let wname = format!("{p}.wkv.weight");
            let scales = [
                format!("{p}.wkv.weight_scale_inv"),
                format!("{p}.wkv.scale"),
            ];
            let wkv = ck.matrix(&wname, &scales, shape.kv_len(), ENGRAM_DIM)?;
            let q = ck.matrix(&format!("{p}.q_weight"), &[], shape.streams, shape.hidden)?;
            let k = ck.matrix(&format!("{p}.k_weight"), &[], shape.streams, shape.hidden)?;
            let w = q.iter().zip(&k).map(|(q, k)| q * k).collect();
            Ok(LayerWeights { wkv, w })
        };
        let first = load(ENGRAM_LAYERS[0])?;
        let second = load(ENGRAM_LAYERS[1])?;
        Ok(Self {
            shape,
            layers: [first, second],
        })
    }
}

/// One Qwen4Exp PLE layer's weights as vLLM's `Qwen4ExpPLELayer` holds
/// them, bf16 bits: `kv_proj` (the checkpoint's `key_proj` `[C][D]` then
/// `value_proj` `[H][D]`, as vLLM's merged projection stacks them), the
/// three grouped norms' weights `[C]` and the depthwise convolution's
/// `[C][kernel]` (`conv1d.weight`, `[C, 1, kernel]` in the checkpoint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PleWeights {
    /// `[C + H][D]`.
    pub kv_proj: Vec<u16>,
    /// `norm_key.weight`.
    pub norm_key: Vec<u16>,
    /// `norm_query.weight`.
    pub norm_query: Vec<u16>,
    /// `norm_conv.weight`.
    pub norm_conv: Vec<u16>,
    /// `conv1d.weight`.
    pub conv: Vec<u16>,
}

/// The channels `C` of a PLE layer of `streams` streams of `hidden`,
/// once its shape is checked: `C` within the fusion's bound, its
/// projection `[C + hidden, dim]` within `MAX_WKV_BYTES` in f32, a kernel
/// of 1 to 16.
fn ple_channels(
    (hidden, streams): (usize, usize),
    dim: usize,
    kernel: usize,
) -> Result<usize, WeightsError> {
    let c = hidden
        .checked_mul(streams)
        .filter(|&c| c > 0 && c <= 1 << 20)
        .ok_or_else(|| WeightsError::Shape(format!("{streams} streams of {hidden}")))?;
    let proj_bytes = (c + hidden) as u64 * dim as u64 * 4;
    if proj_bytes > MAX_WKV_BYTES || dim == 0 || !(1..=16).contains(&kernel) {
        return Err(WeightsError::Shape(format!(
            "a [{c} + {hidden}, {dim}] projection (at most {MAX_WKV_BYTES} bytes in f32) \
             and a kernel of {kernel} (1 to 16)"
        )));
    }
    Ok(c)
}

/// Where a Qwen4Exp checkpoint keeps PLE layer `layer`'s tensors (layer
/// ids 1-based, as `ple_layer_ids`; decoder layer `layer - 1`): under the
/// multimodal model's `model.language_model.`, the text model's `model.`,
/// or bare.
fn ple_prefixes(layer: u32) -> [String; 3] {
    let i = layer.saturating_sub(1);
    [
        format!("model.language_model.layers.{i}.ple"),
        format!("model.layers.{i}.ple"),
        format!("layers.{i}.ple"),
    ]
}

impl PleWeights {
    /// Deterministic weights from `seed` for `streams` streams of
    /// `hidden` channels, an n-gram embedding of `dim` values and a
    /// convolution `kernel` wide (tests and demos): the norms' weights
    /// within 0.1 of 0 (vLLM's norms scale by `1 + weight`), the
    /// convolution's within 0.5, `kv_proj` within `1 / sqrt(dim)`; every
    /// value a bf16 value.
    pub fn from_seed(
        seed: u64,
        (hidden, streams): (usize, usize),
        dim: usize,
        kernel: usize,
    ) -> Result<Self, WeightsError> {
        let c = ple_channels((hidden, streams), dim, kernel)?;
        let mut g = SplitMix64::new(seed ^ 0x51e5_7a11);
        let mut draw = |n: usize, amp: f32| -> Vec<u16> {
            (0..n)
                .map(|_| {
                    let u = (g.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                    f32_to_bf16_bits((u * 2.0 - 1.0) * amp)
                })
                .collect()
        };
        let (norm_key, norm_query, norm_conv) = (draw(c, 0.1), draw(c, 0.1), draw(c, 0.1));
        let conv = draw(c * kernel, 0.5);
        let kv_proj = draw((c + hidden) * dim, 1.0 / (dim as f32).sqrt());
        Ok(Self {
            kv_proj,
            norm_key,
            norm_query,
            norm_conv,
            conv,
        })
    }

    /// Load PLE layer `layer` (1-based) of `streams` streams of `hidden`
    /// channels, its n-gram embedding `dim` values, its convolution
    /// `kernel` wide, from a checkpoint (a safetensors file, its directory
    /// or its index): tensors `{prefix}.key_proj.weight`,
    /// `{prefix}.value_proj.weight`, `{prefix}.norm_key.weight`,
    /// `{prefix}.norm_query.weight`, `{prefix}.norm_conv.weight` and
    /// `{prefix}.conv1d.weight`, BF16 as vLLM holds them (F32 and F16 are
    /// rounded to bf16, as vLLM's loader copies them; an F8_E4M3 projection
    /// with a `weight_scale_inv` is dequantized to bf16, where vLLM would
    /// run an FP8 GEMM).
    pub fn from_checkpoint(
        checkpoint: &Path,
        layer: u32,
        (hidden, streams): (usize, usize),
        dim: usize,
        kernel: usize,
    ) -> Result<Self, WeightsError> {
        let c = ple_channels((hidden, streams), dim, kernel)?;
        let mut ck = Checkpoint::open(checkpoint)?;
        let mut prefix = None;
        for p in ple_prefixes(layer) {
            if ck.has(&format!("{p}.key_proj.weight"))? {
                prefix = Some(p);
                break;
            }
        }
        let p = prefix.ok_or_else(|| WeightsError::Checkpoint {
            path: ck.files.root().to_path_buf(),
            reason: format!(
                "no PLE layer {layer}: none of {} is present",
                ple_prefixes(layer)
                    .map(|p| format!("`{p}.key_proj.weight`"))
                    .join(", ")
            ),
        })?;
        let mut bf16 = |name: &str, rows: usize, cols: usize| -> Result<Vec<u16>, WeightsError> {
            let full = format!("{p}.{name}");
            let scales = [format!("{full}_scale_inv"), format!("{full}_scale")];
            let v = ck.matrix(&full, &scales, rows, cols)?;
            Ok(v.into_iter().map(f32_to_bf16_bits).collect())
        };
        let mut kv_proj = bf16("key_proj.weight", c, dim)?;
        kv_proj.extend(bf16("value_proj.weight", hidden, dim)?);
        Ok(Self {
            kv_proj,
            norm_key: bf16("norm_key.weight", c, 1)?,
            norm_query: bf16("norm_query.weight", c, 1)?,
            norm_conv: bf16("norm_conv.weight", c, 1)?,
            conv: bf16("conv1d.weight", c, kernel)?,
        })
    }
}

/// The files of a checkpoint, mapped on demand.
struct Checkpoint {
    files: CheckpointFiles,
    maps: BTreeMap<PathBuf, Mmap>,
}

impl From<CheckpointError> for WeightsError {
    fn from(e: CheckpointError) -> Self {
        match e {
            CheckpointError::Io { path, source } => Self::Io { path, source },
            CheckpointError::Layout { path, reason } => Self::Checkpoint { path, reason },
        }
    }
}

impl Checkpoint {
    fn open(path: &Path) -> Result<Self, WeightsError> {
        Ok(Self {
            files: CheckpointFiles::open(path)?,
            maps: BTreeMap::new(),
        })
    }

    /// Whether the checkpoint holds tensor `name`.
    fn has(&mut self, name: &str) -> Result<bool, WeightsError> {
        let Some(file) = self.file_of(name)? else {
            return Ok(false);
        };
        let m = self.mapped(&file)?;
        Ok(parse(m, &file)?.tensor(name).is_ok())
    }

    /// The file holding `name`, or `None` when the index does not list it.
    fn file_of(&self, name: &str) -> Result<Option<PathBuf>, WeightsError> {
        Ok(self.files.file_of(name)?)
    }

    fn mapped(&mut self, file: &Path) -> Result<&Mmap, WeightsError> {
        if !self.maps.contains_key(file) {
            let io = |source| WeightsError::Io {
                path: file.to_path_buf(),
                source,
            };
            let f = File::open(file).map_err(io)?;
            // SAFETY: read-only private mapping; a checkpoint changed while it
            // is read gives wrong weights, never unsafety in this process.
            let m = unsafe { Mmap::map(&f) }.map_err(io)?;
            self.maps.insert(file.to_path_buf(), m);
        }
        self.maps.get(file).ok_or_else(|| WeightsError::Checkpoint {
            path: file.to_path_buf(),
            reason: "mapping vanished".into(),
        })
    }

    /// Tensor `name` as f32 values of shape [rows, cols] (or flat rows*cols),
    /// dequantized with the first of `scale_names` present when it is FP8.
    fn matrix(
        &mut self,
        name: &str,
        scale_names: &[String],
        rows: usize,
        cols: usize,
    ) -> Result<Vec<f32>, WeightsError> {
        let file = self
            .file_of(name)?
            .ok_or_else(|| WeightsError::Checkpoint {
                path: self.files.root().to_path_buf(),
                reason: format!("index has no tensor `{name}`"),
            })?;
        let mut scale = None;
        for s in scale_names {
            if let Some(sf) = self.file_of(s)? {
                let m = self.mapped(&sf)?;
                let st = parse(m, &sf)?;
                if let Ok(t) = st.tensor(s) {
                    scale = Some((s.clone(), t.dtype(), t.shape().to_vec(), t.data().to_vec()));
                    break;
                }
            }
        }
        let m = self.mapped(&file)?;
        let st = parse(m, &file)?;
        let err = |reason: String| WeightsError::Checkpoint {
            path: file.clone(),
            reason,
        };
        let t = st
            .tensor(name)
            .map_err(|e| err(format!("tensor `{name}`: {e}")))?;
        let shape = t.shape();
        // [rows, cols], flat, or with unit dimensions between (a depthwise
        // convolution's [C, 1, kernel]).
        let inner: Vec<usize> = shape.iter().skip(1).copied().filter(|&d| d != 1).collect();
        let fits = shape == [rows * cols]
            || (shape.first() == Some(&rows)
                && (inner == [cols] || (cols == 1 && inner.is_empty())));
        if !fits {
            return Err(err(format!(
                "tensor `{name}` has shape {shape:?}, expected [{rows}, {cols}]"
            )));
        }
        let n = rows * cols;
        let data = t.data();
        let out = match t.dtype() {
            Dtype::F32 => values(data, n, 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            Dtype::BF16 => values(data, n, 2, |b| {
                bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]))
            }),
            Dtype::F16 => values(data, n, 2, |b| {
                half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
            }),
            Dtype::F8_E4M3 => {
                let (sname, sdt, sshape, sdata) = scale.ok_or_else(|| {
                    err(format!(
                        "tensor `{name}` is F8_E4M3 but none of {scale_names:?} is present"
                    ))
                })?;
                fp8_blocks(data, rows, cols, sdt, &sshape, &sdata)
                    .map_err(|r| err(format!("tensor `{name}` with `{sname}`: {r}")))?
            }
            other => {
                return Err(err(format!(
                    "tensor `{name}` is {other:?}; accepted: BF16, F16, F32, F8_E4M3 with scales"
                )));
            }
        };
        let out = out.ok_or_else(|| err(format!("tensor `{name}` holds the wrong byte count")))?;
        if let Some(i) = out.iter().position(|v| !v.is_finite()) {
            return Err(err(format!("tensor `{name}` value {i} is not finite")));
        }
        Ok(out)
    }
}

fn parse<'a>(m: &'a Mmap, path: &Path) -> Result<SafeTensors<'a>, WeightsError> {
    SafeTensors::deserialize(m).map_err(|e| WeightsError::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("not safetensors: {e}"),
    })
}

/// `n` values of `width` bytes each, or `None` when the byte count differs.
fn values(data: &[u8], n: usize, width: usize, f: impl Fn(&[u8]) -> f32) -> Option<Vec<f32>> {
    (data.len() == n * width).then(|| data.chunks_exact(width).map(f).collect())
}

/// Dequantize an FP8 E4M3 [rows, cols] matrix with block scales.
fn fp8_blocks(
    data: &[u8],
    rows: usize,
    cols: usize,
    sdt: Dtype,
    sshape: &[usize],
    sdata: &[u8],
) -> Result<Option<Vec<f32>>, String> {
    let [sr, sc] = *sshape else {
        return Err(format!("scale shape {sshape:?} is not 2-D"));
    };
    if sr == 0 || sc == 0 || sr > rows || sc > cols {
        return Err(format!(
            "scale shape {sshape:?} does not tile [{rows}, {cols}]"
        ));
    }
    let (br, bc) = (rows.div_ceil(sr), cols.div_ceil(sc));
    if rows.div_ceil(br) != sr || cols.div_ceil(bc) != sc {
        return Err(format!(
            "scale shape {sshape:?} does not tile [{rows}, {cols}]"
        ));
    }
    let scales: Vec<f32> = match sdt {
        Dtype::F32 => values(sdata, sr * sc, 4, |b| {
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }),
        Dtype::BF16 => values(sdata, sr * sc, 2, |b| {
            bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]))
        }),
        Dtype::F8_E8M0 => values(sdata, sr * sc, 1, |b| {
            ue8m0_to_f32(b[0]).unwrap_or(f32::NAN)
        }),
        other => return Err(format!("scale dtype {other:?} is not F32, BF16 or F8_E8M0")),
    }
    .ok_or("scale tensor holds the wrong byte count")?;
    if data.len() != rows * cols {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(rows * cols);
    for (r, row) in data.chunks_exact(cols).enumerate() {
        let srow = &scales[(r / br) * sc..(r / br + 1) * sc];
        for (c, &code) in row.iter().enumerate() {
            let v = e4m3_to_f32(code).ok_or_else(|| format!("value ({r}, {c}) is an FP8 NaN"))?;
            out.push(v * srow[c / bc]);
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests;
