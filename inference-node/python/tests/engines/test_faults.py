"""Faults per request (engram_rack.faults): a ring request that had no rows
under a table's `fail` policy names the engine step it came from, the
step's requests go to the fault board, and only they fail; work tagged as
serving no request fails nothing; where no request can be named, or no
board takes them, `RingFault` stops the engine as before. The ring's
kernels run under Triton's interpreter against a real donor."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import signal  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import engram_rack as er  # noqa: E402
from engram_rack import faults  # noqa: E402
from engram_rack.ring import (  # noqa: E402
    IDLE_STEP,
    STATUS_OK,
    Fault,
    RingFault,
    RingLookup,
    set_step,
)

STEP_TAGS_AT = 3328


@pytest.fixture
def fresh_board(tmp_path, monkeypatch):
    """A fault board of this test's own, named by the environment."""
    path = tmp_path / "board"
    path.write_bytes(b"")
    monkeypatch.setenv(faults.BOARD_ENV, str(path))
    return faults.board()


@pytest.fixture
def failing(rack):
    """A ring served by node `only-donor` (donor d alone, policy `fail`,
    1 s lookup timeout) and the donor, up."""
    donor = rack.start()
    mem = er.Memory(rack.config, "only-donor", metrics="off")
    ring = RingLookup((1,), (0, 24), positions=4, device="cpu", deadline=3.0)
    handle = mem.serve_ring(ring.native)
    yield donor, ring
    del handle
    donor.signal(signal.SIGCONT)
    ring.close()
    mem.close()


def lookup(ring) -> int:
    """One step's lookup of two positions; the ring's status for it."""
    ids = torch.zeros(2, 24, dtype=torch.int64)
    out = torch.zeros(2, 24, 256, dtype=torch.bfloat16)
    ring.lookup(1, ids, out, scale0_zero=True)
    return int(ring.state[1])


def slot_tag(ring, seq: int) -> int:
    words = np.frombuffer(memoryview(ring.native), dtype=np.int64, count=512)
    return int(words[STEP_TAGS_AT // 8 + seq % ring.slots])


def test_a_fault_names_its_step_and_fails_only_that_steps_requests(failing, fresh_board):
    donor, ring = failing
    steps = faults.Steps()
    assert steps.begin(["a", "b"]) == 1
    assert lookup(ring) == STATUS_OK
    assert slot_tag(ring, 1) == 1, "publish copied the step's tag into the slot"
    assert faults.route_faults(steps) == 0
    # The donor freezes: step 2's rows do not come.
    donor.hang()
    steps.begin(["c"])
    assert lookup(ring) != STATUS_OK
    got = ring.take_faults()
    assert len(got) == 1 and got[0].step == 2 and got[0].layer == 1 and got[0].seq == 2, got
    assert faults.route_faults(steps, got) == 1
    posted = fresh_board.take()
    assert [r for r, _ in posted] == ["c"]
    assert "rows did not come (request 2, layer 1" in posted[0][1]
    assert "policy is fail" in posted[0][1]
    assert fresh_board.take() == [], "each report is taken once"
    # Work that serves no request (graph capture, dummy batches): logged,
    # nothing failed.
    steps.idle()
    assert lookup(ring) != STATUS_OK
    assert faults.route_faults(steps) == 0
    assert fresh_board.take() == []
    # The donor is back: the next step's rows come, nothing more fails.
    donor.signal(signal.SIGCONT)
    deadline = time.monotonic() + 20
    while True:
        steps.begin(["d"])
        if lookup(ring) == STATUS_OK or time.monotonic() > deadline:
            break
        faults.route_faults(steps)
        fresh_board.take()
        time.sleep(0.2)
    assert int(ring.state[1]) == STATUS_OK
    assert faults.route_faults(steps) == 0
    assert fresh_board.take() == []


def test_faults_no_request_can_be_named_for_stop_the_engine(fresh_board, tmp_path,
                                                            monkeypatch):
    steps = faults.Steps(keep=2)
    for ids in (["a"], ["b"], ["c"]):
        steps.begin(ids)
    # The client could not tell the step (0), or it is older than kept.
    for tag in (0, 1):
        with pytest.raises(RingFault, match=f"cannot name \\(tag {tag}\\)"):
            faults.route_faults(steps, [Fault(9, tag, 14, 2)])
    assert faults.route_faults(steps, [Fault(9, 3, 14, 2)]) == 1
    assert [r for r, _ in fresh_board.take()] == ["c"]
    # No board this process can write: the engine stops.
    monkeypatch.setenv(faults.BOARD_ENV, str(tmp_path / "gone" / "board"))
    with pytest.raises(RingFault, match="no fault board"):
        faults.route_faults(steps, [Fault(9, 3, 14, 2)])
    # A full board too.
    full = tmp_path / "full"
    with open(full, "wb") as f:
        f.truncate(faults.MAX_BOARD_BYTES)
    monkeypatch.setenv(faults.BOARD_ENV, str(full))
    with pytest.raises(RingFault, match="no fault board"):
        faults.route_faults(steps, [Fault(9, 3, 14, 2)])
    # Faults of work that serves no request need no board.
    assert faults.route_faults(steps, [Fault(9, IDLE_STEP, 14, 5)]) == 0


def test_more_faults_than_the_log_keeps_stop_the_engine(failing):
    """A client logs its faults in a ring of 32 entries; an engine that
    finds more since its last look cannot say whose requests they failed."""
    _, ring = failing
    h64 = np.frombuffer(memoryview(ring.native), dtype=np.int64, count=512)
    assert ring.take_faults() == []
    h64[13] += 33  # as if the client had logged 33 faults
    with pytest.raises(RingFault, match="more than the ring's fault log keeps"):
        ring.take_faults()
    assert ring.take_faults() == []


def test_a_board_is_shared_by_the_processes_of_one_engine(tmp_path):
    """Reports appended by several writers are each read once by every
    reader (one per scheduler), a torn last line waits for its end, and a
    line that is not a report is skipped."""
    path = tmp_path / "b"
    path.write_bytes(b"")
    w1, w2 = faults.FaultBoard(str(path)), faults.FaultBoard(str(path))
    r1, r2 = faults.FaultBoard(str(path)), faults.FaultBoard(str(path))
    assert w1.report(["x", "y"], "m1") and w2.report(["z"], "m2")
    with open(path, "ab") as f:
        f.write(b'not json\n{"req": "half')
    want = [("x", "m1"), ("y", "m1"), ("z", "m2")]
    assert r1.take() == want and r2.take() == want
    with open(path, "ab") as f:
        f.write(b'", "error": "m3"}\n')
    assert r1.take() == [("half", "m3")]
    assert r1.take() == [] and r2.take() == [("half", "m3")]


def test_the_step_tag_is_copied_without_a_host_sync(failing):
    """`set_step` fills the step word the publish kernel reads; every
    request of the step carries it, and a new tag reaches only later ones."""
    _, ring = failing
    set_step(41)
    assert lookup(ring) == STATUS_OK
    set_step(42)
    assert lookup(ring) == STATUS_OK
    assert slot_tag(ring, 1) == 41 and slot_tag(ring, 2) == 42
    with pytest.raises(er.BadInputError):
        set_step(-1)
