//! `engram-bench ssd --contention`: the SSD copy's 24-row batch read while
//! the drive is busy, at each I/O priority, in one run.
//!
//! Series, each for the same time: the batch read alone (the idle
//! baseline); then beside a saturating sequential reader (an
//! expert-streaming stand-in) at real-time, best-effort and idle priority;
//! then beside a writer with fsync (page writeback) likewise. The
//! background load alone is measured first, so each series also reports
//! what protection costs it (its bandwidth beside the reads, over its
//! bandwidth alone). Targets, with the sequential reader: real-time p99 at
//! most 5x the idle p99, and at least 10x better than best-effort's p99.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cluster_config::{IoClass, SsdIo, SsdIoprio};
use engram_protocol::ROW_BYTES;
use engram_protocol::synthetic::SplitMix64;
use inference_node::source::ssd::{SsdOptions, SsdReader};
use rack_harness::load::{Meter, Streamer};
use serde::Serialize;

use crate::stats::{Latency, Summary, print_table};

/// The priorities compared.
pub const PRIORITIES: [SsdIoprio; 3] = [
    SsdIoprio::DEFAULT,
    SsdIoprio {
        class: IoClass::BestEffort,
        level: 4,
    },
    SsdIoprio {
        class: IoClass::Idle,
        level: 0,
    },
];

/// Real-time p99 at most this many times the idle p99.
pub const TARGET_VS_IDLE: f64 = 5.0;
/// Best-effort p99 at least this many times real-time's.
pub const TARGET_VS_BEST_EFFORT: f64 = 10.0;

/// What runs beside the reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Load {
    /// Nothing.
    None,
    /// A sequential O_DIRECT reader, 32 x 1 MiB in flight.
    Reader,
    /// 1 MiB writes with an fsync every 8 MiB.
    Writer,
}

impl Load {
    fn name(self) -> &'static str {
        match self {
            Self::None => "idle",
            Self::Reader => "sequential reader",
            Self::Writer => "writer + fsync",
        }
    }

    /// Start it on the drive holding `table` (a scratch file for the writer
    /// in `scratch`).
    pub fn start(self, table: &Path, scratch: &Path) -> Result<Option<Streamer>> {
        Ok(match self {
            Self::None => None,
            Self::Reader => Some(Streamer::reader(table)?),
            Self::Writer => Some(Streamer::writer(scratch, 1 << 30)?),
        })
    }
}

/// One series' figures.
#[derive(Debug, Clone, Serialize)]
pub struct Series {
    /// The background load.
    pub load: Load,
    /// The reads' priority (as the reader got it).
    pub ioprio: String,
    /// Batches read.
    pub batches: u64,
    /// Per-batch latency.
    pub batch: Summary,
    /// p99 over the idle series' p99.
    pub p99_vs_idle: f64,
    /// The load's bandwidth beside the reads, MiB/s.
    pub load_mib_s: f64,
    /// That over the load's bandwidth alone.
    pub load_kept: f64,
}

/// How the contention run goes.
#[derive(Debug, Clone)]
pub struct ContentionSpec {
    /// The table (also what the sequential reader streams).
    pub table: PathBuf,
    /// Time per series.
    pub seconds: f64,
    /// Most batches per series.
    pub max_batches: u64,
}

/// Read random 24-row batches of `reader` for `secs` (or `max` batches).
fn read_batches(reader: &mut SsdReader, rows: u64, secs: f64, max: u64) -> Result<Latency> {
    let mut lat = Latency::new();
    let mut rng = SplitMix64::new(0xC0417);
    let mut out = vec![0u8; 24 * ROW_BYTES];
    let until = Instant::now() + Duration::from_secs_f64(secs);
    while Instant::now() < until && lat.count() < max {
        let ids: Vec<u64> = (0..24).map(|_| rng.below(rows)).collect();
        let t = Instant::now();
        reader.read(&ids, &mut out).context("a batch read")?;
        lat.record(t.elapsed());
    }
    Ok(lat)
}

/// The load alone for `secs`: its bandwidth, MiB/s.
fn load_alone(load: Load, spec: &ContentionSpec, scratch: &Path) -> Result<f64> {
    let Some(s) = load.start(&spec.table, scratch)? else {
        return Ok(0.0);
    };
    std::thread::sleep(Duration::from_millis(500));
    let m = Meter::start(&s);
    std::thread::sleep(Duration::from_secs_f64(spec.seconds));
    let bw = m.mib_per_second(&s);
    s.stop()?;
    Ok(bw)
}

