//! A prefetch in flight: both layers' fetches, each finishing on the
//! memory's runtime into a cell its waiters read without a lock once it is
//! set. A waiter polls for a few tens of microseconds (yielding the core
//! between looks), then sleeps on the layer's own condition variable with
//! the caller's deadline; nothing it holds is shared with another ticket.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use engram_protocol::ROW_BYTES;
use engram_protocol::hashing::{COLUMNS, ENGRAM_LAYERS};
use engram_sync::{Condvar, Mutex};

use super::EmbedError;
use crate::model::Fetch;

/// How long a wait polls before it sleeps (a woken thread takes tens of
/// microseconds on a VM; the node's own loop spins as long).
const SPIN: Duration = Duration::from_micros(30);

/// Bytes of one position's rows of one layer.
pub const POSITION_BYTES: usize = COLUMNS * ROW_BYTES;

type Callback = Box<dyn FnOnce() + Send>;

/// One layer's fetch: set once when it ends.
#[derive(Default)]
pub(crate) struct Done {
    fetch: OnceLock<(Fetch, Duration)>,
    /// Guards the sleep and the callbacks, never the result.
    sleep: Mutex<Vec<Callback>>,
    woken: Condvar,
}

impl std::fmt::Debug for Done {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Done")
            .field("ready", &self.fetch.get().is_some())
            .finish_non_exhaustive()
    }
}

impl Done {
    /// The fetch ended (`took`: since the prefetch): wake every waiter and
    /// run the callbacks, outside the lock.
    pub(crate) fn finish(&self, fetch: Fetch, took: Duration) {
        let _ = self.fetch.set((fetch, took));
        let callbacks = {
            let mut g = self.sleep.lock();
            std::mem::take(&mut *g)
        };
        self.woken.notify_all();
        for cb in callbacks {
            cb();
        }
    }

    /// Whether the fetch has ended.
    pub(crate) fn is_finished(&self) -> bool {
        self.fetch.get().is_some()
    }

    /// The result, waiting until `deadline` at most (`None`: until it ends).
    fn wait(&self, deadline: Option<Instant>) -> Option<&(Fetch, Duration)> {
        let spin_until = Instant::now() + SPIN;
        loop {
            if let Some(f) = self.fetch.get() {
                return Some(f);
            }
            let now = Instant::now();
            if now >= spin_until || deadline.is_some_and(|d| now >= d) {
                break;
            }
            // Yield, not a bare spin: where the caller shares a core with
            // the I/O thread (a small machine, a pinned engine), the I/O
            // thread sends the request and takes the answer in this time.
            // On a 2-core VM with the client pinned to one core this took
            // a step from about 105 us to 90 us (C) and 127 us to 97 us
            // (Python); placed freely it costs nothing.
            std::thread::yield_now();
        }
        let mut g = self.sleep.lock();
        loop {
            if let Some(f) = self.fetch.get() {
                return Some(f);
            }
            match deadline {
                None => g = self.woken.wait(g),
                Some(d) => {
                    let left = d.checked_duration_since(Instant::now())?;
                    g = self.woken.wait_timeout(g, left).0;
                }
            }
        }
    }

    /// Call `cb` once the fetch has ended (now, when it has).
    fn on_ready(&self, cb: Callback) {
        {
            let mut g = self.sleep.lock();
            if self.fetch.get().is_none() {
                g.push(cb);
                return;
            }
        }
        cb();
    }
}

/// How one layer's rows were served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The Engram layer (1 or 14).
    pub layer: u32,
    /// The table id.
    pub table: u32,
    /// Sources that answered, in order of first use (`zeros`: by policy).
    pub sources: Vec<String>,
    /// Sources also asked after the hedge delay.
    pub hedges: u32,
    /// Sources asked after a failure.
    pub failovers: u32,
    /// Whether an answer came after the table's deadline.
    pub late: bool,
    /// Whether rows are zeros by the table's `zeros` policy (Engram off).
    pub zeros: bool,
    /// Messages sent (more than one only for a wide prefill).
    pub messages: u32,
    /// Distinct rows fetched.
    pub rows: usize,
    /// From the prefetch to the last row's arrival.
    pub elapsed: Duration,
}

