//! The node daemon (`inference-node serve`): one model-loop thread runs
//! submitted sequences as a continuous batch: a sequence joins at a step
//! boundary (up to the node's `max_batch`; the rest wait in arrival order
//! in a bounded queue) and leaves when done, every step one message per
//! table for all of them, and each caller gets its own positions of each
//! step ([`Batcher`]). Between batches it applies reloads, and when idle it
//! runs a one-token self-check through the real serving path (routers,
//! fusion) before each systemd watchdog ping, so a wedged loop misses its
//! watchdog. The gRPC side (`engram.node.v1.EngramNode`) only queues work
//! and reads state. The loop is the config's model family's
//! ([`ServedModel`]: DeepSeek V4.1's or Qwen4Exp's).

mod served;

pub use served::{Admission, ServedModel};

use std::collections::{BTreeMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use cluster_config::Config;
use daemon_runtime::notify::Notifier;
use engram_protocol::node_api as api;
use engram_sync::Mutex;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::model::input::MAX_TOKENS;
use crate::model::node::{Backbone, InputChoice};
use crate::model::{
    BatchDriver, LoopSpec, MAX_SPECULATE, PositionRecord, SeqSpec, StepKind, StepRecord, Summary,
    TableSlot,
};
use crate::router::{Breaker, Router};

/// Sequences waiting at most (more are refused with RESOURCE_EXHAUSTED).
pub const QUEUE_DEPTH: usize = 8;
/// Step records buffered per caller; a caller this far behind is cut off
/// (the loop never waits for a reader).
pub const STREAM_BUFFER: usize = 4096;
/// Most positions one request may ask to decode.
pub const MAX_REQUEST_TOKENS: u64 = 10_000_000;
/// Most positions one request may prefill.
pub const MAX_PREFILL: u32 = 1 << 20;
/// Idle self-check period without a watchdog.
const IDLE_CHECK: Duration = Duration::from_secs(5);
/// The environment variable of the test-only stall: after this many
/// milliseconds the loop thread stops (as a wedged loop would), while the
/// gRPC side keeps answering.
pub const TEST_STALL_ENV: &str = "ENGRAM_TEST_STALL_AFTER_MS";

type Events = mpsc::Sender<Result<api::GenerateEvent, Status>>;

/// Work for the loop thread.
#[derive(Debug)]
enum Order {
    Generate(Waiting),
    Reload {
        config: Box<Config>,
        reply: tokio::sync::oneshot::Sender<Result<String, String>>,
    },
}

/// State the gRPC side reads.
#[derive(Debug)]
struct Shared {
    queued: AtomicU32,
    running: AtomicBool,
    draining: AtomicBool,
    /// Ends the running sequences after their current step (drain deadline).
    abort: AtomicBool,
    /// Most sequences in the batch (the node's `max_batch`).
    max_batch: AtomicU32,
    tokens_per_second: Mutex<f64>,
}

/// The daemon's handle: queues work for the loop thread.
#[derive(Debug, Clone)]
pub struct Daemon {
    orders: SyncSender<Order>,
    shared: Arc<Shared>,
    routers: Vec<Arc<Router>>,
    slots: Vec<TableSlot>,
    fusion: &'static str,
    /// Why a request may not speculate (`None`: it may).
    no_speculation: Option<&'static str>,
    /// Why a request may not give text (`None`: it may).
    no_text: Option<&'static str>,
}

/// What the loop thread needs besides the model.
#[derive(Debug)]
pub struct LoopContext {
    /// The node's runtime (fetches run on it).
    pub handle: tokio::runtime::Handle,
    /// systemd notifications.
    pub notifier: Arc<Notifier>,
    /// Where the backbone stand-in runs.
    pub backbone: Backbone,
    /// The node's name in the config (for reloads).
    pub name: String,
    /// The node's metrics (reloads register new sources in them).
    pub metrics: Arc<crate::metrics::NodeMetrics>,
}

impl Daemon {
    /// Start the loop thread over `nm`. The thread ends when every handle
    /// is dropped.
    pub fn start(
        nm: impl Into<ServedModel>,
        cx: LoopContext,
    ) -> std::io::Result<(Self, std::thread::JoinHandle<()>)> {
        let nm = nm.into();
        let (tx, rx) = sync_channel(QUEUE_DEPTH);
        let shared = Arc::new(Shared {
            queued: AtomicU32::new(0),
            running: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            abort: AtomicBool::new(false),
            max_batch: AtomicU32::new(nm.max_batch()),
            tokens_per_second: Mutex::new(nm.tokens_per_second()),
        });
        let d = Self {
            orders: tx,
            shared: shared.clone(),
            routers: nm.routers(),
            slots: nm.slots(),
            fusion: nm.fusion_name(),
            no_speculation: nm.no_speculation(),
            no_text: nm.no_text(),
        };
        let t = std::thread::Builder::new()
            .name("model-loop".into())
            .spawn(move || worker(nm, rx, shared, cx))?;
        Ok((d, t))
    }

    /// Refuse new sequences from now on.
    pub fn drain(&self) {
        self.shared.draining.store(true, Ordering::Relaxed);
    }

    /// End the running sequence after its current step, and start no
    /// other (the drain deadline).
    pub fn abort(&self) {
        self.shared.abort.store(true, Ordering::Relaxed);
    }

    /// Whether a sequence is running or waiting.
    pub fn busy(&self) -> bool {
        self.shared.running.load(Ordering::Relaxed)
            || self.shared.queued.load(Ordering::Relaxed) > 0
    }

    /// Apply a new config between sequences; the reply says what changed,
    /// or why nothing did.
    pub async fn reload(&self, config: Config) -> Result<String, String> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let order = Order::Reload {
            config: Box::new(config),
            reply,
        };
        // The queue may be full of sequences: wait for room off the runtime.
        let tx = self.orders.clone();
        tokio::task::spawn_blocking(move || tx.send(order))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|_| "the model loop has stopped".to_string())?;
        rx.await
            .map_err(|_| "the model loop has stopped".to_string())?
    }
}

