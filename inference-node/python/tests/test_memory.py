"""engram_rack against real donor processes: rows, dequantization, failover,
version pins, deadlines, the GIL, bad input, asyncio, metrics, leaks."""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest

import engram_rack as er
from conftest import Donor, binary, free_port, write_config

VOCAB = 99_092


def random_sequence(rng, n):
    ids = rng.integers(0, VOCAB, size=n, dtype=np.int64)
    ids[rng.random(n) < 0.05] = -1  # some DEAD positions
    return ids


def expected(rack, mem, ids, context):
    """Every position's rows of both layers, from the table files."""
    addr = mem.addresses(ids, context)
    out = []
    for slot, layer in enumerate(er.LAYERS):
        a = addr[:, slot, :]
        live = a[:, 0] != er.NO_ROW
        want = np.zeros((len(ids), er.COLUMNS, er.ROW_BYTES), dtype=np.uint8)
        if live.any():
            want[live] = rack.rows(layer, a[live]).reshape(-1, er.COLUMNS, er.ROW_BYTES)
        out.append(want)
    return out


def test_rows_equal_the_table_files_for_thousands_of_random_positions(rack):
    rack.start()
    rng = np.random.default_rng(7)
    with er.Memory(rack.config, "n") as mem:
        assert mem.tables == (1, 14)
        checked = 0
        while checked < 4000:
            n = int(rng.integers(1, 64))
            ids = random_sequence(rng, n)
            context = list(rng.integers(0, VOCAB, size=int(rng.integers(0, 4))))
            t = mem.prefetch(ids, context)
            want = expected(rack, mem, ids, context)
            for slot, layer in enumerate(er.LAYERS):
                out = mem.row_buffer(n)
                served = t.wait(layer, out, timeout=5)
                # The donor, or the SSD copy as a hedge on a loaded machine.
                assert set(served.sources) <= {"d", "ssd"}, served
                assert not served.zeros
                np.testing.assert_array_equal(out, want[slot])
            checked += n
        assert mem.stats()[0]["failed"] == 0


def same_addresses(got, positions):
    """`Memory.addresses` output against `inference-node addresses --json` positions."""
    assert len(got) == len(positions)
    for p, pos in enumerate(positions):
        if pos["rows"] is None:
            assert (got[p] == er.NO_ROW).all()
        else:
            assert got[p, 0].tolist() == pos["rows"]["1"]
            assert got[p, 1].tolist() == pos["rows"]["14"]


def test_addresses_are_the_node_cli_addresses(rack):
    # The config has no token map: raw ids are compressed ids, as for the CLI's --compressed-ids.
    ids = [5, 17, -1, 99_000, 3, 3, 3]
    with er.Memory(rack.config, "ref") as mem:
        got = mem.addresses(ids)
    out = subprocess.run(
        [binary("inference-node"), "addresses", "--config", str(rack.config),
         "--compressed-ids", ",".join(map(str, ids)), "--json"],
        check=True, capture_output=True, text=True,
    )
    same_addresses(got, json.loads(out.stdout)["positions"])


def test_raw_ids_go_through_the_token_map_as_the_node_cli_takes_them(rack, tables):
    # A map of 2000 raw ids onto 1000 compressed ids (raw i -> i // 2).
    (rack.dir / "map.txt").write_text("".join(f"{i // 2}\n" for i in range(2000)))
    config = write_config(rack.dir / "mapped.toml", tables, free_port(), model='token_map = "map.txt"\n')
    ids = [5, 1999, -1, 0, 2, 3, 700, 701]
    with er.Memory(config, "ref", metrics="off") as mem:
        got = mem.addresses(ids, context=[11, 12])
        with pytest.raises(er.BadInputError, match="raw token id 2000 is not in the token map"):
            mem.prefetch([1, 2000])
    out = subprocess.run(
        [binary("inference-node"), "addresses", "--config", str(config),
         "--token-ids", ",".join(map(str, [11, 12] + ids)), "--json"],
        check=True, capture_output=True, text=True,
    )
    same_addresses(got, json.loads(out.stdout)["positions"][2:])


