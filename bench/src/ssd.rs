//! `engram-bench ssd`: three ways to read 24 random rows from an SSD copy,
//! measured in one run on one file.
//!
//! - (a) mmap + memcpy per row, page cache dropped first: the unoptimized
//!   path (every miss is a page fault, one at a time);
//! - (b) seed 000's scheme: 4 readers, each reading its 6 rows one after
//!   another with pread (O_DIRECT): the project's pread pool with 4 threads;
//! - (c) the project's SSD source: io_uring, O_DIRECT, all 24 reads in
//!   flight with one submit.
//!
//! The pread pool with 24 threads (the fallback where io_uring is
//! unavailable) is reported too. Series are interleaved per round; figures
//! are medians over rounds.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use cluster_config::SsdIo;
use engram_protocol::ROW_BYTES;
use engram_protocol::etab::{TableLayout, TableMeta};
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_store::table_file::TableFile;
use inference_node::source::ssd::{SsdOptions, SsdReader};

use crate::contention::{self, ContentionSpec};
use crate::stats::{Latency, Summary, median_summary, print_table};

/// Arguments of `engram-bench ssd`.
#[derive(Debug, Args)]
pub struct SsdArgs {
    /// The table file to read (generated there if missing).
    #[arg(long, default_value = "target/bench-ssd/ssd.etab")]
    file: PathBuf,
    /// Rows of a generated table (default: 4 GiB of rows).
    #[arg(long, default_value_t = 16_270_000)]
    rows: u64,
    /// Random 24-row batches per series per round.
    #[arg(long, default_value_t = 2_000)]
    batches: usize,
    /// Rounds (figures are medians over them).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Read beside a busy drive instead: idle, then beside a sequential
    /// reader and beside a writer with fsync, at each I/O priority.
    #[arg(long)]
    contention: bool,
    /// With --contention: seconds per series.
    #[arg(long, default_value_t = 8.0)]
    seconds: f64,
}

const SEED: u64 = 0x55D;

fn ensure_file(args: &SsdArgs) -> Result<()> {
    crate::stats::ensure_table(&args.file, args.rows, SEED)
}

