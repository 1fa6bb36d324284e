"""What both engine plugins share: whether the rack is asked for, and this
process's one link to it (`engram_rack.host.HostLink` for V4.1's tables,
`engram_rack.Tables` for a model of another family's)."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("engram_rack.plugin")

_lock = threading.Lock()
_link = None
_tables = None


class PluginError(RuntimeError):
    """The plugin is asked for but cannot run: says why and what to set."""


def settings() -> dict | None:
    """What the environment asks for, None when the plugin is off, or
    PluginError when it is asked for but incomplete."""
    socket = os.environ.get("ENGRAM_RACK_SOCKET", "").strip()
    config = os.environ.get("ENGRAM_RACK_CONFIG", "").strip()
    if not socket and not config:
        return None
    if socket:
        return {"socket": socket}
    node = os.environ.get("ENGRAM_RACK_NODE", "").strip()
    if not node:
        raise PluginError("ENGRAM_RACK_CONFIG is set but ENGRAM_RACK_NODE is not: "
                          "name this host's [[node]] in the rack config")
    if not os.path.isfile(config):
        raise PluginError(f"ENGRAM_RACK_CONFIG={config}: no such file")
    return {"config": config, "node": node}


def global_rank() -> int:
    """This process's rank in the whole job (not its TP rank: DP replicas
    each have a TP rank 0)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - no process group yet
        pass
    for var in ("RANK", "LOCAL_RANK"):
        v = os.environ.get(var, "").strip()
        if v.isdigit():
            return int(v)
    return 0


def _configured() -> dict:
    """`settings()`, or PluginError when the rack is not configured."""
    found = settings()
    if found is None:
        raise PluginError("the rack is not configured (ENGRAM_RACK_SOCKET or "
                          "ENGRAM_RACK_CONFIG)")
    return found


def _metrics() -> str | None:
    """Where this process serves /metrics: `ENGRAM_RACK_METRICS` on global
    rank 0, nowhere on the others."""
    return (os.environ.get("ENGRAM_RACK_METRICS") or None) if global_rank() == 0 else "off"


def link():
    """This process's link to the rack (`engram_rack.host.HostLink`),
    opened on first use. Without a host client only global rank 0 serves
    /metrics (`ENGRAM_RACK_METRICS`)."""
    global _link
    with _lock:
        if _link is None:
            from .host import HostLink

            _link = HostLink(metrics=_metrics(), **_configured())
            log.info("engram_rack: %s rack client, tables %s", _link.mode,
                     _link.hello.get("tables"))
        return _link


def tables():
    """This process's tables of the rack's node (a model of any family:
    the engine hashes, the rack's tables give rows), opened on first use:
    through the host's engine socket (`ENGRAM_RACK_SOCKET`: its host-local
    tables, `engram_rack.engine_socket.EngineTables`) or this process's own
    `engram_rack.Tables` (only global rank 0 then serves /metrics)."""
    global _tables
    with _lock:
        if _tables is None:
            found = _configured()
            if "socket" in found:
                from .engine_socket import EngineTables

                _tables = EngineTables(found["socket"])
            else:
                from . import Tables

                _tables = Tables(found["config"], found["node"], metrics=_metrics())
            log.info("engram_rack: node %s's tables %s", _tables.node,
                     [(t["table"], t["layer"], t["encoding"]) for t in _tables.tables])
        return _tables


def device():
    """The device this process's engine runs on: its current CUDA device,
    or the CPU where there is none."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reset() -> None:
    """Forget this process's link and tables (tests)."""
    global _link, _tables
    with _lock:
        if _link is not None:
            _link.close()
        if _tables is not None:
            _tables.close()
        _link = _tables = None
