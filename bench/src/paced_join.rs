//! `engram-bench paced --join`: a sequence joins a running batch, and what
//! its prefill costs the sequences already decoding. Four sequences decode
//! at the token rate from a donor over loopback TLS (the node's continuous
//! batch, in this process: `NodeModel::run_batch`, as `inference-node
//! serve` runs it); one second in, a fifth joins with a prefill of
//! `--join-prefill` positions. With no prefill budget its whole prefill is
//! fetched and fused in one step, the decoders waiting behind it; with the
//! node's budget (`DEFAULT_PREFILL_BUDGET` positions a step beside the
//! decoders) it comes in chunks. The figure is the decoders' step time
//! while the joiner prefills, against the step time `W` and against their
//! steps before it joined.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cluster_config::Transport;
use inference_node::metrics::NodeMetrics;
use inference_node::model::node::{InputChoice, NodeModel};
use inference_node::model::{
    BatchDriver, DEFAULT_PREFILL_BUDGET, LoopSpec, SeqSpec, StepRecord, Tokens,
};
use serde::Serialize;

use crate::plot::{Bar, Bars};
use crate::rack::{self, Child, RackSpec};
use crate::stats::median;

/// Sequences decoding before the join.
const DECODERS: usize = 4;
/// Positions the joiner decodes after its prefill.
const JOINER_DECODES: u64 = 20;
/// Its tag.
const JOINER: u64 = 99;
/// Prefill budgets run: none (the whole prefill in one step), a small
/// one, and the node's default.
const BUDGETS: [usize; 3] = [0, 32, DEFAULT_PREFILL_BUDGET];

/// What `paced --join` needs from the command line.
pub struct JoinArgs<'a> {
    pub out: &'a Path,
    pub hash_base: u64,
    pub rates: &'a [f64],
    pub prefill: usize,
    pub seconds: f64,
    pub repeat: usize,
    pub json: bool,
}

/// One run's decoders' step times, microseconds.
#[derive(Debug, Clone, Serialize)]
struct Run {
    /// Before the join: median and worst.
    before_p50_us: f64,
    before_max_us: f64,
    /// From the join to the joiner's last prefill chunk: steps, median
    /// and worst.
    during_steps: usize,
    during_p50_us: f64,
    during_max_us: f64,
    /// Of the worst step, the time fusing (the CPU's stand-in for the GPU:
    /// every position of the step, the joiner's chunk included).
    during_max_fusion_us: f64,
}

/// One (rate, budget) point: medians over its runs.
#[derive(Debug, Clone, Serialize)]
struct Point {
    rate: f64,
    /// Prefill positions a step takes beside the decoders (0: no limit,
    /// the whole prefill in one step).
    budget: usize,
    w_us: f64,
    before_p50_us: f64,
    during_steps: f64,
    during_p50_us: f64,
    during_max_us: f64,
    during_max_fusion_us: f64,
    /// The worst step while the joiner prefilled, over `W`.
    worst_over_w: f64,
    runs: Vec<Run>,
}

#[derive(Debug, Serialize)]
struct Report {
    transport: &'static str,
    decoders: usize,
    join_prefill: usize,
    seconds_per_point: f64,
    repeat: usize,
    points: Vec<Point>,
}

/// Four decoders from the first step; the joiner at `join_at`.
struct Join {
    tokens: Arc<Tokens>,
    step: u64,
    join_at: u64,
    prefill: usize,
    limit: u64,
    /// Each step's (time, the joiner's prefill in it or still to come,
    /// time fusing).
    steps: Vec<(f64, bool, f64)>,
    joined: Option<usize>,
    prefill_left: bool,
    prefilled: u64,
    error: Option<String>,
}

impl Join {
    fn seq(&self, tag: u64, start: usize, prefill: usize, limit: u64) -> SeqSpec {
        SeqSpec {
            tag,
            tokens: Arc::clone(&self.tokens),
            range: start..start + prefill + limit as usize,
            prefill,
            speculate: 0,
            limit: Some(limit),
        }
    }
}

