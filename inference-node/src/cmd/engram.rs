//! The Engram math tools: `addresses` of a token sequence, `token-map`
//! from a tokenizer, and `gpu-check` (GPU fusion against the CPU path).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use cluster_config::model::TokenMapSource;
use engram_protocol::hashing::{HashParams, Preset, V41_COMPRESSED_VOCAB, V41_PAD_RAW_ID};
use inference_node::engram::TokenMap;
use inference_node::engram::addresses::{
    addresses as engram_addresses, compress, parse_ids, to_json, to_table,
};

#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["compressed_ids", "token_ids"]))]
pub struct AddressArgs {
    /// Hashing preset: `v41`.
    #[arg(long, conflicts_with_all = ["hash_base", "config"])]
    preset: Option<String>,
    /// Small preset: primes above N - 1, V4.1's multipliers.
    #[arg(long, conflicts_with = "config")]
    hash_base: Option<u64>,
    /// Take the preset, token map, expected size and pad from this rack config's [model].
    #[arg(long)]
    config: Option<PathBuf>,
    /// Compressed ids, comma-separated; -1 is DEAD.
    #[arg(long, allow_hyphen_values = true)]
    compressed_ids: Option<String>,
    /// Raw token ids, comma-separated (-1 is DEAD); needs --tokenizer, --token-map or --config.
    #[arg(long, allow_hyphen_values = true)]
    token_ids: Option<String>,
    /// Build the token map from this tokenizer.json.
    #[arg(long, conflicts_with_all = ["token_map", "config"])]
    tokenizer: Option<PathBuf>,
    /// Load a precomputed token map (one compressed id per line).
    #[arg(long, conflicts_with = "config")]
    token_map: Option<PathBuf>,
    /// Compressed vocabulary size the map must have (default 99092 under v41).
    #[arg(long, conflicts_with = "config")]
    compressed_vocab: Option<u32>,
    /// Compressed id of the pad (default: the map's id of raw token 2, else 2).
    #[arg(long, allow_hyphen_values = true)]
    pad_id: Option<i64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct TokenMapArgs {
    /// The model's tokenizer.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Where to write the map.
    #[arg(long)]
    out: PathBuf,
    /// Refuse a map of another compressed size (V4.1: 99092).
    #[arg(long)]
    expect: Option<u32>,
}

#[derive(clap::Args)]
pub struct GpuCheckArgs {
    /// Hidden size.
    #[arg(long, default_value_t = 5120)]
    hidden: usize,
    /// Residual streams.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Positions fused on the GPU per timed call.
    #[arg(long, default_value_t = 256)]
    positions: usize,
    /// Positions also fused on the CPU for the comparison.
    #[arg(long, default_value_t = 8)]
    cpu_positions: usize,
    /// Timed calls.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
}

fn load_map(
    tokenizer: Option<&Path>,
    map: Option<&Path>,
    expect: Option<u32>,
) -> Result<Option<TokenMap>> {
    let m = match (tokenizer, map) {
        (Some(t), _) => TokenMap::from_tokenizer_file(t)?,
        (None, Some(m)) => TokenMap::load(m)?,
        (None, None) => return Ok(None),
    };
    if let Some(n) = expect {
        m.check_size(n)?;
    }
    Ok(Some(m))
}

pub fn addresses(args: AddressArgs) -> Result<()> {
    let (preset, map) = match &args.config {
        Some(path) => {
            let c = cluster_config::Config::load(path)?;
            if c.family() == cluster_config::model::Family::Qwen4Exp {
                return qwen4exp_addresses(&c, &args);
            }
            let m = c
                .model
                .with_context(|| format!("{} has no [model] table", path.display()))?;
            let (t, f) = match &m.token_map {
                TokenMapSource::Tokenizer(t) => (Some(t.as_path()), None),
                TokenMapSource::Map(f) => (None, Some(f.as_path())),
                TokenMapSource::None => (None, None),
            };
            let map = load_map(t, f, m.compressed_vocab)?;
            let pad = map.as_ref().and_then(|mp| mp.get(m.pad_token));
            (m.hashing, map.map(|mp| (mp, pad)))
        }
        None => {
            let preset = match (&args.preset, args.hash_base) {
                (_, Some(b)) => Preset::from_base(b)?,
                (Some(p), None) if p == "v41" => Preset::V41,
                (Some(p), None) => {
                    bail!("--preset {p:?}: the known preset is v41 (or give --hash-base N)")
                }
                (None, None) => Preset::V41,
            };
            let expect = args
                .compressed_vocab
                .or((preset == Preset::V41).then_some(V41_COMPRESSED_VOCAB));
            let map = load_map(args.tokenizer.as_deref(), args.token_map.as_deref(), expect)?;
            let pad = map.as_ref().and_then(|m| m.get(V41_PAD_RAW_ID));
            (preset, map.map(|m| (m, pad)))
        }
    };
    let params = HashParams::new(preset)?;
    let ids = match (&args.compressed_ids, &args.token_ids) {
        (Some(list), _) => parse_ids(list)?,
        (None, Some(list)) => {
            let Some((map, _)) = &map else {
                bail!("--token-ids needs --tokenizer FILE, --token-map FILE or --config FILE");
            };
            compress(map, &parse_ids(list)?)?
        }
        (None, None) => bail!("give --compressed-ids or --token-ids"),
    };
    let map_pad = map.as_ref().and_then(|(_, p)| *p).map(i64::from);
    let pad = args.pad_id.or(map_pad).unwrap_or(2);
    let rows = engram_addresses(&params, pad, &ids)?;
    let mut so = std::io::stdout().lock();
    if args.json {
        writeln!(so, "{}", to_json(&ids, &rows))?;
    } else {
        write!(so, "{}", to_table(&params, pad, &ids, &rows))?;
    }
    Ok(())
}

/// `addresses` on a `qwen4exp` rack: each position's 16 row ids of its
/// PLE table, hashed from raw ids as the engines hash them (an EOS starts
/// a new window).
fn qwen4exp_addresses(c: &cluster_config::Config, args: &AddressArgs) -> Result<()> {
    let m = c.model.as_ref().context("no [model] table")?;
    let hashing = inference_node::model::ngram::node::hashing_of(m).map_err(anyhow::Error::msg)?;
    let (base, eos) = (hashing.config.base, hashing.config.eos);
    let ids = match (&args.compressed_ids, &args.token_ids) {
        (Some(_), _) => bail!("a qwen4exp rack hashes raw ids: give --token-ids"),
        (None, Some(list)) => parse_ids(list)?,
        (None, None) => bail!("give --token-ids"),
    };
    let heads = hashing.heads();
    let rows = hashing.ids(&[], &ids)?;
    let mut so = std::io::stdout().lock();
    if args.json {
        let per: Vec<&[u64]> = rows.chunks(heads).collect();
        writeln!(
            so,
            "{}",
            serde_json::json!({"family": "qwen4exp", "ids": ids, "rows": per})
        )?;
        return Ok(());
    }
    writeln!(
        so,
        "qwen4exp: {heads} rows a token (orders 2 to {} x {} heads), ngram_vocab_size_base {base}, eos {eos}, {} rows",
        hashing.config.ngram_size, hashing.config.heads_per_ngram, hashing.padded_rows
    )?;
    for (i, (id, r)) in ids.iter().zip(rows.chunks(heads)).enumerate() {
        let list: Vec<String> = r.iter().map(u64::to_string).collect();
        writeln!(so, "position {i} (id {id}): {}", list.join(" "))?;
    }
    Ok(())
}

pub fn token_map(args: TokenMapArgs) -> Result<()> {
    let map = TokenMap::from_tokenizer_file(&args.tokenizer)?;
    if let Some(n) = args.expect {
        map.check_size(n)?;
    }
    let f = File::create(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    map.write(std::io::BufWriter::new(f))
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "{}: {} raw ids -> {} compressed ids",
        args.out.display(),
        map.raw_len(),
        map.compressed_len()
    );
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn gpu_check(_: &GpuCheckArgs) -> Result<()> {
    bail!("this build has no GPU support: build with --features cuda")
}

#[cfg(feature = "cuda")]
pub fn gpu_check(a: &GpuCheckArgs) -> Result<()> {
    use inference_node::engram::fusion::{CpuFusion, Fusion, POSITION_ROW_BYTES};
    use inference_node::engram::gpu::{CHUNK, GpuFusion};
    use inference_node::engram::{FusionShape, FusionWeights};
    use std::sync::Arc;
    use std::time::Instant;

    let shape = FusionShape::new(a.hidden, a.streams)?;
    // Fail fast, before building gigabytes of weights, where no GPU is usable.
    inference_node::engram::gpu::probe()?;
    let positions = a.positions.clamp(1, CHUNK);
    println!(
        "seeded weights, hidden {} streams {}; building...",
        a.hidden, a.streams
    );
    let w = Arc::new(FusionWeights::from_seed(1, shape));
    let mut gpu = GpuFusion::new(&w, 0)?;
    let mut rows = vec![0u8; positions * POSITION_ROW_BYTES];
    engram_protocol::synthetic::synthetic_rows(7, 1, 0, &mut rows);
    let live = vec![true; positions];
    let h0: Vec<f32> = (0..positions * shape.state_len())
        .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 300.0)
        .collect();
    let n = a.cpu_positions.clamp(1, positions);
    let state = shape.state_len();
    for layer in [1u32, 14] {
        let mut cpu_h = h0[..n * state].to_vec();
        CpuFusion::new(Arc::clone(&w)).fuse(
            layer,
            &rows[..n * POSITION_ROW_BYTES],
            &live[..n],
            &mut cpu_h,
        )?;
        let mut gpu_h = h0.clone();
        gpu.fuse(layer, &rows, &live, &mut gpu_h)?;
        let (mut max_abs, mut max_rel) = (0f64, 0f64);
        for (g, c) in gpu_h.iter().zip(&cpu_h) {
            let d = f64::from((g - c).abs());
            max_abs = max_abs.max(d);
            max_rel = max_rel.max(d / f64::from(c.abs()).max(1e-3));
        }
        println!(
            "layer {layer}: GPU vs CPU over {n} positions x {state} values: max |diff| {max_abs:.3e}, max relative {max_rel:.3e}"
        );
    }
    let mut h = h0.clone();
    gpu.fuse(1, &rows, &live, &mut h)?;
    let t = Instant::now();
    for _ in 0..a.rounds {
        h.copy_from_slice(&h0);
        gpu.fuse(1, &rows, &live, &mut h)?;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "GPU fusion: {:.0} positions/s per layer ({} calls of {positions} positions, {:.2} ms per call, host copies included)",
        (a.rounds * positions) as f64 / secs,
        a.rounds,
        secs * 1e3 / a.rounds as f64
    );
    Ok(())
}
