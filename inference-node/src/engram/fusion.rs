//! Fusion (docs/ENGRAM.md section 5): per position and Engram layer, the 24 rows
//! dequantized to bf16 values (as V4.1 rounds them) form `e` [6144];
//! `kv = wkv * e`; `key` = the first S*H values as [S, H], `value` = the last
//! H; per stream `dot = sum(h*w*key) * rsqrt(mean(h^2)+eps) *
//! rsqrt(mean(key^2)+eps) / sqrt(H)`, `gate = sigmoid(sign(dot) *
//! sqrt(max(|dot|, 1e-6)))`, `h += gate * value` in f32. DEAD positions get
//! gate 0 (their state is left as it is and their rows are never read).
//!
//! This module holds the [`Fusion`] interface, the input checks every
//! backend shares, the CPU backend, and the backend choice ([`backend`]).
//!
//! CPU numerics: the matrix-vector product accumulates in f32 (8 lanes, four
//! positions per pass over the weights so each weight is read once per four
//! positions); the three per-stream sums run in f64 so huge or tiny states
//! neither overflow nor lose the normalization.

use std::sync::Arc;

use engram_protocol::hashing::{COLUMNS, ENGRAM_LAYERS};
use engram_protocol::row::{RowError, bf16_bits_to_f32, dequantize_row_bf16};
use engram_protocol::{ROW_BYTES, ROW_VALUES, RowBytes};
use thiserror::Error;

use super::weights::{ENGRAM_DIM, FusionShape, FusionWeights};

/// The norm epsilon.
pub const NORM_EPS: f64 = 1e-20;
/// Bytes of one position's rows for one layer.
pub const POSITION_ROW_BYTES: usize = COLUMNS * ROW_BYTES;
/// Positions fused per pass over the weights.
const BLOCK: usize = 4;

/// Why a fusion call failed.
#[derive(Debug, Error)]
pub enum FusionError {
    /// The layer does not run Engram.
    #[error("layer {0} does not run Engram (layers: 1, 14)")]
    Layer(u32),
    /// Buffers do not agree on the number of positions.
    #[error("{what}: {got} does not fit {positions} positions (expected {expected})")]
    Length {
        /// The buffer at fault, with its unit.
        what: &'static str,
        /// Positions in the call.
        positions: usize,
        /// Length the buffer needs for them.
        expected: usize,
        /// Length it has.
        got: usize,
    },
    /// A row of a live position is corrupt.
    #[error("position {position}, column {column}: {error}")]
    Row {
        /// Index of the position in the call.
        position: usize,
        /// Which of the position's rows (`0..COLUMNS`).
        column: usize,
        /// Why the row does not decode.
        error: RowError,
    },
    /// The GPU backend is not available or failed.
    #[error("gpu: {0}")]
    Gpu(String),
    /// Qwen4Exp's PLE fusion refused its parameters or inputs.
    #[error(transparent)]
    Ple(#[from] crate::engram::ple::PleError),
}

/// A fusion backend.
pub trait Fusion: Send + std::fmt::Debug {
    /// `cpu` or `gpu`.
    fn name(&self) -> &'static str;

    /// The shapes it fuses.
    fn shape(&self) -> FusionShape;

