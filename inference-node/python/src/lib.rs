//! `engram_rack._native`: the node's Engram memory (`inference_node::embed`)
//! for Python. The package's `engram_rack/__init__.py` wraps it with numpy
//! (array allocation, dtype and shape checks, asyncio); this layer takes
//! buffer-protocol objects, releases the GIL for every wait and every call
//! that may block, and maps each error kind to its own exception class.

mod ring;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::mpsc::{Sender, channel};
use std::time::Duration;

use engram_protocol::encoding::RowEncoding;
use engram_sync::Mutex;
use inference_node::embed::{
    self, EmbedError, EmbeddedNode, MetricsAt, OpenOptions, RowLayout, Segment,
};
use pyo3::buffer::{Element, PyBuffer};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _native,
    EngramError,
    PyException,
    "Base of every engram_rack error."
);
create_exception!(
    _native,
    ConfigError,
    EngramError,
    "The config cannot be read or lacks what the memory needs."
);
create_exception!(
    _native,
    SetupError,
    EngramError,
    "The memory could not be built (a copy, a certificate, no usable source)."
);
create_exception!(
    _native,
    BadInputError,
    EngramError,
    "A call's arguments are wrong (sizes, dtypes, ids, layers)."
);
create_exception!(
    _native,
    NoSourceError,
    EngramError,
    "Every source failed and the table's policy is `fail`."
);
create_exception!(
    _native,
    DeadlineExceeded,
    EngramError,
    "The caller's deadline passed before the rows arrived; the ticket stays valid."
);
create_exception!(_native, ClosedError, EngramError, "The memory is closed.");

fn err(e: EmbedError) -> PyErr {
    let m = e.to_string();
    match e {
        EmbedError::Config(_) => ConfigError::new_err(m),
        EmbedError::Setup(_) => SetupError::new_err(m),
        EmbedError::BadInput(_) => BadInputError::new_err(m),
        EmbedError::NoSource(_) => NoSourceError::new_err(m),
        EmbedError::Timeout(_) => DeadlineExceeded::new_err(m),
        EmbedError::Closed => ClosedError::new_err(m),
        EmbedError::Internal(_) => EngramError::new_err(m),
    }
}

/// Where `/metrics` goes: None (the config's address), "off" or IP:PORT.
fn metrics_at(metrics: Option<&str>) -> PyResult<MetricsAt> {
    Ok(match metrics {
        None => MetricsAt::Config,
        Some("off") => MetricsAt::Off,
        Some(a) => MetricsAt::Addr(a.parse().map_err(|_| {
            bad(format!(
                "metrics {a:?} is not \"off\" or an IP:PORT address"
            ))
        })?),
    })
}

fn bad(m: String) -> PyErr {
    BadInputError::new_err(m)
}

/// What a row buffer must hold.
const ROWS: &str = "rows are bytes: use dtype uint8";
/// What a bf16 output must be.
const BF16: &str =
    "bfloat16 output needs uint16 (or int16: a torch bfloat16 tensor viewed as int16)";
/// What an `ids` buffer must hold.
const INT64: &str = "token ids are int64 (numpy.int64)";

/// A C-contiguous buffer of `T` (`writable`: and not read-only), or a
/// clear error naming `what` and, for an array of another dtype, `need`.
fn buffer<T: Element>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    need: &str,
    writable: bool,
) -> PyResult<PyBuffer<T>> {
    let b = PyBuffer::<T>::get(obj).map_err(|e| match obj.getattr("dtype") {
        Ok(dtype) => bad(format!("{what} has dtype {dtype}; {need}")),
        Err(_) => bad(format!("{what} must be a buffer: {need} ({e})")),
    })?;
    if !b.is_c_contiguous() {
        return Err(bad(format!("{what} must be C-contiguous")));
    }
    if writable && b.readonly() {
        return Err(bad(format!("{what} is read-only")));
    }
    Ok(b)
}

