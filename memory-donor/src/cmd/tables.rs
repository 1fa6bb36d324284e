//! The table tools: `memory-donor gen`, `pack`, `verify` and `inspect`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use engram_protocol::ROW_BYTES;
use engram_store::generate::{GenSpec, generate_as, generate_sparse, parse_rows, table_shape};
use engram_store::pack::{PackSpec, pack};
use engram_store::pack_ngram::{NgramPackSpec, pack_ngram};
use engram_store::progress::Progress;
use engram_store::table_file::TableFile;
use engram_store::verify::add_page_sums;

/// `memory-donor gen`.
#[derive(clap::Args)]
pub struct GenArgs {
    #[arg(long)]
    layer: u32,
    /// Rows (default: the sum of the layer's primes under --hash-preset or --hash-base).
    #[arg(long, required_unless_present_any = ["hash_preset", "hash_base"])]
    rows: Option<u64>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long)]
    out: PathBuf,
    /// Hashing preset (`v41`): sizes the table and is recorded in the metadata.
    #[arg(long)]
    hash_preset: Option<String>,
    /// Hashing base size (primes above base - 1): sizes the table and is recorded.
    #[arg(long)]
    hash_base: Option<u64>,
    /// Generator threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Write a sparse file: only the pages holding these rows (ids and
    /// ranges A..B, comma-separated) carry their rows; every other page is
    /// a hole of zero rows. The digest and page checksums are the table's,
    /// so it verifies: how a full-size table is checked on a small disk.
    #[arg(long, value_name = "ROWS")]
    sparse_rows: Option<String>,
    /// The rows' encoding (default V4.1's `e4m3_ue8m0_32x256`), e.g.
    /// `fp8_per_tensorx160`, `bf16x160` or `nvfp4_e4m3_16x160` for
    /// Qwen3.8-Flash-Next-shaped tables (docs/models.md).
    #[arg(long, conflicts_with_all = ["sparse_rows", "hash_preset", "hash_base"])]
    encoding: Option<String>,
    /// The table's F32 scale, for an encoding with one (default 1.0).
    #[arg(long, requires = "encoding")]
    tensor_scale: Option<f32>,
}

/// `memory-donor pack`.
#[derive(clap::Args)]
pub struct PackArgs {
    #[arg(long)]
    checkpoint: PathBuf,
    #[arg(long)]
    layer: u32,
    #[arg(long)]
    out: PathBuf,
    #[arg(long)]
    hash_preset: Option<String>,
    #[arg(long)]
    hash_base: Option<u64>,
    /// The checkpoint's config.json (default: the one in the checkpoint's
    /// directory, if any): the table's rows and hashing are checked against it.
    #[arg(long)]
    config_json: Option<PathBuf>,
    /// The model family: `v41` (DeepSeek V4.1's Engram tables) or
    /// `qwen4exp` (Qwen3.8-Flash-Next's n-gram table, from its row shards
    /// and global scale: docs/models.md).
    #[arg(long, default_value = "v41", value_parser = ["v41", "qwen4exp"])]
    model: String,
    /// qwen4exp: what comes before `ngram_embedding.` in the tensors'
    /// names (default: the checkpoint's one n-gram table, or the one of
    /// `layers.{layer - 1}.`).
    #[arg(long)]
    tensor_prefix: Option<String>,
    /// qwen4exp: the shards the table is split into (default: the config's
    /// `split_ngram_parts`, or 512).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    parts: Option<u64>,
}

/// `memory-donor verify`.
#[derive(clap::Args)]
pub struct VerifyArgs {
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Give files made before page checksums existed their `page_xxh3`
    /// tensor (verifying them on the way; needs room for one more copy
    /// of the file while it is rewritten).
    #[arg(long)]
    write_page_checksums: bool,
    /// Threads that read, check and hash (default: every core, at most
    /// 16; fewer leave cores to a donor serving on the same machine).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: Option<u16>,
}

