//! `engram-bench load`: how long a donor takes to serve a table, against
//! the floors of the same work measured in the same run on the same file.
//!
//! Series (interleaved per round; figures are medians over rounds):
//!
//! - **hash floor**: BLAKE3 of the whole file on every core from the page
//!   cache (what `b3sum` does): the least a verified load can cost;
//! - **read floor, warm**: the file read on every core from the page
//!   cache into reused buffers (`cat` on all cores);
//! - **read floor, cold**: the same with the file dropped from the page
//!   cache first, so it comes from the disk;
//! - **donor, verified, warm / cold**: `memory-donor serve` started until
//!   its `ready` line, digest recomputed, the table served from the file's
//!   pages (the default: nothing copied);
//! - **donor, --trust-digest, warm**;
//! - **donor, one load thread**: the verified start on one thread, for
//!   scale;
//! - **memory floor**: fresh anonymous memory of the table's size written
//!   on every core (what placing rows costs before any row is read);
//! - **donor restart from the fd store**: a donor under a fake systemd
//!   killed with SIGKILL and started again, the file's mark handed back
//!   and its pages served again unread (also with `--copy-tables`, where
//!   the copy itself is handed back);
//! - **donor, `--copy-tables`** (verified warm, `--trust-digest` warm,
//!   verified cold): the table copied into the donor's own memory, as a
//!   donor with RDMA, a host socket or a NUMA node does;
//! - **donor, `--copy-tables`, verified, warm, memory the host took
//!   back**: after a pause of 4 s, so that on a virtual machine whose host
//!   takes freed memory back the copy pays for it (every other donor
//!   series first touches and frees the table's size of memory, see
//!   [`touch_memory`]);
//! - **`memory-donor verify`, cold**, on every core and on one thread
//!   (`--threads 1`): what an operator runs on a table file, and what a
//!   node runs on its SSD copy at start.
//!
//! Targets (the issue's): verified warm within 1.5x of the hash floor,
//! `--trust-digest` within 2x of the warm read, verified cold within 1.2x
//! of the cold read, and a restart from the fd store under 1 s; each is
//! given for the default and for `--copy-tables`, whose trusted start is
//! held against the read and memory floors together (no copy beats both).

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use engram_store::fill;
use rack_harness::{NotifySocket, Process, bin};

use crate::plot::{Bar, Bars};
use crate::stats::{median, print_table};

/// Arguments of `engram-bench load`.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// The table file (generated there if missing).
    #[arg(long, default_value = "target/bench-load/load.etab")]
    file: PathBuf,
    /// Rows of a generated table (default: 1.09 GB of rows).
    #[arg(long, default_value_t = 4_130_000)]
    rows: u64,
    /// Rounds (figures are medians over them).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Where the chart goes (`load.svg`, `load.png`).
    #[arg(long, default_value = "target/bench-load")]
    out: PathBuf,
}

/// One series: its name, whether it is a floor, and its seconds per round.
struct Series {
    name: &'static str,
    floor: bool,
    secs: Vec<f64>,
}

const SEED: u64 = 0x10AD;

/// The flag that makes a donor copy its tables (the default serves the
/// files' pages).
const COPY: &str = "--copy-tables";

fn ensure_file(args: &LoadArgs) -> Result<()> {
    crate::stats::ensure_table(&args.file, args.rows, SEED)
}

