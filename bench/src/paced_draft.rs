//! `engram-bench paced --draft`: speculative decoding with a draft model's
//! stand-in (`inference-node run --speculate K --draft-us D`), served by a
//! donor over loopback TCP, with and without draft prefetch, across draft
//! lengths K and token rates: stall and tokens/s next to seed 000's
//! prediction from the fetch times each run measured (the drafts' time
//! added to both).
//!
//! Without prefetch a verification fetches its `(K+1) x 24` rows per table
//! when the pass starts; with it each position's rows are fetched as soon
//! as it exists, so only the last draft's are left for the pass.
//!
//! With `--draft-reject P`, each draft is wrong with probability P %: its
//! verification rejects it and the drafts after it (their rows fetched for
//! nothing: the wasted bytes), and decoding goes on from it. Every run's
//! kept outputs are checked against a run without speculation at the same
//! rate: the benchmark fails when one differs by a bit.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use inference_node::model::Summary;
use serde::Serialize;

use crate::plot::{Bar, Bars};
use crate::rack::{self, Child, RackSpec};
use crate::stats::median;

/// One (K, rate, prefetch) point: medians over its runs.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    k: usize,
    rate: f64,
    prefetch: bool,
    tokens_per_second: f64,
    predicted_tokens_per_second: f64,
    measured_over_predicted: f64,
    stall_p50_us: f64,
    stall_p99_us: f64,
    /// Table 1's fetch p50 (from the pass's start; 0 when it was in before).
    fetch_p50_us: f64,
    /// Draft positions rejected, and the bytes of rows fetched for them
    /// only, per run.
    rejected_positions: f64,
    wasted_bytes: f64,
    runs: usize,
}

#[derive(Debug, Serialize)]
struct Report {
    draft_us: u64,
    reject_percent: u8,
    /// Every run's kept outputs were bit-identical to the run without
    /// speculation at its rate (the benchmark fails otherwise).
    outputs_identical: bool,
    seconds_per_point: f64,
    repeat: usize,
    points: Vec<Point>,
    /// Points where prefetch raised tokens/s.
    faster_with_prefetch: usize,
}

/// Settings of the draft series.
pub struct DraftArgs<'a> {
    pub out: &'a Path,
    pub hash_base: u64,
    pub rates: &'a [f64],
    pub ks: &'a [usize],
    pub draft_us: u64,
    pub reject_percent: u8,
    pub seconds: f64,
    pub repeat: usize,
    pub json: bool,
}

/// Run every (K, rate) with and without prefetch, `repeat` times each.
pub fn run(a: &DraftArgs) -> Result<()> {
    if a.ks.is_empty()
        || a.ks
            .iter()
            .any(|&k| !(1..=inference_node::model::MAX_SPECULATE).contains(&k))
    {
        bail!(
            "--draft-ks must be draft lengths in 1..={}",
            inference_node::model::MAX_SPECULATE
        );
    }
    let t_all = Instant::now();
    let tables = rack::table_pair(a.out, a.hash_base)?;
    let spec = RackSpec::one_donor();
    let rk = rack::write_config(a.out, &tables, &spec)?;
    let donor = Child::launch_donor(&rk.config, "donor-a", &[])?;
    donor.wait_ready(Duration::from_secs(120))?;
    let runs_dir = a.out.join("draft-runs");
    std::fs::create_dir_all(&runs_dir)?;
    let cx = Runs {
        a,
        config: &rk.config,
        runs_dir: &runs_dir,
    };
    // Each rate's outputs without speculation: what every run must keep.
    let mut reference = Vec::new();
    for &rate in a.rates {
        reference.push(cx.plain(rate)?);
    }
    let mut points = Vec::new();
    for &k in a.ks {
        for (&rate, want) in a.rates.iter().zip(&reference) {
            for prefetch in [false, true] {
                points.push(cx.point(k, rate, prefetch, want)?);
            }
        }
    }
    drop(donor);
    let faster = points
        .chunks(2)
        .filter(|p| p.len() == 2 && p[1].tokens_per_second > p[0].tokens_per_second)
        .count();
    let report = Report {
        draft_us: a.draft_us,
        reject_percent: a.reject_percent,
        outputs_identical: true,
        seconds_per_point: a.seconds,
        repeat: a.repeat,
        points,
        faster_with_prefetch: faster,
    };
    std::fs::write(
        a.out.join("paced-draft.json"),
        serde_json::to_vec_pretty(&report)?,
    )?;
    let (svg, png) = chart(&report).write_both(&a.out.join("paced-draft"))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_table(&report);
    println!(
        "wrote {}, {} and {} ({:.0} s in all)",
        a.out.join("paced-draft.json").display(),
        png.display(),
        svg.display(),
        rack::since(t_all)
    );
    Ok(())
}

/// Runs of the node against the bench's donor.
struct Runs<'a> {
    a: &'a DraftArgs<'a>,
    config: &'a Path,
    runs_dir: &'a Path,
}

