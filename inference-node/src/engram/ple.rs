//! Qwen4Exp's PLE fusion on the CPU (docs/models.md): after `kv_proj` gives
//! a token a key per residual stream and one shared value, the signed-sqrt
//! gate and the depthwise causal convolution whose state carries across a
//! sequence's tokens, with vLLM's kernels' arithmetic (`ple_gate`,
//! `ple_conv`): f32 math, rounded to bf16 where vLLM's kernels round.
//!
//! Per token and residual stream `s` (`H` channels each, `HC` streams,
//! `C = HC x H`):
//!
//! - `k = norm(key_s) (1 + w_k)`, `q = norm(hidden_s) (1 + w_q)` (RMSNorm
//!   over the stream's `H` values, `eps`), each rounded;
//! - `d = round(round(sum(round(k q))) / sqrt(H))`, the gate `g =
//!   round(sigmoid(sign(d) round(sqrt(max(|d|, 1e-6)))))`;
//! - `gated_s = round(g value)`, and the convolution's input `x_s =
//!   round(norm(gated_s) (1 + w_c))`.
//!
//! Then per channel `c`, the convolution over the last
//! `(kernel - 1) x dilation + 1` inputs, every `dilation`-th (taps before
//! the sequence's first token come from its state, zeros for a new one):
//! `y = round(sum_k w[c][k] x[t - (kernel - 1 - k) dilation][c])`, and the
//! layer's output `round(hidden + round(gated + round(y sigmoid(y))))`,
//! the two additions rounded to nearest as torch's adds and a GPU's store
//! do.
//! The state keeps the sequence's last `(kernel - 1) x dilation` inputs.

use engram_protocol::row::{bf16_bits_to_f32, f32_to_bf16_bits};

/// How f32 values become bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rounding {
    /// To nearest, ties to even: what a GPU's conversion does (and torch's).
    #[default]
    Nearest,
    /// Toward zero (the low 16 bits dropped): what Triton's interpreter does
    /// for a kernel's `.to(tl.bfloat16)` on CPU, where vLLM's kernels can be
    /// run for reference.
    Truncate,
}

impl Rounding {
    /// `x` as bf16 bits.
    pub fn bits(self, x: f32) -> u16 {
        match self {
            Self::Nearest => f32_to_bf16_bits(x),
            Self::Truncate if x.is_nan() => f32_to_bf16_bits(x),
            Self::Truncate => (x.to_bits() >> 16) as u16,
        }
    }

    /// `x` rounded to bf16 and back.
    pub fn round(self, x: f32) -> f32 {
        bf16_bits_to_f32(self.bits(x))
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Why a PLE layer's parameters or inputs are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("PLE fusion: {0}")]
pub struct PleError(pub String);

/// One PLE layer's gate and convolution parameters.
#[derive(Debug, Clone)]
pub struct PleLayer {
    /// Channels per residual stream (`H`).
    pub h: usize,
    /// Residual streams (`HC`).
    pub streams: usize,
    /// The convolution's kernel size (4 in Qwen4Exp).
    pub kernel: usize,
    /// Its dilation (`ngram_size`: 3).
    pub dilation: usize,
    /// RMSNorm's epsilon.
    pub eps: f32,
    /// How values are rounded to bf16 (to nearest unless set).
    pub rounding: Rounding,
    norm_key: Vec<f32>,
    norm_query: Vec<f32>,
    norm_conv: Vec<f32>,
    /// `[C][kernel]`.
    conv: Vec<f32>,
}

/// A `kv_proj` weight prepared for [`PleLayer::project_with`]: its bf16
/// values input by input (`[D][C + H]`), so that one input's weights for
/// every output are contiguous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvProj {
    outs: usize,
    d: usize,
    by_input: Vec<u16>,
}

/// Tokens [`PleLayer::project_with`] projects per pass over the weight.
const PROJECT_BLOCK: usize = 8;

impl KvProj {
    /// Prepare `weight` (`[outs][D]`, bf16 bits, as a checkpoint stores a
    /// linear layer).
    pub fn new(weight: &[u16], outs: usize) -> Result<Self, PleError> {
        if outs == 0 || weight.is_empty() || !weight.len().is_multiple_of(outs) {
            return Err(PleError(format!(
                "a kv_proj of {} values for {outs} outputs",
                weight.len()
            )));
        }
        let d = weight.len() / outs;
        let mut by_input = vec![0u16; weight.len()];
        for (o, row) in weight.chunks_exact(d).enumerate() {
            for (k, &b) in row.iter().enumerate() {
                by_input[k * outs + o] = b;
            }
        }
        Ok(Self { outs, d, by_input })
    }
}

/// A sequence's convolution state: its last `(kernel - 1) x dilation`
/// inputs, oldest first (`[window][C]`, bf16 bits); empty for a new one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PleState {
    /// The inputs, or empty before the sequence's first token.
    pub window: Vec<u16>,
}