/// Drop the file from the page cache (written back first).
fn drop_cache(path: &Path) -> Result<()> {
    let f = std::fs::File::open(path)?;
    let _ = f.sync_all();
    // SAFETY: an advisory call on a valid descriptor.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

/// Read the whole file on every core into per-thread 4 MiB buffers.
fn read_all(path: &Path) -> Result<Duration> {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    const CHUNK: u64 = 4 << 20;
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let next = AtomicU64::new(0);
    let began = Instant::now();
    let failed = std::thread::scope(|s| {
        let workers: Vec<_> = (0..fill::cores())
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    let mut buf = vec![0u8; CHUNK as usize];
                    loop {
                        let at = next.fetch_add(CHUNK, Ordering::Relaxed);
                        if at >= len {
                            return Ok(());
                        }
                        let n = CHUNK.min(len - at) as usize;
                        f.read_exact_at(&mut buf[..n], at)?;
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .filter_map(|w| w.join().ok())
            .find_map(Result::err)
    });
    if let Some(e) = failed {
        return Err(e).context("reading the table file");
    }
    Ok(began.elapsed())
}

/// Write `bytes` of fresh anonymous memory on every core (huge pages
/// asked for, as the donor does) and free it; returns how long the writes
/// took. On a virtual machine whose host takes freed memory back (free
/// page reporting), memory first touched after a pause costs far more
/// (seen here: 1.0 to 2.4 s a GiB instead of 0.15 s); touching it right
/// before a donor starts gives the donor memory the host has backed, so
/// the series measure the donor, not the hypervisor.
fn touch_memory(bytes: u64) -> Result<Duration> {
    let len = usize::try_from(bytes)?;
    let mut map = memmap2::MmapMut::map_anon(len)?;
    let _ = map.advise(memmap2::Advice::HugePage);
    let threads = fill::cores();
    let per = len.div_ceil(threads);
    let began = Instant::now();
    std::thread::scope(|s| {
        for part in map.chunks_mut(per) {
            s.spawn(move || part.fill(1));
        }
    });
    Ok(began.elapsed())
}

/// BLAKE3 of the whole file on every core, from the page cache.
fn hash_all(path: &Path) -> Result<Duration> {
    let f = std::fs::File::open(path)?;
    // SAFETY: the bench's own file, not modified while mapped.
    let map = unsafe { memmap2::Mmap::map(&f) }?;
    let began = Instant::now();
    let d = fill::hash_parallel(&map, fill::cores());
    let took = began.elapsed();
    // Used, so the hashing is not optimized away.
    if d.0 == [0; 32] {
        eprintln!("(an all-zero digest)");
    }
    Ok(took)
}

/// Start a donor on the file with `extra` flags (under `notify` when
/// given) and time it until its ready line.
fn start_donor(
    file: &Path,
    extra: &[&str],
    notify: Option<&NotifySocket>,
) -> Result<(Process, Duration)> {
    let table = format!("1={}", file.display());
    let mut args = vec!["--table", &table, "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let began = Instant::now();
    let p = match notify {
        Some(n) => Process::launch_donor_under(n, &args)?,
        None => {
            let mut cmd = std::process::Command::new(bin("memory-donor"));
            cmd.arg("serve").args(&args).env("RUST_LOG", "info");
            Process::spawn(cmd)?
        }
    };
    p.wait_line(Duration::from_secs(600), |l| {
        l.contains("ready listen=").then_some(())
    })
    .with_context(|| format!("the donor did not become ready:\n{}", p.log()))?;
    Ok((p, began.elapsed()))
}

/// `memory-donor verify` of the file with `extra` flags, timed to its exit.
fn verify(file: &Path, extra: &[&str]) -> Result<f64> {
    let began = Instant::now();
    let out = std::process::Command::new(bin("memory-donor"))
        .arg("verify")
        .args(extra)
        .arg(file)
        .output()
        .context("running memory-donor verify")?;
    let took = began.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!(
            "memory-donor verify failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(took)
}

/// A donor start, timed; the donor is stopped after.
fn donor(file: &Path, extra: &[&str]) -> Result<f64> {
    let (p, took) = start_donor(file, extra, None)?;
    drop(p);
    Ok(took.as_secs_f64())
}

/// A donor under a fake systemd, killed with SIGKILL and started again:
/// the restart, timed.
fn restart_from_store(file: &Path, dir: &Path, extra: &[&str]) -> Result<f64> {
    let notify = NotifySocket::bind(dir)?;
    let (mut first, _) = start_donor(file, extra, Some(&notify))?;
    let end = Instant::now() + Duration::from_secs(10);
    while notify.stored().is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    first.signal(libc::SIGKILL);
    first.wait(Duration::from_secs(10));
    let (second, took) = start_donor(file, extra, Some(&notify))?;
    if !second.log().contains("table adopted from the fd store") {
        bail!(
            "the restarted donor did not adopt its table:\n{}",
            second.log()
        );
    }
    drop(second);
    let _ = std::fs::remove_file(&notify.path);
    Ok(took.as_secs_f64())
}

/// Run the benchmark.
pub fn run(args: &LoadArgs) -> Result<()> {
    crate::rack::kill_children_on_interrupt()?;
    ensure_file(args)?;
    std::fs::create_dir_all(&args.out)?;
    let file = std::fs::canonicalize(&args.file)?;
    let bytes = std::fs::metadata(&file)?.len();
    let mut series: Vec<Series> = SERIES
        .iter()
        .map(|&(name, floor)| Series {
            name,
            floor,
            secs: vec![],
        })
        .collect();
    let scratch = tempfile::tempdir()?;
    for round in 0..args.rounds.max(1) {
        eprintln!("round {} of {}", round + 1, args.rounds.max(1));
        measure_round(&mut series, &file, bytes, scratch.path())?;
    }
    let med: Vec<f64> = series.iter().map(|s| median(s.secs.clone())).collect();
    let (targets, figures) = targets_and_figures(&med);
    let chart = Bars {
        title: format!(
            "engram-bench load: {:.2} GB table file, {} cores (medians of {} rounds)",
            bytes as f64 / 1e9,
            fill::cores(),
            args.rounds.max(1)
        ),
        unit: "seconds".into(),
        bars: series
            .iter()
            .zip(&med)
            .map(|(s, m)| Bar {
                label: s.name.into(),
                value: *m,
                floor: s.floor,
            })
            .collect(),
    };
    let (svg, png) = chart.write_both(&args.out.join("load"))?;
    let out = Outcome {
        file: &file,
        bytes,
        rounds: args.rounds.max(1),
        series: &series,
        med: &med,
        targets: &targets,
        figures: &figures,
        charts: [&svg, &png],
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out.json())?);
    } else {
        out.print();
    }
    Ok(())
}

/// What a run measured, for its report.
struct Outcome<'a> {
    file: &'a Path,
    bytes: u64,
    rounds: usize,
    series: &'a [Series],
    med: &'a [f64],
    targets: &'a [Target],
    figures: &'a [(&'static str, f64)],
    charts: [&'a Path; 2],
}