/// Drop the file's pages from the page cache (written back first: dirty
/// pages cannot be dropped).
fn drop_cache(file: &std::fs::File) {
    let _ = file.sync_all();
    // SAFETY: plain syscall on a valid descriptor; advisory.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

struct Mmapped {
    map: memmap2::Mmap,
    layout: TableLayout,
}

impl Mmapped {
    fn read(&self, rows: &[u64], out: &mut [u8]) -> Result<()> {
        for (&r, o) in rows.iter().zip(out.chunks_exact_mut(ROW_BYTES)) {
            let at = self.layout.row_offset(r).context("row in range")? as usize;
            o.copy_from_slice(self.map.get(at..at + ROW_BYTES).context("row in file")?);
        }
        Ok(())
    }
}

/// `--contention`: the batch read beside a busy drive, at each priority.
fn run_contention(args: &SsdArgs) -> Result<()> {
    let spec = ContentionSpec {
        table: args.file.clone(),
        seconds: args.seconds,
        max_batches: args.batches as u64 * args.rounds as u64,
    };
    contention::check(&spec)?;
    let series = contention::run_series(&spec)?;
    if args.json {
        let target = |load| {
            contention::ratios(&series, load).map(|(vs_idle, vs_be)| {
                serde_json::json!({
                    "realtime_p99_vs_idle": vs_idle,
                    "best_effort_p99_vs_realtime": vs_be,
                    "met": vs_idle <= contention::TARGET_VS_IDLE
                        && vs_be >= contention::TARGET_VS_BEST_EFFORT,
                })
            })
        };
        let v = serde_json::json!({
            "benchmark": "ssd-contention",
            "file": args.file,
            "seconds_per_series": args.seconds,
            "series": series,
            "sequential_reader": target(contention::Load::Reader),
            "writer": target(contention::Load::Writer),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        contention::print(&spec, &series);
    }
    Ok(())
}

/// Run the benchmark.
pub fn run(args: &SsdArgs) -> Result<()> {
    ensure_file(args)?;
    if args.contention {
        return run_contention(args);
    }
    let table = TableFile::open(&args.file)?;
    let meta = table.meta.clone();
    if meta.rows < 1_000_000 {
        bail!(
            "the table is too small for an SSD benchmark ({} rows)",
            meta.rows
        );
    }
    let mut readers = Readers::open(args, table.layout)?;
    if !readers.uring.is_direct() {
        eprintln!("warning: this file system refuses O_DIRECT; reads go through the page cache");
    }
    let mut rounds: Vec<[Summary; 4]> = Vec::new();
    for round in 0..args.rounds {
        rounds.push(readers.round(args, &meta, round)?);
        eprintln!("round {} of {} done", round + 1, args.rounds);
    }
    let med: Vec<Summary> = (0..4)
        .map(|s| median_summary(&rounds.iter().map(|r| r[s]).collect::<Vec<_>>()))
        .collect();
    let direct = readers.uring.is_direct();
    if args.json {
        let (r50, r99, r999) = ratio(&med[2], &med[1]);
        let series: Vec<_> = NAMES
            .iter()
            .zip(&med)
            .map(|(n, s)| serde_json::json!({"series": n, "batch": s}))
            .collect();
        let v = serde_json::json!({
            "benchmark": "ssd",
            "file": args.file,
            "rows": meta.rows,
            "batches_per_round": args.batches,
            "rounds": args.rounds,
            "direct": direct,
            "series": series,
            "uring_over_seq4": {"p50": r50, "p99": r99, "p999": r999},
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print_text(args, &meta, &med, direct)
}

/// The series' names, in the order a round measures them.
const NAMES: [&str; 4] = [
    "(a) mmap + memcpy",
    "(b) 4 readers x 6 pread",
    "(c) io_uring, 24 in flight",
    "pread pool, 24 threads",
];

/// p50, p99 and p99.9 of `a` over `b`.
fn ratio(a: &Summary, b: &Summary) -> (f64, f64, f64) {
    (
        a.p50_us / b.p50_us,
        a.p99_us / b.p99_us,
        a.p999_us / b.p999_us,
    )
}

/// The four ways of reading a batch, each open on the file.
struct Readers {
    file: PathBuf,
    layout: TableLayout,
    /// Mapped anew each round after the cache is dropped: pages still
    /// mapped would survive the drop.
    mm: Option<Mmapped>,
    seq4: SsdReader,
    uring: SsdReader,
    pool24: SsdReader,
    out: Vec<u8>,
}

impl Readers {
    fn open(args: &SsdArgs, layout: TableLayout) -> Result<Self> {
        let open = |io, threads| {
            SsdReader::open(
                &args.file,
                None,
                true,
                SsdOptions {
                    io,
                    direct: true,
                    pread_threads: threads,
                    ..SsdOptions::default()
                },
            )
        };
        Ok(Self {
            file: args.file.clone(),
            layout,
            mm: None,
            seq4: open(SsdIo::Pread, 4)?,
            uring: open(SsdIo::Uring, 0)?,
            pool24: open(SsdIo::Pread, 24)?,
            out: vec![0u8; 24 * ROW_BYTES],
        })
    }

    fn map_cold_at(path: &Path, layout: TableLayout) -> Result<Mmapped> {
        let file = std::fs::File::open(path)?;
        drop_cache(&file);
        // SAFETY: the file is not modified while mapped (the benchmark owns it).
        let map = unsafe { memmap2::Mmap::map(&file)? };
        Ok(Mmapped { map, layout })
    }

    /// One round: `--batches` random 24-row batches through each way,
    /// every 64th checked against the generator (a synthetic table).
    fn round(&mut self, args: &SsdArgs, meta: &TableMeta, round: usize) -> Result<[Summary; 4]> {
        let seed: Option<u64> = meta
            .source
            .strip_prefix("synthetic seed=")
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok());
        let out = &mut self.out;
        let mut lat: [Latency; 4] = Default::default();
        for (s, l) in lat.iter_mut().enumerate() {
            let mut rng = SplitMix64::new(1000 * round as u64 + s as u64);
            if s == 0 {
                drop(self.mm.take());
                self.mm = Some(Self::map_cold_at(&self.file, self.layout)?);
            }
            for b in 0..args.batches {
                let rows: Vec<u64> = (0..24).map(|_| rng.below(meta.rows)).collect();
                let t = Instant::now();
                match s {
                    0 => self.mm.as_ref().context("mapped")?.read(&rows, out)?,
                    1 => self.seq4.read(&rows, out)?,
                    2 => self.uring.read(&rows, out)?,
                    _ => self.pool24.read(&rows, out)?,
                }
                l.record(t.elapsed());
                if b % 64 == 0
                    && let Some(seed) = seed
                    && let Some(bad) = first_mismatch(seed, meta.layer, &rows, out)
                {
                    bail!("{}: row {bad} is not the generator's", NAMES[s]);
                }
            }
        }
        Ok(lat.map(|l| l.summary()))
    }
}

fn print_text(args: &SsdArgs, meta: &TableMeta, med: &[Summary], direct: bool) -> Result<()> {
    let (r50, r99, r999) = ratio(&med[2], &med[1]);
    println!(
        "24-row batches from {} ({} rows, {:.2} GiB), {} batches x {} rounds, medians; O_DIRECT: {}",
        args.file.display(),
        meta.rows,
        std::fs::metadata(&args.file)?.len() as f64 / (1u64 << 30) as f64,
        args.batches,
        args.rounds,
        direct
    );
    let rows: Vec<Vec<String>> = NAMES
        .iter()
        .zip(med)
        .map(|(n, s)| {
            vec![
                n.to_string(),
                format!("{:.1}", s.p50_us),
                format!("{:.1}", s.p99_us),
                format!("{:.1}", s.p999_us),
            ]
        })
        .collect();
    print_table(&["series", "p50 us", "p99 us", "p99.9 us"], &rows);
    println!();
    println!(
        "(c) / (b): p50 {r50:.2}x, p99 {r99:.2}x, p99.9 {r999:.2}x  (target: p50 and p99 <= 0.6x)"
    );
    let (a50, a99, _) = ratio(&med[2], &med[0]);
    println!("(c) / (a): p50 {a50:.2}x, p99 {a99:.2}x");
    Ok(())
}
