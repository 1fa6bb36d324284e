"""What both engine plugins share for Qwen4Exp's PLE n-gram tables: which
rack table a PLE layer reads, the encoding an engine's table dtype means,
and the table as this host maps it (docs/models.md)."""

from __future__ import annotations

from . import plugin as _plugin
from .plugin import PluginError


def ple_layer(config, ple_dense_layer_id: int) -> int:
    """The model layer (1-based, as `ple_layer_ids`) of PLE layer index
    `ple_dense_layer_id` (vLLM's index into the sorted ids)."""
    ids = sorted(set(int(x) for x in (getattr(config, "ple_layer_ids", None) or ())))
    if not 0 <= int(ple_dense_layer_id) < len(ids):
        raise PluginError(f"PLE layer index {ple_dense_layer_id}: the model's ple_layer_ids "
                          f"are {ids}")
    return ids[int(ple_dense_layer_id)]


def rack_table(layer: int) -> dict:
    """The rack table of model layer `layer` (PluginError when the node
    routes none)."""
    found = [t for t in _plugin.tables().tables if t["layer"] == layer]
    if not found:
        have = [(t["table"], t["layer"]) for t in _plugin.tables().tables]
        raise PluginError(f"PLE layer {layer}: the node routes no table of that layer "
                          f"(tables, layers: {have}); give the table layer = {layer}")
    return found[0]


def host_view(layer: int, table: int, remote_ok: bool = False):
    """Table `table` as this host maps it; where no donor on this host
    shares it and the node has no local copy, None when `remote_ok` (its
    rows then come through an engine ring), else PluginError saying why."""
    from . import EngramError, NoSourceError

    try:
        return _plugin.tables().table_view(table, wait=10.0)
    except NoSourceError as e:
        if remote_ok:
            return None
        raise PluginError(f"PLE layer {layer}: {e}. route it to a donor on this host (its host "
                          "socket) or to the node's `local` copy") from None
    except EngramError as e:
        raise PluginError(f"PLE layer {layer}: {e}") from None


def encoding_for(dtype, width: int) -> str:
    """The rack encoding of an engine's PLE table of `dtype` rows of
    `width` values, or PluginError for one the rack does not serve."""
    import torch

    if dtype == torch.float8_e4m3fn:
        return f"fp8_per_tensorx{width}"
    if dtype == torch.bfloat16:
        return f"bf16x{width}"
    if dtype == torch.uint8:
        raise PluginError("an NVFP4 PLE table is served to vLLM's NVFP4 method only (SGLang "
                          "does not offload NVFP4 tables): use the FP8 or BF16 table")
    raise PluginError(f"a PLE table of {dtype} rows: engram_rack serves FP8 (per-tensor scale) "
                      "and BF16 tables")
