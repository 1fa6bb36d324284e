"""engram_rack: a node's Engram memory, embedded in a Python inference engine.

Open the node's memory from the rack's cluster config, prefetch both Engram
tables' rows at the start of each step, and wait for each layer's rows where
the forward pass needs them, straight into your own (pinned) buffer::

    import numpy as np
    import engram_rack

    with engram_rack.Memory("/etc/engram-rack/rack.toml", "gpu-node-1") as mem:
        rows = mem.row_buffer(1)                  # (1, 24, 264) uint8
        t = mem.prefetch([token_id], context=previous_three_token_ids)
        served = t.wait(1, rows, timeout=0.005)   # layer 1's rows, GIL released
        values = engram_rack.dequantize(rows)     # (1, 24, 256) float32

Every routing rule of the node daemon applies (deadlines, hedging, circuit
breakers, failover to the SSD copy, table-version pins), with the same
metrics. See docs/engines.md in the repository for where the calls go in a
V4.1 forward pass.

`Tables(config, node)` is the same rack for a model of any family (a
Qwen4Exp rack's n-gram table, rows of any encoding): the engine hashes,
the rack gives rows by id, and a host-local donor's table maps here as
its memory (docs/models.md).
"""

from __future__ import annotations

import asyncio
from os import PathLike
from typing import Iterable, Sequence

import numpy as np

from . import _native
from ._native import (
    BadInputError,
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    EngramError,
    NoSourceError,
    Served,
    SetupError,
    TableView,
)

__all__ = [
    "Memory",
    "Tables",
    "Ticket",
    "Served",
    "TableView",
    "dequantize",
    "LAYERS",
    "COLUMNS",
    "ROW_BYTES",
    "ROW_VALUES",
    "NO_ROW",
    "EngramError",
    "ConfigError",
    "SetupError",
    "BadInputError",
    "NoSourceError",
    "DeadlineExceeded",
    "ClosedError",
]

__version__ = _native.VERSION

#: The Engram layers, in the order tickets and addresses use.
LAYERS = (1, 14)
#: Rows per position per layer (8 heads x 3 n-gram orders).
COLUMNS = 24
#: Bytes of one stored row (256 e4m3 values and 8 ue8m0 scales).
ROW_BYTES = 264
#: Values of one dequantized row.
ROW_VALUES = 256
#: The row id `addresses` gives a DEAD position.
NO_ROW = _native.NO_ROW

_INT64_MAX = np.iinfo(np.int64).max


def _ids(ids) -> np.ndarray:
    """Token ids as a contiguous int64 vector, or a clear error."""
    try:
        a = np.asarray(ids)
    except Exception as e:  # noqa: BLE001 - any failure to convert is bad input
        raise BadInputError(f"token ids must be a sequence of integers: {e}") from None
    if a.ndim != 1:
        raise BadInputError(f"token ids must be one-dimensional, got shape {a.shape}")
    if a.size == 0:
        raise BadInputError("no positions: the token id list is empty")
    if a.dtype.kind not in "iu":
        raise BadInputError(f"token ids must be integers, got dtype {a.dtype}")
    if a.dtype.kind == "u" and a.dtype.itemsize >= 8 and int(a.max()) > _INT64_MAX:
        raise BadInputError(f"token id {int(a.max())} is out of range")
    return np.ascontiguousarray(a, dtype=np.int64)


_INT64 = np.dtype(np.int64)


def _fast_ids(ids):
    """`ids` itself when it is already what the native call takes (a 1-D
    int64 array: checked there), else `_ids(ids)`: no work on the hot path."""
    if type(ids) is np.ndarray and ids.dtype is _INT64 and ids.ndim == 1:
        return ids
    return _ids(ids)


def _context(context) -> list[int]:
    if context is None:
        return []
    if isinstance(context, (str, bytes)):
        raise BadInputError("context must be a sequence of token ids, not a string")
    try:
        return [int(x) for x in list(context)[-3:]]
    except (TypeError, ValueError) as e:
        raise BadInputError(f"context must be a sequence of token ids: {e}") from None


