//! `inference-node run`: the model loop over an input at a token rate,
//! with a per-second status line, an optional JSONL trace (one line per
//! step) and a summary next to seed 000's prediction.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, Result, bail};
use cluster_config::model::Family;
use inference_node::metrics::{ModelSeries, NodeMetrics};
use inference_node::model::ngram::node::NgramNode;
use inference_node::model::node::{Backbone, InputChoice, NodeModel};
use inference_node::model::summary::Seconds;
use inference_node::model::{
    Draft, LoopSpec, MAX_BATCH, MAX_DRAFT_TIME, MAX_SPECULATE, StepRecord,
};

/// Arguments of `run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The cluster config.
    #[arg(long)]
    pub config: PathBuf,
    /// This node's name in it.
    #[arg(long)]
    pub name: String,
    /// A text file, tokenized with the config's tokenizer (or a word-level
    /// tokenizer built from the text). Default: the built-in text.
    #[arg(long, conflicts_with = "ids")]
    pub input: Option<PathBuf>,
    /// A file of raw token ids (whitespace or comma separated).
    #[arg(long)]
    pub ids: Option<PathBuf>,
    /// Positions to decode (the input repeats when shorter). Default: the input once.
    #[arg(long)]
    pub tokens: Option<u64>,
    /// Token rate (default: the node's tokens_per_second).
    #[arg(long)]
    pub tokens_per_second: Option<f64>,
    /// Write one JSON line per step here.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Sequences decoding together (one message per table per step).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Positions of each sequence prefilled in one sweep before decoding.
    #[arg(long, default_value_t = 0)]
    pub prefill: usize,
    /// Draft positions verified with each token ((k+1) x 24 rows per table per step).
    #[arg(long, default_value_t = 0)]
    pub speculate: usize,
    /// With --speculate: a draft model's stand-in taking this many
    /// microseconds per draft token before each verification (at most
    /// 1,000,000).
    #[arg(long, value_name = "US")]
    pub draft_us: Option<u64>,
    /// With --draft-us: fetch each draft's rows as soon as it is drafted,
    /// not when the verification starts.
    #[arg(long)]
    pub draft_prefetch: bool,
    /// With --draft-us: the chance (0 to 100 %) that a draft is wrong; the
    /// verification rejects it and the drafts after it (their rows fetched
    /// for nothing, reported as wasted bytes) and decoding goes on from it.
    #[arg(long, value_name = "PERCENT", default_value_t = 0,
          value_parser = clap::value_parser!(u8).range(0..=100))]
    pub draft_reject: u8,
    /// Wake the path to each step's rows this many microseconds before the
    /// step (a Ping to each table's first donor, and one of the node's I/O
    /// threads polling until the rows are in, at most 1 ms past the step's
    /// start); 0: off, every thread on the path sleeps between steps.
    #[arg(long, value_name = "US", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(0..=10_000))]
    pub warm_us: u64,
    /// Serve /metrics here (default: the node's `metrics` key, if set).
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Where the backbone's stand-in compute runs: `cpu` (a precise wait) or `gpu` (a busy kernel; needs --features cuda).
    #[arg(long, value_enum, default_value_t = Backbone::Cpu)]
    pub backbone: Backbone,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// No per-second status lines.
    #[arg(long)]
    pub quiet: bool,
    /// Every N steps, a `progress steps=S end_us=E monotonic_us=M` line on
    /// stderr: the step's end on the run's clock and on CLOCK_MONOTONIC, so
    /// a script can act at a chosen token and place its own events on the
    /// trace's time axis (failover drills do).
    #[arg(long, value_name = "N")]
    pub progress_every: Option<std::num::NonZeroU64>,
}