/// `memory-donor inspect`.
#[derive(clap::Args)]
pub struct InspectArgs {
    file: PathBuf,
    #[arg(long)]
    json: bool,
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Write a synthetic table.
pub fn gen_table(a: GenArgs) -> Result<()> {
    let GenArgs {
        layer,
        rows,
        seed,
        out,
        hash_preset,
        hash_base,
        threads: t,
        sparse_rows,
        encoding,
        tensor_scale,
    } = a;
    let encoding = match encoding.as_deref() {
        None => engram_protocol::encoding::RowEncoding::V41,
        Some(name) => engram_protocol::encoding::RowEncoding::parse(name)
            .map_err(|e| anyhow::anyhow!("--encoding: {e}"))?,
    };
    let tensor_scale = match (encoding.has_tensor_scale(), tensor_scale) {
        (true, s) => {
            let s = s.unwrap_or(1.0);
            if !s.is_finite() || s <= 0.0 {
                bail!("--tensor-scale {s}: a table scale is a positive finite number");
            }
            Some(s.to_bits())
        }
        (false, None) => None,
        (false, Some(_)) => bail!("--tensor-scale: {} has no table scale", encoding.name()),
    };
    let (rows, hash_preset, hash_base) =
        table_shape(layer, rows, hash_preset, hash_base).map_err(anyhow::Error::msg)?;
    let spec = GenSpec {
        layer,
        rows,
        seed,
        hash_preset,
        hash_base,
        threads: t.unwrap_or_else(cores),
    };
    let mut p = Progress::stderr(
        format!("generating layer {layer}"),
        rows,
        encoding.row_bytes() as u64,
    );
    let meta = match sparse_rows {
        Some(list) => {
            let touched = parse_rows(&list).map_err(|e| anyhow::anyhow!("--sparse-rows: {e}"))?;
            generate_sparse(&out, &spec, &touched, Some(&mut p))
        }
        None => generate_as(&out, &spec, encoding, tensor_scale, Some(&mut p)),
    }
    .with_context(|| format!("generating {}", out.display()))?;
    p.finish();
    println!(
        "{}: layer {} rows {} digest {}",
        out.display(),
        meta.layer,
        meta.rows,
        meta.digest
    );
    Ok(())
}

/// Build a table from a checkpoint.
pub fn pack_table(a: PackArgs) -> Result<()> {
    let PackArgs {
        checkpoint,
        layer,
        out,
        hash_preset,
        hash_base,
        config_json,
        model,
        tensor_prefix,
        parts,
    } = a;
    if model == "qwen4exp" {
        if hash_preset.is_some() || hash_base.is_some() {
            bail!(
                "--hash-preset and --hash-base are V4.1's: a qwen4exp table's hashing comes from its config.json"
            );
        }
        let spec = NgramPackSpec {
            layer,
            tensor_prefix,
            parts,
            config_json,
        };
        let meta = pack_ngram(&checkpoint, &out, &spec, |rows, row_bytes| {
            Some(Progress::stderr(
                format!("packing layer {layer}"),
                rows,
                row_bytes,
            ))
        })?;
        println!(
            "{}: layer {} rows {} encoding {} digest {}",
            out.display(),
            meta.layer,
            meta.rows,
            meta.encoding.name(),
            meta.digest
        );
        return Ok(());
    }
    if tensor_prefix.is_some() || parts.is_some() {
        bail!("--tensor-prefix and --parts are for --model qwen4exp");
    }
    if config_json.is_none() && !engram_store::checkpoint::config_beside(&checkpoint).is_file() {
        eprintln!(
            "note: no config.json in the checkpoint's directory: the table is not checked \
             against the model's engram parameters (name one with --config-json)"
        );
    }
    let spec = PackSpec {
        hash_preset,
        hash_base,
        config_json,
    };
    let meta = pack(&checkpoint, layer, &out, &spec, |rows| {
        Some(Progress::stderr(
            format!("packing layer {layer}"),
            rows,
            ROW_BYTES as u64,
        ))
    })?;
    println!(
        "{}: layer {} rows {} digest {}",
        out.display(),
        meta.layer,
        meta.rows,
        meta.digest
    );
    Ok(())
}

/// Verify table files (adding page checksums where asked).
pub fn verify(a: VerifyArgs) -> Result<()> {
    let VerifyArgs {
        files,
        write_page_checksums,
        threads,
    } = a;
    let threads = threads.map_or_else(engram_store::verify::default_threads, usize::from);
    let mut failed = 0;
    for f in &files {
        let result = TableFile::open_any(f).and_then(|t| {
            let what = if write_page_checksums && !t.has_page_sums() {
                "adding page checksums to"
            } else {
                "verifying"
            };
            let mut p = Progress::stderr(
                format!("{what} {}", f.display()),
                t.meta.rows,
                t.row_bytes() as u64,
            );
            let d = if write_page_checksums {
                add_page_sums(f, Some(&mut p))?.digest
            } else {
                t.verify_on(threads, Some(&mut p))?
            };
            p.finish();
            let t = TableFile::open_any(f)?;
            Ok((t, d))
        });
        match result {
            Ok((t, d)) => {
                let sums = if t.has_page_sums() {
                    "page checksums ok"
                } else {
                    "no page checksums (add them with --write-page-checksums)"
                };
                println!(
                    "{}: ok: layer {} rows {} digest {d}; {sums}",
                    f.display(),
                    t.meta.layer,
                    t.meta.rows
                );
            }
            Err(e) => {
                eprintln!("{e}");
                failed += 1;
            }
        }
    }
    if failed > 0 {
        bail!("{failed} of {} tables failed verification", files.len());
    }
    Ok(())
}

/// Print a table's metadata (of any row encoding; one the node does not
/// read yet says so).
pub fn inspect(a: InspectArgs) -> Result<()> {
    use engram_protocol::encoding::RowEncoding;
    let (file, json) = (a.file.as_path(), a.json);
    let (m, layout) = TableFile::read_meta(file)?;
    let node_reads = m.encoding == RowEncoding::V41;
    let scale = m.tensor_scale.map(f32::from_bits);
    if json {
        let v = serde_json::json!({
            "path": file.display().to_string(),
            "format_version": engram_protocol::etab::FORMAT_VERSION,
            "encoding": m.encoding.name(),
            "row_bytes": layout.row_bytes,
            "rows_per_page": layout.rows_per_page,
            "tensor_scale": scale,
            "served": true,
            "node_reads": node_reads,
            "layer": m.layer,
            "rows": m.rows,
            "pages": layout.pages,
            "data_start": layout.data_start,
            "file_len": layout.file_len(),
            "page_checksums": layout.page_sums.then_some("xxh3_64"),
            "digest": m.digest.to_hex(),
            "digest_prefix": format!("{:016x}", m.digest.prefix()),
            "hash_preset": m.hash_preset,
            "hash_base": m.hash_base,
            "source": m.source,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("file:        {}", file.display());
        println!(
            "format:      {} v{} ({})",
            engram_protocol::etab::FORMAT_NAME,
            engram_protocol::etab::FORMAT_VERSION,
            m.encoding.name()
        );
        if let Some(s) = scale {
            println!("scale:       {s} (one per table)");
        }
        if !node_reads {
            println!(
                "served:      by donors, to clients of protocol version 2; the node reads V4.1's 264-byte rows only (docs/models.md)"
            );
        }
        println!("layer:       {}", m.layer);
        println!(
            "rows:        {} ({:.2} GiB of rows, {} bytes each)",
            m.rows,
            (m.rows * layout.row_bytes) as f64 / (1u64 << 30) as f64,
            layout.row_bytes
        );
        println!(
            "pages:       {} x 4096 bytes from offset {}, {} rows each",
            layout.pages, layout.data_start, layout.rows_per_page
        );
        println!(
            "checksums:   {}",
            if layout.page_sums {
                "XXH3-64 per page (page_xxh3)"
            } else {
                "none (add with `memory-donor verify --write-page-checksums`)"
            }
        );
        println!("digest:      {}", m.digest);
        println!(
            "hashing:     preset {} base {}",
            m.hash_preset.as_deref().unwrap_or("-"),
            m.hash_base.map_or("-".into(), |b| b.to_string())
        );
        println!("source:      {}", m.source);
    }
    Ok(())
}