class Ticket:
    """Both layers' rows of one prefetch, on their way (or, from
    `Tables.prefetch`, one table's rows at its own row size)."""

    __slots__ = ("_t",)

    def __init__(self, native):
        self._t = native

    @property
    def positions(self) -> int:
        """Positions in the batch."""
        return self._t.positions

    @property
    def nbytes(self) -> int:
        """Bytes of one layer's rows: positions x columns x row_bytes."""
        return self._t.nbytes

    @property
    def row_bytes(self) -> int:
        """Bytes per row: 264, or the table's own (`Tables.prefetch`)."""
        return self._t.row_bytes

    @property
    def columns(self) -> int:
        """Rows per position per layer: 24, or the columns a
        `prefetch_rows` asked for."""
        return self._t.columns

    def row_buffer(self) -> np.ndarray:
        """A (positions, columns, row_bytes) uint8 array for one layer's rows."""
        return np.zeros((self.positions, self.columns, self.row_bytes), dtype=np.uint8)

    def ready(self, layer: int) -> bool:
        """Whether `layer`'s fetch has ended (without waiting)."""
        return self._t.ready(layer)

    def wait(self, layer: int, out, timeout: float | None = None) -> Served:
        """Wait for `layer`'s rows (1 or 14) and write them into `out`.

        `out` is any writable C-contiguous uint8 buffer of `nbytes` bytes (a
        numpy array such as `Memory.row_buffer`, or a CPU torch tensor's
        `.numpy()`): position after position, 24 rows of 264 bytes, column
        order; a DEAD position's rows are zeros. The GIL is released while
        waiting. At most `timeout` seconds (None: the table's own deadline
        and hard timeout bound it); DeadlineExceeded leaves the ticket valid.
        NoSourceError when every source failed under the `fail` policy.
        """
        return self._t.wait(layer, out, timeout)

    async def wait_async(self, layer: int, out, timeout: float | None = None) -> Served:
        """`wait` for asyncio: suspends the coroutine, never the event loop."""
        if not self._t.ready(layer):
            loop = asyncio.get_running_loop()
            fut = loop.create_future()

            def resolve() -> None:
                if not fut.done():
                    fut.set_result(None)

            def wake() -> None:  # on the package's notifier thread
                try:
                    loop.call_soon_threadsafe(resolve)
                except RuntimeError:  # the loop has closed: nobody waits
                    pass

            self._t.on_ready(layer, wake)
            try:
                await asyncio.wait_for(fut, timeout)
            except (asyncio.TimeoutError, TimeoutError):
                raise DeadlineExceeded(
                    f"layer {layer}: rows not ready within {timeout} s; the ticket is still valid"
                ) from None
        return self._t.wait(layer, out, 0.0)

    def rows(self, layer: int, timeout: float | None = None) -> np.ndarray:
        """`wait` into a new (positions, columns, row_bytes) uint8 array, and return it."""
        out = np.empty((self.positions, self.columns, self.row_bytes), dtype=np.uint8)
        self._t.wait(layer, out, timeout)
        return out