/// A clear error when the output buffer `out` shares memory with the
/// input `input` (a slice of one written while the other is read).
fn apart<A, B>(input: &PyBuffer<A>, out: &PyBuffer<B>) -> PyResult<()> {
    let span = |p: *mut std::ffi::c_void, n: usize| (p as usize, p as usize + n);
    let (a0, a1) = span(input.buf_ptr(), input.len_bytes());
    let (b0, b1) = span(out.buf_ptr(), out.len_bytes());
    if a0 < b1 && b0 < a1 {
        return Err(bad(
            "out shares memory with the input: give an output buffer of its own".into(),
        ));
    }
    Ok(())
}

/// The buffer's memory as a slice.
///
/// # Safety
/// `b` must stay exported (alive) while the slice is used, and nothing else
/// may write it meanwhile.
unsafe fn slice<T>(b: &PyBuffer<T>) -> &[T] {
    // SAFETY: a C-contiguous buffer of item_count() T, aligned (checked by
    // PyBuffer::get), exported for as long as `b` lives; the caller
    // promises no concurrent writer.
    unsafe { std::slice::from_raw_parts(b.buf_ptr().cast::<T>(), b.item_count()) }
}

/// The buffer's memory as a mutable slice.
///
/// # Safety
/// As [`slice`], and `b` must be writable and not aliased by another slice.
#[allow(clippy::mut_from_ref)] // the memory is the exporter's, not `b`'s
unsafe fn slice_mut<T>(b: &PyBuffer<T>) -> &mut [T] {
    // SAFETY: as in `slice`; writable was checked by `buffer`.
    unsafe { std::slice::from_raw_parts_mut(b.buf_ptr().cast::<T>(), b.item_count()) }
}

