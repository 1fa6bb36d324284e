"""engram_rack inside SGLang: Qwen4Exp's PLE n-gram table from the rack.

Installed by `engram_rack.sglang` beside V4.1's hooks, through SGLang's own
`HookRegistry`. SGLang keeps an offloaded PLE table in host memory
(`Qwen4ExpPinnedHostEmbedding`: pinned, or a file-backed mapping) and its
Triton gather kernel reads the rows straight from that host pointer. With
the rack on:

- AROUND `Qwen4ExpNGramEmbedding.__init__`: the table is offloaded
  (`ple_offload_embedding`: the rack's memory is host memory), and the
  table being built knows its model layer (`ple_layer_ids`, 1-based); its
  `weight_scale` is the rack table's `tensor_scale`;
- AROUND `allocate_ple_host_table`: a PLE table's storage is the rack's
  table as this host maps it (a host-local donor's memfd, one copy for
  every process on the host, or the node's `local` copy), this rank's rows
  of it, registered with CUDA read-only once (or read through the host's
  page tables), never a copy;
- AROUND `Qwen4ExpForConditionalGeneration.load_weights`: the checkpoint's
  `ngram_embedding.shard_N` rows are skipped (the rack has them; its memory
  is read-only) and a `weight_scale` in the checkpoint must equal the rack
  table's;
- `initialize_dummy_weights` leaves the rack's table and scale alone;
- a table only across the network (no donor on this host, no local copy)
  keeps no rows here: AROUND `Qwen4ExpPinnedHostEmbedding.gather`, its
  rows come through an engine ring of the table's row size
  (`engram_rack.ring.RingLookup.lookup_rows`: kernels only, on SGLang's
  prefetch stream or inside its captured graphs), each TP rank asking for
  the rows it owns, widened to bf16 as SGLang's gather kernel does (zeros
  for the rest); SGLang's reduction and scale run unchanged. Rows that do
  not come are zeros, or under a `fail` policy a fault that fails the
  step's requests, as V4.1's rings.

Encodings: FP8 with a per-tensor scale and BF16 (SGLang's two).
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import warnings

from . import plugin as _plugin
from .plugin import PluginError
from .qwen4exp import encoding_for, host_view, ple_layer, rack_table

log = logging.getLogger("engram_rack.sglang")

MODULE = "sglang.srt.models.qwen4_exp"
NGRAM_INIT = f"{MODULE}.Qwen4ExpNGramEmbedding.__init__"
ALLOCATE = f"{MODULE}.allocate_ple_host_table"
LOAD = f"{MODULE}.Qwen4ExpForConditionalGeneration.load_weights"
GATHER = f"{MODULE}.Qwen4ExpPinnedHostEmbedding.gather"
#: Positions one ring request of a remote PLE table carries.
RING_POSITIONS = int(os.environ.get("ENGRAM_RACK_RING_POSITIONS", "512") or 512)
_SHARD = re.compile(r"(.*)\.ngram_embedding\.shard_\d+\.weight$")

_building: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "engram_rack_sglang_ple", default=None)


def _table_of(config, ple_layer_index: int) -> dict:
    return rack_table(ple_layer(config, ple_layer_index))


def ngram_init(original, self, config, embedding_dim, ple_layer_index: int = 0,
               quant_config=None, prefix: str = ""):
    """AROUND `Qwen4ExpNGramEmbedding.__init__` (see the module's docs)."""
    table = _table_of(config, ple_layer_index)
    if not getattr(config, "ple_offload_embedding", False):
        log.info("engram_rack: the PLE table is offloaded (the rack's host memory)")
        config.ple_offload_embedding = True
    token = _building.set(table)
    try:
        original(self, config, embedding_dim, ple_layer_index, quant_config, prefix)
    finally:
        _building.reset(token)
    emb = self.ngram_embedding
    emb.engram_rack = table
    emb.engram_ring = None
    if table["tensor_scale"] is not None:
        emb.weight_scale.fill_(table["tensor_scale"])
    if table.get("remote"):
        _start_ring(emb, table, int(self.ngram_heads))


def _start_ring(emb, table: dict, heads: int) -> None:
    """The engine ring a remote table's rows come through, served by the
    host's client or this process's tables."""
    from .ring import RingLookup

    if not 1 <= heads <= 24:
        raise PluginError(f"PLE layer {table['layer']}: {heads} n-gram heads; an engine ring "
                          "carries 1 to 24 rows a position")
    emb.engram_ring = RingLookup((table["layer"],), (0, heads), positions=RING_POSITIONS,
                                 device=_plugin.device(), row_bytes=table["row_bytes"])
    _plugin.tables().serve(emb.engram_ring)
    lo = emb.shard_indices.org_vocab_start_index
    hi = emb.shard_indices.org_vocab_end_index
    emb.engram_own = None if emb.tp_size == 1 else (int(lo), int(hi))
    log.info("engram_rack: PLE layer %d reads table %d (%s) through an engine ring",
             table["layer"], table["table"], table["encoding"])


def gather(original, self, input_ids, out=None):
    """AROUND `Qwen4ExpPinnedHostEmbedding.gather`: a remote table's rows
    through its ring (SGLang's own kernel over host memory otherwise)."""
    ring = getattr(self, "engram_ring", None)
    if ring is None:
        return original(self, input_ids, out)
    import torch

    shape = (*input_ids.shape, self.embedding_dim)
    output = self.allocate_output(shape, input_ids.device) if out is None else out
    if tuple(output.shape) != shape or output.dtype != torch.bfloat16:
        raise ValueError(f"invalid PLE output {tuple(output.shape)} {output.dtype}: "
                         f"{shape} bfloat16")
    ids = input_ids.reshape(-1, ring.cols)
    if ids.shape[0]:
        raw = torch.empty((ids.shape[0], ring.cols, ring.row_bytes), dtype=torch.uint8,
                          device=input_ids.device)
        ring.lookup_rows(self.engram_rack["layer"], ids, raw, own=self.engram_own)
        rows = raw.view(self.weight.dtype).view(ids.shape[0], ring.cols, self.embedding_dim)
        output.view(ids.shape[0], ring.cols, self.embedding_dim).copy_(rows)
    return output


def allocate(original, shape, dtype, backend: str = "pinned", table_dir=None, tag=None):
    """AROUND `allocate_ple_host_table`: the rack's rows for a PLE table
    being built (SGLang's own allocation otherwise)."""
    table = _building.get()
    if table is None:
        return original(shape, dtype, backend, table_dir, tag)
    import numpy as np
    import torch

    from . import cuda as _cuda

    rows, width = (int(d) for d in shape)
    want = encoding_for(dtype, width)
    if table["encoding"] != want:
        raise PluginError(f"PLE layer {table['layer']}: SGLang reads {want} rows, the rack's "
                          f"table {table['table']} is {table['encoding']}")
    m = re.fullmatch(r"rows(\d+)-(\d+)", tag or "rows0-0")
    lo = int(m.group(1)) if m else 0
    if lo + rows > table["rows"]:
        raise PluginError(
            f"PLE layer {table['layer']}: SGLang's table has {rows} rows from {lo}, the rack's "
            f"table {table['table']} {table['rows']}: its hashing (ngram_vocab_size_base, "
            "make_ngram_vocab_size_divisible_by) is not the model's")
    view = host_view(table["layer"], table["table"], remote_ok=True)
    if view is None:
        # Across the network only: no rows here, a ring brings them.
        table["remote"] = True
        return torch.empty(0, width, dtype=dtype)
    size = view.row_bytes
    array = np.frombuffer(view, dtype=np.uint8)
    how = _cuda.host_table_access(_plugin.device())
    if how == "copy":
        raise PluginError("ENGRAM_RACK_HOST_REGISTER=copy is for V4.1's tables; a PLE table "
                          "is read where the rack maps it")
    if how == "read-only":  # the whole mapping, once per process (as V4.1's tables)
        _cuda.register(int(array.ctypes.data), array.nbytes, read_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only memory, on purpose
        out = torch.from_numpy(array)[lo * size:(lo + rows) * size]
    out = out.view(rows, size).view(dtype)
    return out


def load_weights(original, self, weights):
    """AROUND the model's `load_weights` (see the module's docs)."""
    racks = {name: m.ngram_embedding.engram_rack for name, m in self.named_modules()
             if hasattr(getattr(m, "ngram_embedding", None), "engram_rack")}

    def kept():
        for name, w in weights:
            shard = _SHARD.match(name)
            if shard is not None and shard.group(1) in racks:
                continue
            owner = name.rsplit(".ngram_embedding.weight_scale", 1)
            if len(owner) == 2 and owner[1] == "" and owner[0] in racks:
                table = racks[owner[0]]
                got = float(w.reshape(-1)[0])
                if table["tensor_scale"] is None or got != float(table["tensor_scale"]):
                    raise PluginError(
                        f"PLE layer {table['layer']}: the checkpoint's weight_scale is {got}, "
                        f"the rack's table {table['table']} {table['tensor_scale']}: they are "
                        "not the same table")
            yield name, w

    return original(self, kept())


def held_for_dummy(model) -> list:
    """The rack's PLE weights and scales, taken out of `model` while its
    dummy weights are drawn (`restore` puts them back)."""
    held = []
    for m in model.modules():
        if getattr(m, "engram_rack", None) is not None and "weight" in m._parameters:
            held.append((m, m._parameters.pop("weight"), m._buffers.pop("weight_scale", None)))
    return held


def restore(held) -> None:
    for m, w, s in held:
        m._parameters["weight"] = w
        if s is not None:
            m._buffers["weight_scale"] = s


def install(registry, hook_type) -> None:
    """Register the hooks (see the module's docs)."""
    import importlib

    try:
        importlib.import_module(MODULE)
    except Exception as e:  # noqa: BLE001 - a build without Qwen4Exp
        log.debug("engram_rack: %s not imported (%s)", MODULE, e)
        return
    registry.register(NGRAM_INIT, ngram_init, hook_type.AROUND)
    registry.register(ALLOCATE, allocate, hook_type.AROUND)
    registry.register(LOAD, load_weights, hook_type.AROUND)
    registry.register(GATHER, gather, hook_type.AROUND)
