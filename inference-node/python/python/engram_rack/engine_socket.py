"""A rack of another model family than V4.1 through the host's engine
socket (`inference-node engines`): `EngineTables` is `engram_rack.Tables`'
interface over it (what each table is; the host-local ones mapped here,
each a `MappedTable`). Needs no torch."""

from __future__ import annotations

import json
import mmap
import os

from . import BadInputError, NoSourceError, SetupError, _native

__all__ = ["EngineTables", "MappedTable"]


class MappedTable(mmap.mmap):
    """A host-local table the engine socket handed over, mapped read-only
    here (a buffer, as `engram_rack.TableView` is): rows back to back at
    `row_bytes`, every process on the host mapping the same memory."""

    @classmethod
    def of(cls, fd: int, message: dict) -> "MappedTable":
        m = cls(fd, int(message["bytes"]), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        m.table, m.layer = int(message["table"]), int(message["layer"])
        m.rows, m.row_bytes = int(message["rows"]), int(message.get("row_bytes", 264))
        m.encoding = message.get("encoding", "e4m3_ue8m0_32x256")
        m.tensor_scale = message.get("tensor_scale")
        m.digest, m.generation = message.get("digest"), message.get("generation")
        m.layout = message.get("layout", "packed")
        m.packed, m.shared = m.layout == "packed", True
        if m.rows * m.row_bytes > len(m):
            raise SetupError(f"table {m.table}'s memory is {len(m)} bytes, short of "
                             f"{m.rows} rows of {m.row_bytes}")
        return m

    def offset(self, row: int) -> int:
        """Where row `row` starts."""
        if not 0 <= int(row) < self.rows:
            raise BadInputError(f"row {row} is out of range ({self.rows} rows)")
        return int(row) * self.row_bytes


class EngineTables:
    """`engram_rack.Tables`' interface over the host's engine socket
    (`inference-node engines` on a rack of another model family than
    V4.1): what each table is, the host-local ones mapped here, and rings
    (`serve`) served by the host's client at the tables' row size. Rows by
    id with a blocking call are not offered: an engine's rows come through
    its rings."""

    def __init__(self, socket: str):
        self._link = _native.EngineLink(str(socket))
        self.hello = json.loads(self._link.hello)
        self._info: dict[int, dict] = {}
        self._here: dict[int, bool] = {}
        for layer, table, msg, here in self._link.tables:
            m = json.loads(msg)
            self._info[table] = {
                "table": table, "layer": layer, "rows": int(m.get("rows", 0)),
                "row_bytes": int(m.get("row_bytes", 264)),
                "encoding": m.get("encoding", "e4m3_ue8m0_32x256"),
                "tensor_scale": m.get("tensor_scale"), "policy": None}
            self._here[table] = here

    @property
    def node(self) -> str:
        return str(self.hello.get("node"))

    @property
    def tables(self) -> list[dict]:
        return [dict(t) for t in self._info.values()]

    def table_view(self, table: int, wait: float = 5.0) -> MappedTable:
        """Table `table`'s host-local memory, mapped read-only; NoSourceError
        when it is remote on this host."""
        info = self._info.get(int(table))
        if info is None:
            raise BadInputError(f"table {table} is not one the engine socket told of "
                                f"(tables: {sorted(self._info)})")
        if not self._here[int(table)]:
            raise NoSourceError(f"table {table} is not in this process's memory: no donor on "
                                "this host shares it through its host socket")
        fd = self._link.table_fd(info["layer"])
        try:
            for _layer, t, msg, _here in self._link.tables:
                if t == int(table):
                    return MappedTable.of(fd, json.loads(msg))
        finally:
            os.close(fd)
        raise NoSourceError(f"table {table} went")

    def lookup(self, table: int, ids, out=None, timeout=None):
        raise SetupError("through the engine socket rows come by engine ring (serve a "
                         "engram_rack.ring.RingLookup or HostRing); for blocking lookups by id "
                         "open the node's tables in this process (engram_rack.Tables)")

    def serve(self, ring) -> dict:
        """Have the host's client serve `ring` (its sections routed tables'
        layers, of their row size) while this link is open; SetupError
        with the client's reason when it refuses."""
        if self._link is None:
            raise SetupError("the engine socket link is closed")
        reply = json.loads(self._link.attach(getattr(ring, "native", ring)))
        if reply.get("ring") != "serving":
            raise SetupError(f"the host's rack client refused a ring: {reply.get('why', reply)}")
        return reply

    def close(self, drain: float = 2.0) -> None:
        self._link = None
