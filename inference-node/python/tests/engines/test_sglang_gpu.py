"""engram_rack.sglang under what a GPU engine does to it, on CPU
(engines/emulation.py): a decode step captured whole, hasher hook
included, with no host sync and every replay right; and SGLang's DP
attention on two gloo ranks, each with its own tokens (unequal batches, an
idle one), where the plugin must read each rank's own rows and join no
collective of its own (SGLang's are made to raise)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
sglang = pytest.importorskip("sglang")
SE = pytest.importorskip("sglang.srt.layers.engram")

import emulation  # noqa: E402
from conftest import free_port  # noqa: E402
from test_sglang import (  # noqa: E402, F401
    Pair,
    hasher,
    hidden,
    hooks,
    one_rank,
    reference_rows,
    windows,
)

from engram_rack import sglang as plugin  # noqa: E402


@pytest.mark.parametrize("node", ["hl", "n"])
def test_a_captured_decode_has_no_host_sync_and_replays_stay_identical(host_rack, hooks,
                                                                       monkeypatch, node):
    host_rack.start()
    pairs = [Pair(host_rack, layer, node, hooks, fresh=layer == 1) for layer in (1, 14)]
    h = hasher(pairs[0].layout)
    emulation.emulate_graphs(monkeypatch)
    rng = np.random.default_rng(6)
    seqs = [rng.integers(0, 5000, 12).tolist() for _ in range(4)]
    steps = [h.hash_windows(*windows([(s[:k], [s[k]]) for s in seqs]))[0] for k in (3, 6, 9)]
    ids_in = steps[0].clone()
    outs = [torch.empty(4, 24, 256, dtype=torch.bfloat16) for _ in pairs]

    def forward():
        ids = ids_in + 0  # the hasher's output, made inside the graph
        plugin.publish_after_hash(ids)  # the AFTER hook, as it runs in capture
        for p, out in zip(pairs, outs):
            out.copy_(p.rack.embed(ids[:, p.index]))

    g = emulation.Graph()
    g.capture_begin()
    try:
        forward()
    finally:
        g.capture_end()
    for i, ids in enumerate(steps):
        ids_in.copy_(ids)
        g.replay()
        for p, out in zip(pairs, outs):
            want = reference_rows(host_rack, p.layer_id, ids[:, p.index])
            assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (i, p.layer_id)


RANK = textwrap.dedent(
    """
    import os, sys, json
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import numpy as np, torch, torch.distributed as dist
    rank, port, config, node = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=__import__("datetime").timedelta(seconds=60))
    import sglang.srt.layers.engram as SE
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.plugins.hook_registry import HookRegistry
    get_parallel().override_permanently(tp_size=2, tp_rank=rank, attn_dp_size=2, attn_cp_size=1,
                                        tp_group=None)
    torch.cuda.current_device = lambda: 0
    SE._sorted_host_reads = lambda d: False

    def collective(*a, **k):
        raise RuntimeError("the plugin joined a collective of its own")

    import sglang.srt.distributed as D
    for mod in (SE, D):
        for name in ("tensor_model_parallel_all_reduce", "dp_gather_replicate", "dp_scatter",
                     "dp_reduce_scatter_tensor", "attn_cp_all_gather_into_tensor"):
            if hasattr(mod, name):
                setattr(mod, name, collective)
    os.environ.update(ENGRAM_RACK_CONFIG=config, ENGRAM_RACK_NODE=node, ENGRAM_RACK_METRICS="off")
    from engram_rack import sglang as plugin
    plugin.register()
    HookRegistry.apply_hooks()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)) if "__file__" in dir() else ".")
    from test_sglang import hasher, layout, table_rows, windows, reference_rows

    class R:  # what reference_rows reads of a rack
        pass

    rack = R()
    rack.config = __import__("pathlib").Path(config)
    rack.tables = json.loads(sys.argv[5])
    rack.tables = {int(k): v for k, v in rack.tables.items()}
    rows = [table_rows(rack, 1), table_rows(rack, 14)]
    lay = layout(rows)
    embeds = {layer: SE.EngramEmbedding(rows[i], 256, layer, lay.column_bounds(i))
              for i, layer in enumerate((1, 14))}
    h = hasher(lay)
    rng = np.random.default_rng(rank)
    # Rank 0 decodes 3 sequences then prefills 5; rank 1 prefills 5, then idles.
    batches = [[3, 5], [5, 0]][rank]
    for step, n in enumerate(batches):
        if n:
            p = rng.integers(0, 5000, n + 4).tolist()
            ids, _ = h.hash_windows(*windows([(p[:4], p[4:4 + n])]))
        else:
            ids = torch.zeros(0, 2, 24, dtype=torch.int64)
        plugin.publish_after_hash(ids)
        for i, (layer, emb) in enumerate(embeds.items()):
            got = emb(ids[:, i], None)
            assert got.shape == (n, 24, 256)
            if n:
                want = reference_rows(rack, layer, ids[:, i])
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (step, layer)
    dist.barrier()
    print("ok", rank, flush=True)
    """
)


@pytest.mark.parametrize("node", ["hl", "n"])
def test_dp_attention_ranks_read_their_own_tokens_with_no_collective(host_rack, node):
    import json

    host_rack.start()
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    port = free_port()
    tables = json.dumps({k: str(v) for k, v in host_rack.tables.items()})
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port),
                               str(host_rack.config), node, tables],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=str(here))
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung: a collective with unequal or idle batches")
        outs.append((p.returncode, out, err))
    for rc, out, err in outs:
        assert rc == 0 and out.startswith("ok"), err[-3000:]
