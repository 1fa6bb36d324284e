"""A small real rack for the package's tests: tables made by `memory-donor
gen`, a cluster config on loopback ports, donors started as processes and
waited on through their `ready` line, killed when a test ends.

The binaries come from ENGRAM_BIN_DIR (default: the workspace's
target/release); build them first with `cargo build --release --workspace`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
HASH_BASE = 1000
SEED = 11


def bin_dir() -> Path:
    return Path(os.environ.get("ENGRAM_BIN_DIR", REPO / "target" / "release"))


def binary(name: str) -> Path:
    p = bin_dir() / name
    if not p.is_file():
        pytest.fail(f"{p} is missing: build the binaries first (cargo build --release --workspace)")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gen(dir: Path, name: str, layer: int, seed: int,
        hash_base: int = HASH_BASE) -> tuple[Path, str, int]:
    """A table sized as `hash_base` addresses it: (path, digest, rows)."""
    path = dir / name
    out = subprocess.run(
        [binary("memory-donor"), "gen", "--layer", str(layer), "--seed", str(seed),
         "--hash-base", str(hash_base), "--out", str(path)],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    return path, out[-1], int(out[out.index("rows") + 1])


class Donor:
    """`memory-donor serve`, its stderr collected; killed on stop()."""

    def __init__(self, config: Path, name: str):
        env = dict(os.environ, RUST_LOG="info")
        self.proc = subprocess.Popen(
            [binary("memory-donor"), "serve", "--config", str(config), "--name", name],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(60):
            self.stop()
            raise RuntimeError("donor never became ready:\n" + "".join(self.lines[-20:]))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "ready listen=" in line:
                self._ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def hang(self) -> None:
        """SIGSTOP, then wait until every thread is stopped (the signal is
        asynchronous: a thread running on another core finishes its slice)."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        tasks = Path(f"/proc/{self.proc.pid}/task")
        while time.monotonic() < deadline:
            states = []
            for t in tasks.iterdir():
                try:
                    states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
                except OSError:
                    pass
            if states and all(st in "tT" for st in states):
                return
            time.sleep(0.001)
        raise RuntimeError("the donor did not stop")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@dataclass
