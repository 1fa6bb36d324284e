"""engram_rack inside vLLM: DeepSeek V4.1's Engram tables from the rack.

A vLLM general plugin (entry point `vllm.general_plugins`, name
`engram_rack`), loaded by vLLM in every process before the model is built.
Off unless the environment names the rack (`ENGRAM_RACK_SOCKET`, the
host's engine socket; or `ENGRAM_RACK_CONFIG` with `ENGRAM_RACK_NODE`).
When on, V4.1's `Engram` builds `RackEmbedding`, a `ParallelEngramEmbedding`
that replaces two things only, and leaves vLLM's side stream, events, CUDA
graphs and async scheduling as they are:

- its storage: for a table a host-local donor serves (planar, mapped from
  the donor's memfd), the rank's rows `[vocab_start_idx, vocab_end_idx)`
  of that memory, registered with CUDA once (read-only, or through the
  host's page tables: `engram_rack.cuda`), so vLLM's own lookup kernel
  reads them through UVA exactly as it reads its `cpu_offload` table. The
  weight loaders (checkpoint and dummy) leave it alone; it counts as
  loaded.
- its `lookup()`, for a table across the network: publish, wait and gather
  kernels on the engine ring (`engram_rack.ring`), served by the host's
  rack client; no host sync, no Python on the rows' path. Each step's
  ring requests carry the step's tag; before every step the model runner
  reads the rings' fault logs (host memory) and posts the requests of a
  step whose rows did not come under a table's `fail` policy to the fault
  board, and the scheduler fails them with a retryable request error
  (`engram_rack.faults`); vLLM serves on.

Each rank reads only its own tokens' rows (`dp_size` 1: no DP exchange),
its TP head slice as vLLM shards heads. See docs/engines.md.

Qwen4Exp's PLE n-gram table comes from the rack too
(`engram_rack.vllm_qwen4exp`, docs/models.md).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading

from . import plugin as _plugin
from .plugin import PluginError, global_rank, link, settings

__all__ = ["PluginError", "global_rank", "install", "link", "register", "settings"]

log = logging.getLogger("engram_rack.vllm")

#: vLLM releases whose Engram classes this plugin is written against.
SUPPORTED = ("0.33.",)
MODEL_MODULES = (
    "vllm.models.deepseek_v41.nvidia.model",
    "vllm.models.deepseek_v41.amd.model",
)
COMMON = "vllm.models.deepseek_v41.common.engram"
#: The model runner whose every step first checks the rings for faults.
RUNNER = "vllm.v1.worker.gpu_model_runner"
#: The scheduler that fails the requests the fault board names.
SCHEDULER = "vllm.v1.core.sched.scheduler"
#: The error code a request failed for its rows carries.
ERROR_CODE = "engram_rack_no_rows"
#: Positions one ring request carries (a longer step goes in turns).
RING_POSITIONS = int(os.environ.get("ENGRAM_RACK_RING_POSITIONS", "512") or 512)

_lock = threading.Lock()
_class = None


def check_version(version: str) -> None:
    """Refuse a vLLM release the hooks were not written against."""
    if not version.startswith(SUPPORTED):
        raise PluginError(f"vLLM {version} is not supported by engram_rack.vllm "
                          f"(supported: {', '.join(s + 'x' for s in SUPPORTED)}); "
                          "unset ENGRAM_RACK_SOCKET and ENGRAM_RACK_CONFIG to run "
                          "vLLM without the rack")


def _discard(param, loaded_weight) -> None:
    """The checkpoint's table stays on disk: the rack serves it."""