/// What a call of the fusion gives, per token `[C]` (bf16 bits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PleOutput {
    /// The gated values.
    pub gated: Vec<u16>,
    /// The convolution's inputs.
    pub normed: Vec<u16>,
    /// The convolution's output (after SiLU).
    pub conv: Vec<u16>,
    /// The layer's output (hidden state plus both branches).
    pub out: Vec<u16>,
}

impl PleLayer {
    /// A layer of `streams` streams of `h` channels; the norms' weights
    /// (`[C]` each) and the convolution's (`[C][kernel]`), bf16 bits.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        h: usize,
        streams: usize,
        kernel: usize,
        dilation: usize,
        eps: f32,
        norm_key: &[u16],
        norm_query: &[u16],
        norm_conv: &[u16],
        conv: &[u16],
    ) -> Result<Self, PleError> {
        let c = h.checked_mul(streams).filter(|&c| c > 0 && c <= 1 << 20);
        let Some(c) = c else {
            return Err(PleError(format!("{streams} streams of {h} channels")));
        };
        if !(1..=16).contains(&kernel) || !(1..=16).contains(&dilation) {
            return Err(PleError(format!("kernel {kernel}, dilation {dilation}")));
        }
        if !(eps.is_finite() && eps > 0.0) {
            return Err(PleError(format!("eps {eps}")));
        }
        for (name, v, want) in [
            ("norm_key", norm_key, c),
            ("norm_query", norm_query, c),
            ("norm_conv", norm_conv, c),
            ("conv", conv, c * kernel),
        ] {
            if v.len() != want {
                return Err(PleError(format!(
                    "{name} has {} values, not {want}",
                    v.len()
                )));
            }
        }
        let f = |v: &[u16]| v.iter().map(|&b| bf16_bits_to_f32(b)).collect();
        Ok(Self {
            h,
            streams,
            kernel,
            dilation,
            eps,
            rounding: Rounding::Nearest,
            norm_key: f(norm_key),
            norm_query: f(norm_query),
            norm_conv: f(norm_conv),
            conv: f(conv),
        })
    }

    /// Each token's n-gram embedding (`[n][heads x values]`, bf16 bits)
    /// from its rows (`[n][heads]` rows of `encoding`, in the order
    /// `engram_protocol::qwen4exp::Qwen4ExpHashing::ids` gives their ids),
    /// each dequantized as vLLM's table methods do, with the table's
    /// `scale` (FP8, NVFP4).
    pub fn embed(
        encoding: engram_protocol::encoding::RowEncoding,
        rows: &[u8],
        scale: f32,
    ) -> Result<Vec<u16>, PleError> {
        let (rb, v) = (encoding.row_bytes(), encoding.values());
        if !rows.len().is_multiple_of(rb) {
            return Err(PleError(format!("{} bytes of rows of {rb}", rows.len())));
        }
        let mut out = vec![0u16; rows.len() / rb * v];
        for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(v)) {
            encoding
                .dequantize_bf16(row, scale, o)
                .map_err(|e| PleError(e.to_string()))?;
        }
        Ok(out)
    }

    /// `kv_proj`: each token's n-gram embedding (`[n][D]`, bf16 bits) times
    /// `weight` (`[C + H][D]`, as a checkpoint stores a linear layer) to its
    /// keys `[n][C]` and value `[n][H]`, accumulated in f32 in order and
    /// rounded once (a CPU or GPU matmul may sum in another order: results
    /// can differ in the last bf16 step). A loop that projects every step
    /// prepares the weight once ([`KvProj`], [`PleLayer::project_with`]).
    pub fn project(
        &self,
        embeddings: &[u16],
        weight: &[u16],
    ) -> Result<(Vec<u16>, Vec<u16>), PleError> {
        self.project_with(embeddings, &KvProj::new(weight, self.channels() + self.h)?)
    }

    /// [`PleLayer::project`] with the weight prepared: the same sums, each
    /// output's in the same order, so the same bits.
    pub fn project_with(
        &self,
        embeddings: &[u16],
        kv: &KvProj,
    ) -> Result<(Vec<u16>, Vec<u16>), PleError> {
        let (c, h) = (self.channels(), self.h);
        let (outs, d) = (kv.outs, kv.d);
        if outs != c + h {
            return Err(PleError(format!(
                "a kv_proj of {outs} outputs for {c} + {h} channels"
            )));
        }
        if !embeddings.len().is_multiple_of(d) {
            return Err(PleError(format!(
                "{} embedding values, rows of {d}",
                embeddings.len()
            )));
        }
        let n = embeddings.len() / d;
        let (mut key, mut value) = (Vec::with_capacity(n * c), Vec::with_capacity(n * h));
        // Every output accumulates its D products in order (from -0.0, as
        // an iterator's sum does), all outputs side by side: the inner loop
        // runs across outputs, so it vectorizes without reordering a sum.
        // Tokens go in blocks that share each pass over the weight (read
        // from memory once a block, not once a token).
        let mut acc = vec![-0.0f32; PROJECT_BLOCK * outs];
        for block in embeddings.chunks(PROJECT_BLOCK * d) {
            let tokens = block.len() / d;
            let acc = &mut acc[..tokens * outs];
            acc.fill(-0.0);
            for (k, col) in kv.by_input.chunks_exact(outs).enumerate() {
                for (t, a) in acc.chunks_exact_mut(outs).enumerate() {
                    let e = bf16_bits_to_f32(block[t * d + k]);
                    for (a, &w) in a.iter_mut().zip(col) {
                        *a += bf16_bits_to_f32(w) * e;
                    }
                }
            }
            for a in acc.chunks_exact(outs) {
                key.extend(a[..c].iter().map(|&x| f32_to_bf16_bits(x)));
                value.extend(a[c..].iter().map(|&x| f32_to_bf16_bits(x)));
            }
        }
        Ok((key, value))
    }

    /// Channels (`C`).
    pub fn channels(&self) -> usize {
        self.h * self.streams
    }

    /// Inputs the state keeps.
    pub fn state_len(&self) -> usize {
        (self.kernel - 1) * self.dilation
    }

    /// `x (1 + w)` after RMSNorm over `x`, per value, before rounding.
    fn norm(&self, x: &[f32], w: &[f32], out: &mut [f32]) {
        let ss: f32 = x.iter().map(|v| v * v).sum();
        let r = 1.0 / (ss / self.h as f32 + self.eps).sqrt();
        for ((o, &v), &w) in out.iter_mut().zip(x).zip(w) {
            *o = v * r * (1.0 + w);
        }
    }

    /// The gate of one token: `(gated, normed)`, `[C]` each, from its
    /// keys `[C]`, value `[H]` and hidden state `[C]` (bf16 bits).
    fn gate(
        &self,
        key: &[u16],
        value: &[u16],
        hidden: &[u16],
        gated: &mut [u16],
        normed: &mut [u16],
    ) {
        let (h, r) = (self.h, self.rounding);
        let (mut k, mut q) = (vec![0f32; h], vec![0f32; h]);
        let (mut kn, mut qn, mut g) = (vec![0f32; h], vec![0f32; h], vec![0f32; h]);
        let v: Vec<f32> = value.iter().map(|&b| bf16_bits_to_f32(b)).collect();
        for s in 0..self.streams {
            let at = s * h..(s + 1) * h;
            for i in 0..h {
                k[i] = bf16_bits_to_f32(key[at.start + i]);
                q[i] = bf16_bits_to_f32(hidden[at.start + i]);
            }
            self.norm(&k, &self.norm_key[at.clone()], &mut kn);
            self.norm(&q, &self.norm_query[at.clone()], &mut qn);
            let dot: f32 = kn
                .iter()
                .zip(&qn)
                .map(|(&a, &b)| r.round(r.round(a) * r.round(b)))
                .sum();
            let d = r.round(r.round(dot) / (h as f32).sqrt());
            let sign = if d > 0.0 {
                1.0
            } else if d < 0.0 {
                -1.0
            } else {
                0.0
            };
            let magnitude = r.round(d.abs().max(1e-6).sqrt());
            let gate = r.round(sigmoid(sign * magnitude));
            for i in 0..h {
                g[i] = r.round(gate * v[i]);
                gated[at.start + i] = r.bits(g[i]);
            }
            self.norm(&g, &self.norm_conv[at.clone()], &mut kn);
            for i in 0..h {
                normed[at.start + i] = r.bits(kn[i]);
            }
        }
    }

    /// The fusion of one sequence's next `n` tokens (`key` `[n][C]`,
    /// `value` `[n][H]`, `hidden` `[n][C]`, bf16 bits), carrying `state`
    /// (updated to the sequence's last inputs).
    pub fn forward(
        &self,
        state: &mut PleState,
        key: &[u16],
        value: &[u16],
        hidden: &[u16],
    ) -> Result<PleOutput, PleError> {
        let (c, h, sl) = (self.channels(), self.h, self.state_len());
        let r = self.rounding;
        let n = value.len() / h;
        if value.len() != n * h || key.len() != n * c || hidden.len() != n * c {
            return Err(PleError(format!(
                "{} keys, {} values, {} hidden for {n} tokens of {c} channels",
                key.len(),
                value.len(),
                hidden.len()
            )));
        }
        if !state.window.is_empty() && state.window.len() != sl * c {
            return Err(PleError(format!(
                "a state of {} values, not {}",
                state.window.len(),
                sl * c
            )));
        }
        let mut gated = vec![0u16; n * c];
        let mut normed = vec![0u16; n * c];
        for t in 0..n {
            let tok = t * c..(t + 1) * c;
            self.gate(
                &key[tok.clone()],
                &value[t * h..(t + 1) * h],
                &hidden[tok.clone()],
                &mut gated[tok.clone()],
                &mut normed[tok],
            );
        }
        // The window the taps read: the state (zeros for a new sequence),
        // then this call's inputs.
        let mut window = if state.window.is_empty() {
            vec![0u16; sl * c]
        } else {
            state.window.clone()
        };
        window.extend_from_slice(&normed);
        let mut out = vec![0u16; n * c];
        let mut conv = vec![0u16; n * c];
        for t in 0..n {
            for ch in 0..c {
                let mut acc = 0f32;
                for k in 0..self.kernel {
                    let tap = bf16_bits_to_f32(window[(t + self.dilation * k) * c + ch]);
                    acc += self.conv[ch * self.kernel + k] * tap;
                }
                let y = r.round(acc);
                let i = t * c + ch;
                conv[i] = r.bits(y * sigmoid(y));
                // The residual additions, to nearest always: torch's adds,
                // or a GPU's store.
                let ple =
                    Rounding::Nearest.round(bf16_bits_to_f32(gated[i]) + bf16_bits_to_f32(conv[i]));
                out[i] = f32_to_bf16_bits(bf16_bits_to_f32(hidden[i]) + ple);
            }
        }
        state.window = window[n * c..].to_vec();
        Ok(PleOutput {
            gated,
            normed,
            conv,
            out,
        })
    }
}

#[cfg(test)]
mod tests;