    /// Fuse `positions = live.len()` positions of Engram layer `layer`:
    /// `rows` holds 24 rows per position in column order (a DEAD position's
    /// rows are not read and may be anything), `hidden` holds S*H f32 values
    /// per position (stream-major) and is updated in place.
    fn fuse(
        &mut self,
        layer: u32,
        rows: &[u8],
        live: &[bool],
        hidden: &mut [f32],
    ) -> Result<(), FusionError>;
}

/// Check a fusion call's buffers; returns the layer's index (0 or 1).
pub fn check_inputs(
    shape: FusionShape,
    layer: u32,
    rows: &[u8],
    live: &[bool],
    hidden: &[f32],
) -> Result<usize, FusionError> {
    let li = ENGRAM_LAYERS
        .iter()
        .position(|&l| l == layer)
        .ok_or(FusionError::Layer(layer))?;
    let n = live.len();
    for (what, expected, got) in [
        ("rows (bytes)", n * POSITION_ROW_BYTES, rows.len()),
        ("hidden (values)", n * shape.state_len(), hidden.len()),
    ] {
        if got != expected {
            return Err(FusionError::Length {
                what,
                positions: n,
                expected,
                got,
            });
        }
    }
    Ok(li)
}

/// The gate of one stream from its three sums over the hidden dimension.
pub fn gate(sum_hwk: f64, sum_hh: f64, sum_kk: f64, hidden: usize) -> f64 {
    let n = hidden as f64;
    let dot = sum_hwk / (sum_hh / n + NORM_EPS).sqrt() / (sum_kk / n + NORM_EPS).sqrt() / n.sqrt();
    let mag = dot.abs().max(1e-6).sqrt();
    // sign(0) is 0, so a zero dot gives sigmoid(0) = 0.5; NaN stays NaN.
    let x = if dot > 0.0 {
        mag
    } else if dot < 0.0 {
        -mag
    } else {
        dot * 0.0
    };
    1.0 / (1.0 + (-x).exp())
}

/// Apply the gate to every stream of one position: `h` [S*H], `kv` [(S+1)*H].
pub fn apply_gates(shape: FusionShape, h: &mut [f32], w: &[f32], kv: &[f32]) {
    let hd = shape.hidden;
    let value = &kv[shape.streams * hd..];
    for ((hs, ws), key) in h
        .chunks_exact_mut(hd)
        .zip(w.chunks_exact(hd))
        .zip(kv.chunks_exact(hd))
    {
        let (mut hwk, mut hh, mut kk) = (0f64, 0f64, 0f64);
        for ((&h, &w), &k) in hs.iter().zip(ws).zip(key) {
            let (h, w, k) = (f64::from(h), f64::from(w), f64::from(k));
            hwk += h * w * k;
            hh += h * h;
            kk += k * k;
        }
        let g = gate(hwk, hh, kk, hd) as f32;
        for (h, &v) in hs.iter_mut().zip(value) {
            *h += g * v;
        }
    }
}

/// Dequantize one position's 24 rows into `e` [6144] as bf16 values.
pub fn dequantize_position(rows: &[u8], position: usize, e: &mut [f32]) -> Result<(), FusionError> {
    let mut bf = [0u16; ROW_VALUES];
    for (column, (row, out)) in rows
        .chunks_exact(ROW_BYTES)
        .zip(e.chunks_exact_mut(ROW_VALUES))
        .enumerate()
    {
        let bad = |error| FusionError::Row {
            position,
            column,
            error,
        };
        let row: &RowBytes = row.try_into().map_err(|_| {
            bad(RowError::Length {
                len: row.len(),
                rows: 1,
            })
        })?;
        dequantize_row_bf16(row, &mut bf).map_err(bad)?;
        for (o, &b) in out.iter_mut().zip(&bf) {
            *o = bf16_bits_to_f32(b);
        }
    }
    Ok(())
}

/// `kv[p] = wkv * e[p]` for `P` positions in one pass over the weights.
#[inline(always)]
fn matvec<const P: usize>(wkv: &[f32], e: &[f32], kv_len: usize, kv: &mut [f32]) {
    let es: [&[f32]; P] = std::array::from_fn(|p| &e[p * ENGRAM_DIM..(p + 1) * ENGRAM_DIM]);
    for (r, wrow) in wkv.chunks_exact(ENGRAM_DIM).enumerate() {
        let mut acc = [[0f32; 8]; P];
        for (i, wc) in wrow.chunks_exact(8).enumerate() {
            for p in 0..P {
                let ec = &es[p][i * 8..i * 8 + 8];
                for l in 0..8 {
                    acc[p][l] += wc[l] * ec[l];
                }
            }
        }
        for p in 0..P {
            let a = acc[p];
            kv[p * kv_len + r] = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn matvec_avx2<const P: usize>(wkv: &[f32], e: &[f32], kv_len: usize, kv: &mut [f32]) {
    matvec::<P>(wkv, e, kv_len, kv);
}

/// `kv = wkv * e` for `p` (1..=BLOCK) positions, with 256-bit lanes where the CPU has them.
fn matvec_block(wkv: &[f32], e: &[f32], p: usize, kv_len: usize, kv: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        unsafe {
            match p {
                BLOCK => matvec_avx2::<BLOCK>(wkv, e, kv_len, kv),
                _ => (0..p).for_each(|i| {
                    matvec_avx2::<1>(wkv, &e[i * ENGRAM_DIM..], kv_len, &mut kv[i * kv_len..]);
                }),
            }
        }
        return;
    }
    match p {
        BLOCK => matvec::<BLOCK>(wkv, e, kv_len, kv),
        _ => (0..p).for_each(|i| {
            matvec::<1>(wkv, &e[i * ENGRAM_DIM..], kv_len, &mut kv[i * kv_len..]);
        }),
    }
}

/// The CPU backend. Buffers are reused between calls.
#[derive(Debug)]
pub struct CpuFusion {
    weights: Arc<FusionWeights>,
    e: Vec<f32>,
    kv: Vec<f32>,
    /// The live positions of a call.
    live: Vec<usize>,
}

impl CpuFusion {
    /// A CPU backend over `weights`.
    pub fn new(weights: Arc<FusionWeights>) -> Self {
        let kv_len = weights.shape.kv_len();
        Self {
            weights,
            e: vec![0.0; BLOCK * ENGRAM_DIM],
            kv: vec![0.0; BLOCK * kv_len],
            live: Vec::new(),
        }
    }
}

impl Fusion for CpuFusion {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn shape(&self) -> FusionShape {
        self.weights.shape
    }

    fn fuse(
        &mut self,
        layer: u32,
        rows: &[u8],
        live: &[bool],
        hidden: &mut [f32],
    ) -> Result<(), FusionError> {
        let shape = self.weights.shape;
        let li = check_inputs(shape, layer, rows, live, hidden)?;
        let mut live_positions = std::mem::take(&mut self.live);
        live_positions.clear();
        live_positions.extend((0..live.len()).filter(|&p| live[p]));
        let fused = self.fuse_positions(li, &live_positions, rows, hidden);
        self.live = live_positions;
        fused
    }
}

impl CpuFusion {
    /// Fuse `positions` (the live ones) with the weights of layer index
    /// `li`.
    fn fuse_positions(
        &mut self,
        li: usize,
        positions: &[usize],
        rows: &[u8],
        hidden: &mut [f32],
    ) -> Result<(), FusionError> {
        let weights = Arc::clone(&self.weights);
        let lw = &weights.layers[li];
        let shape = weights.shape;
        let kv_len = shape.kv_len();
        let state = shape.state_len();
        for block in positions.chunks(BLOCK) {
            for (slot, &p) in block.iter().enumerate() {
                let r = &rows[p * POSITION_ROW_BYTES..(p + 1) * POSITION_ROW_BYTES];
                dequantize_position(
                    r,
                    p,
                    &mut self.e[slot * ENGRAM_DIM..(slot + 1) * ENGRAM_DIM],
                )?;
            }
            matvec_block(&lw.wkv, &self.e, block.len(), kv_len, &mut self.kv);
            for (slot, &p) in block.iter().enumerate() {
                apply_gates(
                    shape,
                    &mut hidden[p * state..(p + 1) * state],
                    &lw.w,
                    &self.kv[slot * kv_len..(slot + 1) * kv_len],
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