impl Runs<'_> {
    fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.a.seconds * 10.0 + 120.0)
    }

    /// A run at `rate` without speculation: the digest of its outputs.
    fn plain(&self, rate: f64) -> Result<String> {
        rack::check_interrupted()?;
        let file = self.runs_dir.join(format!("plain-{rate}.json"));
        let args = rack::paced_args(rate, self.a.seconds);
        rack::run_node(self.config, "donor", &args, &file, self.timeout())?;
        let s: Summary = serde_json::from_slice(&std::fs::read(&file)?)
            .with_context(|| format!("reading {}", file.display()))?;
        Ok(s.outputs_digest)
    }

    /// `repeat` runs drafting `k` tokens at `rate`, with or without
    /// prefetch, each checked to keep the outputs `want`; their medians.
    fn point(&self, k: usize, rate: f64, prefetch: bool, want: &str) -> Result<Point> {
        let a = self.a;
        let mut runs = Vec::new();
        for rep in 0..a.repeat {
            runs.push(self.speculating(k, rate, prefetch, want, rep)?);
        }
        let m = |f: &dyn Fn(&Summary) -> f64| median(runs.iter().map(f).collect());
        Ok(Point {
            k,
            rate,
            prefetch,
            tokens_per_second: m(&|s| s.tokens_per_second),
            predicted_tokens_per_second: m(&|s| s.predicted_tokens_per_second),
            measured_over_predicted: m(&|s| s.measured_over_predicted),
            stall_p50_us: m(&|s| s.stall_p50_us),
            stall_p99_us: m(&|s| s.stall_p99_us),
            fetch_p50_us: m(&|s| s.tables.first().map_or(f64::NAN, |t| t.fetch_p50_us)),
            rejected_positions: m(&|s| s.rejected_positions as f64),
            wasted_bytes: m(&|s| s.wasted_bytes as f64),
            runs: runs.len(),
        })
    }

    fn speculating(
        &self,
        k: usize,
        rate: f64,
        prefetch: bool,
        want: &str,
        rep: usize,
    ) -> Result<Summary> {
        let a = self.a;
        rack::check_interrupted()?;
        let file = self
            .runs_dir
            .join(format!("k{k}-{rate}-{prefetch}-{}.json", rep + 1));
        let mut args = rack::paced_args(rate, a.seconds);
        args.extend([
            "--speculate".to_string(),
            k.to_string(),
            "--draft-us".into(),
            a.draft_us.to_string(),
            "--draft-reject".into(),
            a.reject_percent.to_string(),
        ]);
        if prefetch {
            args.push("--draft-prefetch".into());
        }
        rack::run_node(self.config, "donor", &args, &file, self.timeout())?;
        let s: Summary = serde_json::from_slice(&std::fs::read(&file)?)
            .with_context(|| format!("reading {}", file.display()))?;
        if s.failed_steps > 0 {
            bail!("k {k} at {rate} tokens/s: {} steps failed", s.failed_steps);
        }
        if s.outputs_digest != want {
            bail!(
                "k {k} at {rate} tokens/s, prefetch {prefetch}: the outputs kept \
                 ({}) are not the run without speculation's ({want}); see {}",
                s.outputs_digest,
                file.display()
            );
        }
        eprintln!(
            "k {k:>2} {rate:>6} tokens/s prefetch {:<3}: {:>8.1} tokens/s (predicted {:>8.1}), stall p99 {:>7.1} us, {} rejected",
            if prefetch { "on" } else { "off" },
            s.tokens_per_second,
            s.predicted_tokens_per_second,
            s.stall_p99_us,
            s.rejected_positions
        );
        Ok(s)
    }
}

fn print_table(r: &Report) {
    println!(
        "draft prefetch: a donor over loopback TCP, drafts {} us per token, {}% of drafts wrong; medians of {} runs of {} s",
        r.draft_us, r.reject_percent, r.repeat, r.seconds_per_point
    );
    let rows: Vec<Vec<String>> = r
        .points
        .chunks(2)
        .filter(|p| p.len() == 2)
        .map(|p| {
            let (off, on) = (&p[0], &p[1]);
            vec![
                off.k.to_string(),
                off.rate.to_string(),
                format!(
                    "{:.1} / {:.1}",
                    off.tokens_per_second, off.predicted_tokens_per_second
                ),
                format!(
                    "{:.1} / {:.1}",
                    on.tokens_per_second, on.predicted_tokens_per_second
                ),
                format!("{:.3}", on.tokens_per_second / off.tokens_per_second),
                format!("{:.0} / {:.0}", off.stall_p50_us, off.stall_p99_us),
                format!("{:.0} / {:.0}", on.stall_p50_us, on.stall_p99_us),
                format!("{:.0} / {:.0}", off.fetch_p50_us, on.fetch_p50_us),
                format!(
                    "{:.0} / {:.1}",
                    on.rejected_positions,
                    on.wasted_bytes / 1e3
                ),
            ]
        })
        .collect();
    crate::stats::print_table(
        &[
            "k",
            "tokens/s",
            "off: tok/s meas / pred",
            "on: tok/s meas / pred",
            "on/off",
            "off: stall p50/p99 us",
            "on: stall p50/p99 us",
            "layer-1 fetch p50 off/on us",
            "rejected / wasted KB",
        ],
        &rows,
    );
    println!(
        "prefetch raised tokens/s at {} of {} points; every run's outputs were bit-identical to \
         the run without speculation",
        r.faster_with_prefetch,
        r.points.len() / 2
    );
}

fn chart(r: &Report) -> Bars {
    Bars {
        title: format!(
            "speculation with a {} us/token draft: tokens/s without (grey) and with draft prefetch",
            r.draft_us
        ),
        unit: "tokens/s".into(),
        bars: r
            .points
            .iter()
            .map(|p| Bar {
                label: format!(
                    "k {} at {} tok/s, prefetch {}",
                    p.k,
                    p.rate,
                    if p.prefetch { "on" } else { "off" }
                ),
                value: p.tokens_per_second,
                floor: !p.prefetch,
            })
            .collect(),
    }
}