impl Served {
    /// How `fetch` served `rows` distinct rows of `table` (layer `layer`)
    /// in `elapsed`.
    pub(crate) fn of(
        layer: u32,
        table: u32,
        fetch: &Fetch,
        rows: usize,
        elapsed: Duration,
    ) -> Self {
        Self {
            layer,
            table,
            sources: fetch.sources.iter().map(|s| s.to_string()).collect(),
            hedges: fetch.hedges,
            failovers: fetch.failovers,
            late: fetch.late,
            zeros: fetch.zeros,
            messages: fetch.messages,
            rows,
            elapsed,
        }
    }
}

/// Per-layer counters of a memory's lookups, since it opened.
#[derive(Debug, Default)]
pub(crate) struct LayerCounters {
    pub prefetches: AtomicU64,
    pub rows: AtomicU64,
    pub messages: AtomicU64,
    pub hedges: AtomicU64,
    pub failovers: AtomicU64,
    pub late: AtomicU64,
    pub zeros: AtomicU64,
    pub failed: AtomicU64,
}

impl LayerCounters {
    pub(crate) fn count(&self, f: &Fetch) {
        let add = |c: &AtomicU64, n: u64| c.fetch_add(n, Ordering::Relaxed);
        add(&self.prefetches, 1);
        add(&self.rows, (f.bytes.len() / ROW_BYTES) as u64);
        add(&self.messages, u64::from(f.messages));
        add(&self.hedges, u64::from(f.hedges));
        add(&self.failovers, u64::from(f.failovers));
        add(&self.late, u64::from(f.late));
        add(&self.zeros, u64::from(f.zeros));
        add(&self.failed, u64::from(f.error.is_some()));
    }
}

/// Both layers' rows of one batch, on their way (or one or two tables'
/// rows of any row size: [`super::NodeTables::prefetch`]).
#[derive(Debug)]
pub struct Ticket {
    pub(crate) live: Vec<bool>,
    pub(crate) index: [Vec<u32>; 2],
    pub(crate) tables: [u32; 2],
    pub(crate) done: [Arc<Done>; 2],
    /// Rows per position per layer: 24, or a row-id prefetch's columns.
    columns: usize,
    /// The layers it fetches (a row-id prefetch may carry one).
    present: [bool; 2],
    /// The model layer of each slot (V4.1's: 1 and 14).
    layers: [u32; 2],
    /// Bytes per row (V4.1's: 264).
    row_bytes: usize,
}

/// A row-id batch planned: which positions are live, and per slot each
/// id's index among the slot's distinct ids (what one fetch asks for).
#[derive(Debug)]
pub(crate) struct RowPlan {
    pub live: Vec<bool>,
    pub index: [Vec<u32>; 2],
    /// Each present slot's distinct ids, sorted (`None`: slot not asked).
    pub unique: [Option<Vec<u64>>; 2],
    pub present: [bool; 2],
}

/// Where a row asked with [`super::NO_ROW`] beside live ids points in a
/// sparse plan: past every fetch, so it is written as zeros.
const NO_INDEX: u32 = u32::MAX;