/// The last three items of a sequence of token ids (None: none).
fn last_three(context: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<i64>> {
    let Some(c) = context else {
        return Ok(Vec::new());
    };
    let wrong = |e: PyErr| bad(format!("context must be a sequence of token ids: {e}"));
    if c.is_instance_of::<pyo3::types::PyString>() {
        return Err(bad(
            "context must be a sequence of token ids, not a string".into()
        ));
    }
    let n = c.len().map_err(wrong)?;
    (n.saturating_sub(3)..n)
        .map(|i| {
            c.get_item(i)
                .and_then(|x| x.extract::<i64>())
                .map_err(wrong)
        })
        .collect()
}

fn segments(list: Vec<(usize, Vec<i64>)>) -> Vec<Segment> {
    list.into_iter()
        .map(|(len, ctx)| Segment::after(len, &ctx))
        .collect()
}

fn timeout(t: Option<f64>) -> PyResult<Option<Duration>> {
    match t {
        None => Ok(None),
        Some(s) if (0.0..=86_400.0).contains(&s) => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(bad(format!(
            "timeout {s} is not a number of seconds in 0..=86400 (None: the table's own limits)"
        ))),
    }
}

/// A node's Engram memory (see `engram_rack.Memory`).
#[pyclass(name = "Memory", module = "engram_rack._native", frozen)]
struct Memory {
    inner: Arc<EmbeddedNode>,
    /// The thread that serves this process's rings, once one is served.
    hub: Mutex<Option<inference_node::ring::RingHub>>,
}

#[pymethods]
impl Memory {
    /// Open node `node` of the cluster config `config`. `metrics`: None
    /// (the node's address in the config), "off", or "IP:PORT".
    #[staticmethod]
    #[pyo3(signature = (config, node, metrics=None))]
    fn open(
        py: Python<'_>,
        config: PathBuf,
        node: String,
        metrics: Option<String>,
    ) -> PyResult<Self> {
        let metrics = metrics_at(metrics.as_deref())?;
        let inner = py
            .detach(|| EmbeddedNode::open_with(&config, &node, &OpenOptions { metrics }))
            .map_err(err)?;
        Ok(Self {
            inner: Arc::new(inner),
            hub: Mutex::new(None),
        })
    }

    /// Serve `ring` from this memory, on this process's ring thread (one
    /// for all its rings): for an engine with no host client.
    fn serve_ring(&self, py: Python<'_>, ring: &ring::Ring) -> PyResult<ring::RingHandle> {
        let mem = embed::NodeMemory::V41(Arc::clone(&self.inner));
        ring::serve_on(py, &self.hub, mem, ring)
    }

    /// Row ids of `ids` (int64 buffer) cut into `segments` [(len, context)],
    /// into `out` (uint64 buffer, positions x 2 x 24).
    fn addresses(
        &self,
        ids: &Bound<'_, PyAny>,
        segments_: Vec<(usize, Vec<i64>)>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ids = buffer::<i64>(ids, "ids", INT64, false)?;
        let out = buffer::<u64>(out, "out", "row ids are uint64", true)?;
        apart(&ids, &out)?;
        // SAFETY: both buffers are held for the call, with the GIL.
        let (ids_s, out_s) = unsafe { (slice(&ids), slice_mut(&out)) };
        self.inner
            .addresses(ids_s, &segments(segments_), out_s)
            .map_err(err)
    }

    /// Warm the path to the next prefetch's rows, due in about `lead_us`
    /// microseconds (see `EmbeddedNode::warm`); returns at once.
    #[pyo3(signature = (lead_us))]
    fn warm(&self, lead_us: u64) -> PyResult<()> {
        self.inner.warm(Duration::from_micros(lead_us)).map_err(err)
    }

    /// Start both tables' fetches for `ids` (an int64 buffer), one
    /// sequence after `context` (its tokens before them; the last three
    /// are read).
    #[pyo3(signature = (ids, context=None))]
    fn prefetch(
        &self,
        ids: &Bound<'_, PyAny>,
        context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Ticket> {
        let ids = buffer::<i64>(ids, "ids", INT64, false)?;
        // SAFETY: held for the call, with the GIL.
        let ids_s = unsafe { slice(&ids) };
        let ctx = last_three(context)?;
        let inner = self
            .inner
            .prefetch(ids_s, &[Segment::after(ids_s.len(), &ctx)])
            .map_err(err)?;
        Ok(Ticket { inner })
    }

    /// Start fetches by row ids: `rows` (a uint64 buffer) holds, per
    /// position, columns `lo..hi` of layer 1 then layer 14 (`layer` None),
    /// or of `layer` alone.
    #[pyo3(signature = (rows, layer, lo, hi))]
    fn prefetch_rows(
        &self,
        rows: &Bound<'_, PyAny>,
        layer: Option<u32>,
        lo: usize,
        hi: usize,
    ) -> PyResult<Ticket> {
        let rows = buffer::<u64>(rows, "rows", "give a uint64 array", false)?;
        // SAFETY: held for the call, with the GIL.
        let rows_s = unsafe { slice(&rows) };
        let layers = layer.map_or(embed::RowLayers::Both, embed::RowLayers::One);
        let inner = self
            .inner
            .prefetch_rows(rows_s, layers, lo..hi)
            .map_err(err)?;
        Ok(Ticket { inner })
    }

    /// Start both tables' fetches for `ids` cut into `segments` [(len, context)].
    fn prefetch_segments(
        &self,
        ids: &Bound<'_, PyAny>,
        segments_: Vec<(usize, Vec<i64>)>,
    ) -> PyResult<Ticket> {
        let ids = buffer::<i64>(ids, "ids", INT64, false)?;
        // SAFETY: held for the call, with the GIL.
        let ids_s = unsafe { slice(&ids) };
        let inner = self
            .inner
            .prefetch(ids_s, &segments(segments_))
            .map_err(err)?;
        Ok(Ticket { inner })
    }

    /// Per-layer counters: a list of two dicts.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, pyo3::types::PyDict>>> {
        use pyo3::types::PyDictMethods;
        let s = self.inner.stats().map_err(err)?;
        s.iter()
            .map(|l| {
                let d = pyo3::types::PyDict::new(py);
                for (k, v) in [
                    ("layer", u64::from(l.layer)),
                    ("table", u64::from(l.table)),
                    ("prefetches", l.prefetches),
                    ("rows", l.rows),
                    ("messages", l.messages),
                    ("hedges", l.hedges),
                    ("failovers", l.failovers),
                    ("late", l.late),
                    ("zeros", l.zeros),
                    ("failed", l.failed),
                ] {
                    d.set_item(k, v)?;
                }
                Ok(d)
            })
            .collect()
    }

    /// The node's metrics, Prometheus text.
    fn metrics_text(&self) -> PyResult<String> {
        self.inner.metrics_text().map_err(err)
    }

    /// Where /metrics is served ("IP:PORT"), or None.
    #[getter]
    fn metrics_address(&self) -> PyResult<Option<String>> {
        Ok(self
            .inner
            .metrics_addr()
            .map_err(err)?
            .map(|a| a.to_string()))
    }

    /// Table ids of layers 1 and 14.
    #[getter]
    fn tables(&self) -> PyResult<(u32, u32)> {
        let [a, b] = self.inner.tables().map_err(err)?;
        Ok((a, b))
    }

    /// The node's name.
    #[getter]
    fn node(&self) -> String {
        self.inner.node().to_string()
    }

    /// The node's token rate in the config.
    #[getter]
    fn tokens_per_second(&self) -> f64 {
        self.inner.tokens_per_second()
    }

    /// Whether close() has run.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Layer `layer`'s table as this process maps it (a host-local
    /// donor's memory, or the node's own copy): a read-only buffer. Waits
    /// up to `wait` seconds for a host socket to hand it over.
    #[pyo3(signature = (layer, wait=5.0))]
    fn table_view(&self, py: Python<'_>, layer: u32, wait: f64) -> PyResult<TableView> {
        let w = timeout(Some(wait))?.unwrap_or_default();
        let inner = py.detach(|| self.inner.table_view(layer, w)).map_err(err)?;
        Ok(TableView { inner })
    }

    /// Let fetches in flight end (at most `drain` seconds), then stop.
    #[pyo3(signature = (drain=2.0))]
    fn close(&self, py: Python<'_>, drain: f64) -> PyResult<()> {
        let d = timeout(Some(drain))?.unwrap_or_default();
        py.detach(|| {
            self.hub.lock().take();
            self.inner.close(d)
        });
        Ok(())
    }
}

/// A node's tables for an engine of any model family (see
/// `engram_rack.Tables`): what each is, rows by id, host-local views.
#[pyclass(name = "Tables", module = "engram_rack._native", frozen)]
struct Tables {
    inner: Arc<embed::NodeTables>,
    /// The thread that serves this process's rings, once one is served.
    hub: Mutex<Option<inference_node::ring::RingHub>>,
}

#[pymethods]
impl Tables {
    /// Open node `node` of the cluster config `config`. `metrics`: None
    /// (the node's address in the config), "off", or "IP:PORT".
    #[staticmethod]
    #[pyo3(signature = (config, node, metrics=None))]
    fn open(
        py: Python<'_>,
        config: PathBuf,
        node: String,
        metrics: Option<String>,
    ) -> PyResult<Self> {
        let metrics = metrics_at(metrics.as_deref())?;
        let inner = py
            .detach(|| embed::NodeTables::open(&config, &node, &OpenOptions { metrics }))
            .map_err(err)?;
        Ok(Self {
            inner: Arc::new(inner),
            hub: Mutex::new(None),
        })
    }

    /// Serve `ring` (of a routed table's layer and row size) from these
    /// tables, on this process's ring thread: for an engine with no host
    /// client.
    fn serve_ring(&self, py: Python<'_>, ring: &ring::Ring) -> PyResult<ring::RingHandle> {
        let mem = embed::NodeMemory::Tables(Arc::clone(&self.inner));
        ring::serve_on(py, &self.hub, mem, ring)
    }

    /// The node's name.
    #[getter]
    fn node(&self) -> String {
        self.inner.node().to_string()
    }

    /// Every routed table: dicts of table, layer, rows, row_bytes,
    /// encoding, values, tensor_scale and policy.
    fn tables<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, pyo3::types::PyDict>>> {
        let mut out = Vec::new();
        for t in self.inner.tables().map_err(err)? {
            let d = pyo3::types::PyDict::new(py);
            d.set_item("table", t.table)?;
            d.set_item("layer", t.layer)?;
            d.set_item("rows", t.rows)?;
            d.set_item("row_bytes", t.row_bytes)?;
            d.set_item("encoding", t.encoding.name())?;
            d.set_item("values", t.encoding.values())?;
            d.set_item("tensor_scale", t.tensor_scale)?;
            d.set_item("policy", t.policy.to_string())?;
            out.push(d);
        }
        Ok(out)
    }

    /// Table `table`'s rows `ids` (a uint64 buffer) into `out` (a writable
    /// uint8 buffer of len(ids) x row_bytes), waiting (GIL released) at
    /// most `timeout` seconds.
    #[pyo3(signature = (table, ids, out, timeout=None))]
    fn lookup(
        &self,
        py: Python<'_>,
        table: u32,
        ids: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<Served> {
        let t = self::timeout(timeout)?;
        let i = buffer::<u64>(ids, "ids", "row ids are uint64 (numpy.uint64)", false)?;
        let o = buffer::<u8>(out, "out", ROWS, true)?;
        apart(&i, &o)?;
        // SAFETY: both held for the call; the caller does not write them meanwhile.
        let (is, os) = unsafe { (slice(&i), slice_mut(&o)) };
        let s = py
            .detach(|| self.inner.lookup(table, is, os, t))
            .map_err(err)?;
        Ok(s.into())
    }

    /// Start tables `tables`' fetches of `rows` (a uint64 buffer: positions
    /// of len(tables) x `columns` ids; NO_ROW: no row), returning at once.
    fn prefetch(
        &self,
        tables: Vec<u32>,
        rows: &Bound<'_, PyAny>,
        columns: usize,
    ) -> PyResult<Ticket> {
        let rows = buffer::<u64>(rows, "rows", "row ids are uint64 (numpy.uint64)", false)?;
        // SAFETY: held for the call, with the GIL.
        let rows_s = unsafe { slice(&rows) };
        let inner = self.inner.prefetch(&tables, rows_s, columns).map_err(err)?;
        Ok(Ticket { inner })
    }

    /// Table `table` as this process maps it (a host-local donor's memory,
    /// or the node's own copy): a read-only buffer. Waits up to `wait`
    /// seconds for a host socket to hand it over.
    #[pyo3(signature = (table, wait=5.0))]
    fn table_view(&self, py: Python<'_>, table: u32, wait: f64) -> PyResult<TableView> {
        let w = timeout(Some(wait))?.unwrap_or_default();
        let inner = py.detach(|| self.inner.table_view(table, w)).map_err(err)?;
        Ok(TableView { inner })
    }

    /// The node's metric series, Prometheus' text format.
    fn metrics_text(&self) -> PyResult<String> {
        self.inner.metrics_text().map_err(err)
    }

    /// Let lookups in flight end (at most `drain` seconds), then stop.
    #[pyo3(signature = (drain=2.0))]
    fn close(&self, py: Python<'_>, drain: f64) -> PyResult<()> {
        let d = timeout(Some(drain))?.unwrap_or_default();
        py.detach(|| self.inner.close(d));
        Ok(())
    }
}

/// A table's mapped memory (see `engram_rack.Memory.table_view`): a
/// read-only buffer that holds the memory while any view of it lives.
#[pyclass(name = "TableView", module = "engram_rack._native", frozen)]
struct TableView {
    inner: embed::TableView,
}

impl TableView {
    fn out_of_range(&self, row: u64) -> PyErr {
        bad(format!(
            "row {row} is out of range ({} rows)",
            self.inner.rows()
        ))
    }
}

#[pymethods]
impl TableView {
    /// Its table id.
    #[getter]
    fn table(&self) -> u32 {
        self.inner.table()
    }

    /// Its model layer.
    #[getter]
    fn layer(&self) -> u32 {
        self.inner.layer()
    }

    /// Its version (hex digest).
    #[getter]
    fn digest(&self) -> String {
        self.inner.digest().to_string()
    }

    /// Its rows.
    #[getter]
    fn rows(&self) -> u64 {
        self.inner.rows()
    }

    /// Its bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.bytes().len()
    }

    /// The donor's generation of this memory (None for the node's own copy).
    #[getter]
    fn generation(&self) -> Option<u64> {
        self.inner.generation()
    }

    /// Whether every process on the host maps this same memory.
    #[getter]
    fn shared(&self) -> bool {
        self.inner.shared()
    }

    /// True when rows are back to back; false for 15 rows per 4 KiB page
    /// or planar.
    #[getter]
    fn packed(&self) -> bool {
        self.inner.packed()
    }

    /// How the rows lie: "packed", "paged" (15 rows per 4 KiB page) or
    /// "planar" (values from 0, scales from `scales_at`).
    #[getter]
    fn layout(&self) -> &'static str {
        self.inner.layout().name()
    }

    /// Bytes per row (264 but for an encoded table's).
    #[getter]
    fn row_bytes(&self) -> usize {
        self.inner.row_bytes()
    }

    /// How its rows are encoded (e.g. "fp8_per_tensorx160").
    #[getter]
    fn encoding(&self) -> String {
        self.inner.encoding().name()
    }

    /// Its F32 scale, for an encoding with one (None for the others).
    #[getter]
    fn tensor_scale(&self) -> Option<f32> {
        self.inner.tensor_scale()
    }

    /// Where a planar table's scale bytes start (None for the others).
    #[getter]
    fn scales_at(&self) -> Option<usize> {
        match self.inner.layout() {
            RowLayout::Planar { scales_at } => Some(scales_at),
            _ => None,
        }
    }

    /// Where row `row` starts in the buffer (its 264 bytes contiguous:
    /// packed or paged; a planar table has `offsets`).
    fn offset(&self, row: u64) -> PyResult<usize> {
        if let RowLayout::Planar { .. } = self.inner.layout() {
            return Err(bad(
                "a planar table's rows are split: use offsets(row)".into()
            ));
        }
        self.inner.offset(row).ok_or_else(|| self.out_of_range(row))
    }

    /// Where row `row`'s values and its scale bytes start, in any layout.
    fn offsets(&self, row: u64) -> PyResult<(usize, usize)> {
        self.inner
            .offsets(row)
            .ok_or_else(|| self.out_of_range(row))
    }

    /// The buffer protocol: read-only, one dimension of bytes.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let bytes = slf.get().inner.bytes();
        let len = pyo3::ffi::Py_ssize_t::try_from(bytes.len())
            .map_err(|_| bad("the table is larger than a Python buffer can be".into()))?;
        // SAFETY: `view` is the caller's to fill; the bytes stay mapped
        // while `slf` lives, which the buffer holds a reference to (set by
        // PyBuffer_FillInfo), and they are read-only (readonly = 1 makes a
        // request for a writable buffer fail with BufferError).
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                bytes.as_ptr().cast_mut().cast(),
                len,
                1,
                flags,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(PyErr::fetch(slf.py()))
        }
    }

    fn __len__(&self) -> usize {
        self.inner.bytes().len()
    }

    fn __repr__(&self) -> String {
        format!(
            "TableView(table={}, layer={}, rows={}, digest={}, shared={}, packed={})",
            self.inner.table(),
            self.inner.layer(),
            self.inner.rows(),
            self.inner.digest(),
            self.inner.shared(),
            self.inner.packed()
        )
    }
}

