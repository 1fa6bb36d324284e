//! `engram-bench layout`: what a planar table (`host_layout = "planar"`)
//! costs the donor's network gather against a packed one. One synthetic
//! table file is loaded twice into memfds, packed and planar, as a donor
//! loads them; then lookups of random rows are gathered from each into an
//! answer buffer exactly as the donor's handler does (prefetch ahead, then
//! copy each row: one 264-byte copy packed, a 256- and an 8-byte copy
//! planar), the two layouts taking turns lookup by lookup. Medians per
//! lookup, and planar / packed.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use engram_protocol::ROW_BYTES;
use engram_protocol::synthetic::SplitMix64;
use engram_store::generate::{GenSpec, generate};
use engram_store::resident::{Backing, LoadOptions, MlockMode, ResidentTable, RowLayout};
use serde::Serialize;

use crate::stats::median;

/// Arguments of `engram-bench layout`.
#[derive(clap::Args, Debug)]
pub struct LayoutArgs {
    /// Rows in the table (the default, 8,000,000, is 2.1 GB: far past
    /// every cache, as a real table is).
    #[arg(long, default_value_t = 8_000_000)]
    rows: u64,
    /// Timed lookups per size and layout.
    #[arg(long, default_value_t = 20_000)]
    lookups: usize,
    /// Where the table file is written (removed after).
    #[arg(long, default_value = "/var/tmp")]
    dir: std::path::PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The donor's prefetch distance (its handler's `PREFETCH_AHEAD`).
const PREFETCH_AHEAD: usize = 64;

/// One lookup size: medians in nanoseconds per lookup.
#[derive(Debug, Serialize)]
struct Point {
    rows: usize,
    packed_ns: f64,
    planar_ns: f64,
    /// planar / packed.
    ratio: f64,
}

/// Run the benchmark.
pub fn run(args: &LayoutArgs) -> Result<()> {
    if !(1_000..=1_000_000_000).contains(&args.rows) {
        bail!("--rows must be 1,000 to 1,000,000,000");
    }
    if args.lookups == 0 || args.lookups > 10_000_000 {
        bail!("--lookups must be 1 to 10,000,000");
    }
    let dir = tempfile::tempdir_in(&args.dir)
        .with_context(|| format!("a scratch directory in {}", args.dir.display()))?;
    let path = dir.path().join("layout.etab");
    let spec = GenSpec {
        layer: 1,
        rows: args.rows,
        seed: 11,
        hash_preset: None,
        hash_base: None,
        threads: engram_store::fill::cores(),
    };
    eprintln!("writing a {}-row table ...", args.rows);
    generate(&path, &spec, None).context("generating the table")?;
    let load = |planar: bool| -> Result<ResidentTable> {
        let opts = LoadOptions {
            backing: Backing::Memfd,
            mlock: MlockMode::Off,
            trust_digest: true,
            planar,
            ..LoadOptions::default()
        };
        let (t, _) = ResidentTable::load_with(Some(1), &path, &opts, |_| None)?;
        t.populate_range(0..t.memory_bytes().len());
        Ok(t)
    };
    let packed = load(false)?;
    let planar = load(true)?;
    if !matches!(planar.memory().layout(), RowLayout::Planar { .. }) {
        bail!("the planar load is not planar");
    }
    drop(dir);
    let pages = packed.kept().map_or("anonymous", |k| k.pages.name());
    let mut points = Vec::new();
    for n in [24usize, 48, 1024] {
        points.push(measure(&packed, &planar, n, args.lookups));
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&points)?);
        return Ok(());
    }
    println!(
        "gathering random rows into an answer, {} rows ({pages} pages), medians of {} lookups",
        args.rows, args.lookups
    );
    println!("rows   packed ns   planar ns   planar/packed");
    for p in &points {
        println!(
            "{:>4} {:>11.0} {:>11.0} {:>15.3}",
            p.rows, p.packed_ns, p.planar_ns, p.ratio
        );
    }
    Ok(())
}

/// Lookups of `n` random rows from each table in turn; checks that both
/// give the same bytes.
fn measure(packed: &ResidentTable, planar: &ResidentTable, n: usize, lookups: usize) -> Point {
    let mut rng = SplitMix64::new(n as u64);
    let mut out = [
        Vec::with_capacity(n * ROW_BYTES),
        Vec::with_capacity(n * ROW_BYTES),
    ];
    let mut ns = [Vec::with_capacity(lookups), Vec::with_capacity(lookups)];
    let tables = [packed, planar];
    let mut rows = vec![0u64; n];
    for i in 0..lookups {
        rows.iter_mut().for_each(|r| *r = rng.below(packed.rows));
        for k in [i % 2, 1 - i % 2] {
            out[k].clear();
            let t = Instant::now();
            gather(tables[k], &rows, &mut out[k]);
            ns[k].push(t.elapsed().as_nanos() as f64);
        }
        assert_eq!(out[0], out[1], "the layouts disagree");
    }
    let [a, b] = ns;
    let packed_ns = median(a);
    let planar_ns = median(b);
    Point {
        rows: n,
        packed_ns,
        planar_ns,
        ratio: planar_ns / packed_ns.max(1.0),
    }
}

/// The donor handler's gather: prefetch [`PREFETCH_AHEAD`] rows ahead,
/// append each row.
fn gather(t: &ResidentTable, rows: &[u64], out: &mut Vec<u8>) {
    let mut ahead = rows.iter().skip(PREFETCH_AHEAD);
    for &r in rows.iter().take(PREFETCH_AHEAD) {
        t.prefetch(r);
    }
    for &r in rows {
        if let Some(&a) = ahead.next() {
            t.prefetch(a);
        }
        if let Some(row) = t.row(r) {
            row.extend_into(out);
        }
    }
}
