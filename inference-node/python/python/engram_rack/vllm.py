"""engram_rack inside vLLM: DeepSeek V4.1's Engram rows from the rack.

A vLLM general plugin (entry point `vllm.general_plugins`, name
`engram_rack`), loaded by vLLM in every process before the model is built.
It is off unless `ENGRAM_RACK_CONFIG` names the rack's cluster config; then
`ENGRAM_RACK_NODE` must name this host's node in it. When on, it rebinds the
V4.1 `Engram` class (the common module and the nvidia and amd model modules)
to `RackEngram`, which:

- allocates no table (zero-row placeholders: the loader copies nothing);
- at `prepare_embeddings(hash_ids)` (int32 `[T, 24]` row ids, once per step
  per layer, before the decoder layers) copies the ids to pinned host memory
  and starts one fetch per table (`Memory.prefetch_rows`), for this
  tensor-parallel rank's head slice;
- at `_ready_rows(T)` waits into a pinned buffer, copies it to the GPU
  without blocking, dequantizes there and returns bf16 `[T, heads, 256]`.

Both hooks are eager breaks, as in vLLM's own offload path.
`ENGRAM_RACK_VIEW=1` with a host-local donor gathers rows on the GPU from the
table every process on the host maps, with no copy. `ENGRAM_RACK_METRICS`
sets where rank 0 serves /metrics ("off", or "IP:PORT"; default the node's
`metrics`); other ranks serve none. See docs/engines.md.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("engram_rack.vllm")

#: vLLM releases whose Engram hooks this plugin is written against.
SUPPORTED = ("0.33.",)
#: The V4.1 model modules that bind `Engram` by name.
MODEL_MODULES = (
    "vllm.models.deepseek_v41.nvidia.model",
    "vllm.models.deepseek_v41.amd.model",
)
COMMON = "vllm.models.deepseek_v41.common.engram"

_lock = threading.Lock()
_memory = None
_class = None


class PluginError(RuntimeError):
    """The plugin is asked for but cannot run: says why and what to set."""


def settings() -> tuple[str, str] | None:
    """(config, node) from the environment, None when the plugin is off, or
    PluginError when it is asked for but incomplete."""
    config = os.environ.get("ENGRAM_RACK_CONFIG", "").strip()
    if not config:
        return None
    node = os.environ.get("ENGRAM_RACK_NODE", "").strip()
    if not node:
        raise PluginError("ENGRAM_RACK_CONFIG is set but ENGRAM_RACK_NODE is not: "
                          "name this host's [[node]] in the rack config")
    if not os.path.isfile(config):
        raise PluginError(f"ENGRAM_RACK_CONFIG={config}: no such file")
    return config, node


def check_version(version: str) -> None:
    """Refuse a vLLM release the hooks were not written against."""
    if not version.startswith(SUPPORTED):
        raise PluginError(f"vLLM {version} is not supported by engram_rack.vllm "
                          f"(supported: {', '.join(s + 'x' for s in SUPPORTED)}); "
                          "unset ENGRAM_RACK_CONFIG to run vLLM without the rack")


def memory():
    """This process's `engram_rack.Memory`, opened on first use."""
    global _memory
    with _lock:
        if _memory is None or _memory.closed:
            from . import Memory

            found = settings()
            if found is None:
                raise PluginError("ENGRAM_RACK_CONFIG is not set")
            config, node = found
            metrics = os.environ.get("ENGRAM_RACK_METRICS") or None
            if _rank() != 0:
                metrics = "off"
            _memory = Memory(config, node, metrics=metrics)
            log.info("engram_rack: node %s of %s, tables %s", node, config, _memory.tables)
        return _memory


def _rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no distributed state yet
        return 0