/// How a layer's rows were served.
#[pyclass(name = "Served", module = "engram_rack._native", frozen, get_all)]
struct Served {
    layer: u32,
    table: u32,
    sources: Vec<String>,
    hedges: u32,
    failovers: u32,
    late: bool,
    zeros: bool,
    messages: u32,
    rows: usize,
    elapsed: f64,
}

impl From<embed::Served> for Served {
    fn from(s: embed::Served) -> Self {
        Self {
            layer: s.layer,
            table: s.table,
            sources: s.sources,
            hedges: s.hedges,
            failovers: s.failovers,
            late: s.late,
            zeros: s.zeros,
            messages: s.messages,
            rows: s.rows,
            elapsed: s.elapsed.as_secs_f64(),
        }
    }
}

#[pymethods]
impl Served {
    /// The first source that answered ("zeros" when Engram was off by policy).
    #[getter]
    fn source(&self) -> String {
        self.sources.first().cloned().unwrap_or_default()
    }

    fn __repr__(&self) -> String {
        format!(
            "Served(layer={}, table={}, sources={:?}, hedges={}, failovers={}, late={}, zeros={}, messages={}, rows={}, elapsed={:.6})",
            self.layer,
            self.table,
            self.sources,
            self.hedges,
            self.failovers,
            if self.late { "True" } else { "False" },
            if self.zeros { "True" } else { "False" },
            self.messages,
            self.rows,
            self.elapsed
        )
    }
}

