//! The node's Engram memory as a library, for inference engines that run
//! their own forward pass (the Python package and the C library wrap this).
//!
//! [`EmbeddedNode::open`] builds from the cluster config and a node name
//! exactly what `inference-node run` builds (its routers over shared
//! sources, SSD and local copies opened and their digests checked, donors
//! probed, probe loops running, the same metrics), on an I/O thread of its
//! own that runs a tokio runtime as the node's does. A step then asks for
//! both tables' rows at once ([`EmbeddedNode::prefetch`]: one message per
//! table, returning at once) and later takes each layer's rows into its own
//! buffer ([`Ticket::wait`], with its own deadline).
//!
//! Thread safety: the memory and its tickets are `Send + Sync`. No call
//! holds a lock across a wait that another call needs: a prefetch takes a
//! read lock only to clone the open state, and a wait sleeps on its own
//! ticket. [`EmbeddedNode::close`] (or the last drop) lets fetches in
//! flight end, for a bounded time, then stops the probes and the thread.

pub mod batch;
pub mod tables;
mod ticket;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cluster_config::Config;
use engram_protocol::encoding::RowEncoding;
use engram_protocol::hashing::{COLUMNS, ENGRAM_LAYERS, HashParams};
use engram_protocol::row::{ROW_VALUES, bf16_bits_to_f32, dequantize_row_bf16};
use engram_protocol::{ROW_BYTES, RowBytes};
use engram_sync::RwLock;
use thiserror::Error;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

pub use batch::{CONTEXT, MAX_SEGMENTS, NO_ROW, NO_TOKEN, Segment};
pub use tables::{NodeTables, TableInfo};
pub use ticket::{POSITION_BYTES, Served, Ticket};

use crate::memory::Routers;
use crate::metrics::NodeMetrics;
use crate::model::check_config_json;
use crate::model::fetch::{FetchCounts, fetch_rows};
use crate::model::node::{SetupError, chunk_rows, layer_tables, token_map, usable_at_start};
use crate::router::Router;
pub use crate::source::TableView;
use batch::Addressing;
pub use engram_store::resident::RowLayout;
use ticket::{Done, LayerCounters};

/// The longest lead [`EmbeddedNode::warm`] takes (it keeps a thread
/// polling for that long at most).
pub const MAX_WARM_LEAD: Duration = Duration::from_secs(1);

/// How long [`Drop`] lets fetches in flight end.
pub const DEFAULT_DRAIN: Duration = Duration::from_secs(2);

/// What went wrong, by kind (the C library's error codes follow it).
#[derive(Debug, Error)]
pub enum EmbedError {
    /// The config cannot be read or lacks what the memory needs.
    #[error("{0}")]
    Config(String),
    /// The memory could not be built (a copy, a certificate, no usable source).
    #[error("{0}")]
    Setup(String),
    /// A call's arguments are wrong (sizes, ids, layers).
    #[error("{0}")]
    BadInput(String),
    /// Every source failed and the table's policy is `fail`.
    #[error("{0}")]
    NoSource(String),
    /// The caller's deadline passed first.
    #[error("{0}")]
    Timeout(String),
    /// The memory is closed.
    #[error("this Engram memory is closed")]
    Closed,
    /// Something failed that should not (a thread could not start).
    #[error("{0}")]
    Internal(String),
}

impl From<SetupError> for EmbedError {
    fn from(e: SetupError) -> Self {
        match e {
            SetupError::Config(m) => Self::Config(m),
            e => Self::Setup(e.to_string()),
        }
    }
}

/// Where the memory serves its Prometheus `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetricsAt {
    /// The node's `metrics` address in the config, if it has one.
    #[default]
    Config,
    /// Nowhere (read them with [`EmbeddedNode::metrics_text`]).
    Off,
    /// This address.
    Addr(SocketAddr),
}

/// A node's memory of either kind, for what serves engines (the engine
/// socket, the engine rings): DeepSeek V4.1's, with its hashing and its two
/// Engram tables, or the tables of a rack of any family.
#[derive(Debug, Clone)]
pub enum NodeMemory {
    /// DeepSeek V4.1's memory.
    V41(Arc<EmbeddedNode>),
    /// A node's tables of any model family (rows of any size).
    Tables(Arc<NodeTables>),
}

