//! `inference-node fetch`: rows from one donor by hand.

use std::fs::File;
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use engram_protocol::encoding::RowEncoding;
use engram_protocol::etab::{TableLayout, read_header};
use engram_protocol::row::{ROW_VALUES, bf16_bits_to_f32, dequantize_row_f32};
use engram_protocol::{ErrorCode, ROW_BYTES, RowBytes, TableDigest};
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
    /// Write the raw rows (264 bytes each for V4.1's), in the order asked,
    /// to this file.
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
    Ok((f, meta.digest, layout))
}

/// Connect saying protocol version 2 (tables of any encoding), or 1 to a
/// donor of an earlier build that refuses version 2.
async fn connect(donor: SocketAddr, opts: &mut ClientOptions) -> Result<DonorClient> {
    opts.version = engram_protocol::PROTOCOL_VERSION;
    match DonorClient::connect(donor, opts).await {
        Err(inference_node::ClientError::Refused {
            code: ErrorCode::UnsupportedVersion,
            ..
        }) => {
            opts.version = engram_protocol::PROTOCOL_VERSION_V1;
            Ok(DonorClient::connect(donor, opts).await?)
        }
        other => Ok(other?),
    }
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
    let client = connect(args.donor, &mut opts).await?;
    let info = client
        .tables()
        .iter()
        .find(|t| t.table_id == args.table_id)
        .copied()
        .context("the donor does not list the table")?;
    let size = info.row_bytes();
    let mut data = vec![0u8; rows.len() * size];
    // At most max_rows rows and max_rows x 264 bytes a lookup (PROTOCOL.md 3.4).
    let max = client.max_rows() as usize;
    let chunk = max.min(max * ROW_BYTES / size).max(1);
    for (ids, out) in rows.chunks(chunk).zip(data.chunks_mut(chunk * size)) {
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
        let mut want = vec![0u8; size];
        for (id, got) in rows.iter().zip(data.chunks_exact(size)) {
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
    let scale = info.tensor_scale.map_or(1.0, f32::from_bits);
    let mut bf16 = vec![0u16; info.encoding.values()];
    for (id, row) in rows.iter().zip(data.chunks_exact(size)) {
        if args.hex {
            let hex: String = row.iter().map(|b| format!("{b:02x}")).collect();
            writeln!(so, "{id} {hex}")?;
            continue;
        }
        if info.encoding != RowEncoding::V41 {
            match info.encoding.dequantize_bf16(row, scale, &mut bf16) {
                Ok(()) => {
                    let vals: Vec<f32> =
                        bf16.iter().take(8).map(|&b| bf16_bits_to_f32(b)).collect();
                    writeln!(so, "row {id}: {vals:?} ... ({})", info.encoding.name())?;
                }
                Err(e) => writeln!(so, "row {id}: corrupt: {e}")?,
            }
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