/// Both layers' rows of one prefetch, on their way.
#[pyclass(name = "Ticket", module = "engram_rack._native", frozen)]
struct Ticket {
    inner: embed::Ticket,
}

/// Where ready callbacks run: one thread, so the memory's I/O thread never
/// waits for the GIL.
fn notifier() -> &'static Mutex<Sender<Py<PyAny>>> {
    static TX: OnceLock<Mutex<Sender<Py<PyAny>>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = channel::<Py<PyAny>>();
        let _ = std::thread::Builder::new()
            .name("engram-py-notify".into())
            .spawn(move || {
                for cb in rx {
                    Python::attach(|py| {
                        if let Err(e) = cb.call0(py) {
                            e.print(py);
                        }
                    });
                }
            });
        Mutex::new(tx)
    })
}

#[pymethods]
impl Ticket {
    /// Positions in the batch.
    #[getter]
    fn positions(&self) -> usize {
        self.inner.positions()
    }

    /// Bytes of one layer's rows: positions x columns x 264.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.bytes()
    }

    /// Rows per position per layer (24, or a row-id prefetch's columns).
    #[getter]
    fn columns(&self) -> usize {
        self.inner.columns()
    }

    /// Bytes per row (264, or another table's).
    #[getter]
    fn row_bytes(&self) -> usize {
        self.inner.row_bytes()
    }

    /// Whether `layer`'s fetch has ended.
    fn ready(&self, layer: u32) -> PyResult<bool> {
        self.inner.ready(layer).map_err(err)
    }

    /// Wait (GIL released) for `layer`'s rows, at most `timeout` seconds,
    /// and write them into `out` (a writable uint8 buffer of nbytes).
    #[pyo3(signature = (layer, out, timeout=None))]
    fn wait(
        &self,
        py: Python<'_>,
        layer: u32,
        out: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<Served> {
        let t = self::timeout(timeout)?;
        let buf = buffer::<u8>(out, "out", ROWS, true)?;
        // SAFETY: `buf` stays exported until it drops at the end of this
        // call; the engine owns its buffer and must not write it while the
        // rows are being written (the GIL is released meanwhile).
        let dst = unsafe { slice_mut(&buf) };
        let s = py.detach(|| self.inner.wait(layer, dst, t)).map_err(err)?;
        Ok(s.into())
    }

    /// Call `callback()` (with the GIL, on a notifier thread) once
    /// `layer`'s fetch has ended: for an event loop's
    /// `call_soon_threadsafe`.
    fn on_ready(&self, layer: u32, callback: Py<PyAny>) -> PyResult<()> {
        let tx = notifier().lock().clone();
        self.inner
            .on_ready(
                layer,
                Box::new(move || {
                    let _ = tx.send(callback);
                }),
            )
            .map_err(err)
    }
}

