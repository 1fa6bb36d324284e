//! The engine ring and the engine socket for Python (`engram_rack.ring`,
//! `engram_rack.host`): a ring's memory with its layout (the offsets the
//! GPU kernels are given), a ring served by this process's own memory, and
//! the engine socket's client (`inference-node engines`).

use std::os::fd::{AsRawFd, IntoRawFd};
use std::path::PathBuf;
use std::sync::Arc;

use engram_sync::Mutex;
use inference_node::engines::EngineClient;
use inference_node::ring::{self, RingMemory, Shape};
use pyo3::prelude::*;

use crate::{bad, buffer, err, slice, timeout};

/// A ring's memory (made here), mapped read-write: a writable buffer over
/// the whole ring, and its layout.
#[pyclass(name = "Ring", module = "engram_rack._native", frozen)]
pub(crate) struct Ring {
    pub(crate) inner: Arc<RingMemory>,
}

#[pymethods]
impl Ring {
    /// A new ring: `slots` requests in flight at most, `layers` sections
    /// (`layer_ids`: the model layer of each section's table, 0 for an
    /// unused second), `columns` ids per position per layer from
    /// `first_column`, `positions` per request at most, the GPU's deadline
    /// in ns, and bytes per row (264: V4.1's).
    #[new]
    #[pyo3(signature = (slots, layers, columns, positions, first_column, layer_ids, gpu_deadline_ns, row_bytes=264))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        slots: u32,
        layers: u32,
        columns: u32,
        positions: u32,
        first_column: u32,
        layer_ids: (u32, u32),
        gpu_deadline_ns: u64,
        row_bytes: u32,
    ) -> PyResult<Self> {
        let shape = Shape {
            slots,
            layers,
            columns,
            positions,
            first_column,
            layer_ids: [layer_ids.0, layer_ids.1],
            gpu_deadline_ns,
            row_bytes,
        };
        let inner = RingMemory::create(&shape).map_err(|e| bad(e.to_string()))?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// The memfd (owned by the ring: dup it to keep it).
    #[getter]
    fn fd(&self) -> i32 {
        self.inner.file().as_raw_fd()
    }

    /// Its bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }

    /// The first byte's address in this process.
    #[getter]
    fn address(&self) -> usize {
        self.inner.as_ptr() as usize
    }

    /// (slots, layers, columns, positions, first_column, layer ids, GPU deadline ns).
    #[getter]
    fn shape(&self) -> (u32, u32, u32, u32, u32, (u32, u32), u64) {
        let s = self.inner.shape();
        (
            s.slots,
            s.layers,
            s.columns,
            s.positions,
            s.first_column,
            (s.layer_ids[0], s.layer_ids[1]),
            s.gpu_deadline_ns,
        )
    }

    /// Bytes per row.
    #[getter]
    fn row_bytes(&self) -> u32 {
        self.inner.shape().row_bytes
    }

    /// A slot's stride in bytes.
    #[getter]
    fn stride(&self) -> u64 {
        self.inner.shape().stride().unwrap_or(0)
    }

    /// Where a slot's rows start, from the slot's start.
    #[getter]
    fn rows_at(&self) -> u64 {
        self.inner.shape().rows_at().unwrap_or(0)
    }

    /// Where slot `s` starts.
    fn slot_at(&self, s: u32) -> PyResult<u64> {
        self.check_slot(s)?;
        Ok(self.inner.shape().slot_at(s))
    }

    /// Slot `s`'s request word.
    fn request(&self, s: u32) -> PyResult<u64> {
        self.check_slot(s)?;
        Ok(self.inner.request(s))
    }

    /// Slot `s`'s done word of section `l`.
    fn done(&self, s: u32, l: u32) -> PyResult<u64> {
        self.check(s, l)?;
        Ok(self.inner.done(s, l))
    }

    /// Slot `s`'s status of section `l` (`engram_rack.ring.STATUS_*`).
    fn status(&self, s: u32, l: u32) -> PyResult<u32> {
        self.check(s, l)?;
        Ok(self.inner.status(s, l))
    }

    /// How slot `s`'s section `l` was served (`SERVED_*` bits).
    fn served(&self, s: u32, l: u32) -> PyResult<u32> {
        self.check(s, l)?;
        Ok(self.inner.served(s, l))
    }

    /// The client's state: 0 never attached, 1 serving, 2 gone.
    #[getter]
    fn client_state(&self) -> u32 {
        self.inner.client_state()
    }

    /// The client's heartbeat (CLOCK_MONOTONIC ns; 0: none yet).
    #[getter]
    fn heartbeat(&self) -> u64 {
        self.inner.heartbeat()
    }

    /// What a publish kernel does, on the CPU: `ids` (int64,
    /// `[sections in mask][positions][columns]`) into slot `seq % slots`,
    /// then `seq` published.
    fn publish(&self, seq: u64, mask: u32, positions: u32, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = buffer::<i64>(ids, "ids", "ring ids are int64", false)?;
        // SAFETY: held for the call, with the GIL.
        let ids = unsafe { slice(&ids) };
        self.inner
            .publish(seq, mask, positions, ids)
            .map_err(|e| bad(e.to_string()))
    }

    /// The buffer protocol: writable, one dimension of bytes.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let r = &slf.get().inner;
        let len = pyo3::ffi::Py_ssize_t::try_from(r.len())
            .map_err(|_| bad("the ring is larger than a Python buffer can be".into()))?;
        // SAFETY: `view` is the caller's to fill; the mapping lives while
        // `slf` does (the buffer holds a reference), and it is writable
        // shared memory (readonly = 0).
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), r.as_ptr().cast(), len, 0, flags)
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(PyErr::fetch(slf.py()))
        }
    }
}

