"""What a GPU engine does to a plugin, reproduced on CPU.

- `cuda_context()`: building the model inside `with torch.device("cuda")`
  as vLLM does (FakeTensorMode makes every implicit-device tensor a CUDA
  tensor), where pinning one is refused as CUDA refuses it, with the CUDA
  calls a plugin makes at build answered by a fake driver that records
  registrations.
- `FakeStreams`: torch.cuda streams and events on CPU (no-ops, but a
  `synchronize` inside a capture is a host sync and raises).
- `Graph`: a CUDA graph on CPU. While capturing, no op runs: each torch
  op and each Triton kernel launch is recorded, in-place writes are undone
  and new outputs are filled with garbage (what a real capture leaves:
  memory the graph recorded but never ran), and any host sync raises
  `HostSync` (a tensor read into Python, `.numpy()`, a pinned allocation,
  a stream or event synchronize, a blocking engram_rack call). `replay()`
  runs the recorded ops again on the same tensors, as a graph replays
  kernels on static buffers, with no Python of the plugin's.

With vLLM's own `BreakableCUDAGraphCapture` (its `CUDAGraph` replaced by
`Graph`) this gives both of vLLM's modes: FULL, where an eager break runs
inside the capture, and PIECEWISE, where it runs between segments at
capture, over their never-run outputs, and again at every replay.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostSync(RuntimeError):
    """A host sync or blocking copy inside a captured region."""


_active = threading.local()


def capturing() -> "Graph | None":
    return getattr(_active, "graph", None)


def _sync(what: str):
    if capturing() is not None:
        raise HostSync(f"{what} inside a CUDA graph capture")


_SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default: "a tensor read into Python (item, bool, equal)",
    torch.ops.aten.nonzero.default: "nonzero (a data-dependent shape)",
    torch.ops.aten._pin_memory.default: "pinning memory",
    torch.ops.aten.is_pinned.default: "is_pinned (a driver query)",
}


class Graph(TorchDispatchMode):
    """A CUDA graph on CPU (see the module's docs); the `torch.cuda.CUDAGraph`
    interface vLLM's capture uses: capture_begin / capture_end / replay."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.ops: list = []

    def capture_begin(self, *args, **kwargs):
        if capturing() is not None:
            raise RuntimeError("nested capture")
        _active.graph = self
        self.__enter__()

    def capture_end(self):
        self.__exit__(None, None, None)
        _active.graph = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            raise HostSync(f"{_SYNC_OPS[func]} inside a CUDA graph capture")
        if kwargs.get("pin_memory"):
            raise HostSync("a pinned allocation inside a CUDA graph capture")
        written = [a for a, spec in zip(args, func._schema.arguments)
                   if spec.alias_info is not None and spec.alias_info.is_write
                   and isinstance(a, torch.Tensor)]
        written += [v for k, v in kwargs.items() if k == "out" and isinstance(v, torch.Tensor)]
        saved = [w.clone() for w in written]
        out = func(*args, **kwargs)
        for w, s in zip(written, saved):
            w.copy_(s)  # the capture did not run it
        fresh = func._schema.returns and func._schema.returns[0].alias_info is None
        if fresh and isinstance(out, torch.Tensor) and out.numel() and out.is_contiguous():
            out.view(torch.uint8).fill_(0x7F)  # never-run memory
        self.ops.append((func, args, kwargs, out))
        return out

    def record_launch(self, run):
        self.ops.append((None, run, None, None))

    def replay(self):
        for func, args, kwargs, out in self.ops:
            if func is None:
                args()
                continue
            new = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and new is not out and isinstance(new, torch.Tensor):
                out.copy_(new)


def _record_triton(monkeypatch):
    """Triton launches (interpreter) are recorded while capturing, run otherwise."""
    import triton.runtime.interpreter as interp

    call = interp.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        g = capturing()
        if g is None:
            return call(self, *args, **kwargs)
        g.record_launch(lambda: call(self, *args, **kwargs))
        return None

    monkeypatch.setattr(interp.GridExecutor, "__call__", launch)


class FakeStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        _sync("a stream synchronize")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        _sync("an event synchronize")

    def query(self):
        _sync("an event query")
        return True


def fake_streams(monkeypatch):
    """torch.cuda streams and events on CPU (see FakeStream, FakeEvent)."""
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext(s))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: _sync("torch.cuda.synchronize"))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing() is not None)


