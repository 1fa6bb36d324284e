"""Rows for an inference engine's Engram layer, as torch tensors.

Torch helpers for engines that read rows themselves (the plugins read
theirs through the engines' own kernels: `engram_rack.host`,
`engram_rack.ring`):

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

from . import ROW_BYTES, ROW_VALUES, BadInputError

__all__ = ["dequantize_rows", "gather_view", "scale_values", "view_tensor"]

#: Values that share one scale byte.
_BLOCK = 32
_SCALES = ROW_VALUES // _BLOCK
#: The f32 bit pattern of 2^-127 (a subnormal): what scale byte 0 means.
_TWO_TO_MINUS_127_BITS = 0x0040_0000
#: Rows per 4 KiB page of a table file (`TableView.packed` is False).
_PAGE_ROWS = 15
_PAGE_BYTES = 4096


def scale_values(scale_bytes: torch.Tensor, scale0_zero: bool = False) -> torch.Tensor:
    """UE8M0 scale bytes (uint8) to their f32 values, 2^(s - 127).

    The byte is the f32 exponent field, so `s << 23` is the value for s >= 1;
    s = 0 is 2^-127, a subnormal, as the V4.1 reference reads it, or 0.0 with
    `scale0_zero` (vLLM's lookup kernel's rule).
    """
    bits = scale_bytes.to(torch.int32) << 23
    if not scale0_zero:
        bits = torch.where(scale_bytes == 0, torch.full_like(bits, _TWO_TO_MINUS_127_BITS), bits)
    return bits.view(torch.float32)


def dequantize_rows(rows: torch.Tensor, out: torch.Tensor | None = None, *,
                    scale0_zero: bool = False) -> torch.Tensor:
    """Rows (uint8, last axis 264) to bf16 values (last axis 256), on the
    rows' device: each E4M3 code times its block's scale in f32 (exact),
    rounded to bf16 (`scale0_zero`: a scale byte of 0 reads as 0.0, as
    vLLM's kernel reads it). Zero rows (a DEAD position, a padded head)
    give zeros."""
    if rows.dtype != torch.uint8 or rows.ndim == 0 or rows.shape[-1] != ROW_BYTES:
        raise BadInputError(f"rows must be uint8 with a last axis of {ROW_BYTES}, got "
                            f"{rows.dtype} {tuple(rows.shape)}")
    lead = rows.shape[:-1]
    codes = rows[..., :ROW_VALUES].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scales = scale_values(rows[..., ROW_VALUES:], scale0_zero)
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


def view_tensor(view, device: torch.device | str = "cpu"):
    """A table view as something the gather kernel reads on `device`: a CPU
    uint8 tensor over the mapping, or (CUDA) the same memory registered
    once per process by `engram_rack.cuda`'s rules and viewed on the
    device (no copy)."""
    from . import cuda as _cuda

    device = torch.device(device)
    host = torch.frombuffer(memoryview(view), dtype=torch.uint8) if len(view) else \
        torch.empty(0, dtype=torch.uint8)
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        raise BadInputError(f"table views are gathered on CPU or CUDA devices, not {device}")
    how = _cuda.host_table_access(device)
    if how == "copy":
        raise BadInputError("a whole table view is not copied: ENGRAM_RACK_HOST_REGISTER=copy "
                            "copies a rank's rows (engram_rack.host.HostTable.on)")
    if how == "read-only":
        _cuda.register(host.data_ptr(), host.numel(), read_only=True)
    return _cuda.device_view(host.data_ptr(), (host.numel(),), torch.uint8, device)


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
