"""engram_rack.engine: torch dequantization and the Triton gather over table
views (run on CPU tensors under the Triton interpreter), against the
package's own `dequantize`; and the scale byte 0 as each reader takes it."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from conftest import read_rows  # noqa: E402

import engram_rack as er  # noqa: E402
from engram_rack import engine  # noqa: E402


def edge_rows() -> np.ndarray:
    """Rows holding every E4M3 code but the NaNs, under scales 0, 1, 2, 120,
    127, 200 and 254: the extremes of both formats."""
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    rows = []
    for scales in ([0] * 8, [1, 2, 120, 127, 200, 254, 0, 127], [127] * 8):
        for start in range(0, len(codes), 256):
            r = np.zeros(264, np.uint8)
            chunk = np.resize(codes[start:], 256)
            r[:256] = chunk
            r[256:] = scales
            rows.append(r)
    return np.stack(rows)


def bits(t):
    return t.view(torch.int16).numpy()


def test_dequantize_rows_is_the_packages_dequantize_bit_for_bit():
    rows = edge_rows()
    want = er.dequantize(rows, dtype="bfloat16")
    got = engine.dequantize_rows(torch.from_numpy(rows))
    np.testing.assert_array_equal(bits(got), want.view(np.int16))


def test_a_scale_byte_of_0_is_2_to_the_minus_127_as_in_the_reference():
    row = np.zeros(264, np.uint8)
    row[:256] = 0x38  # 1.0
    row[256:] = 0
    got = engine.dequantize_rows(torch.from_numpy(row[None]))
    assert float(got[0, 0].float()) == 2.0 ** -127
    # torch's own UE8M0 type reads it the same way.
    e8m0 = torch.zeros(1, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert float(e8m0.float()[0]) == 2.0 ** -127
    assert float(er.dequantize(row[None])[0, 0]) == 2.0 ** -127


@pytest.mark.parametrize("packed", [True, False])
def test_the_gather_kernel_reads_both_layouts(packed):
    rows = edge_rows()
    n = len(rows)
    if packed:
        table = rows.reshape(-1).copy()
    else:  # 15 rows per 4 KiB page, as a table file's data
        pages = -(-n // 15)
        table = np.zeros(pages * 4096, np.uint8)
        for r in range(n):
            off = (r // 15) * 4096 + (r % 15) * 264
            table[off:off + 264] = rows[r]
    ids = torch.tensor([[0, 1, 2, n - 1], [n - 2, -1, n, 3]], dtype=torch.int32)
    got = engine.gather_view(torch.from_numpy(table), n, packed, ids)
    want = er.dequantize(rows, dtype="bfloat16")
    flat = ids.numpy()
    for t in range(2):
        for c in range(4):
            r = flat[t, c]
            expect = want[r] if 0 <= r < n else np.zeros(256, np.uint16)
            np.testing.assert_array_equal(bits(got[t, c]), expect.view(np.int16))


def test_a_views_gather_and_the_ring_give_the_reference_rows(rack, tmp_path):
    """The `local` copy's view (paged layout) gathered by the kernel, and a
    fetch through the ring with SGLang's scale rule, both give the V4.1
    reference's values (`engram_rack.dequantize`), a head slice included."""
    from engram_rack.ring import RingLookup

    rack.start()
    with er.Memory(rack.config, "ref", metrics="off") as ref, \
            er.Memory(rack.config, "n", metrics="off") as mem:
        ids = torch.tensor(np.random.default_rng(2).integers(0, 20_000, (6, 24)))
        ids[2] = -1  # a DEAD position
        view = ref.table_view(1)
        a = engine.gather_view(engine.view_tensor(view), view.rows, view.packed, ids)
        ring = RingLookup((1,), (0, 24), positions=8, device="cpu", deadline=5.0)
        handle = mem.serve_ring(ring.native)  # noqa: F841 - kept while in use
        b = torch.empty(6, 24, 256, dtype=torch.bfloat16)
        ring.lookup(1, ids, b, scale0_zero=False)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert not bool((b[2] != 0).any())
        want = er.dequantize(read_rows(rack.tables[1], ids[0].numpy()), dtype="bfloat16")
        np.testing.assert_array_equal(bits(b[0]), want.view(np.int16))
        # A rank's head slice, padded past 24 as vLLM pads a 5-way split.
        part = RingLookup((1,), (20, 25), positions=8, device="cpu", deadline=5.0)
        h2 = mem.serve_ring(part.native)  # noqa: F841
        got = torch.empty(6, 5, 256, dtype=torch.bfloat16)
        part.lookup(1, ids, got, scale0_zero=False)
        assert torch.equal(got[:, :4].view(torch.int16), b[:, 20:].view(torch.int16))
        assert not bool((got[:, 4] != 0).any())
        ring.close()
        part.close()


def test_a_ring_refuses_bad_input():
    from engram_rack.ring import RingLookup

    with pytest.raises(er.BadInputError, match="columns"):
        RingLookup((1,), (24, 30), positions=4, device="cpu")
    with pytest.raises(er.BadInputError):
        RingLookup((2,), (0, 24), positions=4, device="cpu")  # no Engram layer 2
    r = RingLookup((14,), (0, 24), positions=4, device="cpu")
    try:
        with pytest.raises(er.BadInputError, match="positions"):
            r.publish({0: torch.zeros(5, 24, dtype=torch.int64)}, 5)
        with pytest.raises(er.BadInputError, match="carries"):
            r.section(1)
        with pytest.raises(er.BadInputError, match="out must be"):
            r.gather(0, torch.empty(2, 7, 256, dtype=torch.bfloat16), 2, scale0_zero=True)
    finally:
        r.close()