class Memory:
    """A node's Engram memory: `Memory(config, node)` opens it.

    Opening builds what the node daemon builds for `node` of the cluster
    config (every source opened and probed, SSD and local copies checked
    against their digests), and serves /metrics at the node's `metrics`
    address unless `metrics` says otherwise ("off", or "IP:PORT"). Errors
    are ConfigError (with the config's file:line where it comes from it)
    or SetupError. Thread-safe; use as a context manager, or call close().
    """

    __slots__ = ("_m",)

    def __init__(self, config: str | PathLike, node: str, *, metrics: str | None = None):
        self._m = _native.Memory.open(str(config), str(node), metrics)

    @classmethod
    def open(cls, config: str | PathLike, node: str, *, metrics: str | None = None) -> "Memory":
        """The same as `Memory(config, node)`."""
        return cls(config, node, metrics=metrics)

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"tables={self._m.tables}"
        return f"engram_rack.Memory(node={self.node!r}, {state})"

    @property
    def node(self) -> str:
        """The node's name in the config."""
        return self._m.node

    @property
    def tables(self) -> tuple[int, int]:
        """Table ids of layers 1 and 14."""
        return self._m.tables

    @property
    def tokens_per_second(self) -> float:
        """The node's token rate in the config (it sets each table's deadline)."""
        return self._m.tokens_per_second

    @property
    def metrics_address(self) -> str | None:
        """Where /metrics is served ("IP:PORT"), or None."""
        return self._m.metrics_address

    @property
    def closed(self) -> bool:
        return self._m.closed

    def addresses(self, ids, context: Sequence[int] | None = None) -> np.ndarray:
        """Row ids of raw token ids `ids`, without fetching.

        Returns a (positions, 2, 24) uint64 array: layer 1's and layer 14's
        24 row ids per position (NO_ROW for a DEAD position, id -1).
        `context`: the sequence's tokens before `ids` (its last three are
        used); empty or None when `ids` start the sequence.
        """
        a = _ids(ids)
        out = np.empty((a.size, 2, COLUMNS), dtype=np.uint64)
        self._m.addresses(a, [(a.size, _context(context))], out)
        return out

    def warm(self, lead: float = 300e-6) -> None:
        """The next prefetch comes in about `lead` seconds: wake the path to
        its rows now, as the node's own loop does before each step (each
        table's first donor is pinged and the memory's I/O thread polls
        until the fetches that follow have ended, or `lead` plus a
        millisecond). Call it a few hundred microseconds before each
        step's prefetch; it returns at once."""
        if not (0.0 <= lead <= 1.0):
            raise BadInputError(f"lead {lead!r}: give seconds between 0 and 1")
        self._m.warm(int(lead * 1e6))

    def prefetch(self, ids, context: Sequence[int] | None = None) -> Ticket:
        """Start both tables' fetches for one sequence's positions; returns at once.

        `ids`: raw token ids of the positions (one for a decode step, k + 1
        for a speculative verification, many for a prefill chunk);
        `context`: the sequence's tokens before them (last three used).
        """
        return Ticket(self._m.prefetch(_fast_ids(ids), context))

    def prefetch_batch(self, sequences: Iterable[tuple[Sequence[int], Sequence[int] | None]]) -> Ticket:
        """One prefetch for a serving batch: `[(ids, context), ...]`, one
        entry per sequence. Rows come back in the order given, one message
        per table for the whole batch."""
        parts = []
        segs = []
        for i, item in enumerate(sequences):
            try:
                ids, context = item
            except (TypeError, ValueError):
                raise BadInputError(f"sequence {i}: give (ids, context)") from None
            a = _ids(ids)
            parts.append(a)
            segs.append((a.size, _context(context)))
        if not parts:
            raise BadInputError("no sequences in the batch")
        return Ticket(self._m.prefetch_segments(np.concatenate(parts), segs))

    def prefetch_rows(self, rows, layer: int | None = None,
                      columns: tuple[int, int] = (0, COLUMNS)) -> Ticket:
        """Start fetches by row ids, for an engine that hashes on its own.

        `rows`: a (positions, 2, w) array of layer 1's then layer 14's row
        ids per position, or with `layer` (1 or 14) that layer's
        (positions, w); numpy or a CPU torch tensor, any integer dtype (a
        negative id must be -1, read as NO_ROW). `columns`: the columns
        (lo, hi) of the 24 these are, w = hi - lo (a tensor-parallel rank's
        head slice); all 24 by default. A position whose ids are all NO_ROW
        is DEAD. Ids are checked against each table's size and deduplicated;
        one message per table. Wait into `ticket.row_buffer()`.
        """
        try:
            lo, hi = (int(c) for c in columns)
        except (TypeError, ValueError):
            raise BadInputError(f"columns {columns!r}: give (lo, hi)") from None
        if not 0 <= lo < hi <= COLUMNS:
            raise BadInputError(f"columns ({lo}, {hi}): give 0 <= lo < hi <= {COLUMNS}")
        a = np.asarray(rows)
        if a.dtype.kind not in "iu":
            raise BadInputError(f"rows have dtype {a.dtype}; give integer row ids")
        width = hi - lo
        want = (2, width) if layer is None else (width,)
        if a.ndim != 1 + len(want) or tuple(a.shape[1:]) != want:
            what = "(positions, 2, %d)" % width if layer is None else "(positions, %d)" % width
            raise BadInputError(f"rows have shape {tuple(a.shape)}; give {what}")
        if a.dtype.kind == "i":
            if a.size and int(a.min()) < -1:
                raise BadInputError(f"row id {int(a.min())} is negative (only -1, NO_ROW, is)")
            a = np.where(a < 0, np.uint64(NO_ROW), a.astype(np.uint64, copy=False))
        a = np.ascontiguousarray(a, dtype=np.uint64)
        return Ticket(self._m.prefetch_rows(a.reshape(-1), layer, lo, hi))

    def row_buffer(self, positions: int) -> np.ndarray:
        """A (positions, 24, 264) uint8 array for one layer's rows."""
        return np.zeros((positions, COLUMNS, ROW_BYTES), dtype=np.uint8)

    def table_view(self, layer: int, wait: float = 5.0) -> TableView:
        """Layer `layer`'s whole table as this process maps it: a read-only
        buffer (buffer protocol) over a host-local donor's memory, which
        every process on the host maps (one physical copy; `view.shared`),
        or else over the node's own `local` copy. Waits up to `wait`
        seconds for the donor's host socket to hand the table over.

        When `view.packed` (always for a donor's memory), rows are back to
        back, row r at r * 264::

            rows = np.frombuffer(view, np.uint8).reshape(view.rows, 264)

        Otherwise (a `local` copy served from its file's pages) 15 rows
        share each 4 KiB page; `view.offset(r)` says where any row starts.
        The view holds the memory as it was: after a swap on the donor, a
        fresh call gives the new version. Writing to it is refused."""
        return self._m.table_view(int(layer), float(wait))

    def serve_ring(self, ring) -> "_native.RingHandle":
        """Serve `ring` (an `engram_rack.ring.Ring`'s native ring, or a
        `_native.Ring`) from this memory, on this process's one ring thread:
        for an engine with no host client (`inference-node engines`).
        Returns a handle; `close()` it (or drop it) to let the ring go."""
        return self._m.serve_ring(getattr(ring, "native", ring))

    def stats(self) -> list[dict]:
        """Per-layer counters since opening: prefetches, rows, messages,
        hedges, failovers, late, zeros, failed."""
        return self._m.stats()

    def metrics(self) -> str:
        """The node's metrics in Prometheus text (what /metrics serves)."""
        return self._m.metrics_text()

    def close(self, drain: float = 2.0) -> None:
        """Let fetches in flight end (at most `drain` seconds), then stop the
        probes, the metrics server and the I/O thread. Idempotent."""
        self._m.close(drain)


