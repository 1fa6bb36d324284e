"""engram_rack inside SGLang: DeepSeek V4.1's Engram tables from the rack.

An SGLang plugin (entry point `sglang.srt.plugins`, name `engram_rack`),
off unless the environment names the rack (`ENGRAM_RACK_SOCKET`, or
`ENGRAM_RACK_CONFIG` with `ENGRAM_RACK_NODE`). When on, it turns on
SGLang's own shared host table (`SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1`,
layout `shared`: every rank looks up its own tokens' rows in the whole
table, no collective, under DP attention and context parallelism alike)
and gives it the rack's memory, with hooks in SGLang's `HookRegistry`:

- REPLACE `sglang.srt.layers.engram._HostTable` with `RackHostTable`: for
  a table a host-local donor serves, the donor's planar memory (mapped
  read-only, registered with CUDA once), which SGLang's own gather kernel
  reads; for a remote table, no memory at all (a meta tensor) and the
  engine ring;
- AROUND `engram_gather`: a remote table's rows come from the ring's wait
  and gather kernels (SGLang's scale rule: byte 0 is 2^-127); every other
  call is SGLang's own;
- AFTER `EngramHasher.forward`: as soon as a batch's ids exist, one kernel
  publishes every remote layer's ids (before block 0), so the layers only
  wait;
- AROUND `EngramEmbedding._load_rows` and `initialize_dummy_weights`: the
  loaders leave the rack's tables alone;
- BEFORE `ModelRunner.forward`: the rings' fault logs (host memory): the
  requests of a step whose rows did not come under a table's `fail`
  policy go to the fault board (`engram_rack.faults`); then this step's
  ring requests are tagged with its batch's request ids;
- AFTER `Scheduler._poll_timeout_aborts`: the leader of each group of
  ranks that share a waiting queue turns the board's requests into
  aborts with the rack's message (HTTP 503), which ride SGLang's own
  broadcast so every rank drops them in the same iteration;
- REPLACE `EngramRowStager` with `RackRowStager` where a table is remote:
  the scheduler hashes an extend batch's tokens on the CPU (SGLang's own
  windows and hashing), fetches its remote rows from the rack through a
  host ring (`engram_rack.ring.HostRing`) and a host-local table's from
  the donor's memory, and copies them to the GPU on a side stream while
  the previous forward runs; the layers only dequantize them, and no ring
  request is published for that batch (`ENGRAM_RACK_STAGE_PREFILL=0`
  leaves a prefill to the forward's ring instead). Rows that do not come
  under `fail` fail the batch's requests through the board (zeros are
  staged meanwhile).

Qwen4Exp's PLE n-gram table comes from the rack too
(`engram_rack.sglang_qwen4exp`, docs/models.md).

Errors stop SGLang: a configuration or version error raises SystemExit
from the plugin (SGLang logs and ignores exceptions there), and a table
the rack cannot give fails the model's construction. See docs/engines.md.
"""

from __future__ import annotations

import logging
import os
import threading

from . import plugin as _plugin
from .plugin import PluginError, link, settings

log = logging.getLogger("engram_rack.sglang")

#: SGLang releases whose Engram classes this plugin is written against.
SUPPORTED = ("0.5.23",)
HOST_TABLE = "sglang.srt.layers.engram._HostTable"
GATHER = "sglang.kernels.ops.embeddings.engram_gather.engram_gather"
HASHER_FORWARD = "sglang.srt.layers.engram.EngramHasher.forward"
LOAD_ROWS = "sglang.srt.layers.engram.EngramEmbedding._load_rows"
DUMMY = "sglang.srt.model_loader.weight_utils.initialize_dummy_weights"
RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
STAGER = "sglang.srt.layers.engram_staging.EngramRowStager"
POLL_ABORTS = "sglang.srt.managers.scheduler.Scheduler._poll_timeout_aborts"
#: Stage a prefill's remote rows in the scheduler (1, the default) or
#: leave them to the forward's ring (0).
STAGE_PREFILL = os.environ.get("ENGRAM_RACK_STAGE_PREFILL", "1") != "0"
RING_POSITIONS = int(os.environ.get("ENGRAM_RACK_RING_POSITIONS", "512") or 512)
#: A remote table's stand-in address (never a real one: not canonical x86-64).
_REMOTE_BASE = 0x7E00_0000_0000_0000

_lock = threading.Lock()
_registered = False
#: Remote tables by their stand-in weight address: (ring, layer).
_remote: dict[int, tuple] = {}
#: The ring every remote layer of this process shares, once made, and
#: the link that serves it.
_ring = None
_ring_link = None

__all__ = ["PluginError", "RackHostTable", "check_version", "register"]