impl BatchDriver for Join {
    fn admit(&mut self, _running: usize) -> Vec<SeqSpec> {
        let len = self.limit as usize;
        if self.step == 0 {
            return (0..DECODERS)
                .map(|i| self.seq(i as u64, i * len, 0, self.limit))
                .collect();
        }
        if self.step == self.join_at {
            self.joined = Some(self.steps.len());
            self.prefill_left = true;
            return vec![self.seq(JOINER, DECODERS * len, self.prefill, JOINER_DECODES)];
        }
        Vec::new()
    }

    fn cancelled(&mut self) -> Vec<u64> {
        Vec::new()
    }

    fn after_step(&mut self, rec: Option<&StepRecord>, _finished: &[u64]) {
        self.step += 1;
        let Some(r) = rec else { return };
        if self.error.is_none()
            && let Some(t) = r.tables.iter().find(|t| t.error.is_some())
        {
            self.error = Some(format!("step {}: {:?}", r.step, t.error));
        }
        // Only the joiner prefills: its prefill is done with the step that
        // brings its count to the whole.
        let prefilling = self.prefill_left;
        self.prefilled += r.prefilled;
        if self.prefilled >= self.prefill as u64 {
            self.prefill_left = false;
        }
        self.steps.push((r.time_us, prefilling, r.fusion_us));
    }
}

/// Run the batch once at `rate` with `budget`; its decoders' step times.
fn one(
    rt: &tokio::runtime::Runtime,
    nm: &mut NodeModel,
    tokens: &Arc<Tokens>,
    rate: f64,
    budget: usize,
    a: &JoinArgs,
) -> Result<(Run, f64)> {
    let steps = (rate * a.seconds).round().max(2.0) as u64;
    let mut driver = Join {
        tokens: Arc::clone(tokens),
        step: 0,
        join_at: (rate.round() as u64).clamp(1, steps / 2),
        prefill: a.prefill,
        limit: steps,
        steps: Vec::new(),
        joined: None,
        prefill_left: false,
        prefilled: 0,
        error: None,
    };
    let spec = LoopSpec {
        tokens_per_second: rate,
        prefill_budget: budget,
        ..LoopSpec::default()
    };
    nm.run_batch(rt.handle().clone(), &spec, &mut driver)
        .map_err(|e| anyhow::anyhow!("the batch at {rate} tokens/s: {e}"))?;
    if let Some(e) = driver.error {
        bail!("at {rate} tokens/s, budget {budget}: {e}");
    }
    let joined = driver.joined.context("the joiner never joined")?;
    let before: Vec<f64> = driver.steps[..joined].iter().map(|s| s.0).collect();
    let during_steps: Vec<(f64, bool, f64)> = driver.steps[joined..]
        .iter()
        .take_while(|s| s.1)
        .copied()
        .collect();
    let during: Vec<f64> = during_steps.iter().map(|s| s.0).collect();
    let worst_fusion = during_steps
        .iter()
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map_or(0.0, |s| s.2);
    if during.is_empty() || before.is_empty() {
        bail!("no step before the join or during its prefill");
    }
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    Ok((
        Run {
            before_p50_us: median(before.clone()),
            before_max_us: max(&before),
            during_steps: during.len(),
            during_p50_us: median(during.clone()),
            during_max_us: max(&during),
            during_max_fusion_us: worst_fusion,
        },
        1e6 / rate,
    ))
}