class Tables:
    """A node's tables for an engine of any model family: `Tables(config,
    node)` opens them as `Memory` does (every source opened and probed,
    copies checked), but knows no model's hashing: the engine brings row
    ids. `tables` says what each is (rows, row_bytes, encoding, values,
    tensor_scale, policy); `lookup` gives rows by id at their own size;
    `table_view` maps a host-local donor's table (rows back to back), which
    an engine's own host-table kernel reads in place; `serve` serves an
    engine ring of a table's row size (`engram_rack.ring.RingLookup`), whose
    rows a GPU gathers with no host sync. Thread-safe; use as a context
    manager, or call close().
    """

    __slots__ = ("_t", "_info", "_handles")

    def __init__(self, config: str | PathLike, node: str, *, metrics: str | None = None):
        self._t = _native.Tables.open(str(config), str(node), metrics)
        self._info = {t["table"]: t for t in self._t.tables()}
        self._handles: list = []

    def __enter__(self) -> "Tables":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"engram_rack.Tables(node={self._t.node!r}, tables={sorted(self._info)})"

    @property
    def node(self) -> str:
        """The node's name in the config."""
        return self._t.node

    @property
    def tables(self) -> list[dict]:
        """Every routed table, in the config's route order."""
        return [dict(t) for t in self._info.values()]

    def table(self, table: int) -> dict:
        """What table `table` is (BadInputError when the node does not route it)."""
        try:
            return dict(self._info[int(table)])
        except KeyError:
            raise BadInputError(f"table {table} is not routed by node {self.node!r} "
                                f"(tables: {sorted(self._info)})") from None

    def lookup(self, table: int, ids, out=None, timeout: float | None = None) -> np.ndarray:
        """Rows `ids` (any shape of non-negative integers) of table `table`,
        shaped `ids.shape + (row_bytes,)` uint8 (or written into `out`);
        repeated ids are fetched once. Raises NoSourceError when every
        source failed under a `fail` policy, DeadlineExceeded past `timeout`."""
        info = self.table(table)
        a = np.asarray(ids)
        if a.dtype.kind not in "iu":
            raise BadInputError(f"row ids must be integers, got dtype {a.dtype}")
        if a.size == 0:
            raise BadInputError("no row ids")
        if a.dtype.kind == "i" and int(a.min()) < 0:
            raise BadInputError(f"row id {int(a.min())} is negative")
        flat = np.ascontiguousarray(a.reshape(-1), dtype=np.uint64)
        shape = a.shape + (info["row_bytes"],)
        if out is None:
            out = np.empty(shape, dtype=np.uint8)
        self._t.lookup(int(table), flat, out, timeout)
        return out

    def prefetch(self, table: int, ids) -> Ticket:
        """Start table `table`'s fetch of rows `ids` ((positions, columns)
        integers; -1: no row, zeros there), returning at once; repeats are
        fetched once. Take the rows with the ticket's `rows(layer)`,
        `wait(layer, out)` or `wait_async(layer, out)` (asyncio), `layer`
        being the table's (`table(t)["layer"]`): (positions, columns,
        row_bytes) uint8."""
        info = self.table(table)
        a = np.asarray(ids)
        if a.dtype.kind not in "iu":
            raise BadInputError(f"row ids must be integers, got dtype {a.dtype}")
        if a.ndim != 2 or a.size == 0:
            raise BadInputError(f"ids have shape {a.shape}; give (positions, columns)")
        if a.dtype.kind == "i":
            if int(a.min()) < -1:
                raise BadInputError(f"row id {int(a.min())} is negative (only -1, no row, is)")
            a = np.where(a < 0, np.uint64(NO_ROW), a.astype(np.uint64, copy=False))
        flat = np.ascontiguousarray(a, dtype=np.uint64).reshape(-1)
        return Ticket(self._t.prefetch([info["table"]], flat, a.shape[1]))

    def table_view(self, table: int, wait: float = 5.0) -> TableView:
        """Table `table` as this process maps it: a host-local donor's
        memory (one copy for the host; `shared`), else the node's own copy;
        NoSourceError when neither holds it. Read-only."""
        return self._t.table_view(int(table), wait)

    def dequantize(self, table: int, rows, out=None) -> np.ndarray:
        """Rows of table `table` (uint8, last axis row_bytes) to their values
        as bf16 bit patterns (uint16, last axis `values`), as the engines
        compute them (the table's tensor_scale applied)."""
        info = self.table(table)
        r = np.ascontiguousarray(np.asarray(rows))
        if r.dtype != np.uint8 or r.ndim == 0 or r.shape[-1] != info["row_bytes"]:
            raise BadInputError(f"rows must be uint8 with a last axis of {info['row_bytes']}, "
                                f"got {r.dtype} {r.shape}")
        if out is None:
            out = np.empty(r.shape[:-1] + (info["values"],), dtype=np.uint16)
        _native.dequantize_bf16(r, out, info["encoding"], info["tensor_scale"])
        return out

    def metrics(self) -> str:
        """The node's metric series, Prometheus' text format."""
        return self._t.metrics_text()

    def serve(self, ring):
        """Serve `ring` (a `RingLookup`, `HostRing` or `_native.Ring` whose
        sections are routed tables' layers, of their row size) on this
        process's ring thread; served until close(). Returns its handle
        (`counters()`). BadInputError names what does not fit."""
        handle = self._t.serve_ring(getattr(ring, "native", ring))
        self._handles.append(handle)
        return handle

    def close(self, drain: float = 2.0) -> None:
        """Let lookups in flight end (at most `drain` seconds), then stop. Idempotent."""
        for h in self._handles:
            h.close()
        self._handles.clear()
        self._t.close(drain)


