"""Faults per request: a ring request that had no rows under a table's
`fail` policy fails the engine requests of the step it came from, and only
those; the engine keeps serving the rest (docs/engines.md, "When rows do
not come").

The path of a fault:

1. Before each engine step the plugin takes a step tag (`Steps.begin`,
   which remembers the step's request ids) and `ring.set_step` copies it
   into GPU memory, where every `publish` kernel of the step copies it
   into its ring slot.
2. The rack client logs a fault with its request's step tag in the ring's
   header (PROTOCOL.md section 6.1).
3. Before the next step the plugin reads the new faults
   (`ring.collect_faults`, host memory only), turns each tag into the
   step's request ids and posts them to the **fault board**: a file every
   process of the engine on this host appends to (`FaultBoard`).
4. The engine's scheduler reads the board before it takes a step's output
   and fails those requests with the rack's error (vLLM: a request error,
   retryable; SGLang: an abort with the error's message).

Where no request can be named (a fault whose step the client could not
tell, more faults than the ring's log keeps, no rack client answering, or
no board this process can write), `RingFault` stops the engine as before:
never tokens served without their rows in silence.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
import threading

from .ring import IDLE_STEP, Fault, RingFault, collect_faults, set_step

__all__ = ["Steps", "FaultBoard", "BOARD_ENV", "MAX_BOARD_BYTES", "board", "route_faults",
           "fault_message", "steps"]

log = logging.getLogger("engram_rack")

#: The variable that names this engine's fault board (inherited by the
#: engine's processes; made by the first process that loads the plugin).
BOARD_ENV = "ENGRAM_RACK_FAULT_BOARD"
#: A board never grows past this; a fault that does not fit stops the engine.
MAX_BOARD_BYTES = 16 << 20
#: Longest line a reader takes (a request id and a message).
_MAX_LINE = 4096


def fault_message(f: Fault) -> str:
    """What a failed request is told."""
    return (f"engram-rack: this request's Engram rows did not come ({f.describe()}) and the "
            "table's policy is fail")


class Steps:
    """Step tags and the request ids of the last `keep` steps."""

    def __init__(self, keep: int = 1024):
        self._ids: collections.OrderedDict[int, tuple[str, ...]] = collections.OrderedDict()
        self._keep = int(keep)
        self._next = 1
        self._lock = threading.Lock()

    def begin(self, request_ids) -> int:
        """A new step of `request_ids`: its tag, set for the kernels it
        launches (`ring.set_step`)."""
        with self._lock:
            tag = self._next
            self._next += 1
            self._ids[tag] = tuple(str(r) for r in request_ids)
            while len(self._ids) > self._keep:
                self._ids.popitem(last=False)
        set_step(tag)
        return tag

    def idle(self) -> None:
        """Work that serves no request follows (a dummy batch, graph
        capture): its faults fail nothing."""
        set_step(IDLE_STEP)

    def requests(self, tag: int) -> tuple[str, ...] | None:
        """Step `tag`'s request ids; `None` when the step is not known
        (tag 0, or older than the last `keep` steps)."""
        with self._lock:
            return self._ids.get(int(tag))


class FaultBoard:
    """The engine's fault board on this host: a file of JSON lines
    `{"req": ID, "error": MESSAGE}`, appended to by every process that
    finds a fault (one `write` per report, `O_APPEND`) and read by each
    scheduler from where it last stopped. Bounded by `MAX_BOARD_BYTES`."""

    def __init__(self, path: str):
        self.path = path
        self._offset = 0
        self._partial = b""
        self._lock = threading.Lock()

    @classmethod
    def create(cls) -> "FaultBoard":
        """A new board in /dev/shm (or the temp dir), removed when this
        process exits; its path goes to `BOARD_ENV` for child processes."""
        import atexit

        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="engram-rack-faults.", dir=where)
        os.close(fd)
        os.environ[BOARD_ENV] = path
        creator = os.getpid()

        def remove():
            if os.getpid() == creator:
                try:
                    os.unlink(path)
                except OSError:
                    pass

        atexit.register(remove)
        return cls(path)

    def report(self, request_ids, message: str) -> bool:
        """Post `request_ids` as failed with `message`; False when the
        board cannot take them (gone, or full)."""
        lines = b"".join(json.dumps({"req": r, "error": message}).encode() + b"\n"
                         for r in request_ids)
        if not lines:
            return True
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            log.error("engram_rack: the fault board %s cannot be written: %s", self.path, e)
            return False
        try:
            if os.fstat(fd).st_size + len(lines) > MAX_BOARD_BYTES:
                log.error("engram_rack: the fault board %s is full", self.path)
                return False
            os.write(fd, lines)
            return True
        except OSError as e:
            log.error("engram_rack: the fault board %s cannot be written: %s", self.path, e)
            return False
        finally:
            os.close(fd)

    def take(self) -> list[tuple[str, str]]:
        """`(request id, message)` for every report since the last take
        (a stat when there is none). A line that is not a report is
        skipped, with a warning."""
        with self._lock:
            try:
                size = os.stat(self.path).st_size
            except OSError:
                return []
            if size <= self._offset:
                return []
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = self._partial + f.read(min(size, MAX_BOARD_BYTES) - self._offset)
            self._offset = max(self._offset, min(size, MAX_BOARD_BYTES))
            *lines, self._partial = data.split(b"\n")
            if len(self._partial) > _MAX_LINE:
                self._partial = b""
        out = []
        for line in lines:
            try:
                d = json.loads(line)
                out.append((str(d["req"]), str(d["error"])))
            except (ValueError, KeyError, TypeError):
                log.warning("engram_rack: the fault board %s has a line that is not a report",
                            self.path)
        return out


_board_lock = threading.Lock()
_steps: Steps | None = None


def steps() -> Steps:
    """This process's step tags (what both engines' plugins use)."""
    global _steps
    with _board_lock:
        if _steps is None:
            _steps = Steps()
        return _steps


_board: FaultBoard | None = None


def board(create: bool = False) -> FaultBoard | None:
    """This engine's fault board: the one `BOARD_ENV` names, or (with
    `create`, in the first process that loads the plugin) a new one."""
    global _board
    with _board_lock:
        path = os.environ.get(BOARD_ENV)
        if _board is not None and _board.path == path:
            return _board
        if path:
            _board = FaultBoard(path)
        elif create:
            _board = FaultBoard.create()
        else:
            return None
        return _board


def route_faults(steps: Steps, faults: list[Fault] | None = None) -> int:
    """Post the requests of every new fault's step to the fault board
    (host memory and one file append; no device sync); the number of
    requests posted. Raises `RingFault` where no request can be named, or
    the board cannot take them: the engine stops."""
    faults = collect_faults() if faults is None else faults
    posted = 0
    for f in faults:
        if f.step == IDLE_STEP:
            log.warning("engram_rack: rows did not come for work that serves no request (%s)",
                        f.describe())
            continue
        ids = steps.requests(f.step)
        if ids is None:
            raise RingFault(f"engine ring: rows did not come ({f.describe()}) under the table's "
                            f"fail policy, for a step this process cannot name (tag {f.step}); "
                            "the engine stops")
        b = board()
        if b is None or not b.report(ids, fault_message(f)):
            raise RingFault(f"engine ring: rows did not come ({f.describe()}) under the table's "
                            "fail policy, and no fault board takes the step's requests; the "
                            "engine stops")
        log.error("engram_rack: rows did not come (%s); failing the step's %d request(s)",
                  f.describe(), len(ids))
        posted += len(ids)
    return posted