def reference_dequantize(rows: np.ndarray) -> np.ndarray:
    """docs/ENGRAM.md: 256 e4m3 codes, then 8 ue8m0 scales (one per 32 values)."""
    codes = rows[..., :256].astype(np.int32)
    scales = rows[..., 256:].astype(np.int32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    normal = (1 + man / 8.0) * np.exp2(exp - 7.0)
    sub = (man / 8.0) * np.exp2(-6.0)
    v = sign * np.where(exp == 0, sub, normal)
    v = np.where((codes & 0x7F) == 0x7F, np.nan, v)
    s = np.exp2(np.repeat(scales, 32, axis=-1) - 127.0)
    return (v * s).astype(np.float32)


def test_dequantized_values_equal_the_reference_and_bf16_is_their_bits(rack):
    rack.start()
    rng = np.random.default_rng(3)
    with er.Memory(rack.config, "n") as mem:
        ids = random_sequence(rng, 200)
        t = mem.prefetch(ids)
        rows = t.rows(14, timeout=5)
    f32 = er.dequantize(rows)
    assert f32.shape == (200, 24, 256) and f32.dtype == np.float32
    want = reference_dequantize(rows)
    np.testing.assert_array_equal(f32, want)
    bf = er.dequantize(rows, dtype="bfloat16")
    assert bf.dtype == np.uint16
    np.testing.assert_array_equal(bf, (f32.view(np.uint32) >> 16).astype(np.uint16))
    # Into a caller's buffer, int16 as a torch bfloat16 tensor viewed as int16 gives.
    out = np.empty((200, 24, 256), dtype=np.int16)
    er.dequantize(rows, out=out, dtype="bfloat16")
    np.testing.assert_array_equal(out.view(np.uint16), bf)


def test_kill_9_of_the_donor_mid_run_fails_over_to_the_ssd_copy_with_no_failed_lookup(rack):
    donor = rack.start()
    rng = np.random.default_rng(11)
    with er.Memory(rack.config, "n", metrics="off") as mem:
        sources = set()
        killed_at = None
        start = time.monotonic()
        lookups = 0
        while time.monotonic() - start < 3.0:
            if killed_at is None and time.monotonic() - start > 1.0:
                donor.signal(signal.SIGKILL)
                killed_at = lookups
            ids = random_sequence(rng, 1)
            context = list(rng.integers(0, VOCAB, size=3))
            t = mem.prefetch(ids, context)
            want = expected(rack, mem, ids, context)
            for slot, layer in enumerate(er.LAYERS):
                out = mem.row_buffer(1)
                served = t.wait(layer, out, timeout=5)
                np.testing.assert_array_equal(out, want[slot])
                sources.update(served.sources)
                lookups += 1
            time.sleep(0.002)
        stats = mem.stats()
    assert killed_at and lookups > killed_at + 20
    assert {"d", "ssd"} <= sources, sources
    assert all(s["failed"] == 0 for s in stats), stats


def test_a_donor_serving_another_version_is_never_used(rack, tables):
    other = write_config(rack.dir / "other.toml", tables, _port(rack), l1="l1-other")
    rack.start(config=other)
    rng = np.random.default_rng(5)
    with er.Memory(rack.config, "n", metrics="off") as mem:
        for _ in range(50):
            ids = random_sequence(rng, 8)
            t = mem.prefetch(ids)
            want = expected(rack, mem, ids, None)
            out = mem.row_buffer(8)
            served = t.wait(1, out, timeout=5)
            assert "d" not in served.sources, served
            np.testing.assert_array_equal(out, want[0])
            t.wait(14, out, timeout=5)
            np.testing.assert_array_equal(out, want[1])


def _port(rack) -> int:
    text = rack.config.read_text()
    return int(text.split('listen = ["127.0.0.1:')[1].split('"')[0])


def test_a_deadline_is_honoured_when_every_donor_is_hung_and_the_gil_is_free(rack):
    donor = rack.start()
    with er.Memory(rack.config, "only-donor", metrics="off") as mem:
        donor.hang()
        try:
            t = mem.prefetch([42])
            out = mem.row_buffer(1)
            ticks = 0
            stop = threading.Event()

            def spin():
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1

            th = threading.Thread(target=spin, daemon=True)
            th.start()
            began = time.monotonic()
            try:
                with pytest.raises(er.DeadlineExceeded, match="still valid"):
                    print(t.wait(1, out, timeout=0.2))
                took = time.monotonic() - began
            finally:
                stop.set()
                th.join()
            assert 0.2 <= took < 0.4, took
            # The other thread ran meanwhile: the GIL was released.
            assert ticks > 10_000, ticks
            # The table's own hard timeout ends the fetch: policy `fail`.
            with pytest.raises(er.NoSourceError, match="table 1"):
                t.wait(1, out, timeout=5)
        finally:
            donor.signal(signal.SIGCONT)


def test_close_answers_the_waits_of_fetches_still_in_flight(rack):
    donor = rack.start()
    mem = er.Memory(rack.config, "only-donor", metrics="off")
    donor.hang()
    try:
        t = mem.prefetch([42])
        began = time.monotonic()
        mem.close(drain=0.1)
        with pytest.raises(er.NoSourceError, match="closed before the rows arrived"):
            t.wait(1, mem.row_buffer(1))
        assert time.monotonic() - began < 2.0
    finally:
        donor.signal(signal.SIGCONT)


def test_asyncio_waits_suspend_the_coroutine_not_the_loop(rack):
    donor = rack.start()

    async def main(mem):
        t = mem.prefetch([1, 2, 3])
        a, b = mem.row_buffer(3), mem.row_buffer(3)
        s1, s14 = await asyncio.gather(t.wait_async(1, a, 5), t.wait_async(14, b, 5))
        assert s1.sources == ["d"] and s14.sources == ["d"]
        donor.hang()
        try:
            t = mem.prefetch([4])
            ticks = 0

            async def count():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.001)

            c = asyncio.ensure_future(count())
            with pytest.raises(er.DeadlineExceeded):
                await t.wait_async(1, mem.row_buffer(1), 0.15)
            c.cancel()
            assert ticks > 20, ticks
        finally:
            donor.signal(signal.SIGCONT)
        return a, b

    with er.Memory(rack.config, "only-donor", metrics="off") as mem:
        a, b = asyncio.run(main(mem))
        t = mem.prefetch([1, 2, 3])
        np.testing.assert_array_equal(a, t.rows(1, 5))
        np.testing.assert_array_equal(b, t.rows(14, 5))


