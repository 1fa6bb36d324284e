"""engram_rack.Tables on a Qwen4Exp rack (docs/models.md): one table of
each encoding (FP8 with its table scale, BF16, NVFP4), a donor over TCP and
a host-local donor; rows by id equal the table files' at their own row
size, a host-local donor's table maps here as its memory, values are the
engines', and bad calls are refused by name."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import engram_rack as er
from conftest import Donor, Engines, free_port, gen_encoded, read_rows

ROWS = 3000
#: table id = layer: (encoding, table scale, seed).
TABLES = {1: ("fp8_per_tensorx160", 0.5, 5), 2: ("bf16x160", None, 6),
          3: ("nvfp4_e4m3_16x160", 0.25, 7)}


@pytest.fixture
def qwen_rack(tmp_path):
    """Donor `d` (TCP) and `h` (TCP and a host socket) serving all three
    tables; node `via-d` routes them to d, `via-h` to h, `ref` to local RAM."""
    text = 'version = 1\n[rack]\nname = "q"\n'
    paths = {}
    for t, (enc, scale, seed) in TABLES.items():
        path, digest = gen_encoded(tmp_path, f"t{t}.etab", t, seed, ROWS, enc, scale)
        paths[t] = path
        text += (f'[[table]]\nid = {t}\nlayer = {t}\npath = "{path}"\nrows = {ROWS}\n'
                 f'digest = "{digest}"\nencoding = "{enc}"\n'
                 + (f"tensor_scale = {scale}\n" if scale is not None else ""))
    sock = tmp_path / "h.sock"
    text += (f'[[donor]]\nname = "d"\nlisten = ["127.0.0.1:{free_port()}"]\ntables = [1, 2, 3]\n'
             'ram_gib = 1.0\nmax_rows = 500\n'
             f'[[donor]]\nname = "h"\nlisten = ["127.0.0.1:{free_port()}", "unix://{sock}"]\n'
             'tables = [1, 2, 3]\nram_gib = 1.0\nmax_rows = 500\n')
    for node, src in (("via-d", "d"), ("via-h", "h"), ("ref", "local")):
        text += f'[[node]]\nname = "{node}"\ntokens_per_second = 100\nprobe_interval_ms = 200\n'
        for t in TABLES:
            text += f'[[node.route]]\ntable = {t}\nsources = ["{src}"]\nhedge = "off"\n'
    text += '[model]\nfamily = "qwen4exp"\neos_token = 7\nhash_base = 1000\n'
    config = tmp_path / "rack.toml"
    config.write_text(text)
    donors = [Donor(config, "d"), Donor(config, "h")]
    yield config, paths
    for d in donors:
        d.stop()


def test_rows_by_id_of_every_encoding_are_the_table_files(qwen_rack):
    config, paths = qwen_rack
    rng = np.random.default_rng(3)
    with er.Tables(config, "via-d", metrics="off") as t:
        info = {x["table"]: x for x in t.tables}
        assert {k: (v["encoding"], v["row_bytes"], v["rows"]) for k, v in info.items()} == {
            1: ("fp8_per_tensorx160", 160, ROWS), 2: ("bf16x160", 320, ROWS),
            3: ("nvfp4_e4m3_16x160", 90, ROWS)}
        assert info[1]["tensor_scale"] == 0.5 and info[2]["tensor_scale"] is None
        for table in TABLES:
            # A batch of 5 positions x 16 heads (Qwen4Exp's rows a token), repeats included.
            ids = rng.integers(0, ROWS, (5, 16))
            ids[0, 1] = ids[0, 0]
            rows = t.lookup(table, ids, timeout=5)
            assert rows.shape == (5, 16, info[table]["row_bytes"])
            want = read_rows(paths[table], ids.ravel()).reshape(rows.shape)
            np.testing.assert_array_equal(rows, want)


def test_a_prefetch_returns_at_once_and_its_ticket_gives_the_rows(qwen_rack):
    """`Tables.prefetch`: a ticket at the table's row size; `rows`, and
    `wait_async` under asyncio, give the table file's rows, zeros where -1
    asked for none."""
    import asyncio

    config, paths = qwen_rack
    rng = np.random.default_rng(4)
    with er.Tables(config, "via-d", metrics="off") as t:
        for table in TABLES:
            info = t.table(table)
            ids = rng.integers(0, ROWS, (6, 16))
            ids[2, 3] = -1
            ticket = t.prefetch(table, ids)
            assert (ticket.positions, ticket.columns, ticket.row_bytes) == (6, 16, info["row_bytes"])
            want = read_rows(paths[table], np.where(ids < 0, 0, ids).ravel()).reshape(
                6, 16, info["row_bytes"])
            want[ids < 0] = 0
            np.testing.assert_array_equal(ticket.rows(info["layer"], timeout=5), want)
            out = ticket.row_buffer()
            again = t.prefetch(table, ids)
            asyncio.run(again.wait_async(info["layer"], out, timeout=5))
            np.testing.assert_array_equal(out, want)
        with pytest.raises(er.BadInputError, match="past table 1"):
            t.prefetch(1, [[ROWS]])
        with pytest.raises(er.BadInputError, match="shape"):
            t.prefetch(1, [1, 2])


def test_a_host_local_donors_table_maps_here_as_its_rows(qwen_rack):
    config, paths = qwen_rack
    with er.Tables(config, "via-h", metrics="off") as t:
        for table, (enc, scale, _) in TABLES.items():
            v = t.table_view(table, wait=10)
            assert v.shared and v.packed and v.layout == "packed" and v.encoding == enc
            assert v.tensor_scale == scale
            size = v.row_bytes
            mem = np.frombuffer(v, dtype=np.uint8)[:ROWS * size].reshape(ROWS, size)
            np.testing.assert_array_equal(mem, read_rows(paths[table], np.arange(ROWS)))
            assert v.offset(17) == 17 * size
            with pytest.raises(ValueError):
                mem[0, 0] = 1  # the donor's memory is read-only here
    # The node's own local copy: this process's memory, rows back to back too.
    with er.Tables(config, "ref", metrics="off") as t:
        v = t.table_view(3, wait=0)
        assert not v.shared and v.packed and v.row_bytes == 90
        mem = np.frombuffer(v, dtype=np.uint8)[:ROWS * 90].reshape(ROWS, 90)
        np.testing.assert_array_equal(mem, read_rows(paths[3], np.arange(ROWS)))
    with er.Tables(config, "via-d", metrics="off") as t:
        with pytest.raises(er.NoSourceError, match="not in this process's memory"):
            t.table_view(1, wait=0)


def _e4m3(codes: np.ndarray) -> np.ndarray:
    """E4M3FN codes to float32 (no NaN code in a generated table)."""
    c = codes.astype(np.int32)
    e, m = (c >> 3) & 15, (c & 7).astype(np.float32)
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * 2.0 ** (e.astype(np.float32) - 10))
    return np.where(c >> 7, -mag, mag).astype(np.float32)


def test_values_are_the_engines(qwen_rack):
    """FP8: each code times the table scale (0.5: exact in bf16); BF16:
    the row's own bits."""
    config, paths = qwen_rack
    with er.Tables(config, "ref", metrics="off") as t:
        ids = np.arange(0, ROWS, 97)
        fp8 = t.lookup(1, ids)
        got = t.dequantize(1, fp8)
        want = (_e4m3(fp8) * np.float32(0.5)).view(np.uint32) >> 16
        np.testing.assert_array_equal(got, want.astype(np.uint16))
        bf = t.lookup(2, ids)
        np.testing.assert_array_equal(t.dequantize(2, bf), bf.view(np.uint16))
        assert t.dequantize(3, t.lookup(3, ids)).shape == (len(ids), 160)