impl NodeMemory {
    /// Let fetches in flight end (at most `drain`), then stop.
    pub fn close(&self, drain: Duration) {
        match self {
            Self::V41(m) => m.close(drain),
            Self::Tables(t) => t.close(drain),
        }
    }

    /// Whether it has been closed.
    pub fn is_closed(&self) -> bool {
        match self {
            Self::V41(m) => m.is_closed(),
            Self::Tables(t) => t.is_closed(),
        }
    }
}

/// Which layers a row-id prefetch ([`EmbeddedNode::prefetch_rows`]) carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowLayers {
    /// Layer 1's ids, then layer 14's, per position.
    Both,
    /// One layer's (1 or 14).
    One(u32),
}

/// How [`EmbeddedNode::open_with`] opens.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Where `/metrics` is served.
    pub metrics: MetricsAt,
}

/// Counters of one layer since the memory opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// The Engram layer.
    pub layer: u32,
    /// The table id.
    pub table: u32,
    /// Prefetches whose fetch of this layer ended.
    pub prefetches: u64,
    /// Distinct rows fetched.
    pub rows: u64,
    /// Messages sent.
    pub messages: u64,
    /// Hedges sent.
    pub hedges: u64,
    /// Failovers.
    pub failovers: u64,
    /// Fetches answered after the table's deadline.
    pub late: u64,
    /// Fetches answered with zeros by policy.
    pub zeros: u64,
    /// Fetches that failed (policy `fail`).
    pub failed: u64,
}

/// What an open memory holds.
#[derive(Debug)]
struct Open {
    /// Held for its sources and probe loops (its drop stops them).
    memory: Routers,
    routers: [Arc<Router>; 2],
    tables: [u32; 2],
    /// Each table's row count (row ids at or past it are refused).
    table_rows: [u64; 2],
    addressing: Addressing,
    chunk_rows: usize,
    metrics: Arc<NodeMetrics>,
    metrics_addr: Option<SocketAddr>,
    metrics_task: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    node: String,
    config: PathBuf,
    tokens_per_second: f64,
    handle: Handle,
    state: RwLock<Option<Arc<Open>>>,
    counters: Arc<[LayerCounters; 2]>,
    /// Fetches started ever and in flight now (what a warm-up and a
    /// close wait for).
    counts: Arc<FetchCounts>,
    io: IoThread,
}

/// A node embedded in an engine process: its routers, I/O thread and
/// metrics, opened from the cluster config. See the module documentation.
#[derive(Debug)]
pub struct EmbeddedNode {
    shared: Shared,
}

impl EmbeddedNode {
    /// Open node `node` of the cluster config at `config`, serving
    /// `/metrics` where the config says.
    pub fn open(config: &Path, node: &str) -> Result<Self, EmbedError> {
        Self::open_with(config, node, &OpenOptions::default())
    }

    /// Open node `node` of the cluster config at `config`.
    pub fn open_with(config: &Path, node: &str, opts: &OpenOptions) -> Result<Self, EmbedError> {
        let cfg = Config::load(config).map_err(|e| EmbedError::Config(e.to_string()))?;
        let n = find_node(&cfg, config, node)?;
        let model = cfg.model.clone().ok_or_else(|| {
            EmbedError::Config(format!(
                "{}: the Engram memory needs a [model] table: its hashing \
                 (hash_preset or hash_base) and token map (tokenizer or token_map)",
                config.display()
            ))
        })?;
        let params =
            HashParams::new(model.hashing).map_err(|e| EmbedError::Config(e.to_string()))?;
        let tables = layer_tables(&cfg, n, &model, &params)?;
        let (tokenizer, map) = token_map(&model)?;
        let map = tokenizer.map(|(_, m)| m).or(map);
        check_config_json(&model, &params, map.as_ref()).map_err(EmbedError::Config)?;
        let pad = match &map {
            Some(m) => m.get(model.pad_token).map_or(0, i64::from),
            None => i64::from(model.pad_token),
        };
        let addressing = Addressing { params, map, pad };
        let tokens_per_second = n.tokens_per_second;
        let metrics_at = metrics_address(&cfg, n, opts)?;
        let name = node.to_string();
        let chunk = chunk_rows(&cfg);
        let (open, handle, io) = open_on_io_thread(node, async move {
            build(cfg, name, tables, addressing, chunk, metrics_at).await
        })?;
        Ok(Self {
            shared: Shared {
                node: node.to_string(),
                config: config.to_path_buf(),
                tokens_per_second,
                handle,
                state: RwLock::new(Some(Arc::new(open))),
                counters: Arc::default(),
                counts: Arc::default(),
                io: engram_sync::Mutex::new(Some(io)),
            },
        })
    }

