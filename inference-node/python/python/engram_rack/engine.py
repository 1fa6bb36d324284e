"""Rows for an inference engine's Engram layer, as torch tensors.

The pieces the vLLM and SGLang plugins share (`engram_rack.vllm`,
`engram_rack.sglang`), usable by any torch engine that hashes on its own:

- `LayerRows`: one Engram layer's rows for one rank. `start(hash_ids)` takes
  the engine's row ids (any device, `[T, 24]`, the same ids engram_rack
  computes), copies them to pinned host memory and starts one fetch per
  table with `Memory.prefetch_rows`; `ready(T)` waits into a pinned buffer,
  copies it to the ids' device without blocking and dequantizes there,
  returning bf16 `[T, w, 256]`. With `view=True` and a host-local donor the
  copy is skipped: rows are gathered on the device straight from the table
  every process on the host maps (`Memory.table_view`).
- `dequantize_rows`: 264-byte rows to bf16 values with torch ops, the values
  `engram_rack.dequantize` gives (a scale byte of 0 is 2^-127).
- `gather_view`: a Triton kernel that gathers and dequantizes rows straight
  from a table view (packed, or 15 rows per 4 KiB page), on a GPU or, under
  `TRITON_INTERPRET=1`, on CPU tensors.

Needs torch (and Triton for `gather_view`); the rest of the package does not.
"""

from __future__ import annotations

import threading

import torch

from . import COLUMNS, LAYERS, ROW_BYTES, ROW_VALUES, BadInputError, Memory

__all__ = ["LayerRows", "dequantize_rows", "gather_view", "scale_values"]

#: Values that share one scale byte.
_BLOCK = 32
_SCALES = ROW_VALUES // _BLOCK
#: The f32 bit pattern of 2^-127 (a subnormal): what scale byte 0 means.
_TWO_TO_MINUS_127_BITS = 0x0040_0000
#: Rows per 4 KiB page of a table file (`TableView.packed` is False).
_PAGE_ROWS = 15
_PAGE_BYTES = 4096


def scale_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale bytes (uint8) to their f32 values, 2^(s - 127).

    The byte is the f32 exponent field, so `s << 23` is the value for s >= 1;
    s = 0 is 2^-127, a subnormal, as the V4.1 reference reads it (not 0.0).
    """
    bits = scale_bytes.to(torch.int32) << 23
    bits = torch.where(scale_bytes == 0, torch.full_like(bits, _TWO_TO_MINUS_127_BITS), bits)
    return bits.view(torch.float32)


def dequantize_rows(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows (uint8, last axis 264) to bf16 values (last axis 256), on the
    rows' device: each E4M3 code times its block's scale in f32 (exact),
    rounded to bf16. Zero rows (a DEAD position, a padded head) give zeros."""
    if rows.dtype != torch.uint8 or rows.ndim == 0 or rows.shape[-1] != ROW_BYTES:
        raise BadInputError(f"rows must be uint8 with a last axis of {ROW_BYTES}, got "
                            f"{rows.dtype} {tuple(rows.shape)}")
    lead = rows.shape[:-1]
    codes = rows[..., :ROW_VALUES].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scales = scale_values(rows[..., ROW_VALUES:])
    values = codes.view(*lead, _SCALES, _BLOCK) * scales.unsqueeze(-1)
    values = values.view(*lead, ROW_VALUES)
    if out is None:
        return values.to(torch.bfloat16)
    out.copy_(values)
    return out


def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # pragma: no cover - Triton ships with torch on Linux
        raise BadInputError(f"gather_view needs Triton: {e}") from None
    return triton, tl


_KERNEL = None
_KERNEL_LOCK = threading.Lock()