def guard_host_reads(monkeypatch):
    """Python-side host syncs raise while capturing: `.numpy()`, `.tolist()`,
    `.item()`, and engram_rack's blocking calls."""
    import engram_rack as er

    for name in ("numpy", "tolist", "item"):
        orig = getattr(torch.Tensor, name)

        def guarded(self, *a, _orig=orig, _name=name, **k):
            _sync(f"Tensor.{_name}()")
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    for cls, name in ((er.Memory, "prefetch_rows"), (er.Memory, "prefetch"),
                      (er.Ticket, "wait"), (er.Memory, "prefetch_batch")):
        orig = getattr(cls, name)

        def guarded(self, *a, _orig=orig, _name=name, **k):
            _sync(f"engram_rack.{_name} (blocks on the host)")
            return _orig(self, *a, **k)

        monkeypatch.setattr(cls, name, guarded)


def emulate_graphs(monkeypatch):
    """Everything a capture test needs: fake streams, guarded host reads,
    recorded Triton launches, and `torch.cuda.CUDAGraph` as `Graph`."""
    fake_streams(monkeypatch)
    guard_host_reads(monkeypatch)
    _record_triton(monkeypatch)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)


class PinRefused(TorchDispatchMode):
    """Pinning a tensor whose device is not the CPU fails, as CUDA torch
    refuses it ("only dense CPU tensors can be pinned")."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("pin_memory"):
            dev = kwargs.get("device")
            if dev is None or torch.device(dev).type != "cpu":
                raise RuntimeError(
                    f"cannot pin a {dev or 'default (cuda)'} tensor: only dense CPU tensors "
                    "can be pinned")
        return func(*args, **kwargs)


class FakeDriver:
    """engram_rack.cuda's calls to the driver, answered and recorded."""

    def __init__(self, **facts):
        self.facts = {"host_register": True, "host_page_tables": False,
                      "host_pointer_for_registered": True, "read_only_register": True,
                      "host_native_atomics": False, "numa_node": 0, **facts}
        self.registered: list[tuple[int, int, bool]] = []

    def install(self, monkeypatch):
        import engram_rack.cuda as c

        monkeypatch.setattr(c, "facts", lambda device: dict(self.facts, device=str(device)))

        def register(address, nbytes, *, read_only):
            key = (int(address), int(nbytes))
            with c._lock:
                if key in c._registered:
                    return c._registered[key]
                self.registered.append((key[0], key[1], read_only))
                c._registered[key] = "read-only" if read_only else "read-write"
                return c._registered[key]

        monkeypatch.setattr(c, "register", register)
        monkeypatch.setattr(c, "_registered", {})
        # A view of device memory: its shape and type (no CUDA here).
        monkeypatch.setattr(c, "device_view",
                            lambda address, shape, dtype, device: torch.empty(
                                shape, dtype=dtype, device="meta"))


@contextlib.contextmanager
def cuda_context(monkeypatch, driver: FakeDriver | None = None):
    """Build inside a default CUDA device context on CPU (see the module's
    docs). Tensors made inside are fake CUDA tensors (shapes only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    driver = driver or FakeDriver()
    driver.install(monkeypatch)
    fake_streams(monkeypatch)
    import engram_rack.plugin as rack_plugin

    monkeypatch.setattr(rack_plugin, "device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: type("P", (), {"multi_processor_count": 132})())
    with FakeTensorMode(allow_non_fake_inputs=True), PinRefused(), torch.device("cuda"):
        yield driver