    fn open_state(&self) -> Result<Arc<Open>, EmbedError> {
        self.shared.state.read().clone().ok_or(EmbedError::Closed)
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.shared.node
    }

    /// The config file it was opened from.
    pub fn config_path(&self) -> &Path {
        &self.shared.config
    }

    /// The node's token rate in the config (its tables' windows follow it).
    pub fn tokens_per_second(&self) -> f64 {
        self.shared.tokens_per_second
    }

    /// The Engram layers, in slot order: `[1, 14]`.
    pub fn layers(&self) -> [u32; 2] {
        ENGRAM_LAYERS
    }

    /// The table ids of layers 1 and 14.
    pub fn tables(&self) -> Result<[u32; 2], EmbedError> {
        Ok(self.open_state()?.tables)
    }

    /// The row counts of layers 1's and 14's tables.
    pub fn table_rows(&self) -> Result<[u64; 2], EmbedError> {
        Ok(self.open_state()?.table_rows)
    }

    /// What layers 1's and 14's tables do when every source failed
    /// (their routes' `policy`).
    pub fn policies(&self) -> Result<[cluster_config::Policy; 2], EmbedError> {
        let open = self.open_state()?;
        Ok([
            open.routers[0].settings().policy,
            open.routers[1].settings().policy,
        ])
    }

    /// Where `/metrics` is served, if anywhere.
    pub fn metrics_addr(&self) -> Result<Option<SocketAddr>, EmbedError> {
        Ok(self.open_state()?.metrics_addr)
    }

    /// Whether [`Self::close`] has run.
    pub fn is_closed(&self) -> bool {
        self.open_state().is_err()
    }

    /// Row ids of every position of `ids` (raw token ids, cut into
    /// `segments`), without fetching: `out[p * 48 + layer_slot * 24 + column]`,
    /// [`NO_ROW`] for a DEAD position.
    pub fn addresses(
        &self,
        ids: &[i64],
        segments: &[Segment],
        out: &mut [u64],
    ) -> Result<(), EmbedError> {
        self.open_state()?.addressing.addresses(ids, segments, out)
    }

    /// Start fetching both tables' rows for `ids` (raw token ids cut into
    /// `segments`, one per sequence) at once, one message per table (more
    /// only when the rows exceed a donor's frame cap); returns at once.
    pub fn prefetch(&self, ids: &[i64], segments: &[Segment]) -> Result<Ticket, EmbedError> {
        let open = self.open_state()?;
        let plan = open.addressing.plan(ids, segments)?;
        let [l1, l14] = plan.layers;
        let ticket = Ticket::new(plan.live, [l1.index, l14.index], open.tables);
        self.start(&open, ticket, [Some(l1.unique), Some(l14.unique)])
    }

    /// Start fetching rows by their ids, as an engine that hashes on its
    /// own (on its GPU) has them: `rows` holds, position after position,
    /// `columns.len()` row ids of each layer in `layers` (both: layer 1's,
    /// then layer 14's; or one layer's), the columns `columns` of the 24
    /// (a tensor-parallel rank's head slice; `0..24` for all). A position
    /// whose ids are all [`NO_ROW`] is DEAD (zeros, nothing fetched).
    /// Ids are checked against each table's size and deduplicated; one
    /// message per table, as [`Self::prefetch`]. The ticket's waits take
    /// `positions x columns.len() x 264` bytes.
    pub fn prefetch_rows(
        &self,
        rows: &[u64],
        layers: RowLayers,
        columns: std::ops::Range<usize>,
    ) -> Result<Ticket, EmbedError> {
        let open = self.open_state()?;
        let width = columns.len();
        if columns.start >= columns.end || columns.end > COLUMNS {
            return Err(EmbedError::BadInput(format!(
                "columns {}..{}: give a non-empty range within 0..{COLUMNS}",
                columns.start, columns.end
            )));
        }
        let slots: Vec<usize> = match layers {
            RowLayers::Both => vec![0, 1],
            RowLayers::One(layer) => vec![ticket::slot_of(layer)?],
        };
        let plan = ticket::plan_rows(
            rows,
            &slots,
            (width, columns.start, false),
            (ENGRAM_LAYERS, open.tables, open.table_rows),
        )?;
        let ticket = Ticket::with_columns(plan.live, plan.index, open.tables, width, plan.present);
        let unique = plan.unique;
        self.start(&open, ticket, unique)
    }

