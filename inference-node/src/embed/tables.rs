//! A node's tables as a library, for any model family (`[model] family`):
//! what an engine that hashes and fuses on its own needs from the rack.
//!
//! [`NodeTables::open`] builds the node's routers from the cluster config
//! exactly as [`super::EmbeddedNode`] does (sources shared, copies opened
//! and checked, donors probed, probe loops running) but knows nothing of a
//! model's hashing: the engine brings row ids. It says what each routed
//! table is ([`TableInfo`]: rows, row size, encoding, table scale, policy),
//! fetches rows by id at the table's own row size ([`NodeTables::lookup`]),
//! and maps a host-local donor's table ([`NodeTables::table_view`]), whose
//! rows an engine's own host-table kernel reads in place.
//!
//! [`super::EmbeddedNode`] is V4.1's (two tables, its hashing, tickets and
//! rings); a Qwen4Exp rack opens here.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cluster_config::model::Family;
use cluster_config::{Config, Policy};
use engram_protocol::encoding::RowEncoding;
use engram_sync::RwLock;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use super::{EmbedError, OpenOptions, Served, TableView, metrics_address, serve_at};
use crate::memory::Routers;
use crate::metrics::NodeMetrics;
use crate::model::TableSlot;
use crate::model::fetch::{FetchCounts, fetch_rows};
use crate::model::node::{SetupError, chunk_rows, usable_at_start};
use crate::router::Router;

/// Most row ids one [`NodeTables::lookup`] takes.
pub const MAX_LOOKUP_ROWS: usize = 1 << 20;

/// What one routed table is.
#[derive(Debug, Clone, PartialEq)]
pub struct TableInfo {
    /// Its id.
    pub table: u32,
    /// Its model layer.
    pub layer: u32,
    /// Its rows (ids at or past this are refused).
    pub rows: u64,
    /// Bytes per row.
    pub row_bytes: usize,
    /// How its rows are encoded.
    pub encoding: RowEncoding,
    /// Its F32 scale (`[[table]] tensor_scale`), for an encoding with one.
    pub tensor_scale: Option<f32>,
    /// What a lookup gives when every source failed.
    pub policy: Policy,
}

/// The node's tables, open. See the module documentation.
#[derive(Debug)]
pub struct NodeTables {
    node: String,
    config: PathBuf,
    handle: Handle,
    state: RwLock<Option<Arc<OpenTables>>>,
    counts: Arc<FetchCounts>,
    io: super::IoThread,
}

#[derive(Debug)]
struct OpenTables {
    /// The rack's model family.
    family: Family,
    /// Held for its sources and probe loops (its drop stops them).
    memory: Routers,
    routers: Vec<Arc<Router>>,
    info: Vec<TableInfo>,
    chunk_rows: usize,
    metrics: Arc<NodeMetrics>,
    metrics_task: Option<JoinHandle<()>>,
}

impl NodeTables {
    /// Open node `node` of the cluster config at `config`.
    pub fn open(config: &Path, node: &str, opts: &OpenOptions) -> Result<Self, EmbedError> {
        let cfg = Config::load(config).map_err(|e| EmbedError::Config(e.to_string()))?;
        let n = super::find_node(&cfg, config, node)?;
        let metrics_at = metrics_address(&cfg, n, opts)?;
        let name = node.to_string();
        let (open, handle, io) =
            super::open_on_io_thread(node, async move { build(cfg, name, metrics_at).await })?;
        Ok(Self {
            node: node.to_string(),
            config: config.to_path_buf(),
            handle,
            state: RwLock::new(Some(Arc::new(open))),
            counts: Arc::default(),
            io: engram_sync::Mutex::new(Some(io)),
        })
    }

