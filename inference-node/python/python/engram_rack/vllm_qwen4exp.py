"""engram_rack inside vLLM: Qwen4Exp's PLE n-gram table from the rack.

Installed by `engram_rack.vllm.install()` beside V4.1's hooks. vLLM's
`Qwen4ExpNGramEmbedding` (NVIDIA and AMD) picks its table's storage class
by `engram_config.cpu_offload`: pinned host memory looked up through UVA,
or device memory. With the rack on, both names are bound to
`RackPLEEmbedding`, vLLM's own `Qwen4ExpPLEPinnedHostEmbedding` whose
weight is not a pinned copy loaded from the checkpoint but the rack's
table as this host maps it: a host-local donor's memfd (one copy for every
process on the host), or the node's `local` copy. Everything else is
vLLM's: the hashing, the side-stream prefetch (`start_prefetch`, an eager
break under CUDA graphs), vLLM's own lookup kernel reading the rows
through UVA, the ETP reduction, the dequantization. The checkpoint's
table shards are skipped (the rack has the rows); its global scale, where
it has one, must equal the rack table's `tensor_scale`.

A table only across the network (no donor on this host, no local copy)
keeps no rows here: vLLM's lookup, on its prefetch side stream, goes
through an engine ring of the table's row size instead
(`engram_rack.ring.RingLookup.lookup_rows`: publish the ids, wait, gather
the rows' bytes into vLLM's prefetch buffer; kernels only, no host sync),
served by the host's client or this process's own; each ETP rank asks
for the rows it owns (the rest zeros), and vLLM's reduction and
dequantization run unchanged. Rows that do not come are zeros, or under a
`fail` policy a fault that fails the step's requests, as V4.1's rings.

Which rack table: the one whose `layer` is the PLE layer's model layer
(`ple_layer_ids`, 1-based), among the node's tables
(`engram_rack.plugin.tables()`: the host's engine socket, or this
process's own `engram_rack.Tables`). Encodings: FP8 with a
per-tensor scale (`fp8_per_tensorx{head_dim}`, vLLM's FP8 method) and
BF16 (`bf16x{head_dim}`, its unquantized method), NVFP4
(`nvfp4_e4m3_16x{head_dim}`, its NVFP4 method: vLLM reads values and block
scales from two arrays, the rack keeps them in one row; the lookup copies
this rank's rows' bytes with vLLM's own byte-copy kernel, or takes them
from the ring, then decodes them with vLLM's own NVFP4 kernel, its global
`weight_scale_2` the rack table's `tensor_scale`).
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import os
import threading
import warnings

from . import plugin as _plugin
from .plugin import PluginError
from .qwen4exp import encoding_for, host_view, ple_layer, rack_table

log = logging.getLogger("engram_rack.vllm")

#: Positions one ring request of a remote PLE table carries (a longer
#: batch goes in turns).
RING_POSITIONS = int(os.environ.get("ENGRAM_RACK_RING_POSITIONS", "512") or 512)

#: vLLM's modules that build a Qwen4Exp n-gram embedding, and the module
#: whose name the PLE layer builds it by (None: the same).
NGRAM_MODULES = (
    ("vllm.models.qwen4_exp.nvidia.ngram_embedding", "vllm.models.qwen4_exp.nvidia.ple_layer"),
    ("vllm.models.qwen4_exp.amd.ple_layer", None),
)
COMMON = "vllm.models.qwen4_exp.common.ngram_embedding"
#: vLLM's NVFP4 table method (values and block scales in two arrays).
NVFP4_METHOD = "Qwen4ExpPLENvFp4EmbeddingMethod"
#: Model classes whose weight loading counts the rack's table as loaded.
MODEL_MODULES = ("vllm.models.qwen4_exp.nvidia.model", "vllm.models.qwen4_exp.amd.model")

#: The model layer of the PLE layer being built (set by `RackNGramEmbedding`).
_building: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "engram_rack_ple_layer", default=None)

_lock = threading.Lock()
_classes: dict[str, type] = {}


def _discard(param, loaded_weight, *args, **kwargs) -> None:
    """The checkpoint's table shards stay on disk: the rack serves them."""