/// Run it.
pub async fn run(args: RunArgs) -> Result<()> {
    let draft = checked_draft(&args)?;
    let config = cluster_config::Config::load(&args.config)?;
    let node = config
        .node(&args.name)
        .with_context(|| format!("node {:?} is not in {}", args.name, args.config.display()))?;
    if let Some(addr) = args.metrics {
        config
            .plaintext_bind("--metrics: /metrics", addr)
            .map_err(anyhow::Error::msg)?;
    }
    let metrics = Arc::new(NodeMetrics::new());
    if let Some(addr) = args.metrics.or(node.metrics) {
        let (bound, _task) = inference_node::memory::serve_metrics(addr, metrics.clone())
            .await
            .with_context(|| format!("binding the metrics address {addr}"))?;
        eprintln!("metrics listen={bound}");
    }
    let trace = match &args.trace {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let input = match (&args.input, &args.ids) {
        (Some(p), _) => InputChoice::Text(p.clone()),
        (None, Some(p)) => InputChoice::Ids(p.clone()),
        (None, None) => InputChoice::Builtin,
    };
    let per_seq = args
        .tokens
        .map_or(0, |t| t.div_ceil(args.batch as u64) as usize);
    let min_len = (per_seq + args.prefill).saturating_mul(args.batch);
    let mut spec = LoopSpec {
        max_tokens: args.tokens,
        batch: args.batch,
        prefill: args.prefill,
        speculate: args.speculate,
        draft,
        warm_lead: std::time::Duration::from_micros(args.warm_us),
        ..LoopSpec::default()
    };
    let cpu_before = daemon_runtime::metrics::process_cpu_seconds();
    let (res, flushed) = if config.family() == Family::Qwen4Exp {
        let nn = NgramNode::from_config(&config, &args.name, args.tokens_per_second, &metrics)
            .await
            .with_context(|| format!("node {:?} cannot start", args.name))?;
        if args.backbone != Backbone::Cpu {
            bail!("--backbone gpu runs DeepSeek V4.1's loop only (docs/models.md)");
        }
        let tokens = nn.input().tokens(&input, min_len)?;
        let (raw, origin) = (tokens.raw, tokens.origin);
        spec.tokens_per_second = nn.tokens_per_second();
        announce(&args, raw.len(), &origin, &spec, nn.fusion_name());
        let slot = nn.slot();
        let row_bytes = nn.memory().router(slot.table).map_or(0, |r| r.row_bytes());
        let series = metrics.model.series(&[(slot.table, row_bytes)]);
        let rx = start_loop(
            &args,
            nn,
            (trace, series),
            Box::new(move |nn: &mut NgramNode, stop, on_step| {
                nn.run(
                    tokio::runtime::Handle::current(),
                    &raw,
                    &spec,
                    stop,
                    on_step,
                )
            }),
        )?;
        let (res, flushed, nn) = rx.await.context("the loop thread ended without a result")?;
        drop(nn);
        (res, flushed)
    } else {
        let nm = NodeModel::from_config(&config, &args.name, args.tokens_per_second, &metrics)
            .await
            .with_context(|| format!("node {:?} cannot start", args.name))?;
        let tokens = nm.tokens(&input, min_len)?;
        spec.tokens_per_second = nm.tokens_per_second();
        let origin = tokens.origin.clone();
        announce(&args, tokens.raw.len(), &origin, &spec, nm.fusion_name());
        let series = metrics
            .model
            .series(&nm.slots().map(|s| (s.table, engram_protocol::ROW_BYTES)));
        let backbone = args.backbone;
        let rx = start_loop(
            &args,
            nm,
            (trace, series),
            Box::new(move |nm: &mut NodeModel, stop, on_step| {
                let handle = tokio::runtime::Handle::current();
                nm.run(handle, &tokens, &spec, backbone, stop, on_step)
            }),
        )?;
        let (res, flushed, nm) = rx.await.context("the loop thread ended without a result")?;
        drop(nm);
        (res, flushed)
    };
    flushed.context("writing the trace")?;
    let mut summary = res?;
    summary.cpu_s = daemon_runtime::metrics::process_cpu_seconds() - cpu_before;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{}", summary.render());
    }
    if summary.failed_steps > 0 {
        bail!(
            "{} steps had a table with no usable rows (policy fail); see the trace for each error",
            summary.failed_steps
        );
    }
    Ok(())
}