impl Ring {
    fn check_slot(&self, s: u32) -> PyResult<()> {
        let n = self.inner.shape().slots;
        if s >= n {
            return Err(bad(format!("slot {s}: the ring has {n}")));
        }
        Ok(())
    }

    fn check(&self, s: u32, l: u32) -> PyResult<()> {
        self.check_slot(s)?;
        let n = self.inner.shape().layers;
        if l >= n {
            return Err(bad(format!("section {l}: the ring has {n}")));
        }
        Ok(())
    }
}

/// A ring served by this process's memory, or by the host's client: its
/// counters; `close()` (or dropping it) lets the ring go.
#[pyclass(name = "RingHandle", module = "engram_rack._native", frozen)]
pub(crate) struct RingHandle {
    pub(crate) inner: Mutex<Option<ring::RingHandle>>,
}

#[pymethods]
impl RingHandle {
    /// The client's give-up age in seconds.
    #[getter]
    fn deadline(&self) -> f64 {
        self.inner
            .lock()
            .as_ref()
            .map_or(0.0, |h| h.deadline().as_secs_f64())
    }

    /// Counters: requests, served, zeros, late, bad_positions, stale.
    fn counters(&self) -> std::collections::HashMap<&'static str, u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let g = self.inner.lock();
        let mut m = std::collections::HashMap::new();
        if let Some(h) = g.as_ref() {
            let c = h.counters();
            m.insert("requests", c.requests.load(Relaxed));
            m.insert("served", c.served.load(Relaxed));
            m.insert("zeros", c.zeros.load(Relaxed));
            m.insert("late", c.late.load(Relaxed));
            m.insert("bad_positions", c.bad_positions.load(Relaxed));
            m.insert("stale", c.stale.load(Relaxed));
        }
        m
    }

    /// Stop serving the ring (its header then says the client is gone).
    fn close(&self) {
        self.inner.lock().take();
    }
}