def check_version(version: str) -> None:
    """Refuse an SGLang release the hooks were not written against."""
    if not any(version == s or version.startswith(s + ".") for s in SUPPORTED):
        raise PluginError(f"SGLang {version} is not supported by engram_rack.sglang "
                          f"(supported: {', '.join(SUPPORTED)}); unset ENGRAM_RACK_SOCKET and "
                          "ENGRAM_RACK_CONFIG to run SGLang without the rack")


def _remote_ring(device):
    """The ring of every remote layer (both sections when both are)."""
    global _ring, _ring_link
    from .ring import RingLookup

    lk = link()
    with _lock:
        if _ring is None or _ring_link is not lk:
            _ring_link = lk
            layers = tuple(layer for layer in (1, 14) if lk.table(layer) is None)
            _ring = RingLookup(layers, (0, 24), positions=RING_POSITIONS, device=device)
            lk.serve(_ring)
        return _ring


class RackHostTable:
    """SGLang's `_HostTable` over the rack (see the module's docs): the
    constructor's arguments are SGLang's; the layer comes from its name."""

    def __init__(self, layout: str, nbytes: int, name: str, group):
        import torch

        try:
            self.layer = int(str(name).rsplit("_", 1)[-1])
        except ValueError:
            raise PluginError(f"an Engram host table named {name!r}: no layer in it") from None
        self.layout = "shared"
        self.nbytes = int(nbytes)
        self.group = group
        self.dirty = False
        device = _plugin.device()
        table = link().table(self.layer)
        self.table = table
        if table is None:
            # No memory here: weight and scale are views of nothing.
            self.bytes = torch.empty(self.nbytes, dtype=torch.uint8, device="meta")
            self.device_ptr = _REMOTE_BASE + (self.layer << 40)
            _remote[self.device_ptr] = (_remote_ring(device), self.layer)
            return
        if max(1, table.nbytes) != self.nbytes:
            raise PluginError(f"layer {self.layer}: SGLang's table is {self.nbytes} bytes, the "
                              f"host's {table.nbytes} ({table.rows} rows)")
        self.bytes = table._bytes[: self.nbytes]
        from . import cuda as _cuda

        values, _ = table.on(device)
        # Registered or read through page tables, the host address is the
        # device's (unified addressing); a private copy has its own.
        copied = _cuda.host_table_access(device) == "copy"
        self.device_ptr = values.data_ptr() if copied else table.address

    def finish_load(self, label: str) -> None:
        where = "remote (engine ring)" if self.table is None else "the host-local donor's memory"
        log.info("engram_rack: table %s (layer %d) is %s", label, self.layer, where)


def gather_on_cpu(weight_ptr, scale_ptr, ids, out, dim, block_size, row_lo=0,
                  row_hi=2 ** 62):
    """SGLang's own gather kernel launched as `engram_gather` launches it,
    for ids on the CPU (Triton's interpreter), which `engram_gather`
    itself refuses: how an engine without a GPU, and the tests, read a
    host table through SGLang's arithmetic."""
    from sglang.kernels.ops.embeddings.engram_gather import _E8M0_ZERO, _engram_gather_kernel

    n = ids.numel()
    if n:
        _engram_gather_kernel[(n,)](weight_ptr, scale_ptr, ids, ids, out, row_lo, row_hi,
                                    DIM=dim, BLK=block_size, E8M0_ZERO=_E8M0_ZERO,
                                    HAS_DST=False)
    return out


def rack_gather(original, weight_ptr, scale_ptr, ids, out, dim, block_size, row_lo=0,
                row_hi=2 ** 62, sort_ids=False):
    """AROUND `engram_gather`: a remote table's rows from the ring."""
    entry = _remote.get(int(weight_ptr))
    if entry is None:
        if not ids.is_cuda:
            return gather_on_cpu(weight_ptr, scale_ptr, ids, out, dim, block_size, row_lo,
                                 row_hi)
        return original(weight_ptr, scale_ptr, ids, out, dim, block_size, row_lo, row_hi,
                        sort_ids)
    ring, layer = entry
    n = ids.numel() // 24
    if n == 0:
        return out
    ids2 = ids.reshape(n, 24)
    rows = out.view(n, 24, dim)
    s = ring.section(layer)
    if ring.pending.pop(s, None) == n:
        ring.wait(s)
        ring.gather(s, rows, n, scale0_zero=False)
    else:
        ring.lookup(layer, ids2, rows, scale0_zero=False)
    return out