/// Plan `rows`, positions of `slots.len() x width` ids (the slots'
/// columns in order, each `width` wide, starting at column `first`): a
/// position of [`super::NO_ROW`] only is DEAD; an id at or past its slot's
/// `bound` is refused by position, the slot's model layer (`layers`),
/// column and table (`tables`), and so is a no-row id beside live ones
/// unless `sparse` (then that row alone is zeros).
pub(crate) fn plan_rows(
    rows: &[u64],
    slots: &[usize],
    (width, first, sparse): (usize, usize, bool),
    (layers, tables, bound): ([u32; 2], [u32; 2], [u64; 2]),
) -> Result<RowPlan, EmbedError> {
    let stride = slots.len() * width;
    if rows.is_empty() || stride == 0 || !rows.len().is_multiple_of(stride) {
        return Err(EmbedError::BadInput(format!(
            "{} row ids are not whole positions of {} layer(s) x {width} columns",
            rows.len(),
            slots.len()
        )));
    }
    let positions = rows.len() / stride;
    if positions > crate::engram::addresses::MAX_POSITIONS {
        return Err(EmbedError::BadInput(format!(
            "{positions} positions is more than the {} one call takes",
            crate::engram::addresses::MAX_POSITIONS
        )));
    }
    let mut live = Vec::with_capacity(positions);
    let mut all: [Vec<u64>; 2] = Default::default();
    for (p, pos) in rows.chunks_exact(stride).enumerate() {
        let dead = pos.iter().all(|&r| r == super::NO_ROW);
        live.push(!dead);
        if dead {
            continue;
        }
        for (k, &slot) in slots.iter().enumerate() {
            for (c, &r) in pos[k * width..(k + 1) * width].iter().enumerate() {
                if sparse && r == super::NO_ROW {
                    all[slot].push(r);
                    continue;
                }
                if r >= bound[slot] {
                    let what = if r == super::NO_ROW {
                        "NO_ROW beside live row ids (a DEAD position has NO_ROW in every column)"
                            .to_string()
                    } else {
                        format!(
                            "row {r}, past table {}'s {} rows",
                            tables[slot], bound[slot]
                        )
                    };
                    return Err(EmbedError::BadInput(format!(
                        "position {p}, layer {}, column {}: {what}",
                        layers[slot],
                        first + c
                    )));
                }
                all[slot].push(r);
            }
        }
    }
    let mut present = [false; 2];
    let mut index: [Vec<u32>; 2] = Default::default();
    let mut unique: [Option<Vec<u64>>; 2] = Default::default();
    for &slot in slots {
        present[slot] = true;
        let mut u: Vec<u64> = all[slot]
            .iter()
            .copied()
            .filter(|&r| r != super::NO_ROW)
            .collect();
        u.sort_unstable();
        u.dedup();
        index[slot] = all[slot]
            .iter()
            .map(|r| match u.binary_search(r) {
                Ok(i) => i as u32,
                Err(_) => NO_INDEX,
            })
            .collect();
        unique[slot] = Some(u);
    }
    Ok(RowPlan {
        live,
        index,
        unique,
        present,
    })
}

/// The slot of an Engram layer (0 for layer 1, 1 for layer 14).
pub(crate) fn slot_of(layer: u32) -> Result<usize, EmbedError> {
    ENGRAM_LAYERS
        .iter()
        .position(|&l| l == layer)
        .ok_or_else(|| {
            EmbedError::BadInput(format!(
                "layer {layer} has no Engram table: the layers are {ENGRAM_LAYERS:?}"
            ))
        })
}

impl Ticket {
    pub(crate) fn new(live: Vec<bool>, index: [Vec<u32>; 2], tables: [u32; 2]) -> Self {
        Self::with_columns(live, index, tables, COLUMNS, [true; 2])
    }

    /// A ticket of `columns` rows per position per layer, for the layers
    /// `present` says.
    pub(crate) fn with_columns(
        live: Vec<bool>,
        index: [Vec<u32>; 2],
        tables: [u32; 2],
        columns: usize,
        present: [bool; 2],
    ) -> Self {
        Self {
            live,
            index,
            tables,
            done: Default::default(),
            columns,
            present,
            layers: ENGRAM_LAYERS,
            row_bytes: ROW_BYTES,
        }
    }

    /// The same ticket over tables of model layers `layers` (one per slot)
    /// and rows of `row_bytes` bytes.
    pub(crate) fn sized(self, layers: [u32; 2], row_bytes: usize) -> Self {
        Self {
            layers,
            row_bytes,
            ..self
        }
    }