    /// The next prefetch comes in about `lead`: wake the path to its rows
    /// now, as the node's own loop does before each step (`inference-node
    /// run --warm-us`). Each table's first source is pinged (a donor then
    /// polls its socket for a millisecond instead of sleeping), and the
    /// memory's I/O thread keeps polling until the fetches started after
    /// this call have ended, or `lead` plus a millisecond has passed. A
    /// paced engine calls it a few hundred microseconds before each step's
    /// prefetch; it returns at once.
    pub fn warm(&self, lead: Duration) -> Result<(), EmbedError> {
        if lead > MAX_WARM_LEAD {
            return Err(EmbedError::BadInput(format!(
                "a warm-up lead of {lead:?}: at most {MAX_WARM_LEAD:?}"
            )));
        }
        let open = self.open_state()?;
        crate::model::fetch::spawn_warm(
            &self.shared.handle,
            open.routers.to_vec(),
            Arc::clone(&self.shared.counts),
            lead,
        );
        Ok(())
    }

    /// Spawn the fetch of each layer's distinct rows (`None`: a layer the
    /// ticket does not carry) and hand the ticket back.
    fn start(
        &self,
        open: &Open,
        ticket: Ticket,
        unique: [Option<Vec<u64>>; 2],
    ) -> Result<Ticket, EmbedError> {
        let started = Instant::now();
        for (slot, unique) in unique.into_iter().enumerate() {
            let Some(unique) = unique else { continue };
            if unique.is_empty() {
                // Every position is DEAD: nothing to fetch, zeros to write.
                ticket.done[slot].finish(crate::model::Fetch::default(), Duration::ZERO);
                continue;
            }
            let router = open.routers[slot].clone();
            let done: Arc<Done> = ticket.done[slot].clone();
            let counters = self.shared.counters.clone();
            let counts = self.shared.counts.clone();
            let chunk = open.chunk_rows;
            counts.in_flight.fetch_add(1, Ordering::AcqRel);
            counts.started.fetch_add(1, Ordering::AcqRel);
            let guard = Unfinished { done, counts };
            self.shared.handle.spawn(async move {
                let f = fetch_rows(&router, &unique, chunk).await;
                counters[slot].count(&f);
                guard.done.finish(f, started.elapsed());
            });
        }
        Ok(ticket)
    }

    /// Layer `layer`'s table as this process maps it (see
    /// [`TableView`] for the layout): a host-local donor's memory, which
    /// every process on the host maps (one physical copy), or else the
    /// node's own `local` copy. Waits up to `wait` for a host socket to
    /// hand the table over (it does so within milliseconds of opening).
    /// The view holds the memory: a swap on the donor leaves it as it
    /// was until dropped, and a fresh call returns the new version.
    pub fn table_view(&self, layer: u32, wait: Duration) -> Result<TableView, EmbedError> {
        let open = self.open_state()?;
        let slot = ENGRAM_LAYERS
            .iter()
            .position(|&l| l == layer)
            .ok_or_else(|| {
                EmbedError::BadInput(format!(
                    "layer {layer} has no Engram table (layers: {ENGRAM_LAYERS:?})"
                ))
            })?;
        view_of(&open.memory, open.tables[slot], wait).map_err(|e| match e {
            EmbedError::NoSource(m) => EmbedError::NoSource(format!("layer {layer}'s {m}")),
            e => e,
        })
    }

