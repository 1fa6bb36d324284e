"""An engine process's link to the rack, and the host-local tables it maps.

`HostLink.from_env()` is how the plugins reach the rack:

- `ENGRAM_RACK_SOCKET=PATH`: the host's engine socket, served by
  `inference-node engines` (one rack client for every GPU process on the
  host: one set of connections, one SSD copy, one set of probes). It hands
  over the host-local donor's tables (read-only memfds, planar: what the
  engines' own host-table kernels read) and serves this process's rings.
- otherwise `ENGRAM_RACK_CONFIG` and `ENGRAM_RACK_NODE`: this process opens
  the node's memory itself (a client per process: for one GPU, or tests).

`HostTable` is one host-local table mapped here: its values and scales as
CPU tensors (no copy), and on a GPU as device tensors over the same memory,
registered once per process by `engram_rack.cuda`'s rules.
"""

from __future__ import annotations

import json
import mmap
import os
import warnings

import numpy as np
import torch

from . import BadInputError, Memory, SetupError, _native
from . import cuda as _cuda

__all__ = ["HostLink", "HostTable"]

VALUES = 256
SCALES = 8


class HostTable:
    """A host-local table this process maps: planar (values, then scales
    at `scales_at`), read-only."""

    def __init__(self, layer: int, rows: int, scales_at: int, buffer, keep):
        self.layer = int(layer)
        self.rows = int(rows)
        self.scales_at = int(scales_at)
        if self.scales_at != self.rows * VALUES:
            raise SetupError(f"layer {layer}'s table is not planar as the engines read it "
                             f"(scales at {scales_at}, not {self.rows * VALUES})")
        array = np.frombuffer(buffer, dtype=np.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer, on purpose
            self._bytes = torch.from_numpy(array)
        if self._bytes.numel() < self.rows * (VALUES + SCALES):
            raise SetupError(f"layer {layer}'s table memory is {self._bytes.numel()} bytes, "
                             f"short of {self.rows} rows")
        self._keep = keep
        self.address = int(array.ctypes.data)
        self.nbytes = self.rows * (VALUES + SCALES)
        self._device: dict = {}

    def _range(self, lo: int, hi: int) -> tuple[int, int]:
        lo, hi = int(lo), int(hi)
        if not 0 <= lo <= hi <= self.rows:
            raise BadInputError(f"rows [{lo}, {hi}) of a {self.rows}-row table")
        return lo, hi

    def values(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows [lo, hi)'s values: a CPU float8_e4m3fn `[hi - lo, 256]` view."""
        lo, hi = self._range(lo, self.rows if hi is None else hi)
        v = self._bytes[lo * VALUES:hi * VALUES].view(torch.float8_e4m3fn)
        return v.view(hi - lo, VALUES)

    def scales(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows [lo, hi)'s scale bytes: a CPU uint8 `[hi - lo, 8]` view."""
        lo, hi = self._range(lo, self.rows if hi is None else hi)
        at = self.scales_at
        return self._bytes[at + lo * SCALES:at + hi * SCALES].view(hi - lo, SCALES)

    def on(self, device, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [lo, hi) as `device` reads them: (values, scales). On CPU the
        views above; on a GPU device tensors over this memory (registered
        read-only, or read through the host's page tables), or over a
        private pinned copy when `ENGRAM_RACK_HOST_REGISTER=copy`."""
        device = torch.device(device)
        hi = self.rows if hi is None else hi
        values, scales = self.values(lo, hi), self.scales(lo, hi)
        how = _cuda.host_table_access(device)
        if how == "cpu":
            return values, scales
        if how == "copy":
            return self._copied(device, values, scales)
        if how == "read-only":
            _cuda.register(self.address, self.nbytes, read_only=True)
        lo = int(lo)
        at_values = self.address + lo * VALUES
        at_scales = self.address + self.scales_at + lo * SCALES
        return (_cuda.device_view(at_values, tuple(values.shape), torch.float8_e4m3fn, device),
                _cuda.device_view(at_scales, tuple(scales.shape), torch.uint8, device))

    def _copied(self, device, values, scales):
        """A private pinned copy of these rows (what `copy` asks for)."""
        out = []
        for t in (values.view(torch.uint8), scales):
            p = torch.empty(t.shape, dtype=torch.uint8, device="cpu", pin_memory=True)
            p.copy_(t)
            self._device.setdefault("pinned", []).append(p)
            out.append(_cuda.device_view(p.data_ptr(), tuple(p.shape), torch.uint8, device))
        return out[0].view(torch.float8_e4m3fn), out[1]


class HostLink:
    """This process's rack client: the host's (`socket`) or its own
    (`config` and `node`). See the module's docs."""

    def __init__(self, *, socket: str | None = None, config: str | None = None,
                 node: str | None = None, metrics: str | None = "off"):
        self._link = None
        self._mem = None
        if socket:
            self._link = _native.EngineLink(str(socket))
            self.hello = json.loads(self._link.hello)
            self.mode = "host"
        elif config and node:
            self._mem = Memory(config, node, metrics=metrics)
            self.hello = {"node": node, "tables": list(self._mem.tables)}
            self.mode = "process"
        else:
            raise SetupError("no rack: set ENGRAM_RACK_SOCKET (the host's engine socket) or "
                             "ENGRAM_RACK_CONFIG and ENGRAM_RACK_NODE")
        self._tables: dict[int, HostTable | None] = {}
        self._handles = []

    @classmethod
    def from_env(cls, *, metrics: str | None = "off") -> "HostLink":
        """The link the environment names (see the module's docs)."""
        socket = os.environ.get("ENGRAM_RACK_SOCKET", "").strip()
        config = os.environ.get("ENGRAM_RACK_CONFIG", "").strip()
        node = os.environ.get("ENGRAM_RACK_NODE", "").strip()
        return cls(socket=socket or None, config=config or None, node=node or None,
                   metrics=metrics)

    @property
    def memory(self) -> Memory | None:
        """This process's own memory (no host client), else None."""
        return self._mem

    def table(self, layer: int) -> HostTable | None:
        """Layer `layer`'s host-local table, planar, mapped here; None when
        it comes from across the network (read it through a ring)."""
        layer = int(layer)
        if layer not in self._tables:
            self._tables[layer] = self._open_table(layer)
        return self._tables[layer]

    def _open_table(self, layer: int) -> HostTable | None:
        if self._link is not None:
            for lay, _table, msg, here in self._link.tables:
                if lay == layer and here:
                    m = json.loads(msg)
                    if m.get("layout") != "planar":
                        return None
                    fd = self._link.table_fd(layer)
                    try:
                        mm = mmap.mmap(fd, int(m["bytes"]), flags=mmap.MAP_SHARED,
                                       prot=mmap.PROT_READ)
                    finally:
                        os.close(fd)
                    return HostTable(layer, m["rows"], m["scales_at"], mm, mm)
            return None
        try:
            view = self._mem.table_view(layer, 5.0)
        except Exception:  # noqa: BLE001 - no view: the table is remote here
            return None
        if view.layout != "planar":
            return None
        return HostTable(layer, view.rows, view.scales_at, view, view)

    def serve(self, ring) -> object:
        """Have `ring` (a `_native.Ring`) served: by the host's client, or by
        this process's memory. Returns a handle that keeps it served."""
        native = getattr(ring, "native", ring)
        if self._link is not None:
            reply = json.loads(self._link.attach(native))
            if reply.get("ring") != "serving":
                raise SetupError(f"the host's rack client refused a ring: {reply.get('why', reply)}")
            self._handles.append(reply)
            return reply
        handle = self._mem.serve_ring(native)
        self._handles.append(handle)
        return handle

    def close(self) -> None:
        """Let go of the rings and the memory."""
        for h in self._handles:
            if hasattr(h, "close"):
                h.close()
        self._handles.clear()
        if self._mem is not None:
            self._mem.close()

