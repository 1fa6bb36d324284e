//! `engram-bench ple`: what a Qwen4Exp PLE layer costs the node's CPU a
//! token, at a shape set on the command line. Its `kv_proj` (`[C + H] x D`
//! multiply-adds a token, `C = streams x hidden`, `D` = 16 rows of 160
//! values) dominates: the node projects with the weight prepared once
//! (`KvProj`: f32, input by input, every output's sum in order), against
//! the baseline of the straightforward projection that converts the bf16
//! weight on every call and sums row by row (what the node did before);
//! both give the same bits, which the run checks. Then the rest of the
//! layer (the gate and the convolution, `PleLayer::forward`), and the
//! token's share of a step at the target rate.

use std::time::Instant;

use anyhow::{Result, bail};
use engram_protocol::row::{bf16_bits_to_f32, f32_to_bf16_bits};
use inference_node::engram::ple::{KvProj, PleLayer, PleState};
use inference_node::engram::weights::PleWeights;
use serde::Serialize;

use crate::stats::median;

/// Arguments of `engram-bench ple`.
#[derive(clap::Args, Debug)]
pub struct PleArgs {
    /// Channels per residual stream (the model's `hidden_size`).
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    /// Residual streams (the model's `hc_count`).
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Values of a token's n-gram embedding (16 rows of 160).
    #[arg(long, default_value_t = 2560)]
    dim: usize,
    /// Tokens per call (1: a decode step's sequence).
    #[arg(long, default_value_t = 1)]
    tokens: usize,
    /// Timed calls of each way, interleaved.
    #[arg(long, default_value_t = 15)]
    repeats: usize,
    /// The target rate whose token time the layer's cost is set against.
    #[arg(long, default_value_t = 100.0)]
    tokens_per_second: f64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The medians, in milliseconds per call.
#[derive(Debug, Serialize)]
struct Report {
    hidden: usize,
    streams: usize,
    dim: usize,
    tokens: usize,
    repeats: usize,
    baseline_project_ms: f64,
    prepared_project_ms: f64,
    /// baseline / prepared.
    speedup: f64,
    gate_and_conv_ms: f64,
    /// Prepared projection plus gate and convolution, per token.
    layer_ms_per_token: f64,
    /// The token time at the target rate.
    token_ms: f64,
    identical: bool,
}

/// The projection as the node made it before: the weight converted on
/// every call, each output its row's in-order sum.
fn baseline(weight: &[u16], outs: usize, emb: &[u16]) -> Vec<u16> {
    let d = weight.len() / outs;
    let w: Vec<f32> = weight.iter().map(|&b| bf16_bits_to_f32(b)).collect();
    let mut out = Vec::with_capacity(emb.len() / d * outs);
    for e in emb.chunks_exact(d) {
        let e: Vec<f32> = e.iter().map(|&b| bf16_bits_to_f32(b)).collect();
        for row in w.chunks_exact(d) {
            let acc: f32 = row.iter().zip(&e).map(|(a, b)| a * b).sum();
            out.push(f32_to_bf16_bits(acc));
        }
    }
    out
}

/// Run the bench.
pub fn run(a: &PleArgs) -> Result<()> {
    if !(1..=64).contains(&a.tokens) || !(1..=1000).contains(&a.repeats) {
        bail!("--tokens must be 1..=64 and --repeats 1..=1000");
    }
    if !(a.tokens_per_second.is_finite() && a.tokens_per_second > 0.0) {
        bail!("--tokens-per-second must be a rate above 0");
    }
    let (h, s, d) = (a.hidden, a.streams, a.dim);
    let w = PleWeights::from_seed(7, (h, s), d, 4)?;
    let c = h * s;
    let layer = PleLayer::new(
        h,
        s,
        4,
        3,
        1e-6,
        &w.norm_key,
        &w.norm_query,
        &w.norm_conv,
        &w.conv,
    )?;
    let prepared = KvProj::new(&w.kv_proj, c + h)?;
    let emb: Vec<u16> = (0..a.tokens * d)
        .map(|i| f32_to_bf16_bits(((i * 7919 % 1000) as f32 / 500.0) - 1.0))
        .collect();
    let hidden: Vec<u16> = (0..a.tokens * c)
        .map(|i| f32_to_bf16_bits(((i * 104_729 % 1000) as f32 / 1000.0) - 0.5))
        .collect();
    let (mut base_ms, mut prep_ms, mut rest_ms) = (Vec::new(), Vec::new(), Vec::new());
    let mut identical = true;
    for _ in 0..a.repeats {
        let t = Instant::now();
        let b = baseline(&w.kv_proj, c + h, &emb);
        base_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let (key, value) = layer.project_with(&emb, &prepared)?;
        prep_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let got: Vec<u16> = (0..a.tokens)
            .flat_map(|i| {
                let mut v = key[i * c..(i + 1) * c].to_vec();
                v.extend_from_slice(&value[i * h..(i + 1) * h]);
                v
            })
            .collect();
        identical &= got == b;
        let mut state = PleState::default();
        let t = Instant::now();
        let out = layer.forward(&mut state, &key, &value, &hidden)?;
        rest_ms.push(t.elapsed().as_secs_f64() * 1e3);
        std::hint::black_box(out);
    }
    let (base, prep, rest) = (median(base_ms), median(prep_ms), median(rest_ms));
    let r = Report {
        hidden: h,
        streams: s,
        dim: d,
        tokens: a.tokens,
        repeats: a.repeats,
        baseline_project_ms: base,
        prepared_project_ms: prep,
        speedup: base / prep,
        gate_and_conv_ms: rest,
        layer_ms_per_token: (prep + rest) / a.tokens as f64,
        token_ms: 1e3 / a.tokens_per_second,
        identical,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "PLE layer: {s} streams of {h} channels, {d}-value embedding, {} token(s) a call, medians of {}",
            r.tokens, r.repeats
        );
        println!(
            "  kv_proj baseline (weight converted per call, row sums)  {:>9.3} ms",
            r.baseline_project_ms
        );
        println!(
            "  kv_proj prepared (KvProj, the node's)                   {:>9.3} ms   speedup {:.1}x",
            r.prepared_project_ms, r.speedup
        );
        println!(
            "  gate and convolution                                    {:>9.3} ms",
            r.gate_and_conv_ms
        );
        println!(
            "  the layer a token: {:.3} ms of a {:.1} ms token at {} tokens/s; same bits as the baseline: {}",
            r.layer_ms_per_token, r.token_ms, a.tokens_per_second, r.identical
        );
    }
    if !identical {
        bail!("the prepared projection's bits differ from the baseline's");
    }
    Ok(())
}