def test_bad_calls_are_refused_by_name(qwen_rack):
    config, _ = qwen_rack
    with er.Tables(config, "via-d", metrics="off") as t:
        with pytest.raises(er.BadInputError, match="not routed"):
            t.lookup(9, [1])
        with pytest.raises(er.BadInputError, match="negative"):
            t.lookup(1, [-1])
        with pytest.raises(er.BadInputError, match="past table 1"):
            t.lookup(1, [ROWS])
        with pytest.raises(er.BadInputError, match="bytes"):
            t.lookup(1, [1, 2], out=np.zeros((2, 150), np.uint8))
        with pytest.raises(er.BadInputError, match="integers"):
            t.lookup(1, [1.5])
        with pytest.raises(er.BadInputError, match="last axis of 90"):
            t.dequantize(3, np.zeros((1, 160), np.uint8))
    with pytest.raises(er.ConfigError, match="node \"nope\""):
        er.Tables(config, "nope")
    # V4.1's memory names what opens this rack.
    with pytest.raises(er.ConfigError, match="engram_rack.Tables"):
        er.Memory(config, "via-d", metrics="off")
    t.close()
    with pytest.raises(er.ClosedError):
        t.lookup(1, [1])


def test_the_engine_socket_hands_over_a_qwen4exp_racks_host_local_tables(qwen_rack, tmp_path):
    """`inference-node engines` on a Qwen4Exp rack: the family named, each
    host-local table's memory handed over (mapped here: the table file's
    rows back to back, with its encoding and scale), a remote table named
    as such with its encoding; a ring of V4.1's row size is refused by
    name, one of the table's served (`test_rings_of_a_tables_row_size...`)."""
    from engram_rack import _native
    from engram_rack.engine_socket import EngineTables

    config, paths = qwen_rack
    here = Engines(config, "via-h", tmp_path / "e-h.sock")
    far = Engines(config, "via-d", tmp_path / "e-d.sock")
    try:
        t = EngineTables(here.socket)
        assert t.hello["family"] == "qwen4exp" and t.node == "via-h"
        info = {x["table"]: x for x in t.tables}
        for table, (enc, scale, _) in TABLES.items():
            assert (info[table]["encoding"], info[table]["tensor_scale"]) == (enc, scale)
            v = t.table_view(table)
            assert v.shared and v.packed and v.encoding == enc and v.row_bytes == info[table]["row_bytes"]
            mem = np.frombuffer(v, dtype=np.uint8)[:ROWS * v.row_bytes].reshape(ROWS, v.row_bytes)
            np.testing.assert_array_equal(mem, read_rows(paths[table], np.arange(ROWS)))
        link = _native.EngineLink(str(here.socket))
        reply = json.loads(link.attach(_native.Ring(4, 1, 3, 8, 0, (1, 0), 2_000_000_000)))
        assert reply["ring"] == "refused" and "fp8_per_tensorx160" in reply["why"], reply
        remote = EngineTables(far.socket)
        assert {x["table"]: x["encoding"] for x in remote.tables} == {
            k: v[0] for k, v in TABLES.items()}
        with pytest.raises(er.NoSourceError, match="not in this process's memory"):
            remote.table_view(1)
        with pytest.raises(er.SetupError, match="engine ring"):
            remote.lookup(1, [0])
        # Rings of the table's row size: served by the host's client.
        _ring_rows(remote.serve, paths, via="the engine socket")
    finally:
        here.stop()
        far.stop()


