"""The engine ring's kernels (engram_rack.ring) under Triton's interpreter,
served by the node's native client against a real donor, with a faked GPU
timer: rows of both scale rules equal the table file's, raw rows equal its
bytes, DEAD and invalid ids give zeros, a long step goes in turns, both
sections published by one kernel are each waited for, and with no client
(never attached, or gone) every wait ends at the GPU's deadline with zeros
and a failure counted on the device, never hanging; and a request with no
rows under a `fail` policy raises `RingFault` at the engine's next check
(host memory only), where the GPU's deadline with no client does too."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import engram_rack as er  # noqa: E402
from engram_rack.engine import dequantize_rows  # noqa: E402
from engram_rack.ring import (  # noqa: E402
    STATUS_OK,
    HostRing,
    STATUS_TIMEOUT,
    RingFault,
    WAIT_BUCKETS,
    RingLookup,
    check_all,
    wait_bucket_bounds,
    wait_quantile,
)

ROWS = {1: None, 14: None}


def reference(rows: np.ndarray, scale0_zero: bool) -> torch.Tensor:
    """bf16 values of raw rows by the engines' arithmetic (vLLM's scale
    byte 0 is 0.0, SGLang's 2^-127): f32 code x f32 scale, rounded once."""
    return dequantize_rows(torch.from_numpy(np.ascontiguousarray(rows)), scale0_zero=scale0_zero)


def table_rows(rack, layer: int) -> int:
    text = rack.config.read_text()
    return int(text.split(f"layer = {layer}\n", 1)[1].split("rows = ", 1)[1].split("\n", 1)[0])


@pytest.fixture
def served(rack):
    rack.start()
    mem = er.Memory(rack.config, "n", metrics="off")
    lookups = []

    def make(layers=(1, 14), columns=(0, 24), positions=16, deadline=2.0):
        r = RingLookup(layers, columns, positions=positions, device="cpu", deadline=deadline)
        lookups.append(r)
        return r

    yield mem, make
    for r in lookups:
        r.close()
    mem.close()


@pytest.mark.parametrize("scale0_zero", [True, False])
def test_rows_through_the_ring_are_the_tables_by_each_engines_rule(rack, served, scale0_zero):
    mem, make = served
    ring = make()
    handle = mem.serve_ring(ring.native)
    rng = np.random.default_rng(1)
    for layer in (1, 14):
        n_rows = table_rows(rack, layer)
        for t in (1, 5, 16, 37):  # 37: three turns of 16
            ids = torch.from_numpy(rng.integers(0, n_rows, (t, 24))).to(torch.int32)
            ids[0] = -1  # a DEAD position
            out = torch.full((t, 24, 256), 7.0, dtype=torch.bfloat16)
            ring.lookup(layer, ids, out, scale0_zero=scale0_zero)
            want = reference(rack.rows(layer, ids.clamp_min(0).numpy()).reshape(t, 24, 264),
                             scale0_zero)
            want[0] = 0
            assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (layer, t)
            raw = torch.zeros(t, 24, 264, dtype=torch.uint8)
            ring.lookup(layer, ids, raw, scale0_zero=scale0_zero)
            got = raw[1:].numpy()
            assert (got == rack.rows(layer, ids[1:].numpy()).reshape(t - 1, 24, 264)).all()
            assert (raw[0] == 0).all()
    assert int(ring.failures.sum()) == 0
    assert handle.counters()["requests"] > 0


def test_one_publish_for_both_sections_and_a_head_slice(rack, served):
    mem, make = served
    ring = make(columns=(9, 12))  # a TP rank's three heads
    handle = mem.serve_ring(ring.native)  # noqa: F841 - kept: dropping it lets the ring go
    rng = np.random.default_rng(2)
    ids = {s: torch.from_numpy(rng.integers(0, table_rows(rack, layer), (4, 24)))
           for s, layer in enumerate((1, 14))}
    ring.publish(ids, 4)
    for s, layer in enumerate((1, 14)):
        out = torch.empty(4, 3, 256, dtype=torch.bfloat16)
        ring.wait(s)
        ring.gather(s, out, 4, scale0_zero=False)
        assert int(ring.state[2 * s + 1]) == STATUS_OK
        want = reference(rack.rows(layer, ids[s][:, 9:12].numpy()).reshape(4, 3, 264), False)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_padded_heads_and_invalid_ids_are_zeros(rack, served):
    mem, make = served
    ring = make(layers=(14,), columns=(21, 27))  # the last rank: heads 24..26 are padding
    handle = mem.serve_ring(ring.native)  # noqa: F841 - kept: dropping it lets the ring go
    n_rows = table_rows(rack, 14)
    ids = torch.tensor([[5] * 24, [n_rows + 3] * 24, [7] * 24], dtype=torch.int64)
    out = torch.full((3, 6, 256), 1.0, dtype=torch.bfloat16)
    ring.lookup(14, ids, out, scale0_zero=False)
    assert (out[:, 3:] == 0).all(), "padded heads"
    assert (out[1] == 0).all(), "an id past the table"
    want = reference(rack.rows(14, np.array([5, 5, 5, 7, 7, 7])).reshape(2, 3, 264), False)
    assert torch.equal(out[[0, 2], :3].view(torch.int16), want.view(torch.int16))
    assert int(ring.state[1]) == 3  # bad ids: served, with the bad positions zero


