//! `engram-bench demo`: the README's first command. Generates a small
//! table, starts a real donor process on loopback, fetches thousands of
//! random rows through the client in 24-row lookups (one per table per
//! token, as the model asks), checks every byte against the generator,
//! shows the version check refusing a wrong digest, prints latencies, and
//! drains the donor with SIGTERM. It leaves no process behind.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use engram_protocol::ROW_BYTES;
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use inference_node::{ClientError, ClientOptions, DonorClient, Request};
use integration_tests::{DonorProcess, gen_table};

use crate::stats::Latency;

/// Settings of the demo.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Rows in the demo table.
    #[arg(long, default_value_t = 500_000)]
    rows: u64,
    /// 24-row lookups to make.
    #[arg(long, default_value_t = 2_000)]
    lookups: usize,
    /// Where to put the table (default: a temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
}

const SEED: u64 = 42;

/// Run the demo.
pub fn run(args: &DemoArgs) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = args.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(&dir)?;
    let t = Instant::now();
    let (path, digest) = gen_table(&dir, "layer1.etab", 1, args.rows, SEED)?;
    let mb = (args.rows * ROW_BYTES as u64) as f64 / 1e6;
    println!(
        "1. generated {} ({} rows, {mb:.0} MB) in {:.1?}",
        path.display(),
        args.rows,
        t.elapsed()
    );
    println!("   digest (the table's version): {digest}");

    let mut donor = DonorProcess::start(&[
        "--table",
        &format!("1={}", path.display()),
        "--listen",
        "127.0.0.1:0",
        "--name",
        "demo-donor",
    ])?;
    println!(
        "2. memory-donor loaded it resident, verified its digest, and listens on {}",
        donor.addr
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (lat, rows_checked) = rt.block_on(async {
        let client = DonorClient::connect(
            donor.addr,
            &ClientOptions::new("demo-node", vec![(1, digest)]),
        )
        .await
        .context("connecting to the donor")?;
        let mut rng = SplitMix64::new(1);
        let mut rows = vec![0u64; 24];
        let mut out = vec![0u8; 24 * ROW_BYTES];
        let mut lat = Latency::default();
        let mut checked = 0u64;
        for _ in 0..args.lookups {
            rows.iter_mut().for_each(|r| *r = rng.below(args.rows));
            let t = Instant::now();
            client
                .lookup(
                    &[Request {
                        table: 1,
                        rows: &rows,
                    }],
                    &mut out,
                )
                .await?;
            lat.record(t.elapsed());
            if let Some(r) = first_mismatch(SEED, 1, &rows, &out) {
                bail!("row {r} differs from the generator");
            }
            checked += rows.len() as u64;
        }
        // A client pinned to another version is refused before any row moves.
        let mut wrong = digest;
        wrong.0[0] ^= 0xFF;
        match DonorClient::connect(
            donor.addr,
            &ClientOptions::new("demo-node", vec![(1, wrong)]),
        )
        .await
        {
            Err(ClientError::DigestMismatch { .. }) => {}
            other => bail!("a wrong pinned digest was not refused: {other:?}"),
        }
        Ok::<_, anyhow::Error>((lat, checked))
    })?;
    let s = lat.summary();
    println!(
        "3. fetched {} lookups x 24 random rows = {rows_checked} rows; every byte matches the generator",
        lat.len()
    );
    println!(
        "   lookup latency (one 24-row message, loopback TCP): p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us, max {:.1} us",
        s.p50_us, s.p99_us, s.p999_us, s.max_us
    );
    println!("   a client pinned to another digest was refused (the version check)");
    donor.signal(libc::SIGTERM);
    match donor.wait(Duration::from_secs(10)) {
        Some(st) if st.success() => {
            println!("4. SIGTERM: the donor said Goodbye, drained and exited cleanly")
        }
        other => bail!(
            "the donor did not exit cleanly ({other:?}); its log:\n{}",
            donor.log()
        ),
    }
    Ok(())
}