    fn open_state(&self) -> Result<Arc<OpenTables>, EmbedError> {
        self.state.read().clone().ok_or(EmbedError::Closed)
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The config file it was opened from.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// The rack's model family (`[model] family`).
    pub fn family(&self) -> Result<Family, EmbedError> {
        Ok(self.open_state()?.family)
    }

    /// Whether [`Self::close`] has run.
    pub fn is_closed(&self) -> bool {
        self.open_state().is_err()
    }

    /// Every table the node routes, in the config's route order.
    pub fn tables(&self) -> Result<Vec<TableInfo>, EmbedError> {
        Ok(self.open_state()?.info.clone())
    }

    /// Table `table`'s rows `rows` into `out` (`rows.len()` rows of the
    /// table's row size, in the order asked; repeated ids are fetched once),
    /// through the node's router: hedged, failed over, checked by the
    /// table's encoding, zeros when every source failed under a `zeros`
    /// policy. Waits at most `timeout` (`None`: until the fetch ends; the
    /// router's own timeouts bound it).
    pub fn lookup(
        &self,
        table: u32,
        rows: &[u64],
        out: &mut [u8],
        timeout: Option<Duration>,
    ) -> Result<Served, EmbedError> {
        let open = self.open_state()?;
        let (k, info) = open.find(table)?;
        if rows.is_empty() || rows.len() > MAX_LOOKUP_ROWS {
            return Err(EmbedError::BadInput(format!(
                "{} row ids: give 1 to {MAX_LOOKUP_ROWS}",
                rows.len()
            )));
        }
        let want = rows.len() * info.row_bytes;
        if out.len() != want {
            return Err(EmbedError::BadInput(format!(
                "an output of {} bytes for {} rows of {} bytes: it must be {want}",
                out.len(),
                rows.len(),
                info.row_bytes
            )));
        }
        if let Some((i, r)) = rows.iter().enumerate().find(|(_, r)| **r >= info.rows) {
            return Err(EmbedError::BadInput(format!(
                "row id {r} (at {i}) is past table {table}'s {} rows",
                info.rows
            )));
        }
        let mut unique = rows.to_vec();
        unique.sort_unstable();
        unique.dedup();
        let started = Instant::now();
        let router = Arc::clone(&open.routers[k]);
        let chunk = open.chunk_rows;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let n = unique.len();
        self.counts.in_flight.fetch_add(1, Ordering::AcqRel);
        let counts = Arc::clone(&self.counts);
        // The ids go to the fetch and come back with its rows.
        self.handle.spawn(async move {
            let f = fetch_rows(&router, &unique, chunk).await;
            counts.in_flight.fetch_sub(1, Ordering::AcqRel);
            let _ = tx.send((f, unique));
        });
        let (fetch, unique) = match timeout {
            Some(t) => rx.recv_timeout(t).map_err(|e| match e {
                std::sync::mpsc::RecvTimeoutError::Timeout => EmbedError::Timeout(format!(
                    "table {table}'s {n} rows did not arrive within {t:?}"
                )),
                std::sync::mpsc::RecvTimeoutError::Disconnected => EmbedError::Closed,
            })?,
            None => rx.recv().map_err(|_| EmbedError::Closed)?,
        };
        if let Some(e) = &fetch.error {
            return Err(EmbedError::NoSource(format!(
                "table {table} (layer {}): {e}",
                info.layer
            )));
        }
        let rb = info.row_bytes;
        for (r, o) in rows.iter().zip(out.chunks_exact_mut(rb)) {
            let at = unique.binary_search(r).unwrap_or(0) * rb;
            o.copy_from_slice(&fetch.bytes[at..at + rb]);
        }
        Ok(Served::of(
            info.layer,
            table,
            &fetch,
            unique.len(),
            started.elapsed(),
        ))
    }

    /// One or two tables' rows of a batch, without waiting: `rows` holds
    /// positions of `tables.len() x columns` ids (each table's `columns`
    /// in turn); an id of [`super::NO_ROW`] asks for no row (zeros: an
    /// engine rank that owns a shard of a table's rows asks for those
    /// only). One fetch per table starts at once (repeats fetched once);
    /// take each table's rows with [`super::Ticket::wait`] of its layer,
    /// position after position at the table's row size. The tables must
    /// be of one row size and of two layers.
    pub fn prefetch(
        &self,
        tables: &[u32],
        rows: &[u64],
        columns: usize,
    ) -> Result<super::Ticket, EmbedError> {
        let open = self.open_state()?;
        if tables.is_empty() || tables.len() > 2 {
            return Err(EmbedError::BadInput(format!(
                "{} tables in one prefetch: give one or two",
                tables.len()
            )));
        }
        if rows.len() > MAX_LOOKUP_ROWS {
            return Err(EmbedError::BadInput(format!(
                "{} row ids: give at most {MAX_LOOKUP_ROWS}",
                rows.len()
            )));
        }
        let mut at = [0usize; 2];
        let (mut layers, mut ids, mut bound) = ([0u32; 2], [0u32; 2], [0u64; 2]);
        for (s, &t) in tables.iter().enumerate() {
            let (k, info) = open.find(t)?;
            (at[s], layers[s], ids[s], bound[s]) = (k, info.layer, t, info.rows);
        }
        let row_bytes = open.info[at[0]].row_bytes;
        if tables.len() == 2 {
            let other = &open.info[at[1]];
            if other.row_bytes != row_bytes || layers[0] == layers[1] {
                return Err(EmbedError::BadInput(format!(
                    "tables {} and {}: one prefetch takes tables of one row size ({} and {} \
                     bytes) and of two layers ({} and {})",
                    ids[0], ids[1], row_bytes, other.row_bytes, layers[0], layers[1]
                )));
            }
        }
        let slots: Vec<usize> = (0..tables.len()).collect();
        let plan =
            super::ticket::plan_rows(rows, &slots, (columns, 0, true), (layers, ids, bound))?;
        let ticket = super::Ticket::with_columns(plan.live, plan.index, ids, columns, plan.present)
            .sized(layers, row_bytes);
        let started = Instant::now();
        for (slot, unique) in plan.unique.into_iter().enumerate() {
            let Some(unique) = unique else { continue };
            if unique.is_empty() {
                ticket.done[slot].finish(crate::model::Fetch::default(), Duration::ZERO);
                continue;
            }
            let router = Arc::clone(&open.routers[at[slot]]);
            let chunk = open.chunk_rows;
            self.counts.in_flight.fetch_add(1, Ordering::AcqRel);
            self.counts.started.fetch_add(1, Ordering::AcqRel);
            let guard = super::Unfinished {
                done: Arc::clone(&ticket.done[slot]),
                counts: Arc::clone(&self.counts),
            };
            self.handle.spawn(async move {
                let f = fetch_rows(&router, &unique, chunk).await;
                guard.done.finish(f, started.elapsed());
            });
        }
        Ok(ticket)
    }

    /// The node's metric series (for a ring's client).
    pub(crate) fn metrics(&self) -> Result<Arc<NodeMetrics>, EmbedError> {
        Ok(Arc::clone(&self.open_state()?.metrics))
    }

    /// Table `table`'s memory as this process maps it: a host-local
    /// donor's (one copy for the host, rows back to back at their own size
    /// for an encoded table), or else the node's own `local` copy. Waits up
    /// to `wait` for a host socket to hand it over.
    pub fn table_view(&self, table: u32, wait: Duration) -> Result<TableView, EmbedError> {
        let open = self.open_state()?;
        open.find(table)?;
        super::view_of(&open.memory, table, wait)
    }

    /// The node's metric series in Prometheus' text format.
    pub fn metrics_text(&self) -> Result<String, EmbedError> {
        Ok(self.open_state()?.metrics.render())
    }

    /// Let lookups in flight end (at most `drain`), then stop the probes,
    /// the connections and the I/O thread. Idempotent.
    pub fn close(&self, drain: Duration) {
        let open = self.state.write().take();
        let Some(open) = open else { return };
        super::drain_and_stop(&self.handle, &self.counts, &self.io, drain, move || {
            if let Some(t) = &open.metrics_task {
                t.abort();
            }
            drop(open);
        });
    }
}

impl Drop for NodeTables {
    fn drop(&mut self) {
        self.close(super::DEFAULT_DRAIN);
    }
}

impl OpenTables {
    fn find(&self, table: u32) -> Result<(usize, &TableInfo), EmbedError> {
        self.info
            .iter()
            .enumerate()
            .find(|(_, t)| t.table == table)
            .ok_or_else(|| {
                EmbedError::BadInput(format!(
                    "table {table} is not routed by this node (tables: {})",
                    self.info
                        .iter()
                        .map(|t| t.table.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })
    }
}

async fn build(
    cfg: Config,
    name: String,
    metrics_at: Option<std::net::SocketAddr>,
) -> Result<OpenTables, SetupError> {
    let metrics = Arc::new(NodeMetrics::new());
    let memory = Routers::from_config(&cfg, &name, &metrics).await?;
    let routers = memory.routers().to_vec();
    let mut info = Vec::with_capacity(routers.len());
    let mut slots = Vec::with_capacity(routers.len());
    for r in &routers {
        let s = r.settings();
        let t = cfg
            .table(s.table)
            .ok_or_else(|| SetupError::Config(format!("table {} is not in the config", s.table)))?;
        info.push(TableInfo {
            table: t.id,
            layer: t.layer,
            rows: t.rows,
            row_bytes: s.encoding.row_bytes(),
            encoding: s.encoding,
            tensor_scale: t.tensor_scale,
            policy: s.policy,
        });
        slots.push(TableSlot {
            table: t.id,
            layer: t.layer,
            window_blocks: 1,
            row_bytes: s.encoding.row_bytes(),
        });
    }
    usable_at_start(&routers, &slots)?;
    let metrics_task = serve_at(metrics_at, &metrics, &name).await?.1;
    Ok(OpenTables {
        family: cfg.family(),
        memory,
        routers,
        info,
        chunk_rows: chunk_rows(&cfg),
        metrics,
        metrics_task,
    })
}