def dequantize(rows, out=None, dtype="float32") -> np.ndarray:
    """Dequantize rows (a uint8 array whose last axis is 264) into values.

    Returns (or fills `out`, shaped like `rows` with a last axis of 256):
    float32 values, or with dtype="bfloat16" their bf16 bit patterns as
    uint16 (numpy has no bfloat16). The values are bit-identical to what the
    node's fusion reads. A DEAD position's zero rows dequantize to zeros.
    """
    r = np.asarray(rows)
    if r.dtype != np.uint8:
        raise BadInputError(f"rows have dtype {r.dtype}; rows are bytes: use dtype uint8")
    if r.ndim == 0 or r.shape[-1] != ROW_BYTES:
        raise BadInputError(f"rows must have a last axis of {ROW_BYTES} bytes, got shape {r.shape}")
    r = np.ascontiguousarray(r)
    shape = r.shape[:-1] + (ROW_VALUES,)
    if dtype in ("float32", np.float32):
        want, fn = np.float32, _native.dequantize_f32
    elif dtype in ("bfloat16", "bf16"):
        want, fn = np.uint16, _native.dequantize_bf16
    else:
        raise BadInputError(f'dtype {dtype!r}: give "float32" or "bfloat16"')
    if out is None:
        out = np.empty(shape, dtype=want)
    elif isinstance(out, np.ndarray):
        ok = out.dtype == want or (want is np.uint16 and out.dtype == np.int16)
        if not ok:
            raise BadInputError(f"out has dtype {out.dtype}; {dtype} output needs {np.dtype(want)}")
        if out.size != int(np.prod(shape)):
            raise BadInputError(f"out has {out.size} values; these rows need {int(np.prod(shape))}")
    fn(r, out)
    return out