/// The batch, speculation and draft flags, checked; the drafts, if any.
fn checked_draft(args: &RunArgs) -> Result<Option<Draft>> {
    if !(1..=MAX_BATCH).contains(&args.batch) {
        bail!("--batch {} is not in 1..={MAX_BATCH}", args.batch);
    }
    if args.speculate > MAX_SPECULATE {
        bail!("--speculate {} is over {MAX_SPECULATE}", args.speculate);
    }
    Ok(match args.draft_us {
        None if args.draft_prefetch => bail!("--draft-prefetch needs --draft-us"),
        None if args.draft_reject > 0 => bail!("--draft-reject needs --draft-us"),
        None => None,
        Some(_) if args.speculate == 0 => bail!("--draft-us needs --speculate 1 or more"),
        Some(us) if us > MAX_DRAFT_TIME.as_micros() as u64 => {
            bail!("--draft-us {us} is over {}", MAX_DRAFT_TIME.as_micros())
        }
        Some(us) => Some(Draft {
            per_token: std::time::Duration::from_micros(us),
            prefetch: args.draft_prefetch,
            reject_percent: args.draft_reject,
        }),
    })
}

/// What the run is about to do, on stderr.
fn announce(args: &RunArgs, tokens: usize, origin: &str, spec: &LoopSpec, fusion: &str) {
    let draft = spec.draft;
    eprintln!(
        "running {} tokens from {} at {} tokens/s (fusion: {}, batch {}, prefill {}, speculate {}{})",
        args.tokens.map_or(tokens as u64, |t| t),
        origin,
        spec.tokens_per_second,
        fusion,
        spec.batch,
        spec.prefill,
        spec.speculate,
        match draft {
            Some(d) => format!(
                ", drafts {} us each, prefetch {}, {}% rejected",
                d.per_token.as_micros(),
                if d.prefetch { "on" } else { "off" },
                d.reject_percent
            ),
            None => String::new(),
        }
    );
}

/// What the loop thread hands back: the summary, the trace's flush, and
/// the node (dropped on the caller's runtime).
type LoopEnd<N> = (
    Result<inference_node::model::Summary, inference_node::model::LoopError>,
    std::io::Result<()>,
    N,
);

/// The loop of a node, run on its thread: the node, the stop flag and
/// the per-step callback in, the summary out.
type LoopFn<N> = dyn FnOnce(
        &mut N,
        &AtomicBool,
        &mut dyn FnMut(&StepRecord) -> std::io::Result<()>,
    ) -> Result<inference_node::model::Summary, inference_node::model::LoopError>
    + Send;

/// Run a node's model loop (`run_loop`) on a thread of its own (the I/O
/// stays on this runtime, whose handle the thread enters), with the
/// trace, progress and per-second lines.
fn start_loop<N: Send + 'static>(
    args: &RunArgs,
    mut node: N,
    (mut trace, mut series): (Option<std::io::BufWriter<std::fs::File>>, ModelSeries),
    run_loop: Box<LoopFn<N>>,
) -> Result<tokio::sync::oneshot::Receiver<LoopEnd<N>>> {
    let stop = Arc::new(AtomicBool::new(false));
    super::stop_on_signals(stop.clone());
    let handle = tokio::runtime::Handle::current();
    let quiet = args.quiet;
    let progress = args.progress_every.map(std::num::NonZeroU64::get);
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("model-loop".into())
        .spawn(move || {
            let _entered = handle.enter();
            let mut seconds = Seconds::default();
            let mut on_step = |r: &StepRecord| -> std::io::Result<()> {
                r.count_in(&mut series);
                if let Some(t) = trace.as_mut() {
                    serde_json::to_writer(&mut *t, r)?;
                    t.write_all(b"\n")?;
                }
                if let Some(n) = progress
                    && (r.step + 1).is_multiple_of(n)
                {
                    eprintln!(
                        "progress steps={} end_us={:.0} monotonic_us={}",
                        r.step + 1,
                        r.start_us + r.time_us,
                        inference_node::model::clock::monotonic_us()
                    );
                }
                for s in seconds.add(r) {
                    if !quiet {
                        eprintln!("{}", s.line());
                    }
                }
                Ok(())
            };
            let res = run_loop(&mut node, &stop, &mut on_step);
            if let (Some(last), false) = (seconds.finish(), quiet) {
                eprintln!("{}", last.line());
            }
            let flushed = trace.as_mut().map_or(Ok(()), Write::flush);
            // The receiver only goes away when the process is ending.
            let _ = tx.send((res, flushed, node));
        })
        .context("starting the loop thread")?;
    Ok(rx)
}
