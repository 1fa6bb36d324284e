//! `--transports unix`: the host source against its floor, in the same run.
//!
//! The donor also listens on a host socket; this process maps its tables
//! through it (the node's [`HostSource`]) and gathers rows from the
//! mapping. The floor is the node's own `local` source: the same tables
//! loaded into this process's RAM ([`LocalRam`]), gathered by the same
//! code. Both series alternate in chunks, round after round, like the
//! network series; their medians are set against the donor over loopback
//! TCP (and TLS) measured in this run.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use engram_protocol::ROW_BYTES;
use engram_protocol::synthetic::{SplitMix64, first_mismatch};
use engram_store::resident::ExpectedTable;
use inference_node::source::{HostSource, LocalRam, RowSource, SourceError};
use serde::Serialize;

use super::{CHUNK, FloorArgs, SEED, SeriesResult, TABLES, Tables};
use crate::stats::{Latency, Summary, median_summary};

/// What the host series found.
#[derive(Debug, Serialize)]
pub(super) struct HostReport {
    /// Per size (24 rows, then 48): the local floor, then the host source.
    pub(super) series: Vec<SeriesResult>,
    /// The kernel's page size of the host mapping (KiB): 2048 and more
    /// when the donor's memfd is hugetlb-backed.
    pub(super) page_kib: Option<u64>,
}

/// Who gathers: this process's own copy, or the donor's mapping.
enum Via<'a> {
    Local(&'a [LocalRam]),
    Host(&'a HostSource),
}

impl Via<'_> {
    fn read(&self, section: usize, rows: &[u64], out: &mut [u8]) -> Result<(), SourceError> {
        let table = TABLES[section].0;
        match self {
            Self::Local(copies) => copies[section].read(table, rows, out),
            Self::Host(h) => h.read(table, rows, out),
        }
    }
}

struct Series<'a> {
    via: Via<'a>,
    sections: usize,
    ids: Vec<Vec<u64>>,
    out: Vec<u8>,
    rng: SplitMix64,
    n: u64,
    rounds: Vec<Summary>,
    name: String,
}

impl Series<'_> {
    /// `n` timed lookups into `lat`, every 16th answer checked.
    fn run(&mut self, n: usize, rows_per_table: u64, lat: &mut Latency) -> Result<()> {
        for _ in 0..n {
            for v in &mut self.ids {
                v.iter_mut()
                    .for_each(|r| *r = self.rng.below(rows_per_table));
            }
            let t = Instant::now();
            for (s, rows) in self.ids.iter().enumerate() {
                let out = &mut self.out[s * 24 * ROW_BYTES..(s + 1) * 24 * ROW_BYTES];
                self.via.read(s, rows, out)?;
            }
            lat.record(t.elapsed());
            self.n += 1;
            if self.n.is_multiple_of(16) {
                for (s, rows) in self.ids.iter().enumerate() {
                    let bytes = &self.out[s * 24 * ROW_BYTES..(s + 1) * 24 * ROW_BYTES];
                    if let Some(r) = first_mismatch(SEED, TABLES[s].0, rows, bytes) {
                        bail!("{}: a wrong row: table {} row {r}", self.name, TABLES[s].0);
                    }
                }
            }
        }
        Ok(())
    }
}

/// The donor's tables mapped through its host socket (within 30 s).
fn map_tables(socket: &Path, pins: &[(u32, ExpectedTable)]) -> Result<HostSource> {
    let host = HostSource::new("bench-donor", socket.to_path_buf(), pins.to_vec())
        .context("watching the donor's host socket")?;
    let t0 = Instant::now();
    while !pins.iter().all(|(id, _)| host.is_mapped(*id)) {
        if t0.elapsed() > Duration::from_secs(30) {
            bail!(
                "the donor's tables were not mapped through {} within 30 s",
                socket.display()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(host)
}

/// Map the donor's tables through `socket`, load the local floor, and run
/// both series.
pub(super) fn run(socket: &Path, tables: &Tables, args: &FloorArgs) -> Result<HostReport> {
    let pins: Vec<(u32, ExpectedTable)> = tables
        .digests
        .iter()
        .map(|&(id, digest)| {
            let want = ExpectedTable {
                digest,
                layer: id,
                rows: tables.rows,
            };
            (id, want)
        })
        .collect();
    let host = map_tables(socket, &pins)?;
    eprintln!("host socket: tables mapped; loading the local floor");
    let copies: Vec<LocalRam> = pins
        .iter()
        .zip(&tables.paths)
        .map(|((id, want), path)| {
            LocalRam::load(*id, path, *want, true)
                .with_context(|| format!("loading {} for the local floor", path.display()))
        })
        .collect::<Result<_>>()?;
    let page_kib = host
        .view(TABLES[0].0)
        .and_then(|v| page_kib(v.bytes().as_ptr() as usize));

    let mut series = Vec::new();
    for sections in [1usize, 2] {
        for (via, what) in [
            (Via::Local(&copies), "node's own local copy (the floor)"),
            (Via::Host(&host), "host source (the donor's mapping)"),
        ] {
            series.push(Series {
                via,
                sections,
                ids: vec![vec![0; 24]; sections],
                out: vec![0u8; sections * 24 * ROW_BYTES],
                rng: SplitMix64::new(101 + series.len() as u64),
                n: 0,
                rounds: Vec::new(),
                name: format!("{what}, {} rows", sections * 24),
            });
        }
    }
    for s in &mut series {
        s.run(args.warmup, tables.rows, &mut Latency::default())?;
    }
    for round in 0..args.rounds {
        eprintln!("host round {} of {}", round + 1, args.rounds);
        let mut lat: Vec<Latency> = series.iter().map(|_| Latency::default()).collect();
        let mut done = 0;
        while done < args.lookups {
            let n = CHUNK.min(args.lookups - done);
            for (s, l) in series.iter_mut().zip(&mut lat) {
                s.run(n, tables.rows, l)?;
            }
            done += n;
        }
        for (s, l) in series.iter_mut().zip(&lat) {
            s.rounds.push(l.summary());
        }
    }
    Ok(HostReport {
        series: series
            .into_iter()
            .map(|s| SeriesResult {
                series: s.name,
                rows: s.sections * 24,
                request_bytes: 0,
                answer_bytes: s.sections * 24 * ROW_BYTES,
                median: median_summary(&s.rounds),
                rounds: s.rounds,
                // Gathered in this process: no server to split from, nor
                // one to let go idle between lookups.
                split: None,
                pause_overran: 0.0,
            })
            .collect(),
        page_kib,
    })
}

/// The kernel page size (KiB) of this process's mapping that holds `addr`.
fn page_kib(addr: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or_default();
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = (a..b).contains(&addr);
        } else if inside && first == "KernelPageSize:" {
            return line.split_whitespace().nth(1)?.parse().ok();
        }
    }
    None
}