impl Outcome<'_> {
    fn json(&self) -> serde_json::Value {
        let [svg, png] = self.charts;
        serde_json::json!({
            "benchmark": "load",
            "file": self.file,
            "file_bytes": self.bytes,
            "cores": fill::cores(),
            "rounds": self.rounds,
            "series": self.series.iter().zip(self.med).map(|(s, m)| serde_json::json!({
                "name": s.name,
                "floor": s.floor,
                "seconds": s.secs,
                "median_seconds": m,
                "gb_per_s": self.bytes as f64 / 1e9 / m,
            })).collect::<Vec<_>>(),
            "targets": self.targets.iter().map(|(name, v, t)| serde_json::json!({
                "name": name, "value": v, "target": t, "met": v <= t,
            })).collect::<Vec<_>>(),
            "figures": self.figures.iter().map(|(name, v)| serde_json::json!({
                "name": name, "value": v,
            })).collect::<Vec<_>>(),
            "chart": [svg, png],
        })
    }

    fn print(&self) {
        let [svg, png] = self.charts;
        println!(
            "table file {} ({:.2} GB), {} cores, medians of {} rounds",
            self.file.display(),
            self.bytes as f64 / 1e9,
            fill::cores(),
            self.rounds
        );
        let rows: Vec<Vec<String>> = self
            .series
            .iter()
            .zip(self.med)
            .map(|(s, m)| {
                let all: Vec<String> = s.secs.iter().map(|x| format!("{x:.3}")).collect();
                vec![
                    s.name.to_string(),
                    format!("{m:.3}"),
                    format!("{:.2}", self.bytes as f64 / 1e9 / m),
                    all.join(" "),
                ]
            })
            .collect();
        print_table(&["series", "median s", "GB/s", "rounds (s)"], &rows);
        println!();
        let rows: Vec<Vec<String>> = self
            .targets
            .iter()
            .map(|(name, v, t)| {
                vec![
                    name.to_string(),
                    format!("{v:.2}"),
                    format!("<= {t}"),
                    if *v <= *t { "met" } else { "NOT met" }.to_string(),
                ]
            })
            .collect();
        print_table(&["target", "value", "target", ""], &rows);
        println!();
        let rows: Vec<Vec<String>> = self
            .figures
            .iter()
            .map(|(name, v)| vec![name.to_string(), format!("{v:.2}")])
            .collect();
        print_table(&["figure", "value"], &rows);
        println!("chart: {} {}", svg.display(), png.display());
    }
}

