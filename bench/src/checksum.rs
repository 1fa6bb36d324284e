//! `engram-bench checksum`: what summing a Rows answer costs the thread
//! that sums it, which (on the donor and on the client alike) was idle a
//! moment before: a pause before every call, spinning, as between two
//! lookups. Two ways to compute the same XXH3-64: 16 bytes at a time (SSE2,
//! the x86-64 baseline) and with the widest vectors the CPU has (AVX2),
//! against `payload_checksum`, which picks one by length
//! ([`engram_protocol::messages::WIDE_SUM_FROM`]). Back to back (no pause)
//! too, where the wide vectors are always faster; and after a pause that
//! keeps the wide units awake as a polling reader does
//! ([`engram_protocol::messages::keep_wide_units_warm`] each turn), after
//! which `payload_checksum` sums with them at any length. And after an
//! idle pause whose end wakes the units [`WOKEN_BEFORE`] before the sum,
//! as the donor does when a request comes in and a sleeping client when
//! its answer does: how soon the wide units are awake.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use engram_protocol::ROW_BYTES;
use engram_protocol::messages::{WIDE_SUM_FROM, keep_wide_units_warm, payload_checksum};
use engram_protocol::session::client::rows_payload_len;
use serde::Serialize;

use crate::stats::median;

/// Arguments of `engram-bench checksum`.
#[derive(clap::Args, Debug)]
pub struct ChecksumArgs {
    /// Timed calls per length, way and pause.
    #[arg(long, default_value_t = 4000)]
    calls: usize,
    /// The pause before each call (spinning), in microseconds: about one
    /// lookup's cycle on loopback (its round trip and the floor bench's
    /// pause between lookups). Near 30 us the result flips from run to
    /// run: that is about how long the vector units stay warm here.
    #[arg(long, default_value_t = 50)]
    pause_us: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// How long before the sum an idle pause's end wakes the wide units, in
/// the "woken" rows: about the least a donor spends parsing a request and
/// gathering its rows before it sums the answer.
const WOKEN_BEFORE: Duration = Duration::from_nanos(500);

/// One length, one pause: median nanoseconds a call.
#[derive(Debug, Serialize)]
struct Point {
    what: String,
    bytes: usize,
    pause_us: u64,
    /// The pause kept the wide vector units awake.
    warm: bool,
    /// The pause was idle, and its end woke the wide units this many ns
    /// before the sum ([`WOKEN_BEFORE`]).
    woken_ns: Option<u64>,
    sse2_ns: f64,
    wide_ns: f64,
    payload_checksum_ns: f64,
    /// `payload_checksum` / the faster of the two.
    chosen_vs_best: f64,
}

type Way = fn(&[u8]) -> u64;

/// Every order of the three ways.
const ORDERS: [[usize; 3]; 6] = [
    [0, 1, 2],
    [0, 2, 1],
    [1, 0, 2],
    [1, 2, 0],
    [2, 0, 1],
    [2, 1, 0],
];

/// The lengths summed: a 24- and a 48-row answer (what follows the
/// checksum field), then larger ones.
fn lengths() -> Vec<(String, usize)> {
    let rows = |n: usize, sections: usize| rows_payload_len(sections, n * ROW_BYTES) - 8;
    let mut v = vec![
        ("24 rows".to_string(), rows(24, 1)),
        ("48 rows".to_string(), rows(48, 2)),
    ];
    for kib in [32usize, 64, 256, 1024] {
        v.push((format!("{kib} KiB"), kib << 10));
    }
    v
}

/// Run the benchmark.
pub fn run(args: &ChecksumArgs) -> Result<()> {
    if args.calls == 0 || args.calls > 10_000_000 {
        bail!("--calls must be 1 to 10,000,000");
    }
    if args.pause_us > 1_000_000 {
        bail!("--pause-us must be at most 1,000,000");
    }
    let ways: [Way; 3] = [
        xxhash_rust::xxh3::xxh3_64,
        twox_hash::XxHash3_64::oneshot,
        payload_checksum,
    ];
    let mut points = Vec::new();
    for (what, bytes) in lengths() {
        let data: Vec<u8> = (0..bytes).map(|i| (i * 31 + 7) as u8).collect();
        let sums: Vec<u64> = ways.iter().map(|w| w(&data)).collect();
        if sums.iter().any(|&s| s != sums[0]) {
            bail!("the ways disagree on {what}: {sums:x?}");
        }
        let woken = Some(WOKEN_BEFORE);
        for (pause_us, warm, woken) in [
            (args.pause_us, false, None),
            (args.pause_us, true, None),
            (args.pause_us, false, woken),
            (0, false, None),
        ] {
            let pause = Duration::from_micros(pause_us);
            let mut ns: [Vec<f64>; 3] = Default::default();
            // The ways take turns, call by call, so drift lands on all,
            // each after each of the others as often (one leaves the
            // vector units warm for the next).
            for i in 0..args.calls * 3 {
                let k = ORDERS[(i / 3) % ORDERS.len()][i % 3];
                let until = Instant::now() + pause;
                while Instant::now() < until {
                    if warm {
                        keep_wide_units_warm();
                    }
                    std::hint::spin_loop();
                }
                if let Some(before) = woken {
                    keep_wide_units_warm();
                    let until = Instant::now() + before;
                    while Instant::now() < until {
                        std::hint::spin_loop();
                    }
                }
                let t = Instant::now();
                std::hint::black_box(ways[k](std::hint::black_box(&data)));
                ns[k].push(t.elapsed().as_nanos() as f64);
            }
            let [sse2, wide, chosen] = ns.map(median);
            points.push(Point {
                what: what.clone(),
                bytes,
                pause_us,
                warm,
                woken_ns: woken.map(|d| d.as_nanos() as u64),
                sse2_ns: sse2,
                wide_ns: wide,
                payload_checksum_ns: chosen,
                chosen_vs_best: chosen / sse2.min(wide),
            });
        }
    }
    if args.json {
        let out = serde_json::json!({
            "benchmark": "checksum",
            "calls": args.calls,
            "wide_sum_from": WIDE_SUM_FROM,
            "points": points,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "XXH3-64 of a Rows payload, median ns a call ({} calls; `payload_checksum` uses SSE2 below {WIDE_SUM_FROM} bytes)",
        args.calls
    );
    println!(
        "{:<9} {:>9} {:>9} {:>12} {:>9} {:>9} {:>17} {:>9}",
        "payload", "bytes", "pause us", "wide units", "SSE2", "wide", "payload_checksum", "vs best"
    );
    for p in &points {
        let units = match (p.warm, p.woken_ns) {
            (true, _) => "kept warm".to_string(),
            (false, Some(ns)) => format!("woken {ns} ns"),
            (false, None) if p.pause_us > 0 => "idle".to_string(),
            (false, None) => "-".to_string(),
        };
        println!(
            "{:<9} {:>9} {:>9} {:>12} {:>9.0} {:>9.0} {:>17.0} {:>9.3}",
            p.what,
            p.bytes,
            p.pause_us,
            units,
            p.sse2_ns,
            p.wide_ns,
            p.payload_checksum_ns,
            p.chosen_vs_best
        );
    }
    Ok(())
}
