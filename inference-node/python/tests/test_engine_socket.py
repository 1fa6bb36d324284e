"""One rack client per host: eight engine processes (the ranks of an 8-GPU
host) on `inference-node engines`' socket, against the same eight each
opening their own memory. Through the socket each rank is handed layer 1's
host-local table (planar, read-only, the donor's own memory: its rows where
an engine's kernel reads them) and reads its head slice of layer 14, which
is remote, through a ring it attaches (published and waited for on the CPU
here, as the GPU's kernels do). The client's death closes every engine's
socket and leaves rings unanswered, never a wait without end. Startup and
memory of both ways are printed (`pytest -s`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import engram_rack as er
from conftest import read_rows

RANKS = 8

RANK = textwrap.dedent(
    """
    import json, mmap, os, sys, time
    import numpy as np
    from engram_rack import _native
    from conftest import read_rows

    mode, where, rank, l1, l14 = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    rows14 = int(sys.argv[6])
    t0 = time.monotonic()
    if mode == "socket":
        link = _native.EngineLink(where)
        tables = {layer: (json.loads(msg), here) for layer, _, msg, here in link.tables}
        m, here = tables[1]
        assert here and m["layout"] == "planar", m
        assert not tables[14][1], "layer 14 is remote"
        fd = link.table_fd(1)
        table = mmap.mmap(fd, m["bytes"], flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        os.close(fd)
        rows, scales_at = m["rows"], m["scales_at"]
        ring = _native.Ring(4, 1, 3, 8, 3 * rank, (14, 0), 2_000_000_000)
        reply = json.loads(link.attach(ring))
        assert reply["ring"] == "serving", reply
    else:
        import engram_rack as er
        mem = er.Memory(*where.split(","), metrics="off")
        view = mem.table_view(1)
        assert view.layout == "planar", view.layout
        table, rows, scales_at = view, view.rows, view.scales_at
        ring = _native.Ring(4, 1, 3, 8, 3 * rank, (14, 0), 2_000_000_000)
        handle = mem.serve_ring(ring)
    ready = time.monotonic() - t0
    data = np.frombuffer(table, np.uint8)
    ids = np.random.default_rng(rank).integers(0, rows, 300)
    want = read_rows(l1, ids)
    assert (data[ids[:, None] * 256 + np.arange(256)] == want[:, :256]).all()
    assert (data[scales_at + ids[:, None] * 8 + np.arange(8)] == want[:, 256:]).all()
    total = int(data[::4096].sum(dtype=np.uint64))  # every page mapped here
    # Layer 14 through the ring: its heads 3r..3r+3 of 8 positions, 20 times.
    got = 0
    for seq in range(1, 21):
        ids14 = np.random.default_rng(100 * rank + seq).integers(0, rows14, (8, 3)).astype(np.int64)
        ring.publish(seq, 1, 8, ids14)
        s = seq % 4
        t = time.monotonic()
        while ring.done(s, 0) != seq:
            assert time.monotonic() - t < 10, "no answer"
            time.sleep(0.0001)
        assert ring.status(s, 0) == 0
        buf = np.frombuffer(ring, np.uint8)
        at = ring.slot_at(s) + ring.rows_at
        out = buf[at:at + 8 * 3 * 264].reshape(24, 264)
        assert (out == read_rows(l14, ids14.ravel())).all()
        got += 1
    print(json.dumps({"ready_s": ready, "steps": got, "pid": os.getpid(), "touched": total}),
          flush=True)
    sys.stdin.readline()
    """
)


def memory_of(pid: int) -> dict:
    """A process's Rss, Pss and anonymous (private) memory, in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss", "Anonymous", "Pss_Shmem"):
            out[key] = int(rest.split()[0])
    return out


def rows14(rack) -> int:
    text = rack.config.read_text()
    return int(text.split("layer = 14\n", 1)[1].split("rows = ", 1)[1].split("\n", 1)[0])


def run_ranks(mode: str, where: str, rack) -> tuple[list[dict], list[dict]]:
    """Start RANKS engine processes, wait for all, measure, release them."""
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=str(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, mode, where, str(r),
                               str(rack.tables[1]), str(rack.tables[14]), str(rows14(rack))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for r in range(RANKS)]
    reports = []
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line, f"a rank failed (exit {p.poll()})"
            reports.append(json.loads(line))
        wall = time.monotonic() - t0
        mems = [memory_of(p.pid) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
        for p in procs:
            p.wait(30)
    assert all(r["steps"] == 20 for r in reports)
    for r in reports:
        r["wall_s"] = wall
    return reports, mems


def test_eight_ranks_share_one_host_client(host_rack):
    host_rack.start("d")
    engines = host_rack.engines("mixed")
    t0 = time.monotonic()
    shared, shared_mem = run_ranks("socket", str(engines.socket), host_rack)
    t1 = time.monotonic()
    own, own_mem = run_ranks("process", f"{host_rack.config},mixed", host_rack)
    t2 = time.monotonic()
    client = memory_of(engines.proc.pid)
    anon = lambda ms: sum(m["Anonymous"] for m in ms)  # noqa: E731
    print(f"\n{RANKS} ranks through the engine socket: {t1 - t0:.2f} s to all ready, "
          f"per-rank ready median {np.median([r['ready_s'] for r in shared]) * 1e3:.1f} ms, "
          f"ranks' anonymous memory {anon(shared_mem) / 1024:.1f} MiB + the client's "
          f"{client['Anonymous'] / 1024:.1f} MiB")
    print(f"{RANKS} ranks each with its own memory: {t2 - t1:.2f} s to all ready, "
          f"per-rank ready median {np.median([r['ready_s'] for r in own]) * 1e3:.1f} ms, "
          f"ranks' anonymous memory {anon(own_mem) / 1024:.1f} MiB")
    # One client: the ranks hold no memory of the rack's beyond their rings.
    assert anon(shared_mem) < anon(own_mem)


def test_the_clients_death_closes_every_socket_and_no_wait_is_endless(host_rack):
    from engram_rack import _native

    host_rack.start("d")
    engines = host_rack.engines("mixed")
    links = [_native.EngineLink(str(engines.socket)) for _ in range(RANKS)]
    rings = [_native.Ring(4, 1, 3, 8, 0, (14, 0), 300_000_000) for _ in range(RANKS)]
    for link, ring in zip(links, rings):
        assert json.loads(link.attach(ring))["ring"] == "serving"
    engines.proc.kill()
    engines.proc.wait(10)
    import select

    for link, ring in zip(links, rings):
        r, _, _ = select.select([link.fileno], [], [], 10)
        assert r, "the socket says the client went"
        assert os.read(link.fileno, 16) == b""
        ring.publish(1, 1, 1, np.zeros(3, np.int64))
        t0 = time.monotonic()
        while ring.done(1, 0) != 1 and time.monotonic() - t0 < 0.3:
            time.sleep(0.001)
        assert ring.done(1, 0) != 1, "no client answered"
        # Killed, the client could not say so: its heartbeat stopped.
        beat = ring.heartbeat
        time.sleep(0.05)
        assert ring.heartbeat == beat


def test_a_bad_ring_or_a_user_not_allowed_is_refused(host_rack, tmp_path):
    from engram_rack import _native

    engines = host_rack.engines("hl")
    link = _native.EngineLink(str(engines.socket))
    odd = _native.Ring(2, 1, 1, 1, 0, (7, 0), 1_000_000)
    reply = json.loads(link.attach(odd))
    assert reply["ring"] == "refused" and "layer 7" in reply["why"], reply
    with pytest.raises(er.BadInputError):
        _native.Ring(65, 1, 1, 1, 0, (1, 0), 1)
    with pytest.raises(er.SetupError, match="engine socket"):
        _native.EngineLink(str(tmp_path / "nothing.sock"), 1.0)