def rack_engram_class(engram_cls):
    """A subclass of vLLM's `Engram` whose rows come from the rack."""
    import torch
    from torch import nn

    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    from .engine import LayerRows

    class _Placeholder(nn.Module):
        """Stands where vLLM's table would: zero rows, so the loader copies
        nothing, and the shape facts `Engram` reads."""

        def __init__(self, layout, layer_hash_index: int):
            super().__init__()
            self.layer = int(layout.layer_ids[layer_hash_index])
            self.dim = layout.head_dim
            self.n_hash_cols = (layout.max_ngram_size - 1) * layout.n_heads
            self.tp_size = get_tensor_model_parallel_world_size()
            self.dp_size = 1
            self.cpu_offload = False
            self.part_n_hash_cols = -(-self.n_hash_cols // self.tp_size)
            self.head_start = get_tensor_model_parallel_rank() * self.part_n_hash_cols
            for name, width, dtype in (("weight", self.dim, torch.float8_e4m3fn),
                                       ("weight_scale_inv", self.dim // 32, torch.uint8)):
                p = nn.Parameter(torch.empty(0, width, dtype=dtype, device="cpu"),
                                 requires_grad=False)
                p.weight_loader = self._discard
                setattr(self, name, p)

        @staticmethod
        def _discard(param, loaded_weight) -> None:
            """The checkpoint's table stays on disk: the rack serves it."""

        def collapse_huge_pages(self) -> None:
            pass

    class RackEngram(engram_cls):
        """vLLM's V4.1 `Engram` with its rows fetched from the rack."""

        def _create_embedding(self, layout, layer_hash_index: int):
            return _Placeholder(layout, layer_hash_index)

        def _init_staging(self, max_tokens: int, head_dim: int) -> None:
            table = self.embed_tokens
            self.staged_rows = torch.empty(max_tokens, table.part_n_hash_cols, head_dim,
                                           dtype=torch.bfloat16)
            self._prefetch_stream = None
            self._prefetch_done = None
            start = table.head_start
            self._rack = LayerRows(
                memory(), table.layer,
                columns=(start, start + table.part_n_hash_cols),
                max_tokens=max_tokens, device=self.staged_rows.device,
                view=os.environ.get("ENGRAM_RACK_VIEW", "") == "1",
            )

        def prepare_embeddings(self, hash_ids: torch.Tensor) -> None:
            self._rack_start(hash_ids)

        @eager_break_during_capture
        def _rack_start(self, hash_ids: torch.Tensor) -> None:
            self._rack.start(hash_ids)

        def _ready_rows(self, num_tokens: int) -> torch.Tensor:
            rows = self.staged_rows[:num_tokens]
            self._rack_fill(rows)
            return rows

        @eager_break_during_capture
        def _rack_fill(self, rows: torch.Tensor) -> None:
            self._rack.ready(rows.shape[0], out=rows)

    RackEngram.__module__ = __name__
    return RackEngram


def install() -> type:
    """Rebind `Engram` in vLLM's V4.1 modules to `RackEngram`; returns it.
    Idempotent (vLLM may load plugins more than once per process)."""
    global _class
    import importlib

    import vllm

    check_version(vllm.__version__)
    common = importlib.import_module(COMMON)
    with _lock:
        if _class is None:
            base = common.Engram
            _class = base if getattr(base, "__module__", "") == __name__ else rack_engram_class(base)
        common.Engram = _class
        for name in MODEL_MODULES:
            mod = sys.modules.get(name)
            if mod is None:
                try:
                    mod = importlib.import_module(name)
                except Exception as e:  # noqa: BLE001 - a platform's module may not import here
                    log.debug("engram_rack: %s not imported (%s); it binds the patched class "
                              "when it is", name, e)
                    continue
            if hasattr(mod, "Engram"):
                mod.Engram = _class
    return _class


def register() -> None:
    """The `vllm.general_plugins` entry point."""
    if settings() is None:
        log.debug("engram_rack: ENGRAM_RACK_CONFIG is not set; the plugin is off")
        return
    install()
    log.info("engram_rack: DeepSeek V4.1 Engram rows come from the rack")
