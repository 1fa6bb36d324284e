"""What a GPU can do with host memory, and registering the rack's memory.

- `facts(device)`: the driver's own answers (`cuDeviceGetAttribute`):
  whether it registers host memory at all, read-only (attribute 113,
  `CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED`), whether it
  reads host memory through the host's own page tables (attribute 100:
  Grace, where no registration is needed), whether a registered address is
  the same on the device (91), and the GPU's NUMA node (from sysfs).
- `register(address, nbytes, device, read_only=...)`: one registration per
  process and address range, whatever asks for it again (SGLang rebuilds
  its lookup state; two layers may share a mapping).
- `host_table_access(device)`: what to do with a host-local table, by the
  device's facts and `ENGRAM_RACK_HOST_REGISTER` (docs/engines.md):
  `readonly` (the default: register read-only, or rely on the host's page
  tables on Grace; refuse to start where neither works, naming the other
  choices), `copy` (a private pinned copy of this rank's rows, for GPUs
  that cannot map memory read-only; costs its size in each process), or
  `refuse`. An unsealed writable table is never offered: it would let any
  engine on the host corrupt every other engine's rows.
- `device_view(address, shape, dtype, device)`: a CUDA tensor over host
  memory the device can read (registered, or through page tables), built
  with `__cuda_array_interface__`: no copy.

Nothing here runs on CPU-only torch but `host_table_access("cpu")`
(`"cpu"`: CPU tensors are read as they are).
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from . import SetupError

#: cuMemHostRegister flags.
PORTABLE = 0x01
DEVICEMAP = 0x02
READ_ONLY = 0x08

_ATTR = {
    "host_native_atomics": 86,
    "host_pointer_for_registered": 91,
    "host_register": 99,
    "host_page_tables": 100,
    "read_only_register": 113,
}

_lock = threading.Lock()
#: (address, nbytes) -> how it was registered, for the life of the process.
_registered: dict[tuple[int, int], str] = {}


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise SetupError(f"the NVIDIA driver library is not loadable: {e}") from None


def facts(device) -> dict:
    """The device's host-memory abilities (see the module's docs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"device": str(device)}
    index = device.index if device.index is not None else torch.cuda.current_device()
    lib = _libcuda()
    lib.cuInit(0)
    dev = ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), index) != 0:
        raise SetupError(f"cuDeviceGet({index}) failed")
    out = {"device": f"cuda:{index}", "name": torch.cuda.get_device_name(index)}
    for name, attr in _ATTR.items():
        v = ctypes.c_int()
        rc = lib.cuDeviceGetAttribute(ctypes.byref(v), attr, dev)
        out[name] = bool(v.value) if rc == 0 else None
    out["numa_node"] = numa_node(index)
    return out


def numa_node(index: int) -> int | None:
    """The NUMA node of GPU `index`'s PCI device (sysfs), or None."""
    try:
        p = torch.cuda.get_device_properties(index)
        bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            n = int(f.read().strip())
        return n if n >= 0 else None
    except (OSError, ValueError, AttributeError):
        return None


def host_table_access(device) -> str:
    """How this process's device reads a host-local table: "cpu",
    "page-tables", "read-only", "copy" (asked for), or SetupError."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    mode = os.environ.get("ENGRAM_RACK_HOST_REGISTER", "readonly").strip() or "readonly"
    if mode not in ("readonly", "copy", "refuse"):
        raise SetupError(f"ENGRAM_RACK_HOST_REGISTER={mode!r}: give readonly, copy or refuse")
    f = facts(device)
    if mode == "copy":
        return "copy"
    if f.get("host_page_tables"):
        return "page-tables"
    if mode == "readonly" and f.get("read_only_register") and f.get("host_pointer_for_registered"):
        return "read-only"
    raise SetupError(
        f"{f.get('name', device)} cannot map the rack's read-only table memory "
        f"(read-only registration supported: {f.get('read_only_register')}, host page "
        f"tables: {f.get('host_page_tables')}); set ENGRAM_RACK_HOST_REGISTER=copy for a "
        "private pinned copy of each rank's rows, or route the table to a donor across "
        "the network (rows then come through the ring)")


def register(address: int, nbytes: int, *, read_only: bool) -> str:
    """Register [address, address + nbytes) with CUDA once per process
    (mapped, portable; read-only when asked): what it did."""
    key = (int(address), int(nbytes))
    with _lock:
        done = _registered.get(key)
        if done is not None:
            return done
        flags = PORTABLE | DEVICEMAP | (READ_ONLY if read_only else 0)
        err = torch.cuda.cudart().cudaHostRegister(key[0], key[1], flags)
        if int(err) != 0:
            raise SetupError(
                f"cudaHostRegister of {nbytes} bytes at {address:#x} with flags "
                f"{flags:#x} failed: {err}")
        how = "read-only" if read_only else "read-write"
        _registered[key] = how
        return how


def registrations() -> dict[tuple[int, int], str]:
    """This process's registrations (address, bytes) -> how."""
    with _lock:
        return dict(_registered)


class _Interface:
    """An object with `__cuda_array_interface__` over device-readable memory."""

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (int(address), False),
            "version": 3,
            "strides": None,
        }


_TYPESTR = {torch.uint8: "|u1", torch.int64: "<i8", torch.int32: "<i4"}


def device_view(address: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor on `device` over `shape` elements of `dtype` at `address`
    (host memory the device reads; no copy). float8_e4m3fn is a view of bytes."""
    device = torch.device(device)
    raw = torch.float8_e4m3fn if dtype == torch.float8_e4m3fn else None
    base = torch.uint8 if raw is not None else dtype
    t = torch.as_tensor(_Interface(address, shape, _TYPESTR[base]), device=device)
    return t.view(raw) if raw is not None else t
