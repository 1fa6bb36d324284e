"""One copy per host: engine processes that open the memory of a node whose
donor is on their own host map the donor's tables (its host socket) instead
of copying them, and `Memory.table_view` hands an engine that memory."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

import engram_rack as er
from conftest import Donor, free_port, gen, read_rows

# Rows are about 24 x hash_base: 240,000 rows, 63 MB a table, so that a
# copy per process would show plainly in the kernel's accounting.
BIG_BASE = 10_000
ENGINES = 4

ENGINE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import engram_rack as er

    config, node, l1, l14 = sys.argv[1:5]
    from conftest import read_rows

    with er.Memory(config, node, metrics="off") as mem:
        views = [mem.table_view(layer) for layer in er.LAYERS]
        for view, path in zip(views, (l1, l14)):
            assert view.shared and view.packed, view
            rows = np.frombuffer(view, np.uint8).reshape(view.rows, er.ROW_BYTES)
            # Every page touched (so each process maps all of it).
            total = int(rows[:, 0].sum(dtype=np.uint64))
            ids = np.random.default_rng(view.table).integers(0, view.rows, 500)
            assert (rows[ids] == read_rows(path, ids)).all(), "rows differ from the file"
            assert view.offset(7) == 7 * er.ROW_BYTES
        # Lookups are served from the same mapping.
        t = mem.prefetch([5, 6, 7])
        for layer in er.LAYERS:
            assert t.wait(layer, mem.row_buffer(3), timeout=5).sources == ["d"]
        print("ready", total, flush=True)
        sys.stdin.readline()
    """
)


@pytest.fixture(scope="module")
def big_tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    return {layer: gen(d, f"l{layer}.etab", layer, 5, BIG_BASE) for layer in (1, 14)}


def host_config(dir: Path, tables, sock: Path) -> Path:
    (p1, d1, r1), (p14, d14, r14) = tables[1], tables[14]
    route = lambda t, p: (  # noqa: E731
        f'[[node.route]]\ntable = {t}\nsources = ["d"]\nssd_path = "{p}"\npolicy = "fail"\n'
    )
    text = (
        'version = 1\n[rack]\nname = "t"\n'
        f'[[table]]\nid = 1\nlayer = 1\npath = "{p1}"\nrows = {r1}\ndigest = "{d1}"\n'
        f'[[table]]\nid = 14\nlayer = 14\npath = "{p14}"\nrows = {r14}\ndigest = "{d14}"\n'
        f'[[donor]]\nname = "d"\nlisten = ["127.0.0.1:{free_port()}", "unix://{sock}"]\n'
        "tables = [1, 14]\nram_gib = 1.0\n"
        '[[node]]\nname = "n"\ntokens_per_second = 100\n' + route(1, p1) + route(14, p14)
        + f"[model]\nhash_base = {BIG_BASE}\n"
    )
    path = dir / "rack.toml"
    path.write_text(text)
    return path


def memfd_pss(pid: int) -> int:
    """Bytes of a process's Pss in mappings of the donor's table memfds."""
    pss, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            inside = "/memfd:engram-table" in line
        elif inside and first == "Pss:":
            pss += int(line.split()[1]) * 1024
    return pss


@pytest.fixture
def short_dir():
    # A Unix socket's path must fit in 107 bytes: not under pytest's tmp_path.
    d = Path(tempfile.mkdtemp(prefix="engram-host-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_four_engine_processes_map_one_copy(big_tables, short_dir):
    config = host_config(short_dir, big_tables, short_dir / "d.sock")
    donor = Donor(config, "d")
    engines = []
    try:
        for _ in range(ENGINES):
            engines.append(subprocess.Popen(
                [sys.executable, "-c", ENGINE, str(config), "n",
                 str(big_tables[1][0]), str(big_tables[14][0])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                cwd=Path(__file__).parent,
            ))
        for e in engines:
            line = e.stdout.readline()
            assert line.startswith("ready"), f"engine ended: {line!r}, exit {e.wait(30)}"
        table_bytes = sum(r * er.ROW_BYTES for _, _, r in big_tables.values())
        per_engine = [memfd_pss(e.pid) for e in engines]
        held = memfd_pss(donor.pid) + sum(per_engine)
        print(f"tables {table_bytes} B; Pss per engine {per_engine}; donor and engines {held}")
        # Each engine maps both tables whole, and is charged its share of
        # the one copy (five processes map it): the sum over every process
        # is the tables once, not five times.
        for pss in per_engine:
            assert pss < table_bytes / 3, (pss, table_bytes)
        assert 0.9 * table_bytes <= held <= 1.1 * table_bytes, (held, table_bytes)
    finally:
        for e in engines:
            if e.poll() is None:
                e.stdin.write("\n")
                e.stdin.flush()
        for e in engines:
            assert e.wait(30) == 0
        donor.stop()


def test_a_table_view_is_read_only_and_holds_its_memory(big_tables, short_dir):
    config = host_config(short_dir, big_tables, short_dir / "d.sock")
    donor = Donor(config, "d")
    try:
        with er.Memory(config, "n", metrics="off") as mem:
            view = mem.table_view(14)
            assert (view.table, view.layer, view.rows) == (14, 14, big_tables[14][2])
            assert view.digest == big_tables[14][1] and view.generation is not None
            assert len(view) == view.nbytes == view.rows * er.ROW_BYTES
            buf = memoryview(view)
            assert buf.readonly and buf.nbytes == view.nbytes
            arr = np.frombuffer(view, np.uint8)
            with pytest.raises(ValueError):
                arr[0] = 1
            with pytest.raises(er.BadInputError, match="out of range"):
                view.offset(view.rows)
            with pytest.raises(er.BadInputError, match="layer 2 has no Engram table"):
                mem.table_view(2)
        # The memory outlives the Memory that gave it, and the donor.
        donor.stop()
        ids = np.arange(0, view.rows, 997)
        rows = arr.reshape(view.rows, er.ROW_BYTES)[ids]
        assert (rows == read_rows(big_tables[14][0], ids)).all()
    finally:
        donor.stop()


def test_without_a_host_donor_a_view_is_refused_clearly(rack):
    # Node "n" reads donor d over TCP (its socket is not on this host) and
    # has no local copy: no memory in this process holds the table.
    rack.start()
    with er.Memory(rack.config, "n", metrics="off") as mem:
        with pytest.raises(er.NoSourceError, match="not in this process's memory"):
            mem.table_view(1, wait=0.05)
        view = er.Memory(rack.config, "ref", metrics="off").table_view(1, wait=0)
        assert not view.shared and view.generation is None
        ids = np.arange(0, view.rows, 13)
        got = np.stack([np.frombuffer(view, np.uint8)[view.offset(int(i)):][:264] for i in ids])
        assert (got == rack.rows(1, ids)).all()