/// A target: name, value, the most it may be.
type Target = (&'static str, f64, f64);

/// The targets and the figures without one, from the series' medians.
fn targets_and_figures(med: &[f64]) -> ([Target; 8], [(&'static str, f64); 2]) {
    let ratio = |a: usize, b: usize| med[a] / med[b];
    let targets: [Target; 8] = [
        ("verified warm / hash floor", ratio(3, 0), 1.5),
        ("trust-digest warm / read floor warm", ratio(4, 1), 2.0),
        ("verified cold / read floor cold", ratio(6, 5), 1.2),
        ("restart from the fd store, seconds", med[9], 1.0),
        (
            "--copy-tables: verified warm / hash floor",
            ratio(10, 0),
            1.5,
        ),
        // A trusted copy cannot beat reading the file and writing fresh
        // memory of its size: its floor is both.
        (
            "--copy-tables: trust-digest warm / (read floor warm + memory floor)",
            med[11] / (med[1] + med[2]),
            2.0,
        ),
        (
            "--copy-tables: verified cold / read floor cold",
            ratio(12, 5),
            1.2,
        ),
        (
            "--copy-tables: restart from the fd store, seconds",
            med[15],
            1.0,
        ),
    ];
    // Figures without a target: `memory-donor verify` (also what a node
    // runs on its SSD copy at start) against the disk, and against itself
    // on one thread.
    let figures = [
        ("verify cold / read floor cold", ratio(13, 5)),
        ("verify on 1 thread / verify on every core", ratio(14, 13)),
    ];
    (targets, figures)
}

/// One round of every series, each measured after the cache and memory
/// state it names: the page cache warm (the donor drops the file's pages
/// behind it as it loads) and memory the host has backed, or the file's
/// pages dropped.
fn measure_round(series: &mut [Series], file: &Path, bytes: u64, scratch: &Path) -> Result<()> {
    let rows_bytes = bytes / 4096 * 3960;
    let warm = |f: &Path| -> Result<()> {
        read_all(f)?;
        touch_memory(rows_bytes)?;
        Ok(())
    };
    warm(file)?;
    series[0].secs.push(hash_all(file)?.as_secs_f64());
    series[1].secs.push(read_all(file)?.as_secs_f64());
    touch_memory(rows_bytes)?;
    series[2].secs.push(touch_memory(rows_bytes)?.as_secs_f64());
    warm(file)?;
    series[3].secs.push(donor(file, &[])?);
    warm(file)?;
    series[4].secs.push(donor(file, &["--trust-digest"])?);
    drop_cache(file)?;
    series[5].secs.push(read_all(file)?.as_secs_f64());
    drop_cache(file)?;
    touch_memory(rows_bytes)?;
    series[6].secs.push(donor(file, &[])?);
    warm(file)?;
    series[7].secs.push(donor(file, &["--load-threads", "1"])?);
    read_all(file)?;
    // Long enough for the host to take freed memory back.
    std::thread::sleep(Duration::from_secs(4));
    series[8].secs.push(donor(file, &[COPY])?);
    warm(file)?;
    series[9].secs.push(restart_from_store(file, scratch, &[])?);
    warm(file)?;
    series[10].secs.push(donor(file, &[COPY])?);
    warm(file)?;
    series[11]
        .secs
        .push(donor(file, &[COPY, "--trust-digest"])?);
    drop_cache(file)?;
    touch_memory(rows_bytes)?;
    series[12].secs.push(donor(file, &[COPY])?);
    drop_cache(file)?;
    series[13].secs.push(verify(file, &[])?);
    drop_cache(file)?;
    series[14].secs.push(verify(file, &["--threads", "1"])?);
    warm(file)?;
    series[15]
        .secs
        .push(restart_from_store(file, scratch, &[COPY])?);
    Ok(())
}

/// The series, in the order a round measures them: name, and whether it
/// is a floor.
const SERIES: [(&str, bool); 16] = [
    ("hash floor: BLAKE3 of the file, all cores, warm", true),
    ("read floor: the file read, all cores, warm", true),
    ("memory floor: fresh memory written, all cores", true),
    (
        "donor start (the file's pages, the default), verified, warm",
        false,
    ),
    (
        "donor start (the file's pages), --trust-digest, warm",
        false,
    ),
    ("read floor: the file read, all cores, cold", true),
    ("donor start (the file's pages), verified, cold", false),
    (
        "donor start (the file's pages), verified, 1 load thread, warm",
        false,
    ),
    (
        "donor start, --copy-tables, verified, warm, memory the host took back",
        false,
    ),
    ("donor restart from the fd store (the file's pages)", false),
    ("donor start, --copy-tables, verified, warm", false),
    ("donor start, --copy-tables, --trust-digest, warm", false),
    ("donor start, --copy-tables, verified, cold", false),
    ("memory-donor verify, cold", false),
    ("memory-donor verify --threads 1, cold", false),
    ("donor restart from the fd store, --copy-tables", false),
];