    /// Each layer's counters since the memory opened.
    pub fn stats(&self) -> Result<[LayerStats; 2], EmbedError> {
        let open = self.open_state()?;
        Ok(std::array::from_fn(|slot| {
            let c = &self.shared.counters[slot];
            let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
            LayerStats {
                layer: ENGRAM_LAYERS[slot],
                table: open.tables[slot],
                prefetches: g(&c.prefetches),
                rows: g(&c.rows),
                messages: g(&c.messages),
                hedges: g(&c.hedges),
                failovers: g(&c.failovers),
                late: g(&c.late),
                zeros: g(&c.zeros),
                failed: g(&c.failed),
            }
        }))
    }

    /// The node's metric series (shared with the rings this memory serves).
    pub(crate) fn metrics(&self) -> Result<Arc<NodeMetrics>, EmbedError> {
        Ok(Arc::clone(&self.open_state()?.metrics))
    }

    /// The node's metrics in Prometheus text (what `/metrics` serves).
    pub fn metrics_text(&self) -> Result<String, EmbedError> {
        Ok(self.open_state()?.metrics.render())
    }

    /// Close: refuse new calls, let fetches in flight end (at most
    /// `drain`), then stop the probes, the metrics server and the I/O
    /// thread. Tickets still held fail their waits with what their fetch
    /// came to, or a timeout. Closing twice is a no-op.
    pub fn close(&self, drain: Duration) {
        let open = self.shared.state.write().take();
        let Some(open) = open else { return };
        drain_and_stop(
            &self.shared.handle,
            &self.shared.counts,
            &self.shared.io,
            drain,
            move || {
                if let Some(t) = &open.metrics_task {
                    t.abort();
                }
                drop(open);
            },
        );
    }
}

impl Drop for EmbeddedNode {
    fn drop(&mut self) {
        self.close(DEFAULT_DRAIN);
    }
}