/// A `Generate` order as it waits for the batch.
#[derive(Debug)]
struct Waiting {
    input: InputChoice,
    max_tokens: u64,
    prefill: u32,
    speculate: u32,
    events: Events,
    arrived: Instant,
}

/// A reload waiting for the batch to end.
type HeldReload = (
    Box<Config>,
    tokio::sync::oneshot::Sender<Result<String, String>>,
);

fn worker(mut nm: ServedModel, rx: Receiver<Order>, shared: Arc<Shared>, cx: LoopContext) {
    let period = cx
        .notifier
        .watchdog()
        .map_or(IDLE_CHECK, |w| (w / 2).max(Duration::from_millis(10)));
    let stall_at = std::env::var(TEST_STALL_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(|ms| Instant::now() + Duration::from_millis(ms));
    let tokenizer = nm.admission();
    let check_tokens = tokenizer.tokens(&InputChoice::Builtin, 0).ok();
    let mut last_ping: Option<Instant> = None;
    let mut waiting: VecDeque<Waiting> = VecDeque::new();
    let mut held: Option<HeldReload> = None;
    let mut next_tag = 0u64;
    loop {
        if stall_at.is_some_and(|t| Instant::now() >= t) {
            tracing::warn!("{TEST_STALL_ENV}: the model loop stops here (test)");
            loop {
                std::thread::park();
            }
        }
        // Between batches: a reload that waited for the batch to end.
        if let Some((config, reply)) = held.take() {
            apply_reload(&mut nm, &cx, &shared, &config, reply);
        }
        if waiting.is_empty() {
            match rx.recv_timeout(period) {
                Ok(Order::Generate(w)) => waiting.push_back(w),
                Ok(Order::Reload { config, reply }) => {
                    apply_reload(&mut nm, &cx, &shared, &config, reply);
                }
                Err(RecvTimeoutError::Timeout) => {
                    self_check(&mut nm, &cx, check_tokens.as_ref(), &mut last_ping, period);
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
            continue;
        }
        // A batch: it runs while sequences run or wait (and no reload waits).
        shared.running.store(true, Ordering::Relaxed);
        let spec = LoopSpec {
            tokens_per_second: nm.tokens_per_second(),
            prefill_budget: nm.prefill_budget(),
            ..LoopSpec::default()
        };
        let mut batch = Batcher {
            rx: &rx,
            waiting: &mut waiting,
            held: &mut held,
            shared: &shared,
            tokenizer: &tokenizer,
            metrics: &cx.metrics,
            series: cx.metrics.model.series(
                &nm.slots()
                    .iter()
                    .map(|s| (s.table, s.row_bytes))
                    .collect::<Vec<_>>(),
            ),
            slots: nm.slots(),
            spec: spec.clone(),
            active: BTreeMap::new(),
            next_tag: &mut next_tag,
            ping: &mut || ping(&cx, &mut last_ping, period),
        };
        if let Err(e) = nm.run_batch(cx.handle.clone(), &spec, &mut batch) {
            tracing::warn!(error = %e, "the batch failed: its sequences end with the error");
            batch.fail_all(&e.to_string());
        }
        cx.metrics.batch_sequences.set(0);
        shared.running.store(false, Ordering::Relaxed);
    }
}

fn ping(cx: &LoopContext, last: &mut Option<Instant>, period: Duration) {
    if last.is_none_or(|t| t.elapsed() >= period) {
        *last = Some(Instant::now());
        if let Err(e) = cx.notifier.watchdog_ping() {
            tracing::debug!(error = %e, "sd_notify WATCHDOG=1");
        }
    }
}

/// Idle: prove the serving path with one token, then ping the watchdog.
fn self_check(
    nm: &mut ServedModel,
    cx: &LoopContext,
    tokens: Option<&crate::model::Tokens>,
    last_ping: &mut Option<Instant>,
    period: Duration,
) {
    let Some(t) = tokens else { return };
    let spec = LoopSpec {
        tokens_per_second: nm.tokens_per_second(),
        max_tokens: Some(1),
        ..LoopSpec::default()
    };
    match nm.run_check(cx.handle.clone(), t, &spec, cx.backbone) {
        Ok(_) => ping(cx, last_ping, period),
        Err(e) => tracing::warn!(error = %e, "self-check failed; no watchdog ping"),
    }
}

fn apply_reload(
    nm: &mut ServedModel,
    cx: &LoopContext,
    shared: &Shared,
    config: &Config,
    reply: tokio::sync::oneshot::Sender<Result<String, String>>,
) {
    let r = nm.reload(&cx.handle, config, &cx.name, &cx.metrics);
    if r.is_ok() {
        *shared.tokens_per_second.lock() = nm.tokens_per_second();
        if let Some(n) = config.node(&cx.name) {
            shared.max_batch.store(n.max_batch, Ordering::Relaxed);
        }
    }
    // The caller may have gone; the reload stands either way.
    let _ = reply.send(r);
}

/// A request in the batch.
struct Active {
    events: Events,
    summary: Summary,
    /// Prefill positions it has not been sent yet (its prefill may come in
    /// chunks beside decoding requests).
    prefill_left: usize,
    speculate: bool,
    steps: u64,
    joined: Instant,
    /// Why it leaves unfinished, if it does.
    leave: Option<Leave>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leave {
    /// Its caller read too slowly.
    CutOff,
    /// Its caller went away.
    Gone,
    /// The drain deadline passed: it ends with what it has.
    Aborted,
}

/// The daemon's side of a continuous batch: it admits waiting requests at
/// step boundaries (up to `max_batch`), splits each step's record among
/// them, and ends each with its summary.
struct Batcher<'a> {
    rx: &'a Receiver<Order>,
    waiting: &'a mut VecDeque<Waiting>,
    held: &'a mut Option<HeldReload>,
    shared: &'a Shared,
    tokenizer: &'a Admission,
    metrics: &'a crate::metrics::NodeMetrics,
    /// The model loop's deployment series.
    series: crate::metrics::ModelSeries,
    slots: Vec<TableSlot>,
    spec: LoopSpec,
    active: BTreeMap<u64, Active>,
    next_tag: &'a mut u64,
    ping: &'a mut dyn FnMut(),
}

impl Batcher<'_> {
    /// Take orders off the channel while the waiting line has room and no
    /// reload waits (a reload waits for the batch; what came after it
    /// waits for the reload).
    fn take_orders(&mut self) {
        while self.held.is_none() && self.waiting.len() < QUEUE_DEPTH {
            match self.rx.try_recv() {
                Ok(Order::Generate(w)) => self.waiting.push_back(w),
                Ok(Order::Reload { config, reply }) => *self.held = Some((config, reply)),
                Err(_) => break,
            }
        }
    }

    /// End every request in the batch with `error` (the batch failed).
    fn fail_all(&mut self, error: &str) {
        for (_, a) in std::mem::take(&mut self.active) {
            let _ = a.events.try_send(Err(Status::internal(error.to_string())));
        }
    }

    fn finish(&mut self, tag: u64) {
        let Some(mut a) = self.active.remove(&tag) else {
            return;
        };
        let last = match a.leave {
            Some(Leave::Gone) => return,
            Some(Leave::CutOff) => Err(Status::resource_exhausted(format!(
                "the caller read too slowly ({STREAM_BUFFER} steps behind): the sequence was stopped"
            ))),
            Some(Leave::Aborted) | None => {
                a.summary.finish(a.joined.elapsed());
                Ok(api::GenerateEvent {
                    event: Some(api::generate_event::Event::Summary(summary_proto(
                        &a.summary,
                    ))),
                })
            }
        };
        // A full buffer or a gone caller: nothing more to tell.
        let _ = a.events.try_send(last);
    }
}

impl BatchDriver for Batcher<'_> {
    fn admit(&mut self, running: usize) -> Vec<SeqSpec> {
        self.take_orders();
        let abort = self.shared.abort.load(Ordering::Relaxed);
        let max = self.shared.max_batch.load(Ordering::Relaxed) as usize;
        let mut out = Vec::new();
        while running + out.len() < max || abort {
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            self.shared.queued.fetch_sub(1, Ordering::Relaxed);
            if abort {
                // Past the drain deadline: what still waits is not started.
                let _ = w
                    .events
                    .try_send(Err(Status::unavailable("the node is draining")));
                continue;
            }
            let min_len = (w.max_tokens as usize).saturating_add(w.prefill as usize);
            let tokens = match self.tokenizer.tokens(&w.input, min_len) {
                Ok(t) => t,
                Err(e) => {
                    let _ = w
                        .events
                        .try_send(Err(Status::invalid_argument(e.to_string())));
                    continue;
                }
            };
            self.metrics
                .queue_seconds
                .observe(w.arrived.elapsed().as_secs_f64());
            let tag = *self.next_tag;
            *self.next_tag += 1;
            let request = LoopSpec {
                prefill: w.prefill as usize,
                speculate: w.speculate as usize,
                ..self.spec.clone()
            };
            let w_step = Duration::from_secs_f64(1.0 / self.spec.tokens_per_second);
            self.active.insert(
                tag,
                Active {
                    events: w.events,
                    summary: Summary::new(&request, &self.slots, w_step),
                    prefill_left: w.prefill as usize,
                    speculate: w.speculate > 0,
                    steps: 0,
                    joined: Instant::now(),
                    leave: None,
                },
            );
            out.push(SeqSpec {
                tag,
                range: 0..tokens.raw.len(),
                tokens: Arc::new(tokens),
                prefill: w.prefill as usize,
                speculate: w.speculate as usize,
                limit: (w.max_tokens > 0).then_some(w.max_tokens),
            });
        }
        self.metrics
            .batch_sequences
            .set((running + out.len()) as i64);
        out
    }

    fn cancelled(&mut self) -> Vec<u64> {
        if self.shared.abort.load(Ordering::Relaxed) {
            for a in self.active.values_mut() {
                a.leave.get_or_insert(Leave::Aborted);
            }
        }
        let gone: Vec<u64> = self
            .active
            .iter()
            .filter(|(_, a)| a.leave.is_some())
            .map(|(&t, _)| t)
            .collect();
        for &t in &gone {
            self.finish(t);
        }
        gone
    }

    fn after_step(&mut self, rec: Option<&StepRecord>, finished: &[u64]) {
        if let Some(rec) = rec {
            (self.ping)();
            rec.count_in(&mut self.series);
            let mut in_step = 0u64;
            for (&tag, a) in &mut self.active {
                let positions: Vec<_> = rec
                    .positions
                    .iter()
                    .filter(|p| u64::from(p.seq) == tag & u64::from(u32::MAX))
                    .map(|p| PositionRecord {
                        seq: 0,
                        ..p.clone()
                    })
                    .collect();
                if positions.is_empty() {
                    continue;
                }
                in_step += 1;
                // A prefilling request's positions in a step are all of
                // its prefill (a chunk, or the rest).
                let prefilled = positions.len().min(a.prefill_left);
                a.prefill_left -= prefilled;
                let kind = if prefilled > 0 {
                    StepKind::Prefill
                } else if a.speculate {
                    StepKind::Verify
                } else {
                    StepKind::Decode
                };
                let own = StepRecord {
                    step: a.steps,
                    kind,
                    positions,
                    prefilled: prefilled as u64,
                    ..rec.clone()
                };
                a.steps += 1;
                a.summary.add(&own);
                match a.events.try_send(Ok(api::GenerateEvent {
                    event: Some(api::generate_event::Event::Step(step_proto(&own))),
                })) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => a.leave = Some(Leave::CutOff),
                    Err(mpsc::error::TrySendError::Closed(_)) => a.leave = Some(Leave::Gone),
                }
            }
            self.metrics.batch_size.observe(in_step as f64);
        }
        for &t in finished {
            self.finish(t);
        }
    }
}