def _gather_kernel():
    """The gather kernel, compiled on first use (Triton is imported lazily)."""
    global _KERNEL
    with _KERNEL_LOCK:
        if _KERNEL is not None:
            return _KERNEL
        triton, tl = _triton()

        @triton.jit
        def gather_rows(table, table_rows, ids, ids_stride_t, ids_stride_c, out, n,
                        COLS: tl.constexpr, PAGED: tl.constexpr, BLOCK_R: tl.constexpr):
            # One program gathers BLOCK_R rows of the flattened [T, COLS] ids.
            r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
            valid = r < n
            t = (r // COLS).to(tl.int64)
            c = (r % COLS).to(tl.int64)
            idx = tl.load(ids + t * ids_stride_t + c * ids_stride_c, mask=valid, other=-1)
            idx = idx.to(tl.int64)
            ok = valid & (idx >= 0) & (idx < table_rows)
            idx = tl.where(ok, idx, 0)
            if PAGED:
                off = (idx // 15) * 4096 + (idx % 15) * 264
            else:
                off = idx * 264
            cols = tl.arange(0, 256)
            code = tl.load(table + off[:, None] + cols[None, :], mask=ok[:, None], other=0)
            sbyte = tl.load(table + off[:, None] + 256 + cols[None, :] // 32,
                            mask=ok[:, None], other=0)
            # E4M3FN by its bits: e = 0 is m * 2^-9, else (8 + m) * 2^(e - 10).
            code = code.to(tl.int32)
            e = (code >> 3) & 15
            m = (code & 7).to(tl.float32)
            unit = (tl.maximum(e, 1) - 10 + 127) << 23
            mag = tl.where(e == 0, m, m + 8.0) * unit.to(tl.float32, bitcast=True)
            value = tl.where((code >> 7) != 0, -mag, mag)
            sbits = tl.where(sbyte == 0, 0x400000, sbyte.to(tl.int32) << 23)
            value = value * sbits.to(tl.float32, bitcast=True)
            # f32 to bf16, to nearest with ties to even, on the bits: exact for
            # subnormals too (the interpreter's own conversion is not).
            u = value.to(tl.uint32, bitcast=True)
            half = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
            tl.store(out + r.to(tl.int64)[:, None] * 256 + cols[None, :],
                     half.to(tl.int16, bitcast=True), mask=valid[:, None])

        _KERNEL = gather_rows
        return _KERNEL


class _Pointer:
    """A raw device-accessible address for a Triton argument (a host table
    registered with CUDA is addressed directly through unified addressing)."""

    def __init__(self, ptr: int, dtype=torch.uint8):
        self._ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._ptr


def view_tensor(view, device: torch.device | str = "cpu"):
    """A table view as something the gather kernel reads on `device`: a CPU
    uint8 tensor over the mapping, or (CUDA) the mapping registered with the
    driver (read-only, mapped) and addressed directly. The registration lasts
    as long as the returned object."""
    device = torch.device(device)
    host = torch.frombuffer(memoryview(view), dtype=torch.uint8) if len(view) else \
        torch.empty(0, dtype=torch.uint8)
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        raise BadInputError(f"table views are gathered on CPU or CUDA devices, not {device}")
    return _Registered(host)


class _Registered(_Pointer):
    """A host mapping registered with CUDA for as long as this object lives."""

    _MAPPED = 0x02
    _READ_ONLY = 0x08

    def __init__(self, host: torch.Tensor):
        cudart = torch.cuda.cudart()
        ptr, size = host.data_ptr(), host.numel()
        err = cudart.cudaHostRegister(ptr, size, self._MAPPED | self._READ_ONLY)
        if int(err) != 0:
            raise BadInputError(f"cudaHostRegister of the table view ({size} bytes) failed: {err}")
        super().__init__(ptr)
        self._host = host
        self._cudart = cudart

    def __del__(self):
        try:
            self._cudart.cudaHostUnregister(self._ptr)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def gather_view(table, rows: int, packed: bool, ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather and dequantize rows `ids` (`[T, w]`, any integer dtype, -1 or an
    id past the table for a zero row) from a table view's memory (`table`
    from `view_tensor`; `rows` and `packed` from the view) into bf16
    `[T, w, 256]` on the ids' device."""
    if ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise BadInputError(f"ids must be an integer [T, w] tensor, got {ids.dtype} {tuple(ids.shape)}")
    t, w = ids.shape
    if out is None:
        out = torch.empty((t, w, ROW_VALUES), dtype=torch.bfloat16, device=ids.device)
    elif out.shape != (t, w, ROW_VALUES) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise BadInputError(f"out must be a contiguous bf16 {(t, w, ROW_VALUES)} tensor")
    n = t * w
    if n == 0:
        return out
    block = 16
    _gather_kernel()[((n + block - 1) // block,)](
        table, rows, ids, ids.stride(0), ids.stride(1), out.view(torch.int16), n,
        COLS=w, PAGED=not packed, BLOCK_R=block,
    )
    return out


class LayerRows:
    """One Engram layer's rows for one engine rank.

    `memory`: an open `engram_rack.Memory`; `layer`: 1 or 14; `columns`: the
    heads `[lo, hi)` this rank owns (a tensor-parallel slice; `hi` may pass
    24 when heads are padded to a multiple of the ranks: those come back as
    zeros); `max_tokens`: the most positions one step brings; `device`:
    where `ready` returns rows. `view=True` gathers from the host's shared
    table (`Memory.table_view`) on the device instead of fetching.
    """

    def __init__(self, memory: Memory, layer: int, *, columns: tuple[int, int] = (0, COLUMNS),
                 max_tokens: int, device: torch.device | str, view: bool = False,
                 view_wait: float = 5.0):
        if layer not in LAYERS:
            raise BadInputError(f"layer {layer}: Engram layers are {LAYERS}")
        lo, hi = (int(c) for c in columns)
        if not (0 <= lo < COLUMNS and lo < hi):
            raise BadInputError(f"columns ({lo}, {hi}): give 0 <= lo < 24 and lo < hi")
        if max_tokens <= 0:
            raise BadInputError(f"max_tokens {max_tokens}: give at least 1")
        self.memory = memory
        self.layer = layer
        self.lo, self.hi = lo, hi
        self.real_hi = min(hi, COLUMNS)
        self.width = hi - lo
        self.max_tokens = int(max_tokens)
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        real = self.real_hi - lo
        self._host_ids = torch.empty((self.max_tokens, real), dtype=torch.int64, pin_memory=pin)
        self._host_rows = torch.zeros((self.max_tokens, real, ROW_BYTES), dtype=torch.uint8,
                                      pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None
        self._ticket = None
        #: What the last `ready` was served by (`Served`: sources, zeros...).
        self.last_served = None
        self._positions = 0
        self._view = None
        if view:
            v = memory.table_view(layer, view_wait)
            self._view = (v, view_tensor(v, self.device), v.rows, v.packed)

    @property
    def uses_view(self) -> bool:
        """Whether rows are gathered from the host's shared table."""
        return self._view is not None

    def _slice(self, hash_ids: torch.Tensor) -> torch.Tensor:
        if hash_ids.ndim != 2 or hash_ids.shape[1] < self.real_hi:
            raise BadInputError(f"hash ids must be [T, 24], got {tuple(hash_ids.shape)}")
        if hash_ids.shape[0] > self.max_tokens:
            raise BadInputError(f"{hash_ids.shape[0]} positions: this layer was set up for "
                                f"at most {self.max_tokens}")
        return hash_ids[:, self.lo:self.real_hi]

    def start(self, hash_ids: torch.Tensor) -> None:
        """Start this step's fetch for the engine's row ids `[T, 24]` (global
        columns; a position whose ids are all -1 is DEAD). Copies the ids to
        host memory (a device sync on a GPU: the caller's eager break)."""
        ids = self._slice(hash_ids)
        n = ids.shape[0]
        self._positions = n
        self._ids_device = ids
        if self._view is not None or n == 0:
            self._ticket = None
            return
        host = self._host_ids[:n]
        host.copy_(ids)
        self._ticket = self.memory.prefetch_rows(host.numpy(), layer=self.layer,
                                                 columns=(self.lo, self.real_hi))

    def ready(self, num_tokens: int | None = None, *, out: torch.Tensor | None = None,
              timeout: float | None = None) -> torch.Tensor:
        """This step's rows: bf16 `[T, w, 256]` on the device (the first
        `num_tokens` positions when given), written into `out` when given (a
        persistent buffer, as a CUDA graph needs). Raises what `Ticket.wait`
        raises."""
        n = self._positions if num_tokens is None else int(num_tokens)
        if n > self._positions:
            raise BadInputError(f"{n} positions asked; this step started {self._positions}")
        shape = (n, self.width, ROW_VALUES)
        if out is None:
            out = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        elif tuple(out.shape) != shape or out.dtype != torch.bfloat16:
            raise BadInputError(f"out must be bf16 {shape}, got {out.dtype} {tuple(out.shape)}")
        real = self.real_hi - self.lo
        if real != self.width:
            out[:, real:].zero_()  # heads past 24: padding a rank owns
        if n == 0:
            return out
        if self._view is not None:
            _, table, rows, packed = self._view
            ids = self._ids_device[:n]
            if ids.device != self.device:
                ids = ids.to(self.device)
            if real == self.width and out.is_contiguous():
                return gather_view(table, rows, packed, ids, out)
            out[:, :real] = gather_view(table, rows, packed, ids)
            return out
        if self._ticket is None:
            raise BadInputError("ready() before start(): no fetch in flight")
        if self._copied is not None:
            self._copied.synchronize()  # last step's copy out of the buffer has ended
        buf = self._host_rows[:self._positions]
        self.last_served = self._ticket.wait(self.layer, buf.numpy(), timeout)
        dev = buf[:n].to(self.device, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        out[:, :real] = dequantize_rows(dev)
        return out

    def close(self) -> None:
        """Drop the view's registration and the last ticket."""
        self._view = None
        self._ticket = None