def embedding_class(base):
    """`RackPLEEmbedding`: vLLM's pinned-host PLE table over the rack's."""
    import numpy as np
    import torch

    from . import cuda as _cuda

    class RackPLEEmbedding(base):
        """One PLE table, ETP-sharded as vLLM shards it, over the rack's memory."""

        def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype, padding_size,
                     prefix, embedding_method, num_ngram_heads: int = 1,
                     max_total_tokens: int = 0, data_parallel_rank: int = 0,
                     reduce_results: bool = True) -> None:
            layer = _building.get()
            if layer is None:
                raise PluginError(f"{prefix}: a PLE table built outside a Qwen4Exp n-gram "
                                  "embedding (engram_rack cannot tell its layer)")
            self.rack_layer = layer
            self.rack_table = rack_table(layer)
            self._rack_view = None
            self._rack_nvfp4 = False
            self._rack_own = None
            #: The engine ring of a table only across the network (None:
            #: the table is in this host's memory).
            self.rack_ring = None
            self.device = _plugin.device()
            # vLLM's base classes, not the pinned class's constructor (whose
            # UVA check and view are for pinned memory: the rack maps its own).
            Qwen4ExpPLEEmbedding = base.__mro__[1]
            Qwen4ExpPLEEmbedding.__init__(
                self, num_embeddings, embedding_dim, params_dtype=params_dtype,
                padding_size=padding_size, prefix=prefix, embedding_method=embedding_method,
                num_ngram_heads=num_ngram_heads, max_total_tokens=max_total_tokens,
                data_parallel_rank=data_parallel_rank, reduce_results=reduce_results)
            self._uva_weight = self._device_rows()
            if self.rack_ring is False:
                self._start_ring(num_ngram_heads)
            self._prefetch_stream = None
            self._prefetch_buffer = None
            self._prefetch_alloc_lock = threading.Lock()
            self._prefetch_rows = max_total_tokens * self.etp_data_parallel_size
            self._num_ngram_heads = num_ngram_heads
            self._output_dim = num_ngram_heads * self.embedding_dim
            self._adopt_scale()

        def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int, dtype):
            """This rank's rows of the rack's table (no copy): rows
            [org_vocab_start_index, + num_embeddings) of its memory. An
            NVFP4 table's values and block scales are asked for apart
            (vLLM's two arrays): each is its span of the rack's rows."""
            nvfp4 = type(getattr(self, "quant_method", None)).__name__ == NVFP4_METHOD
            self._rack_nvfp4 = nvfp4
            if nvfp4:
                values = embedding_dim * (2 if dtype == torch.uint8 else 16)
                want = f"nvfp4_e4m3_16x{values}"
            else:
                want = encoding_for(dtype, embedding_dim)
            t = self.rack_table
            if t["encoding"] != want:
                method = type(getattr(self, "quant_method", None)).__name__
                raise PluginError(f"PLE layer {self.rack_layer}: vLLM reads {want} rows (its "
                                  f"{method}), the rack's table {t['table']} is {t['encoding']}")
            lo = self.shard_indices.org_vocab_start_index
            if lo + num_embeddings > t["rows"]:
                total = getattr(self, "num_embeddings_padded", num_embeddings)
                raise PluginError(
                    f"PLE layer {self.rack_layer}: vLLM's table has {total} rows (this rank: "
                    f"{num_embeddings} from {lo}), the rack's table {t['table']} {t['rows']}: "
                    "its hashing (ngram_vocab_size_base, make_ngram_vocab_size_divisible_by) "
                    "is not the model's")
            if self._rack_view is None and self.rack_ring is None:
                self._rack_view = host_view(self.rack_layer, t["table"], remote_ok=True)
            if self._rack_view is None:
                # Across the network only: no rows here, a ring brings them.
                self.rack_ring = False
                return torch.empty(0, embedding_dim, dtype=dtype)
            view = self._rack_view
            size = view.row_bytes
            array = np.frombuffer(view, dtype=np.uint8)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only memory, on purpose
                rows = torch.from_numpy(array)[lo * size:(lo + num_embeddings) * size]
            # The whole mapping is registered (once per process, as V4.1's
            # tables are); this rank reads its span of it.
            self._rack_map = (int(array.ctypes.data), array.nbytes)
            self._rack_span = (int(array.ctypes.data) + lo * size, num_embeddings * size)
            self._rack_rows = rows.view(num_embeddings, size)
            if nvfp4:  # values first in a row, then the block scales
                at = 0 if dtype == torch.uint8 else values // 2
                return self._rack_rows[:, at:at + embedding_dim].view(dtype)
            return self._rack_rows.view(dtype)

        def _nvfp4_rows(self, ids, output) -> None:
            """An NVFP4 table's rows, decoded as vLLM decodes them: this
            rank's rows' bytes (vLLM's own byte-copy kernel over the rack's
            memory, or the ring), then vLLM's own NVFP4 kernel over them
            (their values and block scales apart, as it reads them)."""
            from triton import next_power_of_2

            C = importlib.import_module(COMMON)
            n = ids.numel()
            row = self.rack_table["row_bytes"]
            raw = torch.empty((n, row), dtype=torch.uint8, device=ids.device)
            if self.rack_ring:
                heads = self.rack_ring.cols
                self.rack_ring.lookup_rows(self.rack_layer, ids.reshape(-1, heads),
                                           raw.view(-1, heads, row), own=self._rack_own)
            else:
                C._lookup_ple_embedding_from_pinned_kernel[(n,)](
                    self._uva_weight, ids.reshape(-1), raw, row,
                    self.shard_indices.org_vocab_start_index,
                    self.shard_indices.org_vocab_end_index,
                    BLOCK_D=next_power_of_2(row))
            dim = self.embedding_dim
            values = raw[:, :dim // 2].contiguous()
            scales = raw[:, dim // 2:].contiguous()
            C._lookup_nvfp4_ple_embedding_kernel[(n,)](
                values, scales, self.weight_scale_2,
                torch.arange(n, dtype=torch.int64, device=ids.device),
                output.view(n, dim), dim, 0, n, BLOCK_D=next_power_of_2(dim))

        def _start_ring(self, heads: int) -> None:
            """The ring this rank's rows come through (served by the host's
            client, or this process's tables)."""
            from .ring import RingLookup

            if not 1 <= heads <= 24:
                raise PluginError(f"PLE layer {self.rack_layer}: {heads} n-gram heads; an engine "
                                  "ring carries 1 to 24 rows a position")
            t = self.rack_table
            self.rack_ring = RingLookup((self.rack_layer,), (0, heads), positions=RING_POSITIONS,
                                        device=self.device, row_bytes=t["row_bytes"])
            _plugin.tables().serve(self.rack_ring)
            lo = self.shard_indices.org_vocab_start_index
            hi = self.shard_indices.org_vocab_end_index
            self._rack_own = None if self.tp_size == 1 else (int(lo), int(hi))
            log.info("engram_rack: PLE layer %d reads table %d (%s) through an engine ring",
                     self.rack_layer, t["table"], t["encoding"])

        def _lookup(self, input_ids, output=None):
            """vLLM's lookup over host memory, or the ring's kernels for a
            table across the network: this rank's rows (the ids it owns)
            as bytes into vLLM's lookup dtype, zeros for the rest."""
            if not self.rack_ring and not self._rack_nvfp4:
                return super()._lookup(input_ids, output)
            shape = (*input_ids.shape, self.embedding_dim)
            dtype = self.embedding_method.lookup_dtype(self)
            if output is None:
                output = torch.empty(shape, dtype=dtype, device=input_ids.device)
            elif tuple(output.shape) != shape or output.dtype != dtype:
                raise ValueError("PLE prefetch output must match the input shape and lookup dtype")
            if not input_ids.numel():
                return output
            if self._rack_nvfp4:
                self._nvfp4_rows(input_ids.long(), output)
                return output
            heads = self.rack_ring.cols
            ids = input_ids.reshape(-1, heads)
            rows = output.view(ids.shape[0], heads, self.embedding_dim)
            self.rack_ring.lookup_rows(self.rack_layer, ids, rows, own=self._rack_own)
            return output

        def _device_rows(self):
            """The rows as this process's device reads them: the CPU
            tensor itself, or a device view over the same memory
            (registered read-only once, or through the host's page tables).
            For a table across the network, no rows, on the device (vLLM
            places its prefetch stream and buffer by it)."""
            if self.rack_ring is False:
                return torch.empty((0, self.embedding_dim), dtype=self.weight.dtype,
                                   device=self.device)
            how = _cuda.host_table_access(self.device)
            if how == "cpu":
                return self._rack_rows if self._rack_nvfp4 else self.weight.data
            if how == "copy":
                raise PluginError("ENGRAM_RACK_HOST_REGISTER=copy is for V4.1's tables; a PLE "
                                  "table is read where the rack maps it")
            address, nbytes = self._rack_span
            if how == "read-only":
                _cuda.register(*self._rack_map, read_only=True)
            raw = _cuda.device_view(address, (nbytes,), torch.uint8, self.device)
            rows = raw.view(self._rack_rows.shape[0], -1)
            return rows if self._rack_nvfp4 else rows.view(self.weight.dtype)

        def _adopt_scale(self) -> None:
            """The table's global scale is the rack table's (FP8's
            `weight_scale`, NVFP4's `weight_scale_2`); a checkpoint's must
            equal it; the table (NVFP4's block scales too) is counted as
            loaded and skipped."""
            rows = [self.weight] + ([self.weight_scale] if self._rack_nvfp4 else [])
            name = "weight_scale_2" if self._rack_nvfp4 else "weight_scale"
            scale = getattr(self, name, None)
            for p in rows + [scale]:
                if p is not None:
                    p.engram_rack = True
            for p in rows:
                p.weight_loader = _discard
            if scale is None:
                return
            value = self.rack_table["tensor_scale"]
            if value is None:
                raise PluginError(f"PLE layer {self.rack_layer}: vLLM's table has a global "
                                  f"{name}, the rack's table {self.rack_table['table']} none")
            scale.data.fill_(value)
            layer, table = self.rack_layer, self.rack_table["table"]

            def check(param, loaded_weight, *args, **kwargs):
                got = float(loaded_weight.reshape(-1)[0])
                if got != float(param.reshape(-1)[0]):
                    raise PluginError(f"PLE layer {layer}: the checkpoint's {name} is "
                                      f"{got}, the rack's table {table} {value}: they are not "
                                      "the same table")

            scale.weight_loader = check

    RackPLEEmbedding.__module__ = __name__
    return RackPLEEmbedding


def ngram_class(base):
    """A subclass of a module's `Qwen4ExpNGramEmbedding` that tells the
    table it builds which model layer it is."""

    class RackNGramEmbedding(base):
        """vLLM's Qwen4Exp n-gram embedding over the rack's table."""

        def __init__(self, config, *args, **kwargs):
            dense = kwargs.get("ple_dense_layer_id", args[1] if len(args) > 1 else None)
            token = _building.set(ple_layer(config, dense))
            try:
                super().__init__(config, *args, **kwargs)
            finally:
                _building.reset(token)

    RackNGramEmbedding.__module__ = __name__
    return RackNGramEmbedding


def install() -> None:
    """Bind vLLM's Qwen4Exp table classes to the rack's (idempotent); the
    model classes' loaders are wrapped by `engram_rack.vllm`."""
    try:
        common = importlib.import_module(COMMON)
    except Exception as e:  # noqa: BLE001 - a build without Qwen4Exp
        log.debug("engram_rack: %s not imported (%s)", COMMON, e)
        return
    with _lock:
        if "embedding" not in _classes:
            _classes["embedding"] = embedding_class(common.Qwen4ExpPLEPinnedHostEmbedding)
    rack = _classes["embedding"]
    for name, builder in NGRAM_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a platform's module may not import
            log.debug("engram_rack: %s not imported (%s)", name, e)
            continue
        mod.Qwen4ExpPLEPinnedHostEmbedding = rack
        mod.Qwen4ExpPLEDeviceEmbedding = rack
        cls = mod.Qwen4ExpNGramEmbedding
        if cls.__module__ != __name__:
            with _lock:
                cls = _classes.setdefault(name, ngram_class(cls))
        mod.Qwen4ExpNGramEmbedding = cls
        if builder is not None:
            try:
                importlib.import_module(builder).Qwen4ExpNGramEmbedding = cls
            except Exception as e:  # noqa: BLE001
                log.debug("engram_rack: %s not imported (%s)", builder, e)