def test_a_batch_of_sequences_is_one_prefetch_with_each_sequence_hashed_alone(rack):
    rack.start()
    with er.Memory(rack.config, "n", metrics="off") as mem:
        seqs = [([5, 6, 7], [1, 2]), ([9], None), ([11, 12], [3, 4, 5, 6])]
        t = mem.prefetch_batch(seqs)
        assert t.positions == 6
        rows1 = t.rows(1, 5)
        at = 0
        for ids, ctx in seqs:
            alone = mem.prefetch(ids, ctx).rows(1, 5)
            np.testing.assert_array_equal(rows1[at:at + len(ids)], alone)
            at += len(ids)
        assert mem.stats()[0]["messages"] == 4  # one per prefetch, not per sequence


@pytest.mark.parametrize("transport", ["tls", "quic"])
def test_over_tls_and_quic_the_donor_serves_every_prefetch_and_batch(tmp_path, tables, transport):
    # Answers larger than one TLS buffer (64 KiB: 249 rows and more) and
    # many pipelined answers: the donor alone serves them all, with nothing
    # to fall back to.
    config = write_config(tmp_path / "rack.toml", tables, free_port(), transport=transport)
    donor = Donor(config, "d")
    try:
        rng = np.random.default_rng(11)
        with er.Memory(config, "only-donor", metrics="off") as mem:
            for i in range(1000):
                n = 1 + i % 17
                ids = rng.integers(0, VOCAB, size=n, dtype=np.int64)
                t = mem.prefetch(ids, list(rng.integers(0, VOCAB, size=3)))
                for layer in er.LAYERS:
                    served = t.wait(layer, mem.row_buffer(n), timeout=10)
                    assert served.sources == ["d"], served
            seqs = [(rng.integers(0, VOCAB, size=1 + s % 17, dtype=np.int64), [s, s + 1, s + 2])
                    for s in range(64)]
            t = mem.prefetch_batch(seqs)
            for layer in er.LAYERS:
                served = t.wait(layer, mem.row_buffer(t.positions), timeout=10)
                assert served.sources == ["d"], served
                assert served.rows > 248, served
            assert all(s["failed"] == 0 and s["failovers"] == 0 for s in mem.stats())
    finally:
        donor.stop()
    assert "connection closed on an error" not in "".join(donor.lines)