def test_no_client_or_a_gone_one_ends_every_wait_at_the_deadline(rack, served):
    mem, make = served
    ring = make(deadline=0.2)
    ids = torch.zeros(2, 24, dtype=torch.int64)
    out = torch.full((2, 24, 256), 3.0, dtype=torch.bfloat16)
    t0 = time.monotonic()
    ring.lookup(1, ids, out, scale0_zero=True)  # never attached
    assert time.monotonic() - t0 < 30
    assert (out == 0).all()
    assert int(ring.state[1]) == STATUS_TIMEOUT and int(ring.failures[0]) == 1
    # The wait is in the header's histogram, in a bucket at (or just past) the deadline.
    waits = ring.waits()
    assert waits.shape == (2, WAIT_BUCKETS) and int(waits.sum()) == 1
    lo, hi = wait_bucket_bounds(int(waits[0].argmax()))
    assert hi > ring.deadline_ns and lo <= ring.deadline_ns * 1.5, (lo, hi)
    assert wait_quantile(waits[0], 0.5) == hi
    handle = mem.serve_ring(ring.native)
    ring.lookup(1, ids, out, scale0_zero=True)
    assert int(ring.state[1]) == STATUS_OK and bool((out != 0).any())
    # The served wait counts too, shorter than the deadline.
    waits = ring.waits()
    assert int(waits[0].sum()) == 2 and int(waits[1].sum()) == 0
    assert wait_quantile(waits[0], 0.0) <= hi
    handle.close()  # the client lets go
    deadline = time.monotonic() + 10
    while ring.native.client_state != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ring.native.client_state == 2
    ring.lookup(1, ids, out, scale0_zero=True)
    assert (out == 0).all() and int(ring.failures[0]) == 2


def test_no_rows_under_the_fail_policy_stop_the_engine_at_its_next_check(rack):
    donor = rack.start()
    mem = er.Memory(rack.config, "only-donor", metrics="off")  # donor d alone, policy fail
    ring = RingLookup((1,), (0, 24), positions=4, device="cpu", deadline=2.0)
    try:
        handle = mem.serve_ring(ring.native)
        ids = torch.zeros(2, 24, dtype=torch.int64)
        out = torch.zeros(2, 24, 256, dtype=torch.bfloat16)
        ring.lookup(1, ids, out, scale0_zero=True)
        assert int(ring.state[1]) == STATUS_OK
        check_all()  # rows came: nothing to raise
        donor.stop()
        ring.lookup(1, ids, out, scale0_zero=True)
        assert (out == 0).all() and int(ring.state[1]) != STATUS_OK
        with pytest.raises(RingFault, match=r"fail policy \(the last: request 2, layer 1"):
            check_all()
        check_all()  # each fault is raised once
        assert ring.faults() == 1
        # No client at all (gone): a wait that reaches the GPU's deadline is
        # the engine's own fault to raise.
        handle.close()
        deadline = time.monotonic() + 10
        while ring.native.client_state != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        ring.lookup(1, ids, out, scale0_zero=True)
        assert int(ring.state[1]) == STATUS_TIMEOUT
        with pytest.raises(RingFault, match="request 3 passed the GPU's deadline"):
            ring.check()
        ring.check()
    finally:
        ring.close()
        mem.close()


def test_a_host_ring_fetches_rows_in_turns_and_raises_when_none_come_under_fail(rack):
    """The scheduler's host ring: rows equal the table's over several turns;
    with the donor gone under `fail`, RingFault instead of zeros."""
    donor = rack.start()
    mem = er.Memory(rack.config, "only-donor", metrics="off")
    ring = HostRing((1, 14), positions=16, deadline=5.0)
    try:
        handle = mem.serve_ring(ring.native)  # noqa: F841 - kept: dropping it lets the ring go
        rng = np.random.default_rng(4)
        for layer in (1, 14):
            ids = rng.integers(0, table_rows(rack, layer), (37, 24))
            ids[5] = -1
            got = ring.fetch(layer, ids)
            want = rack.rows(layer, np.clip(ids, 0, None)).reshape(37, 24, 264)
            want[5] = 0
            assert (got == want).all(), layer
        donor.stop()
        with pytest.raises(RingFault, match="prefill's rows did not come"):
            ring.fetch(1, np.zeros((2, 24), dtype=np.int64))
    finally:
        mem.close()
