//! The node daemon (`inference-node serve`): one model-loop thread runs
//! submitted sequences one at a time, in arrival order (a bounded queue),
//! streaming each step's record to its caller; between sequences it
//! applies reloads, and when idle it runs a one-token self-check through
//! the real serving path (routers, fusion) before each systemd watchdog
//! ping, so a wedged loop misses its watchdog. The gRPC side
//! (`engram.node.v1.EngramNode`) only queues work and reads state.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cluster_config::Config;
use cluster_config::daemon::notify::Notifier;
use engram_protocol::node_api as api;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::model::input::MAX_TOKENS;
use crate::model::node::{Backbone, InputChoice, NodeModel};
use crate::model::{LoopSpec, MAX_SPECULATE, StepRecord, Summary, TableSlot};
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
    Generate {
        input: InputChoice,
        max_tokens: u64,
        prefill: u32,
        speculate: u32,
        events: Events,
    },
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
    /// Ends the running sequence after its current step (drain deadline).
    abort: AtomicBool,
    tokens_per_second: Mutex<f64>,
}

/// The daemon's handle: queues work for the loop thread.
#[derive(Debug, Clone)]
pub struct Daemon {
    orders: SyncSender<Order>,
    shared: Arc<Shared>,
    routers: Vec<Arc<Router>>,
    slots: [TableSlot; 2],
    fusion: &'static str,
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
        nm: NodeModel,
        cx: LoopContext,
    ) -> std::io::Result<(Self, std::thread::JoinHandle<()>)> {
        let (tx, rx) = sync_channel(QUEUE_DEPTH);
        let shared = Arc::new(Shared {
            queued: AtomicU32::new(0),
            running: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            abort: AtomicBool::new(false),
            tokens_per_second: Mutex::new(nm.tokens_per_second()),
        });
        let d = Self {
            orders: tx,
            shared: shared.clone(),
            routers: nm.routers().to_vec(),
            slots: nm.slots(),
            fusion: nm.fusion_name(),
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

fn worker(mut nm: NodeModel, rx: Receiver<Order>, shared: Arc<Shared>, cx: LoopContext) {
    let period = cx
        .notifier
        .watchdog()
        .map_or(IDLE_CHECK, |w| (w / 2).max(Duration::from_millis(10)));
    let stall_at = std::env::var(TEST_STALL_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(|ms| Instant::now() + Duration::from_millis(ms));
    let check_tokens = nm.tokens(&InputChoice::Builtin, 0).ok();
    let mut last_ping: Option<Instant> = None;
    let ping = |last: &mut Option<Instant>| {
        if last.is_none_or(|t| t.elapsed() >= period) {
            *last = Some(Instant::now());
            if let Err(e) = cx.notifier.watchdog_ping() {
                tracing::debug!(error = %e, "sd_notify WATCHDOG=1");
            }
        }
    };
    loop {
        if stall_at.is_some_and(|t| Instant::now() >= t) {
            tracing::warn!("{TEST_STALL_ENV}: the model loop stops here (test)");
            loop {
                std::thread::park();
            }
        }
        match rx.recv_timeout(period) {
            Ok(Order::Generate {
                input,
                max_tokens,
                prefill,
                speculate,
                events,
            }) => {
                shared.queued.fetch_sub(1, Ordering::Relaxed);
                if shared.abort.load(Ordering::Relaxed) {
                    // Past the drain deadline: what still waits is not started.
                    let _ = events.try_send(Err(Status::unavailable("the node is draining")));
                    continue;
                }
                shared.running.store(true, Ordering::Relaxed);
                generate(
                    &mut nm,
                    &cx,
                    &shared,
                    &input,
                    max_tokens,
                    prefill,
                    speculate,
                    &events,
                    &mut || ping(&mut last_ping),
                );
                shared.running.store(false, Ordering::Relaxed);
            }
            Ok(Order::Reload { config, reply }) => {
                let r = nm.reload(&cx.handle, &config, &cx.name, &cx.metrics);
                if r.is_ok() {
                    *shared
                        .tokens_per_second
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = nm.tokens_per_second();
                }
                // The caller may have gone; the reload stands either way.
                let _ = reply.send(r);
            }
            Err(RecvTimeoutError::Timeout) => {
                // Idle: prove the serving path with one token, then ping.
                if let Some(t) = &check_tokens {
                    let spec = LoopSpec {
                        tokens_per_second: nm.tokens_per_second(),
                        max_tokens: Some(1),
                        ..LoopSpec::default()
                    };
                    let stop = AtomicBool::new(false);
                    match nm.run(cx.handle.clone(), t, &spec, cx.backbone, &stop, &mut |_| {
                        Ok(())
                    }) {
                        Ok(_) => ping(&mut last_ping),
                        Err(e) => tracing::warn!(error = %e, "self-check failed; no watchdog ping"),
                    }
                }
            }
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

#[allow(clippy::too_many_arguments)] // one request's fields and the loop's context
fn generate(
    nm: &mut NodeModel,
    cx: &LoopContext,
    shared: &Shared,
    input: &InputChoice,
    max_tokens: u64,
    prefill: u32,
    speculate: u32,
    events: &Events,
    ping: &mut dyn FnMut(),
) {
    let min_len = (max_tokens as usize).saturating_add(prefill as usize);
    let tokens = match nm.tokens(input, min_len) {
        Ok(t) => t,
        Err(e) => {
            let _ = events.try_send(Err(Status::invalid_argument(e.to_string())));
            return;
        }
    };
    let spec = LoopSpec {
        tokens_per_second: nm.tokens_per_second(),
        max_tokens: (max_tokens > 0).then_some(max_tokens),
        prefill: prefill as usize,
        speculate: speculate as usize,
        ..LoopSpec::default()
    };
    let stop = AtomicBool::new(false);
    let mut cut_off = false;
    let res = nm.run(
        cx.handle.clone(),
        &tokens,
        &spec,
        cx.backbone,
        &stop,
        &mut |r| {
            ping();
            match events.try_send(Ok(api::GenerateEvent {
                event: Some(api::generate_event::Event::Step(step_proto(r))),
            })) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => {
                    cut_off = true;
                    stop.store(true, Ordering::Relaxed);
                }
                Err(mpsc::error::TrySendError::Closed(_)) => stop.store(true, Ordering::Relaxed),
            }
            if shared.abort.load(Ordering::Relaxed) {
                stop.store(true, Ordering::Relaxed);
            }
            Ok(())
        },
    );
    let last = match res {
        _ if cut_off => Err(Status::resource_exhausted(format!(
            "the caller read too slowly ({STREAM_BUFFER} steps behind): the sequence was stopped"
        ))),
        Ok(s) => Ok(api::GenerateEvent {
            event: Some(api::generate_event::Event::Summary(summary_proto(&s))),
        }),
        Err(e) => Err(Status::internal(e.to_string())),
    };
    // A full buffer or a gone caller: nothing more to tell.
    let _ = events.try_send(last);
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
                checksum: p.checksum.clone(),
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
        if r.prefill > MAX_PREFILL || r.speculate as usize > MAX_SPECULATE {
            return Err(Status::invalid_argument(format!(
                "prefill must be at most {MAX_PREFILL} and speculate at most {MAX_SPECULATE}"
            )));
        }
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        self.shared.queued.fetch_add(1, Ordering::Relaxed);
        let order = Order::Generate {
            input,
            max_tokens: r.max_tokens,
            prefill: r.prefill,
            speculate: r.speculate,
            events: tx,
        };
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
            tokens_per_second: *self
                .shared
                .tokens_per_second
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
            fusion: self.fusion.into(),
            queued: self.shared.queued.load(Ordering::Relaxed),
            running: self.shared.running.load(Ordering::Relaxed),
        }))
    }
}