/// `engram-bench paced --join`.
pub fn run(a: &JoinArgs) -> Result<()> {
    if a.prefill == 0 || a.prefill > 65_536 {
        bail!("--join-prefill must be 1..=65536 positions");
    }
    let t_all = Instant::now();
    let tables = rack::table_pair(a.out, a.hash_base)?;
    let spec = RackSpec {
        transport: Transport::Tls,
        ..RackSpec::one_donor()
    };
    let rk = rack::write_config(a.out, &tables, &spec)?;
    let donor = Child::launch_donor(&rk.config, "donor-a", &[])?;
    donor.wait_ready(Duration::from_secs(120))?;
    let config = cluster_config::Config::load(&rk.config)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let metrics = NodeMetrics::new();
    let mut nm = rt
        .block_on(NodeModel::from_config(&config, "donor", None, &metrics))
        .map_err(|e| anyhow::anyhow!("the node: {e}"))?;
    let max_rate = a.rates.iter().copied().fold(0.0, f64::max);
    let len = DECODERS * (max_rate * a.seconds).ceil() as usize + a.prefill + 64;
    let tokens = Arc::new(
        nm.tokens(&InputChoice::Builtin, len)
            .map_err(|e| anyhow::anyhow!("tokens: {e}"))?,
    );
    let mut points = Vec::new();
    for &rate in a.rates {
        for budget in BUDGETS {
            points.push(point(&rt, &mut nm, &tokens, rate, budget, a)?);
        }
    }
    drop(donor);
    let report = Report {
        transport: "tls",
        decoders: DECODERS,
        join_prefill: a.prefill,
        seconds_per_point: a.seconds,
        repeat: a.repeat,
        points,
    };
    std::fs::write(
        a.out.join("paced-join.json"),
        serde_json::to_vec_pretty(&report)?,
    )?;
    let (svg, png) = chart(&report).write_both(&a.out.join("paced-join"))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_text(&report, a);
    println!(
        "wrote {}, {} and {} ({:.0} s in all)",
        a.out.join("paced-join.json").display(),
        png.display(),
        svg.display(),
        rack::since(t_all)
    );
    Ok(())
}

/// `repeat` runs at `rate` with a join under `budget`: their medians.
fn point(
    rt: &tokio::runtime::Runtime,
    nm: &mut NodeModel,
    tokens: &Arc<Tokens>,
    rate: f64,
    budget: usize,
    a: &JoinArgs,
) -> Result<Point> {
    let mut runs = Vec::new();
    let mut w_us = 0.0;
    for _ in 0..a.repeat {
        rack::check_interrupted()?;
        let (r, w) = one(rt, nm, tokens, rate, budget, a)?;
        eprintln!(
            "{rate:>6} tokens/s budget {budget:>4}: decoders' steps {:>8.0} us before the join, \
             {:>8.0} us median and {:>8.0} us worst ({:.0} us fusing) over its {} prefill steps (W {w:.0} us)",
            r.before_p50_us,
            r.during_p50_us,
            r.during_max_us,
            r.during_max_fusion_us,
            r.during_steps
        );
        w_us = w;
        runs.push(r);
    }
    let m = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
    let during_max_us = m(|r| r.during_max_us);
    Ok(Point {
        rate,
        budget,
        w_us,
        before_p50_us: m(|r| r.before_p50_us),
        during_steps: m(|r| r.during_steps as f64),
        during_p50_us: m(|r| r.during_p50_us),
        during_max_us,
        during_max_fusion_us: m(|r| r.during_max_fusion_us),
        worst_over_w: during_max_us / w_us,
        runs,
    })
}

fn print_text(report: &Report, a: &JoinArgs) {
    println!(
        "{DECODERS} sequences decoding from a donor over loopback TLS; a fifth joins with a prefill of {} positions (medians of {} runs):",
        a.prefill, a.repeat
    );
    println!(
        "{:>8} {:>7} {:>8} {:>12} {:>8} {:>12} {:>12} {:>12} {:>8}",
        "tok/s",
        "budget",
        "W us",
        "before us",
        "steps",
        "during p50",
        "during max",
        "its fusion",
        "max/W"
    );
    for p in &report.points {
        println!(
            "{:>8} {:>7} {:>8.0} {:>12.0} {:>8.0} {:>12.0} {:>12.0} {:>12.0} {:>8.2}",
            p.rate,
            budget_label(p.budget),
            p.w_us,
            p.before_p50_us,
            p.during_steps,
            p.during_p50_us,
            p.during_max_us,
            p.during_max_fusion_us,
            p.worst_over_w
        );
    }
}

/// A budget as the table and chart name it (0: none).
fn budget_label(budget: usize) -> String {
    if budget == 0 {
        "none".into()
    } else {
        budget.to_string()
    }
}

fn chart(r: &Report) -> Bars {
    Bars {
        title: format!(
            "a prefill of {} positions joins {DECODERS} decoders: their worst step while it prefills, over W (grey: no budget)",
            r.join_prefill
        ),
        unit: "x W".into(),
        bars: r
            .points
            .iter()
            .map(|p| Bar {
                label: format!("{} tok/s, budget {}", p.rate, budget_label(p.budget)),
                value: p.worst_over_w,
                floor: p.budget == 0,
            })
            .collect(),
    }
}
