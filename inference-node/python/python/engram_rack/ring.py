"""The engine ring's GPU side: rows from the rack with no host sync.

A `RingLookup` is one rank's ring (`_native.Ring`, a memfd the host's rack
client maps and serves) and three Triton kernels, all launched on the
caller's current stream, so they are captured in CUDA graphs and replayed
like any kernel:

- `publish`: one program bumps a counter in GPU memory (`seq`), writes the
  step's ids for one or both layer sections into slot `seq % slots`, then
  publishes `seq` in the slot's request word with a system-scope release
  store (`st.release.sys`). A captured copy would always write the same
  address, so the slot is chosen on the device, from the counter.
- `wait`: one program reads the `seq` its section was last published
  with, spins with acquire loads
  (`ld.acquire.sys`) and the GPU timer (`%globaltimer`) until the
  section's done word says `seq` or the ring's GPU deadline passes, and
  records `(seq, status)` in GPU memory: the client's status, or
  `STATUS_TIMEOUT` (then it writes `seq` in the slot's give-up word, for
  the client). A status that is not rows bumps a per-section counter in
  GPU memory that the engine reads later, without a sync.
- `gather`: a grid reads `(seq, status)`, and gathers and dequantizes the
  slot's rows into the engine's output (bf16, or raw bytes), zeros where
  the status gives no rows: the same arithmetic as the engine's own lookup
  (`scale0_zero`: vLLM reads a scale byte of 0 as 0.0, SGLang as 2^-127).

The host side never blocks: the rack client (a native thread, on the host
or in this process) polls the request words and answers. Where a table's
policy is `fail`, a request answered without rows (every source failed,
the client's deadline, or the GPU's) is a fault: the client logs it in the
ring's header with the request's **step tag** (the engine step it came
from: `publish` copies it into the slot from a word in GPU memory that
`set_step` fills before each step, with no host sync), and
`take_faults()` (host memory only) returns the new ones, for the plugins
to fail that step's requests (`engram_rack.faults`). `check()` raises
`RingFault` for any instead, which stops the engine.

On CPU (`TRITON_INTERPRET=1`) the same kernels run under Triton's
interpreter: the release store is an atomic exchange, the acquire load a
volatile load, and the GPU timer a word in memory that a host thread
advances (`FakeTimer`): how the tests run the protocol with a real client.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from typing import NamedTuple

import numpy as np
import torch

from . import LAYERS, ROW_BYTES, BadInputError, NoSourceError, _native
from . import cuda as _cuda

__all__ = ["RingLookup", "HostRing", "RingFault", "Fault", "FakeTimer", "STATUS_NAMES",
           "check_all", "collect_faults", "set_step", "IDLE_STEP", "WAIT_BUCKETS",
           "wait_bucket_bounds", "wait_quantile"]

STATUS_OK, STATUS_ZEROS, STATUS_FAILED, STATUS_BAD_IDS, STATUS_LATE, STATUS_TIMEOUT = range(6)
#: What each status means.
STATUS_NAMES = ("ok", "zeros", "failed", "bad ids", "late", "timeout")
HEADER_BYTES = 4096
# Header words (PROTOCOL.md section 6), as int64 / int32 indices.
_H64_HEARTBEAT, _H64_CLIENT_DEADLINE, _H64_FAULTS, _H64_FAULT_SEQ = 9, 10, 13, 14
_H32_CLIENT_STATE, _H32_FAULT_SECTION, _H32_FAULT_STATUS, _H32_FAIL_SECTIONS = 17, 30, 31, 32
_SLOT_GAVE_UP = 56
#: The wait histograms: int64 [sections][WAIT_BUCKETS] from this offset.
_WAITS_AT = 1024
#: Buckets of a section's wait histogram (`wait_bucket_bounds`).
WAIT_BUCKETS = 80
#: The fault log: entries of 32 bytes (seq, step, section, status), fault
#: `n` in entry `(n - 1) % 32`; then each slot's step tag.
_FAULT_LOG_AT, _FAULT_LOG_ENTRIES, _STEP_TAGS_AT = 2304, 32, 3328
#: The step tag of work that serves no request (profile runs, graph
#: capture, dummy batches): a fault there fails no request. Tags of real
#: steps count from 1; 0 is a fault whose step the client cannot tell.
IDLE_STEP = 1 << 62
#: A client whose heartbeat is older than this does not answer.
_CLIENT_SILENT_NS = 1_000_000_000


def wait_bucket_bounds(b: int) -> tuple[float, float]:
    """Wait-histogram bucket `b`'s span in ns, `[low, high)` (the last
    bucket also holds every longer wait): PROTOCOL.md section 6.1."""
    if b == 0:
        return 0.0, 1024.0
    e, m = 10 + (b - 1) // 4, (b - 1) % 4
    return 2.0 ** e * (1 + m / 4), 2.0 ** e * (1 + (m + 1) / 4)


def wait_quantile(counts: np.ndarray, q: float) -> float:
    """The `q` quantile (0 to 1) of a wait histogram, in ns: the upper
    bound of the bucket it falls in (0.0 for no waits)."""
    counts = np.asarray(counts).reshape(-1)
    total = int(counts.sum())
    if total == 0:
        return 0.0
    rank = max(1, int(np.ceil(q * total)))
    b = int(np.searchsorted(np.cumsum(counts), rank))
    return wait_bucket_bounds(b)[1]


class RingFault(NoSourceError):
    """A ring request had no rows and its table's policy is `fail` (the
    client's answer, or the GPU's deadline with no client to answer): the
    engine must stop rather than serve tokens computed without them."""


class Fault(NamedTuple):
    """A fault the client logged: layer `layer`'s rows of ring request
    `seq`, from engine step `step` (0: unknown), did not come, for
    `status` (`STATUS_NAMES`)."""

    seq: int
    step: int
    layer: int
    status: int

    def describe(self) -> str:
        name = STATUS_NAMES[self.status] if 0 <= self.status < len(STATUS_NAMES) \
            else str(self.status)
        return f"request {self.seq}, layer {self.layer}, {name}"


class _StepWord:
    """The step tag a device's `publish` kernels copy into their slots: a
    word in device memory, filled by a non-blocking copy from a ring of
    pinned host words (64 deep: the host is never that many steps ahead
    of the device), so setting it never waits for the device."""

    DEPTH = 64

    def __init__(self, device: torch.device):
        # Until the first step: work that serves no request.
        self.word = torch.full((1,), IDLE_STEP, dtype=torch.int64, device=device)
        self.cpu = device.type == "cpu"
        # `device="cpu"`: a model may be built inside a CUDA device context.
        self.pinned = None if self.cpu else \
            torch.zeros(self.DEPTH, dtype=torch.int64, device="cpu", pin_memory=True)
        self.i = 0

    def set(self, tag: int) -> None:
        if self.cpu:
            self.word.numpy()[0] = tag
            return
        k = self.i % self.DEPTH
        self.i += 1
        self.pinned.numpy()[k] = tag
        self.word.copy_(self.pinned[k:k + 1], non_blocking=True)


_step_words: dict = {}
_step_lock = threading.Lock()


def _step_word(device: torch.device) -> torch.Tensor:
    with _step_lock:
        w = _step_words.get(device)
        if w is None:
            w = _step_words[device] = _StepWord(device)
        return w.word


def set_step(tag: int) -> None:
    """Tag the requests of the work launched from now on with engine step
    `tag` (1 and up for real steps; `IDLE_STEP` for work that serves no
    request). Call it on the stream the step runs on, outside graph
    capture; it launches one small copy per device and never waits."""
    if not 0 <= int(tag) < 1 << 63:
        raise BadInputError(f"step tag {tag}: 0 to 2^63 - 1")
    with _step_lock:
        words = list(_step_words.values())
    for w in words:
        w.set(int(tag))


#: Every ring of this process (`check_all`).
_rings: "weakref.WeakSet[RingLookup]" = None  # type: ignore[assignment]


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


try:
    import triton
    import triton.language as tl
except ImportError as _e:  # pragma: no cover - Triton ships with torch on Linux
    raise ImportError(f"engram_rack.ring needs Triton: {_e}") from None


@triton.jit
def _now(timer, FAKE: tl.constexpr):
    if FAKE:
        t = tl.load(timer, volatile=True)
    else:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    return t

@triton.jit
def _store_release(ptr, value, INTERP: tl.constexpr):
    if INTERP:
        tl.atomic_xchg(ptr, value)
    else:
        tl.inline_asm_elementwise(
            "st.release.sys.global.b64 [$1], $2; mov.u64 $0, 0;", "=l,l,l",
            [ptr, value], dtype=tl.int64, is_pure=False, pack=1)

@triton.jit
def _load_acquire(ptr, INTERP: tl.constexpr):
    if INTERP:
        v = tl.load(ptr, volatile=True)
    else:
        v = tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr],
            dtype=tl.int64, is_pure=False, pack=1)
    return v

@triton.jit
def _publish(ctr, last, ring, ids0, ids1, st0, sc0, st1, sc1, n, timer, step, own_lo, own_hi,
            STEPS_AT: tl.constexpr, SLOTS: tl.constexpr, STRIDE: tl.constexpr, POS: tl.constexpr,
            COLS: tl.constexpr, FIRST: tl.constexpr, MASK: tl.constexpr, SHARD: tl.constexpr,
            BLOCK: tl.constexpr, INTERP: tl.constexpr, FAKE: tl.constexpr):
    seq = tl.load(ctr) + 1
    tl.store(ctr, seq)
    base = ring + 4096 + (seq % SLOTS) * STRIDE
    ids = (base + 64).to(tl.pointer_type(tl.int64))
    total = n * COLS
    for start in range(0, total, BLOCK):
        k = start + tl.arange(0, BLOCK)
        valid = k < total
        t = (k // COLS).to(tl.int64)
        c = (k % COLS).to(tl.int64)
        if MASK & 1:
            v = tl.load(ids0 + t * st0 + (FIRST + c) * sc0, mask=valid, other=-1).to(tl.int64)
            if SHARD:
                # An ETP rank asks for the rows it owns only (-1: none).
                v = tl.where((v >= own_lo) & (v < own_hi), v, -1)
            tl.store(ids + t * COLS + c, v, mask=valid)
        if MASK & 2:
            v = tl.load(ids1 + t * st1 + (FIRST + c) * sc1, mask=valid, other=-1)
            tl.store(ids + (POS + t) * COLS + c, v.to(tl.int64), mask=valid)
    tl.store((base + 8).to(tl.pointer_type(tl.int32)), n.to(tl.int32))
    tl.store((base + 12).to(tl.pointer_type(tl.int32)), MASK)
    tl.store((base + 48).to(tl.pointer_type(tl.int64)), _now(timer, FAKE))
    if MASK & 1:
        tl.store(last, seq)
    if MASK & 2:
        tl.store(last + 1, seq)
    # The engine step this request belongs to, for the fault log.
    tl.store((ring + STEPS_AT + (seq % SLOTS) * 8).to(tl.pointer_type(tl.int64)), tl.load(step))
    tl.debug_barrier()
    _store_release(base.to(tl.pointer_type(tl.int64)), seq, INTERP)

@triton.jit
def _wait(last, ring, state, fails, timer, deadline_ns, L: tl.constexpr,
         SLOTS: tl.constexpr, STRIDE: tl.constexpr, INTERP: tl.constexpr,
         FAKE: tl.constexpr, WAITS_AT: tl.constexpr, WAIT_BUCKETS: tl.constexpr):
    seq = tl.load(last + L)
    base = ring + 4096 + (seq % SLOTS) * STRIDE
    done_at = (base + 16 + 8 * L).to(tl.pointer_type(tl.int64))
    start = _now(timer, FAKE)
    done = _load_acquire(done_at, INTERP)
    waited = start - start
    while (done != seq) & (waited < deadline_ns):
        done = _load_acquire(done_at, INTERP)
        waited = _now(timer, FAKE) - start
    status = tl.load((base + 32 + 4 * L).to(tl.pointer_type(tl.int32)), volatile=True)
    status = tl.where(done == seq, status.to(tl.int64), 5)
    # The wait's spin time in the header's histogram (PROTOCOL.md 6.1):
    # its exponent and two bits after the leading one, read from the wait
    # as a 32-bit float.
    bits = waited.to(tl.float32).to(tl.int32, bitcast=True)
    e = (bits >> 23) - 127
    bucket = tl.minimum(4 * (e - 10) + ((bits >> 21) & 3) + 1, WAIT_BUCKETS - 1)
    bucket = tl.where(waited < 1024, 0, bucket)
    hist = (ring + WAITS_AT + (L * WAIT_BUCKETS + bucket) * 8).to(tl.pointer_type(tl.int64))
    tl.store(hist, tl.load(hist, volatile=True) + 1)
    # The GPU gave up: say so in the slot, for the client to turn into the
    # table's policy (a fault under `fail`).
    tl.store((base + 56).to(tl.pointer_type(tl.int64)), seq, mask=done != seq)
    tl.store(state + 2 * L, seq)
    tl.store(state + 2 * L + 1, status)
    bad = ((status != 0) & (status != 3)).to(tl.int64)
    tl.store(fails + L, tl.load(fails + L) + bad)

@triton.jit
def _gather(ring, state, out, n, o_t, o_c, L: tl.constexpr, SLOTS: tl.constexpr,
           STRIDE: tl.constexpr, ROWS_AT: tl.constexpr, COLS: tl.constexpr,
           LOCAL: tl.constexpr, PACKED: tl.constexpr, SCALE0_ZERO: tl.constexpr,
           BLOCK_R: tl.constexpr):
    seq = tl.load(state + 2 * L)
    status = tl.load(state + 2 * L + 1)
    usable = (status == 0) | (status == 3)
    rows = ring + 4096 + (seq % SLOTS) * STRIDE + ROWS_AT
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = r < n * LOCAL
    t = (r // LOCAL).to(tl.int64)
    c = (r % LOCAL).to(tl.int64)
    # The request's status as a vector: a scalar bool in a mask is refused
    # by newer Triton interpreters.
    live = valid & (c < COLS) & ((tl.zeros([BLOCK_R], dtype=tl.int32) + usable.to(tl.int32)) != 0)
    row = rows + (t * COLS + c) * 264
    cols = tl.arange(0, 256)
    dst = t[:, None] * o_t + c[:, None] * o_c
    if PACKED:
        b = tl.load(row[:, None] + cols[None, :], mask=live[:, None], other=0)
        tl.store(out + dst + cols[None, :], b, mask=valid[:, None])
        sc = tl.arange(0, 8)
        s = tl.load(row[:, None] + 256 + sc[None, :], mask=live[:, None], other=0)
        tl.store(out + dst + 256 + sc[None, :], s, mask=valid[:, None])
    else:
        w = row.to(tl.pointer_type(tl.float8e4nv))
        values = tl.load(w[:, None] + cols[None, :], mask=live[:, None], other=0.0)
        exps = tl.load(row[:, None] + 256 + cols[None, :] // 32, mask=live[:, None], other=0)
        exps = exps.to(tl.int32)
        scale = (exps << 23).to(tl.float32, bitcast=True)
        if not SCALE0_ZERO:
            scale = tl.where(exps == 0, 2.0 ** -127, scale)
        v = values.to(tl.float32) * scale
        if not SCALE0_ZERO:
            v = tl.where(live[:, None], v, 0.0)
        tl.store(out + dst + cols[None, :], v.to(tl.bfloat16), mask=valid[:, None])


@triton.jit
def _gather_bytes(ring, state, out, n, o_t, o_c, L: tl.constexpr, SLOTS: tl.constexpr,
                  STRIDE: tl.constexpr, ROWS_AT: tl.constexpr, COLS: tl.constexpr,
                  ROW: tl.constexpr, BLOCK_D: tl.constexpr):
    """A ring of any row size: the rows' bytes as they are (the engine's
    own kernels dequantize them), zeros where the status gives none."""
    seq = tl.load(state + 2 * L)
    status = tl.load(state + 2 * L + 1)
    usable = (status == 0) | (status == 3)
    k = tl.program_id(0).to(tl.int64)
    t = k // COLS
    c = k % COLS
    row = ring + 4096 + (seq % SLOTS) * STRIDE + ROWS_AT + k * ROW
    d = tl.arange(0, BLOCK_D)
    inside = d < ROW
    live = inside & ((tl.zeros([BLOCK_D], dtype=tl.int32) + usable.to(tl.int32)) != 0)
    b = tl.load(row + d, mask=live, other=0)
    tl.store(out + t * o_t + c * o_c + d, b, mask=inside)


_rings = weakref.WeakSet()


def check_all() -> None:
    """`check()` every ring of this process: any fault stops the engine."""
    for r in list(_rings):
        r.check()


def collect_faults() -> list[Fault]:
    """Every ring's new faults (`take_faults`), what the plugins read
    before each engine step to fail the requests of the steps they name."""
    out: list[Fault] = []
    for r in list(_rings):
        out.extend(r.take_faults())
    return out


def _kernels():
    """The kernels (compiled on first launch)."""
    return _publish, _wait, _gather, _gather_bytes


class FakeTimer:
    """The GPU timer's stand-in on CPU: a word a thread keeps at the host's
    monotonic clock (ns), every `tick` seconds, until `stop()` (or the
    interpreter's exit: a thread stopped there inside torch's C++ would
    abort the process)."""

    def __init__(self, tick: float = 1e-4):
        self.word = torch.zeros(1, dtype=torch.int64)
        self._word = self.word.numpy()  # written without torch's C++
        self._stop = threading.Event()
        self._tick = tick
        self._word[0] = time.monotonic_ns()
        self._thread = threading.Thread(target=self._run, name="fake-gpu-timer", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def _run(self):
        while not self._stop.is_set():
            self._word[0] = time.monotonic_ns()
            time.sleep(self._tick)

    def stop(self):
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()


def _layers(layer_ids, row_bytes: int) -> tuple[int, ...]:
    """A ring's sections' layers, checked: V4.1's Engram layers in order,
    or (another row size) one or two model layers of routed tables."""
    layer_ids = tuple(int(x) for x in layer_ids)
    if int(row_bytes) == ROW_BYTES:
        if not layer_ids or any(x not in LAYERS for x in layer_ids) or \
                list(layer_ids) != sorted(set(layer_ids)):
            raise BadInputError(f"layers {layer_ids}: one or both of {LAYERS}, in order")
    elif not 1 <= len(layer_ids) <= 2 or len(set(layer_ids)) != len(layer_ids) or \
            any(x <= 0 for x in layer_ids):
        raise BadInputError(f"layers {layer_ids}: one or two model layers (1-based)")
    return layer_ids


class RingLookup:
    """One rank's rows through a ring (see the module's docs).

    `layer_ids`: the ring's sections' Engram layers (`(1, 14)`, `(1,)` or
    `(14,)`); `columns`: this rank's columns `[lo, hi)` of the 24 (hi past
    24: padded heads, zeros). A table of another family (`row_bytes` not
    264: a version 2 ring, PROTOCOL.md 6.1) has sections of its own model
    layers and `columns` `(0, C)`, C rows a position (16 for Qwen4Exp), and
    its rows come as bytes (`lookup_rows`); `positions`: the most one request carries (a
    longer step goes in turns of this many); `slots`: requests in flight
    at most; `deadline`: the GPU's, in seconds. Serve the ring with
    `link.serve(lookup.native)` (the host's client, or this process's
    memory) before the first step.
    """

    def __init__(self, layer_ids, columns, *, positions: int, device, slots: int = 8,
                 deadline: float = 0.05, timer: FakeTimer | None = None,
                 row_bytes: int = ROW_BYTES):
        layer_ids = _layers(layer_ids, row_bytes)
        lo, hi = (int(c) for c in columns)
        real_hi = min(hi, 24)
        if not 0 <= lo < real_hi:
            raise BadInputError(f"columns ({lo}, {hi}): a rank owns at least one of the 24")
        if row_bytes != ROW_BYTES and (lo, hi) != (0, real_hi):
            raise BadInputError(f"columns ({lo}, {hi}): a table of {row_bytes}-byte rows is read "
                                "whole, (0, rows a position), at most 24")
        self.row_bytes = int(row_bytes)
        self.layer_ids = layer_ids
        self.lo, self.hi, self.real_hi = lo, hi, real_hi
        self.positions = int(positions)
        self.device = torch.device(device)
        ids = layer_ids + (0,) * (2 - len(layer_ids))
        self.native = _native.Ring(int(slots), len(layer_ids), real_hi - lo, self.positions, lo,
                                   ids, int(deadline * 1e9), self.row_bytes)
        (self.slots, self.layers, self.cols, _, _, _, self.deadline_ns) = self.native.shape
        self.stride = self.native.stride
        self.rows_at = self.native.rows_at
        self._interp = self.device.type == "cpu"
        if self._interp and not _interpret():
            raise BadInputError("a ring on CPU runs its kernels under TRITON_INTERPRET=1")
        if self._interp and timer is None:
            timer = FakeTimer()
        self._timer = timer
        self.memory = self._map()
        self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)
        #: The `seq` each section was last published with.
        self.last = torch.zeros(2, dtype=torch.int64, device=self.device)
        #: Sections published by `publish` whose wait is still to come
        #: (section -> positions): a layer that finds its section here
        #: waits for that request instead of publishing its own.
        self.pending: dict[int, int] = {}
        self.state = torch.zeros(2 * self.layers, dtype=torch.int64, device=self.device)
        #: Per section: requests answered without rows (failed, zeros, late,
        #: timed out), counted on the device; read it when convenient.
        self.failures = torch.zeros(self.layers, dtype=torch.int64, device=self.device)
        self._timer_word = timer.word if timer is not None else self.counter
        #: The step tag `publish` copies into each request's slot (`set_step`).
        self.step_word = _step_word(self.device)
        # The header as the host reads it: plain loads of mapped memory
        # (numpy, not torch: no device context or dispatch mode sees them).
        self._h64 = np.frombuffer(memoryview(self.native), dtype=np.int64, count=64)
        self._h32 = np.frombuffer(memoryview(self.native), dtype=np.int32, count=128)
        self._faults_seen = int(self._h64[_H64_FAULTS])
        self._log = np.frombuffer(memoryview(self.native), dtype=np.int64, count=HEADER_BYTES // 8)
        self._gave_up_words = np.frombuffer(memoryview(self.native), dtype=np.int64)
        self._gave_up_at = np.array([(HEADER_BYTES + s * self.stride + _SLOT_GAVE_UP) // 8
                                     for s in range(self.slots)], dtype=np.int64)
        self._gave_up_seen = 0
        _rings.add(self)

    def _map(self) -> torch.Tensor:
        """The ring as a uint8 tensor the kernels address: a CPU tensor over
        the mapping, or (CUDA) the mapping registered and viewed on the device."""
        host = torch.frombuffer(memoryview(self.native), dtype=torch.uint8)
        if self._interp:
            return host
        _cuda.register(self.native.address, self.native.nbytes, read_only=False)
        return _cuda.device_view(self.native.address, (self.native.nbytes,), torch.uint8,
                                 self.device)

    def section(self, layer: int) -> int:
        """The ring section of Engram layer `layer`."""
        try:
            return self.layer_ids.index(int(layer))
        except ValueError:
            raise BadInputError(f"layer {layer}: this ring carries {self.layer_ids}") from None

    def publish(self, ids: dict[int, torch.Tensor], n: int, own: tuple[int, int] | None = None) -> None:
        """Publish a request of `n` positions: `ids[section]` is `[T, 24]`
        (any integer dtype, any strides; this rank's columns are read).
        `own`: the ids `[lo, hi)` this rank owns of a table of another
        family (the rest asked as -1: zeros). Launches one kernel; returns
        at once."""
        if own is not None and self.row_bytes == ROW_BYTES:
            raise BadInputError("V4.1's rings split a table by columns, not by ids")
        if not 0 < n <= self.positions:
            raise BadInputError(f"{n} positions: a request carries 1 to {self.positions}")
        mask = 0
        for s in ids:
            mask |= 1 << s
        a = ids.get(0, next(iter(ids.values())))
        b = ids.get(1, a)
        _kernels()[0][(1,)](
            self.counter, self.last, self.memory, a, b, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            n, self._timer_word, self.step_word, *(own or (0, 0)), STEPS_AT=_STEP_TAGS_AT,
            SLOTS=self.slots, STRIDE=self.stride, POS=self.positions, COLS=self.cols,
            FIRST=self.lo, MASK=mask, SHARD=own is not None, BLOCK=256, INTERP=self._interp,
            FAKE=self._timer is not None)

    def wait(self, section: int) -> None:
        """Launch the wait for the last request's `section`."""
        _kernels()[1][(1,)](
            self.last, self.memory, self.state, self.failures, self._timer_word,
            self.deadline_ns, L=section, SLOTS=self.slots, STRIDE=self.stride,
            INTERP=self._interp, FAKE=self._timer is not None, WAITS_AT=_WAITS_AT,
            WAIT_BUCKETS=WAIT_BUCKETS)

    def gather(self, section: int, out: torch.Tensor, n: int, *, scale0_zero: bool) -> None:
        """Launch the gather of the last request's `section` into `out`
        (`[n, hi - lo, 256]` bf16, or `[n, hi - lo, 264]` uint8 raw rows;
        any strides whose last is 1)."""
        if self.row_bytes != ROW_BYTES:
            raise BadInputError(f"a ring of {self.row_bytes}-byte rows gives bytes: gather_rows")
        local = self.hi - self.lo
        packed = out.dtype == torch.uint8
        width = ROW_BYTES if packed else 256
        if out.ndim != 3 or out.shape[0] < n or out.shape[1] != local or out.shape[2] < width \
                or out.stride(2) != 1:
            raise BadInputError(f"out must be [>= {n}, {local}, {width}] with unit last stride, "
                                f"got {tuple(out.shape)} strides {out.stride()}")
        block = 16
        grid = (max(1, -(-n * local // block)),)
        _kernels()[2][grid](
            self.memory, self.state, out, n, out.stride(0), out.stride(1), L=section,
            SLOTS=self.slots, STRIDE=self.stride,
            ROWS_AT=self.rows_at + section * self.positions * self.cols * ROW_BYTES,
            COLS=self.cols, LOCAL=local, PACKED=packed, SCALE0_ZERO=scale0_zero, BLOCK_R=block)

    def gather_rows(self, section: int, out: torch.Tensor, n: int) -> None:
        """Launch the gather of the last request's `section` into `out`,
        the rows' bytes as they are: `[>= n, columns, row_bytes]` uint8 (or
        a view of any dtype of that many bytes a row), unit last stride."""
        if out.dtype != torch.uint8:
            out = out.view(torch.uint8)
        if out.ndim != 3 or out.shape[0] < n or out.shape[1] != self.cols or \
                out.shape[2] != self.row_bytes or out.stride(2) != 1:
            raise BadInputError(f"out must be uint8 [>= {n}, {self.cols}, {self.row_bytes}] with "
                                f"unit last stride, got {tuple(out.shape)} strides {out.stride()}")
        if n == 0:
            return
        _kernels()[3][(n * self.cols,)](
            self.memory, self.state, out, n, out.stride(0), out.stride(1), L=section,
            SLOTS=self.slots, STRIDE=self.stride,
            ROWS_AT=self.rows_at + section * self.positions * self.cols * self.row_bytes,
            COLS=self.cols, ROW=self.row_bytes, BLOCK_D=triton.next_power_of_2(self.row_bytes))

    def lookup_rows(self, layer: int, ids: torch.Tensor, out: torch.Tensor,
                    own: tuple[int, int] | None = None) -> None:
        """A table of another family: rows `ids` (`[T, columns]`) of
        model layer `layer`'s table into `out` (`[T, columns, row_bytes]`
        bytes, or any dtype viewed as such), in turns of at most
        `positions`: publish, wait, gather each. Kernels only. `own`: the
        ids this rank owns (`[lo, hi)`; the rest are zeros, for vLLM's ETP
        reduction)."""
        s = self.section(layer)
        total = ids.shape[0]
        raw = out.view(torch.uint8).reshape(total, self.cols, self.row_bytes) \
            if out.dtype != torch.uint8 or out.ndim != 3 else out
        for start in range(0, total, self.positions):
            n = min(self.positions, total - start)
            self.publish({s: ids[start:start + n]}, n, own)
            self.wait(s)
            self.gather_rows(s, raw[start:start + n], n)

    def lookup(self, layer: int, ids: torch.Tensor, out: torch.Tensor, *,
               scale0_zero: bool) -> None:
        """One layer's rows of `ids` (`[T, 24]`) into `out`, in turns of at
        most `positions`: publish, wait, gather each. Kernels only."""
        s = self.section(layer)
        total = ids.shape[0]
        for start in range(0, total, self.positions):
            n = min(self.positions, total - start)
            self.publish({s: ids[start:start + n]}, n)
            self.wait(s)
            self.gather(s, out[start:start + n], n, scale0_zero=scale0_zero)

    def waits(self) -> np.ndarray:
        """Each section's wait histogram so far (`[sections, WAIT_BUCKETS]`
        counts; `wait_bucket_bounds` gives a bucket's span): how long the
        GPU's waits spun. Reads host memory only."""
        at = _WAITS_AT // 8
        words = np.frombuffer(memoryview(self.native), dtype=np.int64,
                              count=at + self.layers * WAIT_BUCKETS)
        return words[at:].reshape(self.layers, WAIT_BUCKETS).copy()

    def faults(self) -> int:
        """Faults the client has counted in this ring's header."""
        return int(self._h64[_H64_FAULTS])

    def take_faults(self) -> list[Fault]:
        """The faults the client has logged since the last call, oldest
        first (each with its request's step tag). Raises `RingFault` when
        more came than the log keeps (32: whose requests they failed is
        lost), or when a wait passed the GPU's deadline under a `fail`
        policy with no client answering (gone, or silent for a second).
        Reads host memory only."""
        count = int(self._h64[_H64_FAULTS])
        out: list[Fault] = []
        if count > self._faults_seen:
            first, self._faults_seen = self._faults_seen + 1, count
            if count - first >= _FAULT_LOG_ENTRIES:
                raise RingFault(f"engine ring: {count - first + 1} requests had no rows under "
                                f"the table's fail policy since the last step, more than the "
                                f"ring's fault log keeps ({_FAULT_LOG_ENTRIES}); the engine stops")
            for n in range(first, count + 1):
                at = (_FAULT_LOG_AT + ((n - 1) % _FAULT_LOG_ENTRIES) * 32) // 8
                seq, step, packed = (int(x) for x in self._log[at:at + 3])
                section, status = packed & 0xFFFFFFFF, packed >> 32
                layer = self.layer_ids[section] if 0 <= section < len(self.layer_ids) else section
                out.append(Fault(seq, step, layer, status))
        if not int(self._h32[_H32_FAIL_SECTIONS]):
            return out
        gave_up = int(self._gave_up_words[self._gave_up_at].max())
        if gave_up <= self._gave_up_seen:
            return out
        self._gave_up_seen = gave_up
        serving = int(self._h32[_H32_CLIENT_STATE]) == 1
        silent = time.monotonic_ns() - int(self._h64[_H64_HEARTBEAT]) > _CLIENT_SILENT_NS
        if not serving or silent:
            raise RingFault(f"engine ring: request {gave_up} passed the GPU's deadline with no "
                            "rack client answering, and the table's policy is fail; the "
                            "engine stops")
        return out

    def check(self) -> None:
        """Raise `RingFault` for any fault since the last check (see
        `take_faults`): the engine stops. Reads host memory only."""
        faults = self.take_faults()
        if faults:
            raise RingFault(f"engine ring: {len(faults)} request(s) had no rows under the "
                            f"table's fail policy (the last: {faults[-1].describe()}); "
                            "the engine stops")

    def close(self) -> None:
        """Stop the fake timer, if any."""
        if self._timer is not None and isinstance(self._timer, FakeTimer):
            self._timer.stop()


class HostRing:
    """A ring the host publishes to itself: what an engine's scheduler uses
    to fetch a prefill's rows from the rack before the forward pass (SGLang's
    stager), through the same client as the GPU's rings. `fetch` publishes
    from the CPU, polls the done word (sleeping between looks) and copies
    the rows out; a long request goes in turns of `positions`.

    Rows that do not come under a table's `fail` policy (every source
    failed, or the client's deadline) raise `RingFault`; under `zeros` they
    are zeros. With no client answering by `deadline`, `RingFault` too.
    """

    def __init__(self, layer_ids, *, positions: int = 1024, slots: int = 2,
                 deadline: float = 1.0, row_bytes: int = ROW_BYTES, columns: int = 24):
        layer_ids = _layers(layer_ids, row_bytes)
        if not 1 <= int(columns) <= 24 or (row_bytes == ROW_BYTES and int(columns) != 24):
            raise BadInputError(f"{columns} rows a position: V4.1's 24, or 1 to 24 of a table "
                                "of another family")
        self.layer_ids = layer_ids
        self.row_bytes = int(row_bytes)
        ids = layer_ids + (0,) * (2 - len(layer_ids))
        self.native = _native.Ring(int(slots), len(layer_ids), int(columns), int(positions), 0,
                                   ids, int(deadline * 1e9), self.row_bytes)
        (self.slots, self.layers, self.cols, self.positions, _, _, _) = self.native.shape
        self.deadline = float(deadline)
        self.rows_at = self.native.rows_at
        self.seq = 0
        self._bytes = np.frombuffer(memoryview(self.native), dtype=np.uint8)
        self._h32 = np.frombuffer(memoryview(self.native), dtype=np.int32, count=128)
        self._lock = threading.Lock()

    def section(self, layer: int) -> int:
        """The ring section of Engram layer `layer`."""
        try:
            return self.layer_ids.index(int(layer))
        except ValueError:
            raise BadInputError(f"layer {layer}: this ring carries {self.layer_ids}") from None

    def fetch(self, layer: int, ids) -> np.ndarray:
        """Layer `layer`'s packed rows (`[T, 24, 264]` uint8; a table of
        another family: `[T, columns, row_bytes]`) of row ids `ids` (`[T,
        columns]` integers; -1: no row, zeros)."""
        a = np.ascontiguousarray(np.asarray(ids), dtype=np.int64)
        if a.ndim != 2 or a.shape[1] != self.cols:
            raise BadInputError(f"ids have shape {a.shape}; give (positions, {self.cols})")
        s = self.section(layer)
        out = np.zeros((a.shape[0], self.cols, self.row_bytes), dtype=np.uint8)
        with self._lock:
            for start in range(0, a.shape[0], self.positions):
                n = min(self.positions, a.shape[0] - start)
                self._one(s, a[start:start + n], out[start:start + n])
        return out

    def _one(self, s: int, ids: np.ndarray, out: np.ndarray) -> None:
        self.seq += 1
        seq = self.seq
        slot = seq % self.slots
        self.native.publish(seq, 1 << s, ids.shape[0], ids.reshape(-1))
        t0 = time.monotonic()
        nap = 2e-5
        while self.native.done(slot, s) != seq:
            if time.monotonic() - t0 > self.deadline:
                e = RingFault(f"engine ring: no rack client answered a prefill's rows within "
                              f"{self.deadline:g} s (layer {self.layer_ids[s]})")
                e.detail = f"prefill, layer {self.layer_ids[s]}, no rack client answered " \
                    f"within {self.deadline:g} s"
                raise e
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)
        status = self.native.status(slot, s)
        fails = bool(int(self._h32[_H32_FAIL_SECTIONS]) & (1 << s))
        if status in (STATUS_OK, STATUS_BAD_IDS, STATUS_ZEROS) or not fails:
            rb = self.row_bytes
            at = self.native.slot_at(slot) + self.rows_at + s * self.positions * self.cols * rb
            n = ids.shape[0] * self.cols * rb
            out.reshape(-1)[:] = self._bytes[at:at + n]
            return
        name = STATUS_NAMES[status] if 0 <= status < len(STATUS_NAMES) else str(status)
        e = RingFault(f"engine ring: a prefill's rows did not come (request {seq}, layer "
                      f"{self.layer_ids[s]}, {name}) and the table's policy is fail")
        e.detail = f"prefill, layer {self.layer_ids[s]}, {name}"
        raise e
