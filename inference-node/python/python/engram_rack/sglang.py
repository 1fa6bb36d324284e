"""engram_rack inside SGLang: DeepSeek V4.1's Engram rows from the rack.

An SGLang plugin (entry point `sglang.srt.plugins`, name `engram_rack`). Off
unless `ENGRAM_RACK_CONFIG` names the rack's cluster config (then
`ENGRAM_RACK_NODE` names this host's node). When on, it registers with
SGLang's `HookRegistry`:

- REPLACE `sglang.srt.layers.engram.EngramEmbedding` with
  `RackEngramEmbedding`: no table is allocated or loaded; `forward(indices)`
  (int64 `[T, 24]` row ids) returns bf16 `[T, 24, 256]` fetched from the rack
  (this tensor-parallel rank's rows only, zeros elsewhere, as SGLang's own
  sharded table gives before its all-reduce);
- AFTER `sglang.srt.layers.engram.EngramHasher.forward`: as soon as a
  batch's hash ids exist, both layers' fetches start (one message per
  table), so they overlap the layers before the Engram layers;
  `forward` then only waits.

`ENGRAM_RACK_VIEW=1` with a host-local donor gathers rows on the device from
the table every process on the host maps. See docs/engines.md.
"""

from __future__ import annotations

import logging
import os
import threading

from .vllm import PluginError, memory, settings

log = logging.getLogger("engram_rack.sglang")

#: SGLang releases whose Engram classes this plugin is written against.
SUPPORTED = ("0.5.23",)
EMBEDDING = "sglang.srt.layers.engram.EngramEmbedding"
HASHER_FORWARD = "sglang.srt.layers.engram.EngramHasher.forward"

_lock = threading.Lock()
#: The live embeddings by layer index (0: layer 1, 1: layer 14), for prefetch.
_embeddings: dict[int, object] = {}
_registered = False


def check_version(version: str) -> None:
    """Refuse an SGLang release the hooks were not written against."""
    if not any(version == s or version.startswith(s + ".") for s in SUPPORTED):
        raise PluginError(f"SGLang {version} is not supported by engram_rack.sglang "
                          f"(supported: {', '.join(SUPPORTED)}); unset ENGRAM_RACK_CONFIG "
                          "to run SGLang without the rack")


def _tp() -> tuple[int, int]:
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return int(p.tp_rank), int(p.tp_size)
    except Exception:  # noqa: BLE001 - no runtime context (a single process)
        return 0, 1


def embedding_class():
    """`RackEngramEmbedding`, built against the installed torch."""
    import torch
    from torch import nn

    from . import COLUMNS, LAYERS
    from .engine import LayerRows

    class RackEngramEmbedding(nn.Module):
        """SGLang's `EngramEmbedding` with its rows from the rack."""

        def __init__(self, num_embeddings: int, dim: int, layer_id: int,
                     column_bounds: tuple[int, ...]):
            super().__init__()
            if layer_id not in LAYERS:
                raise PluginError(f"Engram layer {layer_id}: the rack serves layers {LAYERS}")
            self.dim = dim
            self.layer_id = layer_id
            self.layer_index = LAYERS.index(layer_id)
            rank, size = _tp()
            self.tp_size = size
            # SGLang shards rows by hash column where they divide evenly:
            # this rank owns the columns [lo, hi).
            per = -(-COLUMNS // size)
            self.lo, self.hi = min(rank * per, COLUMNS), min((rank + 1) * per, COLUMNS)
            self.rows = 0
            self.row_start = 0
            self.host_table = None
            self.peer = None
            self.staged_by_scheduler = False
            self._sort_host_reads = False
            for name, width, dtype in (("weight", dim, torch.float8_e4m3fn),
                                       ("scale", dim // 32, torch.float8_e8m0fnu)):
                p = nn.Parameter(torch.empty(0, width, dtype=dtype), requires_grad=False)
                p.weight_loader = self._discard
                setattr(self, name, p)
            self._rows = None
            self._pending = None
            with _lock:
                _embeddings[self.layer_index] = self

        @staticmethod
        def _discard(param, loaded_weight) -> None:
            """The checkpoint's table stays on disk: the rack serves it."""

        @property
        def shared_host_table_without_ats(self) -> bool:
            return False

        @property
        def _shared(self) -> bool:
            return False

        def finish_load(self, label: str) -> None:
            pass

        def enable_scheduler_staging(self) -> None:
            pass

        def new_rows(self, indices: torch.Tensor) -> torch.Tensor:
            return torch.empty(*indices.shape, self.dim, dtype=torch.bfloat16,
                               device=indices.device)

        def _layer_rows(self, device, tokens: int) -> LayerRows:
            r = self._rows
            if r is None or r.device != torch.device(device) or r.max_tokens < tokens:
                cap = max(tokens, 256 if r is None else 2 * r.max_tokens)
                r = LayerRows(memory(), self.layer_id, columns=(self.lo, self.hi),
                              max_tokens=cap, device=device,
                              view=os.environ.get("ENGRAM_RACK_VIEW", "") == "1")
                self._rows = r
            return r

        def prefetch(self, indices: torch.Tensor) -> None:
            """Start this layer's fetch for `indices` (`[T, 24]`)."""
            if self.lo >= self.hi or indices.shape[0] == 0:
                return
            self._layer_rows(indices.device, indices.shape[0]).start(indices)
            self._pending = indices

        def forward(self, indices: torch.Tensor, forward_batch=None, *,
                    cp_all_tokens: bool = False) -> torch.Tensor:
            out = torch.zeros(*indices.shape, self.dim, dtype=torch.bfloat16,
                              device=indices.device)
            if indices.shape[0] == 0 or self.lo >= self.hi:
                return out
            pending, self._pending = self._pending, None
            same = pending is not None and (pending is indices or (
                pending.shape == indices.shape and bool(torch.equal(pending, indices))))
            rows = self._layer_rows(indices.device, indices.shape[0])
            if not same:
                rows.start(indices)
            out[:, self.lo:self.hi] = rows.ready(indices.shape[0])
            if self.tp_size > 1:
                # Each rank holds its own columns: the sum is the whole row
                # set, as after SGLang's own sharded lookup.
                from sglang.srt.distributed import tensor_model_parallel_all_reduce

                out = tensor_model_parallel_all_reduce(out)
            return out

    RackEngramEmbedding.__module__ = __name__
    return RackEngramEmbedding


def prefetch_after_hash(result, *args, **kwargs):
    """AFTER `EngramHasher.forward`: start both layers' fetches for the hash
    ids it returned (`[T, layers, 24]`)."""
    try:
        if result is not None and result.ndim == 3 and result.shape[0]:
            for index, emb in list(_embeddings.items()):
                if index < result.shape[1]:
                    emb.prefetch(result[:, index])
    except Exception:  # noqa: BLE001 - the forward fetches on its own then
        log.exception("engram_rack: prefetch after hashing failed; the layers fetch")
    return result


def register() -> None:
    """The `sglang.srt.plugins` entry point."""
    global _registered
    if settings() is None:
        log.debug("engram_rack: ENGRAM_RACK_CONFIG is not set; the plugin is off")
        return
    import sglang

    check_version(sglang.__version__)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    with _lock:
        if _registered:
            return
        HookRegistry.register(EMBEDDING, embedding_class(), HookType.REPLACE)
        HookRegistry.register(HASHER_FORWARD, prefetch_after_hash, HookType.AFTER)
        _registered = True
    log.info("engram_rack: DeepSeek V4.1 Engram rows come from the rack")