fn step_proto(r: &StepRecord) -> api::Step {
    api::Step {
        step: r.step,
        kind: r.kind.as_str().into(),
        start_us: r.start_us,
        w_us: r.w_us,
        tables: r
            .tables
            .iter()
            .map(|t| api::TableStep {
                table: t.table,
                layer: t.layer,
                rows: t.rows as u32,
                unique_rows: t.unique_rows as u32,
                messages: t.messages,
                window_us: t.window_us,
                ready_us: t.ready_us,
                stall_us: t.stall_us,
                source: t.source.clone().unwrap_or_default(),
                hedges: t.hedges,
                failovers: t.failovers,
                late: t.late,
                error: t.error.clone().unwrap_or_default(),
            })
            .collect(),
        stall_us: r.stall_us,
        overrun_us: r.overrun_us,
        time_us: r.time_us,
        fusion_us: r.fusion_us,
        positions: r
            .positions
            .iter()
            .map(|p| api::Position {
                seq: p.seq,
                index: p.index,
                id: p.id,
                checksum: p.checksum.to_string(),
            })
            .collect(),
    }
}

fn summary_proto(s: &Summary) -> api::Summary {
    api::Summary {
        tokens: s.tokens,
        steps: s.steps,
        tokens_per_second: s.tokens_per_second,
        predicted_tokens_per_second: s.predicted_tokens_per_second,
        slowdown: s.slowdown,
        stall_p50_us: s.stall_p50_us,
        stall_p99_us: s.stall_p99_us,
        stall_max_us: s.stall_max_us,
        failed_steps: s.failed_steps,
        json: serde_json::to_string(s).unwrap_or_default(),
    }
}

