//! `inference-node fetch`: rows from one donor by hand.

use std::fs::File;
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use engram_protocol::etab::{TableLayout, read_header};
use engram_protocol::row::{ROW_VALUES, dequantize_row_f32};
use engram_protocol::{ROW_BYTES, RowBytes, TableDigest};
use inference_node::rowlist::parse_rows;
use inference_node::{ClientOptions, DonorClient, Request};

/// Most rows one `fetch` takes.
const MAX_FETCH_ROWS: usize = 1_000_000;

#[derive(clap::Args)]
pub struct FetchArgs {
    /// Donor data-plane address.
    #[arg(long)]
    donor: SocketAddr,
    /// Pin the digest of this local table file (and allow --verify).
    #[arg(long, conflicts_with = "digest", required_unless_present = "digest")]
    table: Option<PathBuf>,
    /// Pin this digest (64 hex digits).
    #[arg(long)]
    digest: Option<TableDigest>,
    /// Table id on the donor.
    #[arg(long)]
    table_id: u32,
    /// Rows: `1,2,3`, ranges `10-20`, or both.
    #[arg(long)]
    rows: String,
    /// Print each row as hex.
    #[arg(long, conflicts_with = "out")]
    hex: bool,
    /// Write the raw 264-byte rows, in the order asked, to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// With --table: compare every fetched row with the local file.
    #[arg(long, requires = "table")]
    verify: bool,
    /// Name sent in Hello.
    #[arg(long, default_value = "inference-node-fetch")]
    node_name: String,
    /// File holding the rack credential.
    #[arg(long)]
    credential_file: Option<PathBuf>,
    /// Give up after this long, connecting or per lookup.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
}

fn open_table(path: &Path) -> Result<(File, TableDigest, TableLayout)> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = f.metadata()?.len();
    let (meta, layout) = read_header(len, |buf, off| f.read_exact_at(buf, off))
        .with_context(|| format!("{}", path.display()))?;
    if meta.encoding != engram_protocol::encoding::RowEncoding::V41 {
        bail!(
            "{}: its rows are {}: the node reads V4.1's 264-byte rows only (docs/models.md)",
            path.display(),
            meta.encoding.name()
        );
    }
    Ok((f, meta.digest, layout))
}

pub async fn fetch(args: FetchArgs) -> Result<()> {
    let rows = parse_rows(&args.rows, MAX_FETCH_ROWS).map_err(anyhow::Error::msg)?;
    let local = args.table.as_deref().map(open_table).transpose()?;
    let digest = match (&local, args.digest) {
        (Some((_, d, _)), _) => *d,
        (None, Some(d)) => d,
        (None, None) => bail!("give --table FILE or --digest HEX"),
    };
    let timeout = Duration::from_millis(args.timeout_ms);
    let mut opts = ClientOptions::new(&args.node_name, vec![(args.table_id, digest)]);
    opts.connect_timeout = timeout;
    if let Some(f) = &args.credential_file {
        let c = cluster_config::read_credential(f)?;
        opts.credential = Some(c);
    }
    let client = DonorClient::connect(args.donor, &opts).await?;
    let mut data = vec![0u8; rows.len() * ROW_BYTES];
    let chunk = client.max_rows() as usize;
    for (ids, out) in rows.chunks(chunk).zip(data.chunks_mut(chunk * ROW_BYTES)) {
        let req = [Request {
            table: args.table_id,
            rows: ids,
        }];
        tokio::time::timeout(timeout, client.lookup(&req, out))
            .await
            .map_err(|_| anyhow::anyhow!("lookup timed out after {timeout:?}"))??;
    }
    if args.verify
        && let Some((file, _, layout)) = &local
    {
        let mut want = [0u8; ROW_BYTES];
        for (id, got) in rows.iter().zip(data.chunks_exact(ROW_BYTES)) {
            let off = layout
                .row_offset(*id)
                .context("row out of the local table's range")?;
            file.read_exact_at(&mut want, off)?;
            if got != want {
                bail!(
                    "row {id} differs from {}",
                    args.table.as_deref().unwrap_or(Path::new("")).display()
                );
            }
        }
        eprintln!("verified {} rows against the local table", rows.len());
    }
    if let Some(path) = &args.out {
        std::fs::write(path, &data).with_context(|| format!("writing {}", path.display()))?;
        eprintln!(
            "wrote {} rows ({} bytes) to {}",
            rows.len(),
            data.len(),
            path.display()
        );
        return Ok(());
    }
    let mut so = std::io::stdout().lock();
    for (id, row) in rows.iter().zip(data.chunks_exact(ROW_BYTES)) {
        if args.hex {
            let hex: String = row.iter().map(|b| format!("{b:02x}")).collect();
            writeln!(so, "{id} {hex}")?;
            continue;
        }
        let mut vals = [0f32; ROW_VALUES];
        let row: &RowBytes = row.try_into()?;
        match dequantize_row_f32(row, &mut vals) {
            Ok(()) => writeln!(so, "row {id}: {:?} ...", &vals[..8])?,
            Err(e) => writeln!(so, "row {id}: corrupt: {e}")?,
        }
    }
    Ok(())
}