def _ring_rows(serve, paths, via: str) -> None:
    """Through `serve` (a Tables' or an engine socket's), a ring per table
    at its row size (version 2, PROTOCOL.md 6.1) published from the CPU as
    a GPU's kernel does: 16 ids a position, one DEAD position, a -1 beside
    live ids (an ETP rank's shard): rows equal the table file's, zeros
    where none was asked."""
    from engram_rack import _native

    rng = np.random.default_rng(9)
    for table in TABLES:
        size = {1: 160, 2: 320, 3: 90}[table]
        ring = _native.Ring(4, 1, 16, 8, 0, (table, 0), 5_000_000_000, size)
        assert ring.row_bytes == size
        serve(ring)
        mem = np.frombuffer(memoryview(ring), dtype=np.uint8)
        for seq in range(1, 7):
            n = 1 + seq % 8
            ids = rng.integers(0, ROWS, (n, 16))
            ids[0, 2] = -1
            if n > 2:
                ids[1] = -1
            ring.publish(seq, 1, n, np.ascontiguousarray(ids.ravel(), dtype=np.int64))
            slot = seq % 4
            deadline = time.monotonic() + 10
            while ring.done(slot, 0) != seq:
                assert time.monotonic() < deadline, f"{via}: table {table}, request {seq}"
                time.sleep(1e-4)
            assert ring.status(slot, 0) == 0, via
            at = ring.slot_at(slot) + ring.rows_at
            got = mem[at:at + n * 16 * size].reshape(n, 16, size)
            want = read_rows(paths[table], np.where(ids < 0, 0, ids).ravel()).reshape(n, 16, size)
            want[ids < 0] = 0
            np.testing.assert_array_equal(got, want, err_msg=f"{via}: table {table}")


def test_rings_of_a_tables_row_size_carry_its_rows(qwen_rack):
    """`Tables.serve`: this process's own client serves rings of every
    encoding's row size, from a donor over TCP; a ring of another size,
    or of a layer not routed, is refused by name."""
    from engram_rack import _native

    config, paths = qwen_rack
    with er.Tables(config, "via-d", metrics="off") as t:
        _ring_rows(t.serve, paths, via="Tables")
        with pytest.raises(er.BadInputError, match="264 bytes"):
            t.serve(_native.Ring(2, 1, 16, 8, 0, (1, 0), 1_000_000_000))
        with pytest.raises(er.BadInputError, match="layer 7"):
            t.serve(_native.Ring(2, 1, 16, 8, 0, (7, 0), 1_000_000_000, 160))