def publish_after_hash(result, *args, **kwargs):
    """AFTER `EngramHasher.forward`: publish every remote layer's ids
    (`[T, layers, 24]`) in one kernel, before block 0 (none for a batch
    whose rows the scheduler staged)."""
    ring = _ring
    if ring is None or result is None or result.ndim != 3:
        return result
    batch = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
    if getattr(batch, "engram_staged_rows", None) is not None:
        return result
    n = result.shape[0]
    if not 0 < n <= ring.positions:
        return result
    ids = {ring.section(layer): result[:, i] for i, layer in enumerate((1, 14))
           if layer in ring.layer_ids and i < result.shape[1]}
    if ids:
        ring.publish(ids, n)
        for s in ids:
            ring.pending[s] = n
    return result


def skip_rack_rows(original, self, *args, **kwargs):
    """AROUND `EngramEmbedding._load_rows`: the rack's tables are not
    written (a donor's memory is read-only)."""
    if isinstance(getattr(self, "host_table", None), RackHostTable):
        return None
    return original(self, *args, **kwargs)


def dummy_without_rack_tables(original, model, *args, **kwargs):
    """AROUND `initialize_dummy_weights`: the rack's tables (and a PLE
    table's scale) are left out."""
    from .sglang_qwen4exp import held_for_dummy, restore

    held = []
    for m in model.modules():
        if isinstance(getattr(m, "host_table", None), RackHostTable):
            held.append((m, m._parameters.pop("weight", None), m._parameters.pop("scale", None)))
    ple = held_for_dummy(model)
    try:
        return original(model, *args, **kwargs)
    finally:
        for m, w, s in held:
            m._parameters["weight"], m._parameters["scale"] = w, s
        restore(ple)