    /// The slot of `layer`, when this ticket fetches it.
    fn slot(&self, layer: u32) -> Result<usize, EmbedError> {
        if let Some(s) = (0..2).find(|&s| self.present[s] && self.layers[s] == layer) {
            return Ok(s);
        }
        if self.layers == ENGRAM_LAYERS {
            // A layer V4.1 has no table of says so first.
            slot_of(layer)?;
        }
        let have: Vec<String> = (0..2)
            .filter(|&s| self.present[s])
            .map(|s| self.layers[s].to_string())
            .collect();
        Err(EmbedError::BadInput(format!(
            "this ticket fetched layer {}'s rows only, not layer {layer}'s",
            have.join(" and ")
        )))
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Rows per position per layer (24, or the columns a row-id prefetch asked).
    pub fn columns(&self) -> usize {
        self.columns
    }

    /// Positions in the batch.
    pub fn positions(&self) -> usize {
        self.live.len()
    }

    /// Bytes a layer's rows take in the caller's buffer: positions x
    /// columns (24) x row bytes (264).
    pub fn bytes(&self) -> usize {
        self.live.len() * self.columns * self.row_bytes
    }

    /// Whether `layer`'s rows have arrived (or its fetch has failed).
    pub fn ready(&self, layer: u32) -> Result<bool, EmbedError> {
        Ok(self.done[self.slot(layer)?].fetch.get().is_some())
    }

    /// Call `cb` once `layer`'s fetch has ended, on the memory's I/O thread
    /// (or now, when it has): for an event loop's wake-up, nothing slow.
    pub fn on_ready(&self, layer: u32, cb: Box<dyn FnOnce() + Send>) -> Result<(), EmbedError> {
        self.done[self.slot(layer)?].on_ready(cb);
        Ok(())
    }

    /// Wait for `layer`'s rows (at most `timeout`; `None`: until the fetch
    /// ends, which the table's hard timeout bounds) and write them into
    /// `out`: position after position, 24 rows of 264 bytes each, in
    /// column order; a DEAD position's rows are zeros. On a timeout the
    /// ticket stays usable (wait again, or drop it).
    pub fn wait(
        &self,
        layer: u32,
        out: &mut [u8],
        timeout: Option<Duration>,
    ) -> Result<Served, EmbedError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let slot = self.slot(layer)?;
        if out.len() != self.bytes() {
            return Err(EmbedError::BadInput(format!(
                "the row buffer has {} bytes; {} positions need {} (positions x {} rows x {} bytes)",
                out.len(),
                self.positions(),
                self.bytes(),
                self.columns,
                self.row_bytes
            )));
        }
        let Some((fetch, took)) = self.done[slot].wait(deadline) else {
            return Err(EmbedError::Timeout(format!(
                "layer {layer} (table {}): rows not ready within {:?}; the ticket is still valid",
                self.tables[slot],
                timeout.unwrap_or_default()
            )));
        };
        if let Some(e) = &fetch.error {
            return Err(EmbedError::NoSource(e.clone()));
        }
        self.scatter(slot, &fetch.bytes, out);
        Ok(Served::of(
            layer,
            self.tables[slot],
            fetch,
            fetch.bytes.len() / self.row_bytes,
            *took,
        ))
    }

    /// Distinct rows (as fetched) -> every position's 24 rows, in place.
    fn scatter(&self, slot: usize, fetched: &[u8], out: &mut [u8]) {
        let mut cols = self.index[slot].chunks_exact(self.columns);
        let rb = self.row_bytes;
        let per_position = self.columns * rb;
        for (live, dst) in self.live.iter().zip(out.chunks_exact_mut(per_position)) {
            match live.then(|| cols.next()).flatten() {
                Some(idx) => {
                    for (&i, row) in idx.iter().zip(dst.chunks_exact_mut(rb)) {
                        let at = i as usize * rb;
                        // A sparse plan's no-row id: zeros.
                        match fetched.get(at..at + rb).filter(|_| i != NO_INDEX) {
                            Some(r) => row.copy_from_slice(r),
                            None => row.fill(0),
                        }
                    }
                }
                None => dst.fill(0),
            }
        }
    }
}