def test_bad_input_gets_a_clear_error_and_no_crash(rack, tmp_path):
    rack.start()
    mem = er.Memory(rack.config, "n", metrics="off")
    t = mem.prefetch([1, 2])
    cases = [
        (lambda: t.wait(1, np.zeros(10, np.uint8)), "has 10 bytes"),
        (lambda: t.wait(1, np.zeros((2, 24, 264), np.float32)), "dtype float32"),
        (lambda: t.wait(1, bytearray(2 * 24 * 264 - 1)), "has 12671 bytes"),
        (lambda: t.wait(1, bytes(2 * 24 * 264)), "read-only"),
        (lambda: t.wait(1, np.zeros((2, 24, 528), np.uint8)[:, :, ::2]), "C-contiguous"),
        (lambda: t.wait(2, mem.row_buffer(2)), "layer 2 has no Engram table"),
        (lambda: t.wait(1, mem.row_buffer(2), timeout=-1), "timeout -1"),
        (lambda: mem.prefetch([1, -5]), "position 1: token id -5 is negative"),
        (lambda: mem.prefetch([1, VOCAB]), "position 1: compressed id 99092 is out of range"),
        (lambda: mem.prefetch([]), "empty"),
        (lambda: mem.prefetch([1.5]), "must be integers"),
        (lambda: mem.prefetch([[1, 2]]), "one-dimensional"),
        (lambda: mem.prefetch([1], context=[7, "x"]), "context"),
        (lambda: mem.prefetch_batch([([1], None), 5]), "sequence 1"),
        (lambda: er.dequantize(np.zeros((2, 263), np.uint8)), "last axis of 264"),
        (lambda: er.dequantize(np.zeros((2, 264), np.uint8), dtype="int8"), "dtype 'int8'"),
        (lambda: er.dequantize(np.zeros((2, 264), np.uint8), out=np.zeros(3, np.float32)), "512"),
    ]
    for call, message in cases:
        with pytest.raises(er.BadInputError, match=message.replace("(", r"\(")):
            call()
    # Still usable after all that.
    assert t.rows(1, 5).shape == (2, 24, 264)
    mem.close()
    mem.close()
    with pytest.raises(er.ClosedError):
        mem.prefetch([1])
    with pytest.raises(er.ClosedError):
        mem.stats()
    with pytest.raises(er.ConfigError, match="nope.toml"):
        er.Memory(tmp_path / "nope.toml", "n")
    bad = tmp_path / "bad.toml"
    bad.write_text(rack.config.read_text().replace("ram_gib = 1.0", 'ram_gib = "lots"'))
    with pytest.raises(er.ConfigError, match=r"bad\.toml:\d+"):
        er.Memory(bad, "n")
    with pytest.raises(er.ConfigError, match='node "ghost" is not in'):
        er.Memory(rack.config, "ghost")
    with pytest.raises(er.BadInputError, match="metrics"):
        er.Memory(rack.config, "n", metrics="nowhere")