def stager_class(base):
    """`RackRowStager`: SGLang's `EngramRowStager` (`base`) for a model
    whose Engram tables come from the rack, at least one across the
    network (see the module's docs)."""
    import torch

    class RackRowStager(base):
        def __init__(self, hasher, embeds, device):
            from .ring import HostRing

            self.hasher = hasher
            self.device = device
            self.layers = [e.host_table.layer for e in embeds]
            # Host-local tables: SGLang's own gather from the donor's memory.
            self.tables = [None if e.host_table.table is None
                           else (e.weight.data.view(torch.uint8), e.scale.data.view(torch.uint8))
                           for e in embeds]
            remote = tuple(sorted(layer for layer, t in zip(self.layers, self.tables)
                                  if t is None))
            self.ring = HostRing(remote, positions=RING_POSITIONS * 2)
            link().serve(self.ring)
            self._pool = None
            self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

        @property
        def pool(self):
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(16)
            return self._pool

        @classmethod
        def from_model(cls, model, hasher, device):
            from sglang.srt.layers.engram import Engram
            from sglang.srt.runtime_context import get_parallel

            engrams = sorted((m for m in model.modules() if isinstance(m, Engram)),
                             key=lambda m: m.layer_hash_index)
            embeds = [m.embed for m in engrams]
            ours = embeds and all(isinstance(e.host_table, RackHostTable) for e in embeds)
            if not ours or not STAGE_PREFILL or \
                    all(e.host_table.table is not None for e in embeds):
                # Every table host-local (or none the rack's): SGLang's own.
                return base.from_model(model, hasher, device)
            if get_parallel().attn_cp_size > 1:
                return None  # prefill CP hashes the whole prompt in the forward
            for e in embeds:
                e.staged_by_scheduler = True
            return cls(hasher, embeds, torch.device(device))

        def _gather(self, table, ids):
            # Pinned where a GPU is (the copy to it is then asynchronous).
            pin = self.copy_stream is not None
            out = torch.empty((ids.numel(), table.shape[1]), dtype=table.dtype, pin_memory=pin)
            step = max(1, -(-ids.numel() // 16))
            jobs = [self.pool.submit(torch.index_select, table, 0, ids[i:i + step],
                                     out=out[i:i + step])
                    for i in range(0, ids.numel(), step)]
            for j in jobs:
                j.result()
            return out

        def rows(self, batch):
            """Per Engram layer, the staged `(values [N, 256], scales [N, 8])`
            uint8 host tensors of an extend batch, or None to leave the
            lookup to the forward (what `stage` copies to the GPU)."""
            if not batch.forward_mode.is_extend_without_speculative():
                return None
            windows = self._windows(batch)
            if windows is None:
                return None
            ids, _ = self.hasher.hash_windows(*windows)
            out = []
            for i, (layer, table) in enumerate(zip(self.layers, self.tables)):
                layer_ids = ids[:, i].reshape(-1)
                if table is not None:
                    out.append((self._gather(table[0], layer_ids),
                                self._gather(table[1], layer_ids)))
                    continue
                from .ring import RingFault

                try:
                    packed = self.ring.fetch(layer, layer_ids.reshape(-1, 24).numpy())
                except RingFault as e:
                    packed = _fail_batch(batch, e, (layer_ids.numel() // 24, 24, 264))
                packed = torch.from_numpy(packed.reshape(-1, 264))
                out.append((packed[:, :256].contiguous(), packed[:, 256:].contiguous()))
            return out

        def stage(self, batch):
            host = self.rows(batch)
            if host is None:
                return None
            staged = []
            for values, scales in host:
                if self.copy_stream is None:
                    staged.append((values, scales, None))
                    continue
                with torch.cuda.stream(self.copy_stream):
                    if not values.is_pinned():
                        values, scales = values.pin_memory(), scales.pin_memory()
                    values = values.to(self.device, non_blocking=True)
                    scales = scales.to(self.device, non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record()
                staged.append((values, scales, copied))
            return staged

    RackRowStager.__module__ = __name__
    RackRowStager.__qualname__ = "RackRowStager"
    return RackRowStager


def check_rings(*args, **kwargs):
    """Before each forward: the rings' new faults go to the fault board as
    the failed steps' requests (host memory and a file append), then this
    forward's ring requests are tagged with its batch's request ids."""
    from .faults import route_faults, steps

    s = steps()
    route_faults(s)
    batch = args[1] if len(args) > 1 else kwargs.get("forward_batch")
    rids = getattr(batch, "rids", None)
    if rids:
        s.begin(rids)
    else:
        s.idle()  # an idle DP batch, or a forward of no request


def _fail_batch(batch, fault, shape):
    """A staged prefill whose rows did not come under `fail`: its requests
    go to the fault board and its rows are zeros; raises `fault` where no
    request can be named or the board cannot take them."""
    import numpy as np

    from .faults import board

    rids = [r.rid for r in getattr(batch, "reqs", None) or ()]
    b = board()
    detail = getattr(fault, "detail", None) or str(fault)
    message = f"engram-rack: this request's Engram rows did not come ({detail}) and the " \
        "table's policy is fail"
    if not rids or b is None or not b.report(rids, message):
        raise fault
    log.error("engram_rack: a prefill's rows did not come; failing its %d request(s)", len(rids))
    return np.zeros(shape, dtype=np.uint8)


def board_aborts(result, *args, **kwargs):
    """After the scheduler's own aborts are polled: the fault board's
    requests as aborts with the rack's message (HTTP 503, as SGLang's own
    timeouts), sent to every rank by SGLang's broadcast."""
    from http import HTTPStatus

    from sglang.srt.managers.io_struct import AbortReq

    from .faults import board

    b = board()
    if b is None:
        return result
    out = list(result or [])
    seen = set()
    for rid, message in b.take():
        if rid in seen:
            continue
        seen.add(rid)
        out.append(AbortReq(rid=rid, abort_message=message, finished_reason={
            "type": "abort", "status_code": HTTPStatus.SERVICE_UNAVAILABLE, "message": message}))
    return out


def _install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    os.environ["SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"] = "1"
    os.environ["SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"] = "shared"
    HookRegistry.register(HOST_TABLE, RackHostTable, HookType.REPLACE)
    HookRegistry.register(GATHER, rack_gather, HookType.AROUND)
    HookRegistry.register(HASHER_FORWARD, publish_after_hash, HookType.AFTER)
    HookRegistry.register(LOAD_ROWS, skip_rack_rows, HookType.AROUND)
    HookRegistry.register(DUMMY, dummy_without_rack_tables, HookType.AROUND)
    HookRegistry.register(RUNNER_FORWARD, check_rings, HookType.BEFORE)
    HookRegistry.register(POLL_ABORTS, board_aborts, HookType.AFTER)
    from . import sglang_qwen4exp

    sglang_qwen4exp.install(HookRegistry, HookType)
    import importlib

    staging = importlib.import_module(STAGER.rsplit(".", 1)[0])
    base = staging.EngramRowStager
    if base.__module__ != __name__:
        HookRegistry.register(STAGER, stager_class(base), HookType.REPLACE)


def register() -> None:
    """The `sglang.srt.plugins` entry point. SGLang logs and ignores a
    plugin's exceptions, so an error here ends the process instead."""
    global _registered
    try:
        if settings() is None:
            log.debug("engram_rack: the rack is not configured; the plugin is off")
            return
        import sglang

        check_version(sglang.__version__)
        from .faults import board

        board(create=True)
        with _lock:
            if _registered:
                return
            _install()
            _registered = True
    except PluginError as e:
        log.critical("engram_rack: %s", e)
        raise SystemExit(f"engram_rack: {e}") from e
    log.info("engram_rack: DeepSeek V4.1's Engram tables and Qwen4Exp's PLE tables come "
             "from the rack")