/// Run every series.
pub fn run_series(spec: &ContentionSpec) -> Result<Vec<Series>> {
    let scratch_dir = tempfile::tempdir_in(spec.table.parent().unwrap_or(Path::new(".")))?;
    let scratch = scratch_dir.path().join("writer.bin");
    let rows = engram_store::table_file::TableFile::open(&spec.table)?
        .meta
        .rows;
    let mut alone = [0.0; 3];
    for (i, load) in [Load::Reader, Load::Writer].into_iter().enumerate() {
        alone[i + 1] = load_alone(load, spec, &scratch)?;
        eprintln!("{} alone: {:.0} MiB/s", load.name(), alone[i + 1]);
    }
    let mut out: Vec<Series> = Vec::new();
    let mut plan = vec![(Load::None, PRIORITIES[0])];
    for load in [Load::Reader, Load::Writer] {
        plan.extend(PRIORITIES.map(|p| (load, p)));
    }
    for (load, prio) in plan {
        let opts = SsdOptions {
            io: SsdIo::Uring,
            ioprio: prio,
            ..SsdOptions::default()
        };
        let mut reader = SsdReader::open(&spec.table, None, true, opts)?;
        let streamer = load.start(&spec.table, &scratch)?;
        // Let the load reach its pace before the reads are timed.
        std::thread::sleep(Duration::from_millis(500));
        let meter = streamer.as_ref().map(Meter::start);
        let lat = read_batches(&mut reader, rows, spec.seconds, spec.max_batches)?;
        let load_mib_s = match (&streamer, meter) {
            (Some(s), Some(m)) => m.mib_per_second(s),
            _ => 0.0,
        };
        if let Some(s) = streamer {
            s.stop()?;
        }
        let base = alone[match load {
            Load::None => 0,
            Load::Reader => 1,
            Load::Writer => 2,
        }];
        let batch = lat.summary();
        let idle_p99 = out.first().map_or(batch.p99_us, |s| s.batch.p99_us);
        eprintln!(
            "{:<18} {:<14} {:>6} batches  p50 {:>9.0} us  p99 {:>9.0} us",
            load.name(),
            reader.ioprio(),
            lat.count(),
            batch.p50_us,
            batch.p99_us
        );
        out.push(Series {
            load,
            ioprio: reader.ioprio().to_string(),
            batches: lat.count(),
            batch,
            p99_vs_idle: batch.p99_us / idle_p99,
            load_mib_s,
            load_kept: if base > 0.0 { load_mib_s / base } else { 0.0 },
        });
    }
    Ok(out)
}

/// Real-time vs idle and vs best-effort at p99 beside `load`, if measured.
pub fn ratios(series: &[Series], load: Load) -> Option<(f64, f64)> {
    let find = |class: &str| {
        series
            .iter()
            .find(|s| s.load == load && s.ioprio.starts_with(class))
    };
    let rt = find("realtime")?;
    let be = find("best-effort")?;
    Some((rt.p99_vs_idle, be.batch.p99_us / rt.batch.p99_us))
}

/// Print the series as a table and the targets' verdicts.
pub fn print(spec: &ContentionSpec, series: &[Series]) {
    println!(
        "24-row batches from {} under contention, io_uring + O_DIRECT, {:.0} s per series",
        spec.table.display(),
        spec.seconds
    );
    let rows: Vec<Vec<String>> = series
        .iter()
        .map(|s| {
            vec![
                s.load.name().to_string(),
                s.ioprio.clone(),
                s.batches.to_string(),
                format!("{:.0}", s.batch.p50_us),
                format!("{:.0}", s.batch.p99_us),
                format!("{:.0}", s.batch.p999_us),
                format!("{:.1}x", s.p99_vs_idle),
                if s.load == Load::None {
                    "-".into()
                } else {
                    format!("{:.0} ({:.0}%)", s.load_mib_s, s.load_kept * 100.0)
                },
            ]
        })
        .collect();
    print_table(
        &[
            "load",
            "reads at",
            "batches",
            "p50 us",
            "p99 us",
            "p99.9 us",
            "p99/idle",
            "load MiB/s (of alone)",
        ],
        &rows,
    );
    for load in [Load::Reader, Load::Writer] {
        if let Some((vs_idle, vs_be)) = ratios(series, load) {
            let met = vs_idle <= TARGET_VS_IDLE && vs_be >= TARGET_VS_BEST_EFFORT;
            println!(
                "{}: real-time p99 {vs_idle:.1}x idle (target <= {TARGET_VS_IDLE}x), best-effort p99 {vs_be:.1}x real-time's (target >= {TARGET_VS_BEST_EFFORT}x){}",
                load.name(),
                if load != Load::Reader {
                    ""
                } else if met {
                    "  met"
                } else {
                    "  MISSED"
                }
            );
        }
    }
}

/// Refuse a spec that cannot measure anything.
pub fn check(spec: &ContentionSpec) -> Result<()> {
    if !(spec.seconds > 0.0 && spec.seconds <= 600.0) || spec.max_batches == 0 {
        bail!("--seconds must be in (0, 600] and --batches at least 1");
    }
    Ok(())
}