class Rack:
    dir: Path
    config: Path
    tables: dict[int, Path]
    donors: list[Donor] = field(default_factory=list)

    def start(self, name: str = "d", config: Path | None = None) -> Donor:
        d = Donor(config or self.config, name)
        self.donors.append(d)
        return d

    def rows(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Rows straight from the table file: (len(ids), 264) uint8."""
        return read_rows(self.tables[layer], ids)


def read_rows(path: Path, ids: np.ndarray) -> np.ndarray:
    """Rows of an .etab file: a safetensors header, then 4 KiB pages of
    whole rows (15 of V4.1's 264 bytes; an encoded table's header says its
    `row_bytes` and `rows_per_page`): (len(ids), row_bytes) uint8."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    header = int.from_bytes(bytes(data[:8]), "little")
    meta = json.loads(bytes(data[8:8 + header]))["__metadata__"]
    size, per_page = int(meta.get("row_bytes", 264)), int(meta.get("rows_per_page", 15))
    start = 8 + header
    ids = np.asarray(ids, dtype=np.uint64).ravel()
    offsets = start + (ids // per_page) * 4096 + (ids % per_page) * size
    idx = offsets[:, None].astype(np.int64) + np.arange(size)[None, :]
    return np.asarray(data[idx])


def gen_encoded(dir: Path, name: str, layer: int, seed: int, rows: int, encoding: str,
                tensor_scale: float | None = None) -> tuple[Path, str]:
    """A synthetic table of `encoding` (`memory-donor gen --encoding`): (path, digest)."""
    path = dir / name
    cmd = [binary("memory-donor"), "gen", "--layer", str(layer), "--seed", str(seed),
           "--rows", str(rows), "--encoding", encoding, "--out", str(path)]
    if tensor_scale is not None:
        cmd += ["--tensor-scale", repr(tensor_scale)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
    return path, out[-1]


@pytest.fixture(scope="session")
def tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    l1 = gen(d, "l1.etab", 1, SEED)
    l14 = gen(d, "l14.etab", 14, SEED)
    other = gen(d, "l1-other.etab", 1, SEED + 1)
    return {"l1": l1, "l14": l14, "l1-other": other}


def write_config(path: Path, tables, port: int, *, l1: str = "l1", policy: str = "fail",
                 metrics: int | None = None, model: str = "", transport: str = "tcp",
                 host_socket: Path | None = None) -> Path:
    """The rack: table 1 from `tables[l1]` (another version than the node's
    copy when l1 is "l1-other"), donor `d` serving both tables over
    `transport` (`tls` and `quic` with a rack PKI made by `engram-cluster
    pki`), and nodes `n` (d, then the SSD copy), `only-donor` (d alone) and
    `ref` (local RAM). With `host_socket`, donor `h` also serves both
    tables on this host, planar, through that socket (and TCP), and node
    `hl` routes both to it (then the SSD copy); node `mixed` routes layer 1
    to `h` and layer 14 to `d`."""
    (p1, d1, r1), (p14, d14, r14) = tables[l1], tables["l14"]
    # Plain TCP as a bare address (tests read the port back from it).
    listen = f"127.0.0.1:{port}" if transport == "tcp" else f"{transport}://127.0.0.1:{port}"
    route = lambda t, p, sources: (  # noqa: E731
        f'[[node.route]]\ntable = {t}\nsources = [{sources}]\nssd_path = "{p}"\npolicy = "{policy}"\n'
    )

    def node(name: str, sources: str, extra: str = "") -> str:
        return (f'[[node]]\nname = "{name}"\ntokens_per_second = 100\nprobe_interval_ms = 200\n{extra}'
                + route(1, tables["l1"][0], sources) + route(14, p14, sources))

    text = (
        'version = 1\n[rack]\nname = "t"\n'
        + ("[rack.tls]\n" if transport != "tcp" else "")
        + f'[[table]]\nid = 1\nlayer = 1\npath = "{p1}"\nrows = {r1}\ndigest = "{d1}"\n'
        f'[[table]]\nid = 14\nlayer = 14\npath = "{p14}"\nrows = {r14}\ndigest = "{d14}"\n'
        f'[[donor]]\nname = "d"\nlisten = ["{listen}"]\ntables = [1, 14]\nram_gib = 1.0\nmax_rows = 500\n'
        + node("n", '"d", "ssd"', f'metrics = "127.0.0.1:{metrics}"\n' if metrics else "")
        # A hard timeout past the callers' deadlines: the hung-donor tests time out first.
        + node("only-donor", '"d"', "lookup_timeout_ms = 1000\n")
        + node("ref", '"local"')
        + (host_donor(host_socket, tables, policy) if host_socket else "")
        + f"[model]\nhash_base = {HASH_BASE}\n{model}"
    )
    path.write_text(text)
    if transport != "tcp":
        for step in ("init", "issue"):
            subprocess.run([binary("engram-cluster"), "pki", step, "--config", str(path)],
                           check=True, capture_output=True)
    return path


def point_plugins_at(rack, node: str, socket=None) -> None:
    """Name the rack for the engine plugins: the engine socket, or the
    config and node (and no /metrics), as an engine's environment would."""
    for k in ("ENGRAM_RACK_SOCKET", "ENGRAM_RACK_CONFIG", "ENGRAM_RACK_NODE"):
        os.environ.pop(k, None)
    if socket is not None:
        os.environ["ENGRAM_RACK_SOCKET"] = str(socket)
    else:
        os.environ.update(ENGRAM_RACK_CONFIG=str(rack.config), ENGRAM_RACK_NODE=node)
    os.environ["ENGRAM_RACK_METRICS"] = "off"


def host_donor(socket: Path, tables, policy: str) -> str:
    """Donor `h` (TCP and a planar host socket) and nodes `hl` and `mixed`."""
    p1, p14 = tables["l1"][0], tables["l14"][0]

    def route(t, p, sources):
        return (f'[[node.route]]\ntable = {t}\nsources = [{sources}]\nssd_path = "{p}"\n'
                f'policy = "{policy}"\n')

    return (
        f'[[donor]]\nname = "h"\nlisten = ["127.0.0.1:{free_port()}", "unix://{socket}"]\n'
        'tables = [1, 14]\nram_gib = 1.0\nmax_rows = 500\nhost_layout = "planar"\n'
        '[[node]]\nname = "hl"\ntokens_per_second = 100\nprobe_interval_ms = 200\n'
        + route(1, p1, '"h", "ssd"') + route(14, p14, '"h", "ssd"')
        + '[[node]]\nname = "mixed"\ntokens_per_second = 100\nprobe_interval_ms = 200\n'
        + route(1, p1, '"h", "ssd"') + route(14, p14, '"d", "ssd"')
    )


class Engines:
    """`inference-node engines` for a node of a config: the host's one rack
    client, on `socket`; killed on stop()."""

    def __init__(self, config: Path, node: str, socket: Path, metrics: str = "off"):
        self.socket = socket
        env = dict(os.environ, RUST_LOG="info")
        self.proc = subprocess.Popen(
            [binary("inference-node"), "engines", "--config", str(config), "--name", node,
             "--socket", str(socket), "--metrics", metrics],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        )
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                if "ready engines=" in line:
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(60):
            self.stop()
            raise RuntimeError("inference-node engines never became ready:\n"
                               + "".join(self.lines[-20:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def host_rack(tmp_path, tables):
    """The rack with a host-local planar donor `h` (started) beside `d`
    (not started: `rack.start()`), and `engines(node)` to start the host's
    rack client for a node."""
    socket = tmp_path / "h.sock"
    config = write_config(tmp_path / "rack.toml", tables, free_port(), host_socket=socket)
    r = Rack(tmp_path, config, {1: tables["l1"][0], 14: tables["l14"][0]})
    r.start("h")
    clients: list[Engines] = []

    def engines(node: str) -> Engines:
        e = Engines(config, node, tmp_path / f"engines-{node}.sock")
        clients.append(e)
        return e

    r.engines = engines
    yield r
    for e in clients:
        e.stop()
    for d in r.donors:
        d.stop()


@pytest.fixture
def rack(tmp_path, tables):
    config = write_config(tmp_path / "rack.toml", tables, free_port(), metrics=free_port())
    r = Rack(tmp_path, config, {1: tables["l1"][0], 14: tables["l14"][0]})
    yield r
    for d in r.donors:
        d.stop()


@pytest.fixture(autouse=True, scope="session")
def _close_plugin_links():
    """The engine plugins' process-wide rack link, closed at the end (its
    ring thread and memory stopped before the interpreter goes)."""
    yield
    try:
        from engram_rack import plugin
    except ImportError:
        return
    plugin.reset()
    # A process group left to the interpreter's exit can abort it (its
    # threads outlive the objects that own them).
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def ple_rack(dir: Path, layer: int, rows: int, encoding: str, scale: float | None, eos: int,
             hash_base: int):
    """A Qwen4Exp rack of one PLE table (model layer `layer`, table id 1):
    donor `h` on TCP and a host socket and donor `d` on TCP, both started;
    nodes `hl` (h), `own` (a local copy) and `far` (d only). Returns
    (config, table path, donors)."""
    path, digest = gen_encoded(dir, "ple.etab", layer, 9, rows, encoding, scale)
    sock = dir / "h.sock"
    text = (
        'version = 1\n[rack]\nname = "q"\n'
        f'[[table]]\nid = 1\nlayer = {layer}\npath = "{path}"\nrows = {rows}\n'
        f'digest = "{digest}"\nencoding = "{encoding}"\n'
        + (f"tensor_scale = {scale}\n" if scale else "")
        + f'[[donor]]\nname = "h"\nlisten = ["127.0.0.1:{free_port()}", "unix://{sock}"]\n'
        'tables = [1]\nram_gib = 1.0\n'
        f'[[donor]]\nname = "d"\nlisten = ["127.0.0.1:{free_port()}"]\ntables = [1]\nram_gib = 1.0\n'
    )
    for node, src in (("hl", "h"), ("own", "local"), ("far", "d")):
        text += (f'[[node]]\nname = "{node}"\ntokens_per_second = 100\n'
                 f'[[node.route]]\ntable = 1\nsources = ["{src}"]\n')
    text += f'[model]\nfamily = "qwen4exp"\neos_token = {eos}\nhash_base = {hash_base}\n'
    config = dir / "rack.toml"
    config.write_text(text)
    return config, path, [Donor(config, "h"), Donor(config, "d")]


def plug(rack, node: str) -> None:
    """Point the engine plugins at `node` of `rack.config`; "socket": the
    host's engine socket for node `hl` (`inference-node engines`, kept in
    `rack.engines`), "NODE-socket" for node NODE."""
    from engram_rack import plugin as rack_plugin

    socket = None
    if node == "socket" or node.endswith("-socket"):
        node = "hl" if node == "socket" else node[:-len("-socket")]
        if getattr(rack, "engines", None) is not None:
            rack.engines.stop()
        rack.engines = Engines(rack.config, node, rack.config.parent / f"engines-{node}.sock")
        socket = rack.engines.socket
    point_plugins_at(rack, node, socket)
    rack_plugin.reset()


def mapping_of(address: int) -> str:
    """The file mapped at `address` in this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return rest[-1].strip() if len(rest) == 5 else ""
    return ""