/// Dequantize rows (uint8 buffer, 264 bytes a row) into `out` (float32,
/// 256 values a row): the values the node's fusion reads.
#[pyfunction]
fn dequantize_f32(py: Python<'_>, rows: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
    let r = buffer::<u8>(rows, "rows", ROWS, false)?;
    let o = buffer::<f32>(out, "out", "float32 output needs float32", true)?;
    apart(&r, &o)?;
    // SAFETY: both held for the call; the caller does not write them meanwhile.
    let (rs, os) = unsafe { (slice(&r), slice_mut(&o)) };
    py.detach(|| embed::dequantize_f32(rs, os)).map_err(err)
}

/// Dequantize rows into `out` as bf16 bit patterns (a uint16 or int16
/// buffer: numpy has no bfloat16; view a torch bfloat16 tensor as int16).
/// Rows are V4.1's (264 bytes) unless `encoding` names another (e.g.
/// "fp8_per_tensorx160", with the table's `tensor_scale`).
#[pyfunction]
#[pyo3(signature = (rows, out, encoding=None, tensor_scale=None))]
fn dequantize_bf16(
    py: Python<'_>,
    rows: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    encoding: Option<&str>,
    tensor_scale: Option<f32>,
) -> PyResult<()> {
    let encoding = encoding
        .map(|e| RowEncoding::parse(e).map_err(|e| bad(e.to_string())))
        .transpose()?;
    let r = buffer::<u8>(rows, "rows", ROWS, false)?;
    let run = |os: &mut [u16]| {
        // SAFETY: held for the call; the caller does not write it meanwhile.
        let rs = unsafe { slice(&r) };
        py.detach(|| match encoding {
            Some(e) => embed::dequantize_encoded_bf16(e, tensor_scale, rs, os),
            None => embed::dequantize_bf16(rs, os),
        })
        .map_err(err)
    };
    match buffer::<u16>(out, "out", BF16, true) {
        Ok(o) => {
            apart(&r, &o)?;
            // SAFETY: held for the call.
            run(unsafe { slice_mut(&o) })
        }
        Err(e) => {
            // Same bits, other sign convention: reinterpret an int16 buffer.
            let signed = buffer::<i16>(out, "out", BF16, true).map_err(|_| e)?;
            apart(&r, &signed)?;
            // SAFETY: held for the call; i16 and u16 share size and alignment.
            run(unsafe {
                std::slice::from_raw_parts_mut(signed.buf_ptr().cast::<u16>(), signed.item_count())
            })
        }
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Memory>()?;
    m.add_class::<Tables>()?;
    m.add_class::<Ticket>()?;
    m.add_class::<Served>()?;
    m.add_class::<TableView>()?;
    m.add_class::<ring::Ring>()?;
    m.add_class::<ring::RingHandle>()?;
    m.add_class::<ring::EngineLink>()?;
    m.add_function(wrap_pyfunction!(dequantize_f32, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_bf16, m)?)?;
    m.add("NO_TOKEN", embed::NO_TOKEN)?;
    m.add("NO_ROW", embed::NO_ROW)?;
    m.add("POSITION_BYTES", embed::POSITION_BYTES)?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    for (name, ty) in [
        ("EngramError", py.get_type::<EngramError>()),
        ("ConfigError", py.get_type::<ConfigError>()),
        ("SetupError", py.get_type::<SetupError>()),
        ("BadInputError", py.get_type::<BadInputError>()),
        ("NoSourceError", py.get_type::<NoSourceError>()),
        ("DeadlineExceeded", py.get_type::<DeadlineExceeded>()),
        ("ClosedError", py.get_type::<ClosedError>()),
    ] {
        m.add(name, ty)?;
    }
    Ok(())
}