/// A fetch task's hold on its ticket: however the task ends (its runtime
/// shut down by a close before the rows came, too), the ticket's waiters
/// are answered and the in-flight count drops.
struct Unfinished {
    done: Arc<Done>,
    counts: Arc<FetchCounts>,
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.done.is_finished() {
            self.done.finish(
                crate::model::Fetch {
                    error: Some("the memory closed before the rows arrived".into()),
                    ..Default::default()
                },
                Duration::ZERO,
            );
        }
        self.counts.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Build the open state on the I/O runtime.
async fn build(
    cfg: Config,
    name: String,
    tables: [u32; 2],
    addressing: Addressing,
    chunk_rows: usize,
    metrics_at: Option<SocketAddr>,
) -> Result<Open, SetupError> {
    let metrics = Arc::new(NodeMetrics::new());
    let memory = Routers::from_config(&cfg, &name, &metrics).await?;
    let router = |t: u32| {
        memory
            .router(t)
            .cloned()
            .ok_or_else(|| SetupError::Config(format!("table {t} has no router")))
    };
    let routers = [router(tables[0])?, router(tables[1])?];
    let rows_of = |t: u32| {
        cfg.table(t)
            .map(|t| t.rows)
            .ok_or_else(|| SetupError::Config(format!("table {t} is not in the config")))
    };
    let table_rows = [rows_of(tables[0])?, rows_of(tables[1])?];
    usable_at_start(&routers, &crate::model::v41_slots(tables[0], tables[1]))?;
    let (metrics_addr, metrics_task) = serve_at(metrics_at, &metrics, &name).await?;
    Ok(Open {
        memory,
        routers,
        tables,
        table_rows,
        addressing,
        chunk_rows,
        metrics,
        metrics_addr,
        metrics_task,
    })
}

/// Dequantize rows (`rows.len()` a multiple of 264) into `out` (256 values
/// per row) as f32: the values the node's fusion reads (each rounded to
/// bf16, as V4.1 computes them).
pub fn dequantize_f32(rows: &[u8], out: &mut [f32]) -> Result<(), EmbedError> {
    let mut bf = [0u16; ROW_VALUES];
    each_row(rows, out.len(), |i, row| {
        dequantize_row_bf16(row, &mut bf)?;
        for (o, &b) in out[i * ROW_VALUES..(i + 1) * ROW_VALUES]
            .iter_mut()
            .zip(&bf)
        {
            *o = bf16_bits_to_f32(b);
        }
        Ok(())
    })
}

/// Dequantize rows into `out` as bf16 bit patterns (what
/// [`dequantize_f32`] gives, before widening).
pub fn dequantize_bf16(rows: &[u8], out: &mut [u16]) -> Result<(), EmbedError> {
    each_row(rows, out.len(), |i, row| {
        let dst: &mut [u16; ROW_VALUES] = (&mut out[i * ROW_VALUES..(i + 1) * ROW_VALUES])
            .try_into()
            .map_err(|_| engram_protocol::row::RowError::Length { len: 0, rows: 1 })?;
        dequantize_row_bf16(row, dst)
    })
}

/// Check the sizes, then call `f` on every row with its index.
/// Dequantize rows of `encoding` (`rows.len()` a multiple of its row
/// size) into `out` as bf16 bit patterns, as the engines compute them;
/// `tensor_scale` is the table's F32 scale (ignored by encodings without
/// one; required by those with one).
pub fn dequantize_encoded_bf16(
    encoding: RowEncoding,
    tensor_scale: Option<f32>,
    rows: &[u8],
    out: &mut [u16],
) -> Result<(), EmbedError> {
    let (size, values) = (encoding.row_bytes(), encoding.values());
    let scale = match (encoding.has_tensor_scale(), tensor_scale) {
        (true, None) => {
            return Err(EmbedError::BadInput(format!(
                "{} rows need their table's tensor_scale",
                encoding.name()
            )));
        }
        (_, s) => s.unwrap_or(1.0),
    };
    if !rows.len().is_multiple_of(size) || out.len() != rows.len() / size * values {
        return Err(EmbedError::BadInput(format!(
            "{} bytes of {} rows ({size} bytes each) and an output of {} values \
             ({values} per row)",
            rows.len(),
            encoding.name(),
            out.len()
        )));
    }
    for (i, (row, o)) in rows
        .chunks_exact(size)
        .zip(out.chunks_exact_mut(values))
        .enumerate()
    {
        encoding
            .dequantize_bf16(row, scale, o)
            .map_err(|e| EmbedError::BadInput(format!("row {i}: {e}")))?;
    }
    Ok(())
}

fn each_row(
    rows: &[u8],
    out_len: usize,
    mut f: impl FnMut(usize, &RowBytes) -> Result<(), engram_protocol::row::RowError>,
) -> Result<(), EmbedError> {
    if !rows.len().is_multiple_of(ROW_BYTES) {
        return Err(EmbedError::BadInput(format!(
            "{} bytes of rows is not a whole number of {ROW_BYTES}-byte rows",
            rows.len()
        )));
    }
    let n = rows.len() / ROW_BYTES;
    if out_len != n * ROW_VALUES {
        return Err(EmbedError::BadInput(format!(
            "the output holds {out_len} values; {n} rows need {} ({ROW_VALUES} per row)",
            n * ROW_VALUES
        )));
    }
    for (i, row) in rows.chunks_exact(ROW_BYTES).enumerate() {
        let row: &RowBytes = row
            .try_into()
            .map_err(|_| EmbedError::BadInput(format!("row {i} is not {ROW_BYTES} bytes")))?;
        f(i, row).map_err(|e| EmbedError::BadInput(format!("row {i}: {e}")))?;
    }
    Ok(())
}

/// Node `node` of `cfg` (read from `path`), or which nodes there are.
fn find_node<'a>(
    cfg: &'a Config,
    path: &Path,
    node: &str,
) -> Result<&'a cluster_config::Node, EmbedError> {
    cfg.node(node).ok_or_else(|| {
        EmbedError::Config(format!(
            "node {node:?} is not in {} (nodes: {})",
            path.display(),
            cfg.nodes
                .iter()
                .map(|n| n.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
}

/// Where `/metrics` is served, as `opts` asks for node `n`.
fn metrics_address(
    cfg: &Config,
    n: &cluster_config::Node,
    opts: &OpenOptions,
) -> Result<Option<SocketAddr>, EmbedError> {
    Ok(match opts.metrics {
        MetricsAt::Config => n.metrics,
        MetricsAt::Off => None,
        MetricsAt::Addr(a) => {
            // The loopback rule `check` applies to the config's address.
            cfg.plaintext_bind("metrics: /metrics", a)
                .map_err(EmbedError::Config)?;
            Some(a)
        }
    })
}

/// Serve `/metrics` at `at`, if anywhere: the bound address and the task.
async fn serve_at(
    at: Option<SocketAddr>,
    metrics: &Arc<NodeMetrics>,
    name: &str,
) -> Result<(Option<SocketAddr>, Option<JoinHandle<()>>), SetupError> {
    let Some(a) = at else { return Ok((None, None)) };
    let (bound, task) = crate::memory::serve_metrics(a, metrics.clone())
        .await
        .map_err(|e| {
            SetupError::Config(format!(
                "node {name:?}: binding the metrics address {a}: {e}"
            ))
        })?;
    Ok((Some(bound), Some(task)))
}

/// Table `table`'s memory as this process maps it (see
/// [`EmbeddedNode::table_view`]), waiting up to `wait` when a host-local
/// donor may hand it over.
fn view_of(memory: &Routers, table: u32, wait: Duration) -> Result<TableView, EmbedError> {
    // Only a host-local donor's table is worth waiting for.
    let wait = if memory.may_view(table) {
        wait
    } else {
        Duration::ZERO
    };
    let until = Instant::now() + wait;
    loop {
        if let Some(v) = memory.table_view(table) {
            return Ok(v);
        }
        if Instant::now() >= until {
            return Err(EmbedError::NoSource(format!(
                "table {table} is not in this process's memory: \
                 no donor on this host shares it through its host socket at the \
                 pinned version, and the node has no local copy of it"
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Let fetches in flight end (at most `drain`), run `drop_open` on the
/// I/O runtime (the memory's connections and tasks live there), then stop
/// the I/O thread.
fn drain_and_stop(
    handle: &Handle,
    counts: &FetchCounts,
    io: &IoThread,
    drain: Duration,
    drop_open: impl FnOnce() + Send + 'static,
) {
    let until = Instant::now() + drain;
    while counts.in_flight.load(Ordering::Acquire) > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_micros(500));
    }
    let (tx, rx) = std::sync::mpsc::sync_channel::<()>(1);
    handle.spawn(async move {
        drop_open();
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(Duration::from_secs(1));
    let io = io.lock().take();
    if let Some((stop, thread)) = io {
        let _ = stop.send(());
        let _ = thread.join();
    }
}

/// The I/O thread's stop signal and handle.
type IoParts = (
    tokio::sync::oneshot::Sender<()>,
    std::thread::JoinHandle<()>,
);

/// The I/O thread's stop signal and handle, until closed.
type IoThread = engram_sync::Mutex<Option<IoParts>>;

/// Start an I/O thread and build `node`'s open state on it with `build`:
/// the state, the runtime's handle and the thread (stopped again when the
/// build fails, whose error says the node cannot start).
fn open_on_io_thread<T: Send + 'static>(
    node: &str,
    build: impl Future<Output = Result<T, SetupError>> + Send + 'static,
) -> Result<(T, Handle, IoParts), EmbedError> {
    let (handle, stop_tx, thread) = io_thread()?;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    handle.spawn(async move {
        let _ = tx.send(build.await);
    });
    let built = rx
        .recv()
        .unwrap_or_else(|_| Err(SetupError::Config("the I/O thread ended".into())));
    match built {
        Ok(o) => Ok((o, handle, (stop_tx, thread))),
        Err(e) => {
            let _ = stop_tx.send(());
            let _ = thread.join();
            Err(match e {
                SetupError::Config(m) => EmbedError::Config(m),
                e => EmbedError::Setup(format!("node {node:?} cannot start: {e}")),
            })
        }
    }
}

/// The I/O thread (`engram-io`): a current-thread runtime that runs the
/// memory's fetches until told to stop; its handle, the stop, the thread.
fn io_thread() -> Result<
    (
        Handle,
        tokio::sync::oneshot::Sender<()>,
        std::thread::JoinHandle<()>,
    ),
    EmbedError,
> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| EmbedError::Internal(format!("starting the I/O runtime: {e}")))?;
    let handle = rt.handle().clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("engram-io".into())
        .spawn(move || {
            rt.block_on(async {
                let _ = stop_rx.await;
            });
            rt.shutdown_timeout(Duration::from_secs(1));
        })
        .map_err(|e| EmbedError::Internal(format!("starting the I/O thread: {e}")))?;
    Ok((handle, stop_tx, thread))
}