/// An engine's end of the host's engine socket (`inference-node engines`).
#[pyclass(name = "EngineLink", module = "engram_rack._native", frozen)]
pub(crate) struct EngineLink {
    inner: EngineClient,
}

#[pymethods]
impl EngineLink {
    /// Connect to the engine socket at `path`, waiting at most `wait`
    /// seconds for each of the node's first messages.
    #[new]
    #[pyo3(signature = (path, wait=10.0))]
    fn new(py: Python<'_>, path: PathBuf, wait: f64) -> PyResult<Self> {
        let w = timeout(Some(wait))?.unwrap_or_default();
        let inner = py
            .detach(|| EngineClient::connect(&path, w))
            .map_err(|e| setup(&path, &e))?;
        Ok(Self { inner })
    }

    /// The node's first message, as JSON text.
    #[getter]
    fn hello(&self) -> String {
        self.inner.hello.to_string()
    }

    /// Each table the node told of: (layer, table id, message as JSON
    /// text, whether its memory is here). Remote tables come through rings.
    #[getter]
    fn tables(&self) -> Vec<(u32, u32, String, bool)> {
        self.inner
            .tables
            .iter()
            .map(|t| (t.layer, t.table, t.message.to_string(), t.memory.is_some()))
            .collect()
    }

    /// A new descriptor (the caller's to close) of layer `layer`'s
    /// host-local memory, read-only.
    fn table_fd(&self, layer: u32) -> PyResult<i32> {
        let t = self
            .inner
            .tables
            .iter()
            .find(|t| t.layer == layer)
            .ok_or_else(|| {
                bad(format!(
                    "layer {layer}: the node has no table of that layer"
                ))
            })?;
        let (file, _) = t.memory.as_ref().ok_or_else(|| {
            bad(format!(
                "layer {layer}'s table is remote on this host: read it through a ring"
            ))
        })?;
        let dup = file
            .try_clone()
            .map_err(|e| bad(format!("duplicating the descriptor: {e}")))?;
        Ok(dup.into_raw_fd())
    }

    /// Hand `ring` to the node to serve; its reply as JSON text.
    #[pyo3(signature = (ring, wait=10.0))]
    fn attach(&self, py: Python<'_>, ring: &Ring, wait: f64) -> PyResult<String> {
        let w = timeout(Some(wait))?.unwrap_or_default();
        let r = Arc::clone(&ring.inner);
        let reply = py.detach(|| self.inner.attach(&r, w)).map_err(|e| {
            err(inference_node::embed::EmbedError::Setup(format!(
                "attaching a ring: {e}"
            )))
        })?;
        Ok(reply.to_string())
    }

    /// The socket's descriptor (readable with nothing to read: the node went).
    #[getter]
    fn fileno(&self) -> i32 {
        self.inner.socket().as_raw_fd()
    }
}

/// Serve `ring` from `mem` on the ring thread in `hub` (started on first
/// use: one for all of a memory's rings).
pub(crate) fn serve_on(
    py: Python<'_>,
    hub: &Mutex<Option<ring::RingHub>>,
    mem: inference_node::embed::NodeMemory,
    ring: &Ring,
) -> PyResult<RingHandle> {
    let r = Arc::clone(&ring.inner);
    let handle = py.detach(|| {
        let mut hub = hub.lock();
        if hub.is_none() {
            *hub = Some(ring::RingHub::start(mem, ring::RingOptions::default())?);
        }
        match hub.as_ref() {
            Some(h) => h.add(r),
            None => Err(inference_node::embed::EmbedError::Internal(
                "no ring thread".into(),
            )),
        }
    });
    Ok(RingHandle {
        inner: Mutex::new(Some(handle.map_err(err)?)),
    })
}

fn setup(path: &std::path::Path, e: &std::io::Error) -> PyErr {
    err(inference_node::embed::EmbedError::Setup(format!(
        "the engine socket {}: {e} (is `inference-node engines` running on this host?)",
        path.display()
    )))
}