fn breaker_name(b: Breaker) -> &'static str {
    match b {
        Breaker::Closed => "closed",
        Breaker::HalfOpen => "half_open",
        Breaker::Open => "open",
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<api::GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl api::engram_node_server::EngramNode for Daemon {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        req: Request<api::GenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        if self.shared.draining.load(Ordering::Relaxed) {
            return Err(Status::unavailable("the node is draining"));
        }
        let r = req.into_inner();
        let input = match r.input {
            Some(api::generate_request::Input::Text(_)) if self.no_text.is_some() => {
                return Err(Status::invalid_argument(self.no_text.unwrap_or_default()));
            }
            Some(api::generate_request::Input::Text(t)) if !t.trim().is_empty() => {
                InputChoice::InlineText(t)
            }
            Some(api::generate_request::Input::Ids(ids)) if !ids.ids.is_empty() => {
                if ids.ids.len() > MAX_TOKENS {
                    return Err(Status::invalid_argument(format!(
                        "{} token ids is more than the {MAX_TOKENS} accepted",
                        ids.ids.len()
                    )));
                }
                InputChoice::InlineIds(ids.ids)
            }
            _ => return Err(Status::invalid_argument("give text or token ids")),
        };
        if r.max_tokens > MAX_REQUEST_TOKENS {
            return Err(Status::invalid_argument(format!(
                "max_tokens {} is over {MAX_REQUEST_TOKENS}",
                r.max_tokens
            )));
        }
        if let Some(why) = self.no_speculation.filter(|_| r.speculate > 0) {
            return Err(Status::invalid_argument(why));
        }
        if r.prefill > MAX_PREFILL || r.speculate as usize > MAX_SPECULATE {
            return Err(Status::invalid_argument(format!(
                "prefill must be at most {MAX_PREFILL} and speculate at most {MAX_SPECULATE}"
            )));
        }
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        // Waiting counts the channel and the loop's own line: at most
        // QUEUE_DEPTH in all, whichever holds them.
        if self.shared.queued.fetch_add(1, Ordering::Relaxed) >= QUEUE_DEPTH as u32 {
            self.shared.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(Status::resource_exhausted(format!(
                "{QUEUE_DEPTH} sequences are already waiting"
            )));
        }
        let order = Order::Generate(Waiting {
            input,
            max_tokens: r.max_tokens,
            prefill: r.prefill,
            speculate: r.speculate,
            events: tx,
            arrived: Instant::now(),
        });
        match self.orders.try_send(order) {
            Ok(()) => {}
            Err(e) => {
                self.shared.queued.fetch_sub(1, Ordering::Relaxed);
                return Err(match e {
                    TrySendError::Full(_) => Status::resource_exhausted(format!(
                        "{QUEUE_DEPTH} sequences are already waiting"
                    )),
                    TrySendError::Disconnected(_) => {
                        Status::unavailable("the model loop has stopped")
                    }
                });
            }
        }
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn tables(
        &self,
        _: Request<api::TablesRequest>,
    ) -> Result<Response<api::TablesResponse>, Status> {
        let tables = self
            .slots
            .iter()
            .zip(&self.routers)
            .map(|(slot, r)| {
                let s = r.settings();
                api::TableState {
                    table: slot.table,
                    layer: slot.layer,
                    window_us: s.window.as_secs_f64() * 1e6,
                    hard_timeout_us: s.hard_timeout.as_secs_f64() * 1e6,
                    hedge: s.hedge.to_string(),
                    policy: s.policy.to_string(),
                    sources: r
                        .sources()
                        .iter()
                        .map(|h| api::SourceState {
                            name: h.source.name().to_string(),
                            breaker: breaker_name(h.breaker()).into(),
                            admissible: h.admissible(slot.table),
                            why_not: if h.admissible(slot.table) {
                                String::new()
                            } else {
                                h.why_not(slot.table).to_string()
                            },
                        })
                        .collect(),
                }
            })
            .collect();
        Ok(Response::new(api::TablesResponse {
            tables,
            tokens_per_second: *self.shared.tokens_per_second.lock(),
            fusion: self.fusion.into(),
            queued: self.shared.queued.load(Ordering::Relaxed),
            running: self.shared.running.load(Ordering::Relaxed),
        }))
    }
}