def embedding_class(base):
    """`RackEmbedding`: vLLM's `ParallelEngramEmbedding` over the rack."""
    import torch
    from torch import nn

    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    from .ring import RingLookup

    class RackEmbedding(base):
        """This rank's head slice of one Engram table, from the rack."""

        _weight_loader = staticmethod(_discard)

        def __init__(self, layer: int, num_embeddings: int, dim: int,
                     head_sizes: tuple[int, ...], block_size: int = 32) -> None:
            nn.Module.__init__(self)
            tp = get_tensor_model_parallel_world_size()
            self.rack_layer = int(layer)
            self.num_embeddings, self.dim, self.block_size = num_embeddings, dim, block_size
            self.n_hash_cols = len(head_sizes)
            self.tp_size, self.dp_size = tp, 1
            self.part_n_hash_cols = -(-self.n_hash_cols // tp)
            self.head_start = get_tensor_model_parallel_rank() * self.part_n_hash_cols
            end = self.head_start + self.part_n_hash_cols
            self.vocab_start_idx = sum(head_sizes[:self.head_start])
            self.vocab_end_idx = sum(head_sizes[:end])
            self.part_num_embeddings = self.vocab_end_idx - self.vocab_start_idx
            self.peer_rows = 0
            self.dp_shared_memory = False
            self.use_thp = False
            self._views = self._view_src = None
            self.device = _plugin.device()
            # vLLM's side stream and event (Engram._init_staging) on a GPU.
            self.cpu_offload = self.device.type == "cuda"
            self._num_sms = _sm_count(self.device)
            self.table = link().table(layer)
            self.ring = None
            weight, scales = self._allocate_weights()
            for name, t in (("weight", weight), ("weight_scale_inv", scales)):
                p = nn.Parameter(t, requires_grad=False)
                p.weight_loader = _discard
                p.engram_rack = True
                setattr(self, name, p)
            if self.table is None:
                self._start_ring()

        def _allocate_weights(self):
            """The rank's rows of the host-local table, or empty placeholders
            for a remote one (no memory: the ring brings its rows)."""
            if self.table is None:
                return (torch.empty(0, self.dim, dtype=torch.float8_e4m3fn, device="cpu"),
                        torch.empty(0, self.dim // 32, dtype=torch.uint8, device="cpu"))
            if self.table.rows != self.num_embeddings:
                raise PluginError(f"layer {self.rack_layer}: the host's table has "
                                  f"{self.table.rows} rows, the model {self.num_embeddings}")
            lo, hi = self.vocab_start_idx, self.vocab_end_idx
            return self.table.values(lo, hi), self.table.scales(lo, hi)

        def _storage(self):
            """The rows as the device reads them: over the host's memory
            (registered once per process), never a copy unless asked."""
            if self._views is None:
                lo, hi = self.vocab_start_idx, self.vocab_end_idx
                self._views = self.table.on(self.device, lo, hi)
            return self._views

        def _start_ring(self):
            cols = (self.head_start, self.head_start + self.part_n_hash_cols)
            self.ring = RingLookup((self.rack_layer,), cols, positions=RING_POSITIONS,
                                   device=self.device)
            link().serve(self.ring)

        def collapse_huge_pages(self) -> None:
            pass

        def lookup(self, indices, out, background: bool = False) -> None:
            """vLLM's lookup: its own kernel over the host's memory, or the
            ring's kernels for a remote table (vLLM's byte-0 scale rule)."""
            if self.ring is None:
                return super().lookup(indices, out, background)
            if indices.shape[0] * self.part_n_hash_cols == 0:
                return None
            if out.dtype == torch.uint8 and out.ndim == 2:
                out = out.view(out.shape[0], self.part_n_hash_cols, -1)
            self.ring.lookup(self.rack_layer, indices, out, scale0_zero=True)
            return None

    RackEmbedding.__module__ = __name__
    return RackEmbedding


def _sm_count(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def rack_engram_class(engram_cls, embedding_cls):
    """A subclass of vLLM's `Engram` that builds `RackEmbedding`."""

    class RackEngram(engram_cls):
        """vLLM's V4.1 `Engram` over the rack's table."""

        def _create_embedding(self, layout, layer_hash_index: int):
            heads = tuple(s for order in layout.primes[layer_hash_index] for s in order)
            return embedding_cls(layout.layer_ids[layer_hash_index],
                                 layout.num_embeddings[layer_hash_index],
                                 layout.head_dim, heads)

    RackEngram.__module__ = __name__
    return RackEngram


def _skip_rack_tables(original):
    """vLLM's dummy weight initializer, leaving the rack's tables alone (a
    write into a donor's read-only memory would be a fault, not a value)."""

    def init(param, *args, **kwargs):
        if getattr(param, "engram_rack", False):
            return None
        return original(param, *args, **kwargs)

    init.engram_rack_wrapped = True
    return init


def _count_rack_tables(load_weights):
    """A model's `load_weights` that also counts the rack's tables as
    loaded (a checkpoint without them is fine: the rack has them)."""

    def load(self, weights):
        loaded = load_weights(self, weights)
        if loaded is not None:
            loaded = set(loaded)
            loaded.update(n for n, p in self.named_parameters() if getattr(p, "engram_rack", False))
        return loaded

    load.engram_rack_wrapped = True
    return load


def install() -> type:
    """Rebind `Engram` in vLLM's V4.1 modules to `RackEngram` and guard
    the loaders; returns the class. Idempotent."""
    global _class
    import importlib

    import vllm

    check_version(vllm.__version__)
    common = importlib.import_module(COMMON)
    with _lock:
        if _class is None:
            base = common.Engram
            if getattr(base, "__module__", "") == __name__:
                _class = base
            else:
                _class = rack_engram_class(base, embedding_class(common.ParallelEngramEmbedding))
        common.Engram = _class
        _patch_loaders()
        from . import vllm_qwen4exp

        vllm_qwen4exp.install()
        _patch_runner()
        for mod in wrap_model_loaders(MODEL_MODULES, "DeepseekV41"):
            if hasattr(mod, "Engram"):
                mod.Engram = _class
        wrap_model_loaders(vllm_qwen4exp.MODEL_MODULES, "Qwen4Exp")
    return _class


def wrap_model_loaders(names, prefix: str) -> list:
    """The modules `names` that import here, their model classes named
    `prefix...` counting the rack's tables as loaded (`_count_rack_tables`)."""
    import importlib

    mods = []
    for name in names:
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - a platform's module may not import
                log.debug("engram_rack: %s not imported (%s)", name, e)
                continue
        mods.append(mod)
        for cls in vars(mod).values():
            lw = getattr(cls, "load_weights", None) if isinstance(cls, type) else None
            if lw is not None and cls.__name__.startswith(prefix) \
                    and not getattr(lw, "engram_rack_wrapped", False):
                cls.load_weights = _count_rack_tables(lw)
    return mods


def _patch_loaders() -> None:
    import importlib

    for name in ("vllm.model_executor.model_loader.dummy_loader",
                 "vllm.model_executor.model_loader.weight_utils"):
        mod = importlib.import_module(name)
        f = getattr(mod, "initialize_single_dummy_weight", None)
        if f is not None and not getattr(f, "engram_rack_wrapped", False):
            mod.initialize_single_dummy_weight = _skip_rack_tables(f)


def _checked_step(execute_model):
    """The model runner's step: first the rings' new faults go to the
    fault board as the failed steps' requests (host memory and a file
    append), then this step's ring requests are tagged with its own
    requests (one small copy, no wait)."""
    from .faults import route_faults, steps

    @functools.wraps(execute_model)
    def step(self, scheduler_output, *args, **kwargs):
        s = steps()
        route_faults(s)
        s.begin(getattr(scheduler_output, "num_scheduled_tokens", None) or ())
        return execute_model(self, scheduler_output, *args, **kwargs)

    step.engram_rack_wrapped = True
    return step


def _idle_step(dummy_run):
    """The model runner's dummy runs (profiling, graph capture, DP idle
    batches): their ring requests serve no request."""

    from .faults import steps

    @functools.wraps(dummy_run)
    def run(self, *args, **kwargs):
        steps().idle()
        return dummy_run(self, *args, **kwargs)

    run.engram_rack_wrapped = True
    return run


def _failing_update(update_from_output):
    """The scheduler's `update_from_output`, which first fails the requests
    the fault board names (those this scheduler runs) with a retryable
    request error: vLLM's own path for a request-level error, which
    leaves the engine healthy."""
    from vllm.outputs import RequestError

    from .faults import board

    @functools.wraps(update_from_output)
    def update(self, scheduler_output, model_runner_output):
        b = board()
        if b is not None:
            errors = self.grammar_compile_error_reqs  # vLLM 0.33's request-error map
            for req_id, message in b.take():
                req = self.requests.get(req_id)
                if req is not None and not req.is_finished():
                    errors[req_id] = RequestError(
                        code=ERROR_CODE, message=message, retryable=True)
        return update_from_output(self, scheduler_output, model_runner_output)

    update.engram_rack_wrapped = True
    return update


def _patch_runner() -> None:
    import importlib

    try:
        mod = importlib.import_module(RUNNER)
    except Exception as e:  # noqa: BLE001 - a CPU-only build may not import it
        log.debug("engram_rack: %s not imported (%s)", RUNNER, e)
    else:
        cls = getattr(mod, "GPUModelRunner", None)
        f = getattr(cls, "execute_model", None)
        if f is not None and not getattr(f, "engram_rack_wrapped", False):
            cls.execute_model = _checked_step(f)
        f = getattr(cls, "_dummy_run", None)
        if f is not None and not getattr(f, "engram_rack_wrapped", False):
            cls._dummy_run = _idle_step(f)
    sched = importlib.import_module(SCHEDULER).Scheduler
    f = sched.update_from_output
    if not getattr(f, "engram_rack_wrapped", False):
        sched.update_from_output = _failing_update(f)


def copy_env_to_ray() -> None:
    """Have vLLM's Ray workers inherit `ENGRAM_RACK_*`."""
    var = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
    have = [p.strip() for p in os.environ.get(var, "").split(",") if p.strip()]
    if "ENGRAM_RACK_" not in have:
        os.environ[var] = ",".join(have + ["ENGRAM_RACK_"])


def register() -> None:
    """The `vllm.general_plugins` entry point: errors stop vLLM (it does not
    catch them)."""
    if settings() is None:
        log.debug("engram_rack: the rack is not configured; the plugin is off")
        return
    copy_env_to_ray()
    from .faults import board

    board(create=True)
    install()
    log.info("engram_rack: DeepSeek V4.1's Engram tables and Qwen4Exp's PLE tables come "
             "from the rack")