def test_metrics_are_the_nodes_and_served_at_its_address(rack):
    rack.start()
    with er.Memory(rack.config, "n") as mem:
        mem.prefetch([1]).rows(1, 5)
        text = mem.metrics()
        assert 'engram_node_lookups_total{table="1"} 1' in text
        body = urllib.request.urlopen(f"http://{mem.metrics_address}/metrics", timeout=5).read()
        assert b"engram_node_rows_served_total" in body


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_a_million_lookups_leave_rss_flat(rack):
    rack.start()
    lookups = int(__import__("os").environ.get("ENGRAM_LEAK_LOOKUPS", "1000000"))
    with er.Memory(rack.config, "n", metrics="off") as mem:
        out = mem.row_buffer(1)
        ids = np.array([7], dtype=np.int64)
        warm = min(20_000, lookups // 5)
        before = None
        done = 0
        while done < lookups:
            if before is None and done >= warm:
                before = rss_kib()
            ids[0] = done % VOCAB
            t = mem.prefetch(ids)
            t.wait(1, out, 5)
            t.wait(14, out, 5)
            done += 2
        after = rss_kib()
        assert mem.stats()[1]["prefetches"] == lookups // 2
    grew = after - before
    print(f"{lookups} lookups: RSS {before} KiB -> {after} KiB")
    assert grew < 4096, f"RSS grew {grew} KiB over {lookups} lookups"


def test_prefetch_by_row_ids_matches_the_token_prefetch(rack):
    rack.start()
    rng = np.random.default_rng(5)
    ids = rng.integers(0, VOCAB, size=9, dtype=np.int64)
    ids[4] = -1  # a DEAD position
    with er.Memory(rack.config, "only-donor", metrics="off") as mem:
        addr = mem.addresses(ids, [1, 2, 3])
        by_token = mem.prefetch(ids, [1, 2, 3])
        by_rows = mem.prefetch_rows(addr)
        assert by_rows.columns == 24 and by_rows.positions == 9
        for layer in er.LAYERS:
            want = by_token.rows(layer, timeout=10)
            got = by_rows.row_buffer()
            served = by_rows.wait(layer, got, timeout=10)
            assert served.sources == ["d"], served
            assert (got == want).all()
            assert not got[4].any()
        # One layer, a head slice (columns 8..16), as int64 with -1 for DEAD
        # (what an engine's hash ids look like).
        slice14 = addr[:, 1, 8:16].astype(np.int64)
        slice14[4] = -1
        t = mem.prefetch_rows(slice14, layer=14, columns=(8, 16))
        assert t.columns == 8 and t.nbytes == 9 * 8 * 264
        got = t.rows(14, timeout=10)
        assert (got == by_token.rows(14, timeout=10)[:, 8:16]).all()
        with pytest.raises(er.BadInputError, match="fetched layer 14's rows only"):
            t.rows(1)
        # Bad input: clear errors, nothing fetched.
        past = addr.copy()
        past[0, 0, 3] = 10**9
        cases = [
            (lambda: mem.prefetch_rows(past), "position 0, layer 1, column 3: row 1000000000, past table 1's"),
            (lambda: mem.prefetch_rows(addr[:, :, :8]), r"shape \(9, 2, 8\); give \(positions, 2, 24\)"),
            (lambda: mem.prefetch_rows(addr[:, 0, :], layer=2), "layer 2 has no Engram table"),
            (lambda: mem.prefetch_rows(addr, columns=(5, 5)), "give 0 <= lo < hi <= 24"),
            (lambda: mem.prefetch_rows(addr.astype(np.float32)), "dtype float32"),
            (lambda: mem.prefetch_rows(np.full((1, 2, 24), -5)), "row id -5 is negative"),
            (lambda: mem.prefetch_rows(np.zeros((0, 2, 24), np.uint64)), "not whole positions"),
        ]
        partial = addr.copy()
        partial[1, 1, 0] = er.NO_ROW
        cases.append((lambda: mem.prefetch_rows(partial), "NO_ROW beside live row ids"))
        for call, msg in cases:
            with pytest.raises(er.BadInputError, match=msg):
                call()


def test_dequantize_refuses_an_output_that_shares_the_rows_memory():
    buf = np.zeros(4096, np.uint8)
    rows = buf[:264].reshape(1, 264)
    for dtype, view in (("float32", np.float32), ("bfloat16", np.uint16), ("bfloat16", np.int16)):
        out = buf.view(view)[: 256]
        with pytest.raises(er.BadInputError, match="shares memory with the input"):
            er.dequantize(rows, out.reshape(1, 256), dtype=dtype)
    # Apart, the same call works.
    assert not er.dequantize(rows, np.empty((1, 256), np.float32)).any()


def test_warm_wakes_the_path_and_refuses_a_lead_out_of_range(rack):
    rack.start()
    with er.Memory(rack.config, "n", metrics="off") as mem:
        out = mem.row_buffer(1)
        for i in range(20):
            mem.warm(300e-6)
            t = mem.prefetch([i + 5], [1, 2, 3])
            for layer in er.LAYERS:
                served = t.wait(layer, out, timeout=10)
                assert set(served.sources) <= {"d", "ssd"}, served
        for bad in (-1e-6, 2.0, float("nan")):
            with pytest.raises(er.BadInputError):
                mem.warm(bad)
