"""engram_rack.vllm against vLLM's own Qwen4Exp n-gram embedding, on CPU.

vLLM's `Qwen4ExpNGramEmbedding` with its table loaded from a checkpoint
(the table's rows cut into `split_ngram_parts` shards and its global
scale, through vLLM's own `load_weights`) is the reference; the same
class built after `engram_rack.vllm.install()` reads the rack's table: a
host-local donor's memory (or the node's local copy), through vLLM's own
pinned-host lookup kernel (Triton's interpreter) and its side-stream
prefetch (streams faked on CPU). Embeddings must be bit-identical for
decode, a chunked prefill, a first chunk, a mixed batch and EOS tokens
inside a sequence, for FP8 (per-tensor scale), BF16 and NVFP4 tables; what
the plugin cannot serve is refused by name. (The NVFP4 table's global scale
is a power of two: vLLM's NVFP4 kernel, which the plugin runs, then gives
exact products, where Triton's interpreter would truncate a cast to bf16
that a GPU and vLLM's CPU decoding round.)
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import contextlib  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")
N = pytest.importorskip("vllm.models.qwen4_exp.nvidia.ngram_embedding")
C = pytest.importorskip("vllm.models.qwen4_exp.common.ngram_embedding")

import emulation  # noqa: E402
from conftest import free_port, mapping_of, ple_rack, plug, read_rows  # noqa: E402

from engram_rack import plugin as rack_plugin  # noqa: E402
from engram_rack import vllm as plugin  # noqa: E402

VOCAB = 248_320
BASE = 1_000
EOS = 248_044
HEAD_DIM = 160
HEADS = 16
PARTS = 4
SCALE = 0.0123
NVFP4_SCALE = 0.25
LAYER = 3  # the PLE layer's model layer (ple_layer_ids, 1-based)
MAX_TOKENS = 64

#: What vLLM's config says of the table -> the rack table's encoding.
DTYPES = {"float8_e4m3fn": "fp8_per_tensorx160", None: "bf16x160", "nvfp4": "nvfp4_e4m3_16x160"}
#: Bytes a row of each.
ROW_BYTES = {"float8_e4m3fn": 160, None: 320, "nvfp4": 90}


@pytest.fixture(scope="module")
def vctx():
    """vLLM's config (the engram table in host memory) and a one-rank group."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.config.engram import EngramConfig
    from vllm.distributed import parallel_state as ps

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    cfg.engram_config = EngramConfig(cpu_offload=True)
    with set_current_vllm_config(cfg):
        if not ps.model_parallel_is_initialized():
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            ps.initialize_model_parallel(1, 1)
        yield cfg


def hf_config(dtype, base=BASE):
    return types.SimpleNamespace(
        ngram_size=3, heads_per_ngram=8, eos_token_id=EOS, vocab_size=VOCAB,
        split_ngram_parts=PARTS, seed=1234, ngram_vocab_size_base=base,
        make_ngram_vocab_size_divisible_by=128, ple_embedding_dtype=dtype,
        ple_layer_ids=[LAYER, 9])


def table_rows(base=BASE) -> int:
    """vLLM's rows for PLE layer index 0 (its layout, padded to 128)."""
    _, _, total = N.Qwen4ExpNGramEmbedding._make_vocab_layout(
        ngram_vocab_size_base=base, ngram_heads=HEADS, ple_dense_layer_id=0)
    return -(-total // 128) * 128


@pytest.fixture(params=list(DTYPES), ids=["fp8", "bf16", "nvfp4"])
def qwen_rack(request, tmp_path):
    """One PLE table (model layer 3) of the model's encoding; donor `h` on
    TCP and a host socket; nodes `hl` (h), `own` (a local copy) and `far`
    (donor `d` across the network only)."""
    dtype = request.param
    enc = DTYPES[dtype]
    rows = table_rows()
    scale = {"fp8_per_tensorx160": SCALE, "nvfp4_e4m3_16x160": NVFP4_SCALE}.get(enc)
    config, path, donors = ple_rack(tmp_path, LAYER, rows, enc, scale, EOS, BASE)
    rack = types.SimpleNamespace(config=config, path=path, dtype=dtype, scale=scale, rows=rows,
                                 donors=donors)
    yield rack
    rack_plugin.reset()
    if getattr(rack, "engines", None) is not None:
        rack.engines.stop()
    for d in donors:
        d.stop()


@contextlib.contextmanager
def vllms_own_classes():
    """vLLM's own table and n-gram classes in its module (the reference),
    whatever the plugin bound there."""
    saved = {k: getattr(N, k) for k in ("Qwen4ExpPLEDeviceEmbedding",
                                        "Qwen4ExpPLEPinnedHostEmbedding",
                                        "Qwen4ExpNGramEmbedding")}
    ngram = saved["Qwen4ExpNGramEmbedding"]
    own = ngram.__mro__[1] if ngram.__module__ == "engram_rack.vllm_qwen4exp" else ngram
    N.Qwen4ExpPLEDeviceEmbedding = C.Qwen4ExpPLEDeviceEmbedding
    N.Qwen4ExpPLEPinnedHostEmbedding = C.Qwen4ExpPLEDeviceEmbedding
    N.Qwen4ExpNGramEmbedding = own
    try:
        yield own
    finally:
        for k, v in saved.items():
            setattr(N, k, v)


def build(dtype, base=BASE):
    """vLLM's n-gram embedding as its PLE layer builds it (bf16 default)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return N.Qwen4ExpNGramEmbedding(hf_config(dtype, base), HEADS * HEAD_DIM, 0, MAX_TOKENS,
                                        data_parallel_rank=0,
                                        prefix=f"model.layers.{LAYER - 1}.ple")
    finally:
        torch.set_default_dtype(default)


def checkpoint(rack):
    """The table as a checkpoint holds it: `split_ngram_parts` row shards
    (and the FP8 table's global scale)."""
    rows = read_rows(rack.path, np.arange(rack.rows))
    t = torch.from_numpy(np.ascontiguousarray(rows))
    size = -(-rack.rows // PARTS)
    if rack.dtype == "nvfp4":  # packed values and block scales, sharded alike
        parts = {"weight": t[:, :HEAD_DIM // 2], "weight_scale": t[:, HEAD_DIM // 2:].view(
            torch.float8_e4m3fn)}
        out = [(f"ngram_embedding.shard_{i}.{k}", v[i * size:(i + 1) * size].clone())
               for i in range(PARTS) for k, v in parts.items()]
        out.append(("ngram_embedding.weight_scale_2", torch.tensor([rack.scale])))
        return out
    t = t.view(torch.float8_e4m3fn) if rack.dtype else t.view(torch.bfloat16)
    out = [(f"ngram_embedding.shard_{i}.weight", t[i * size:(i + 1) * size].clone())
           for i in range(PARTS)]
    if rack.scale:
        out.append(("ngram_embedding.weight_scale", torch.tensor([rack.scale])))
    return out


def batch(requests):
    """`requests` = [(context, tokens)] -> input_ids, query_start_loc and
    ngram_context (the two tokens before each chunk, EOS before a start)."""
    ids, starts, ctx = [], [0], []
    for context, tokens in requests:
        ids += tokens
        starts.append(len(ids))
        ctx.append(([EOS, EOS] + list(context))[-2:])
    return torch.tensor(ids), torch.tensor(starts, dtype=torch.int32), torch.tensor(ctx)


def typed_byte_pointers(monkeypatch):
    """vLLM's pinned lookup kernel declares its table and output as uint8
    pointers (`tl.pointer_type(tl.uint8)`): compiled for a GPU it reads any
    row type as bytes. Triton's interpreter ignores the declaration and
    would load FP8 values; launched with the same tensors viewed as bytes
    it runs as the GPU does (the kernel itself unchanged)."""
    kernel = C._lookup_ple_embedding_from_pinned_kernel

    class AsBytes:
        def __getitem__(self, grid):
            launch = kernel[grid]

            def run(weight, ids, output, *args, **kwargs):
                return launch(weight.view(torch.uint8), ids, output.view(torch.uint8),
                              *args, **kwargs)

            return run

    monkeypatch.setattr(C, "_lookup_ple_embedding_from_pinned_kernel", AsBytes())


def same(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("node", ["hl", "own", "socket", "far", "far-socket"])
def test_embeddings_equal_vllms_own_table_loaded_from_the_checkpoint(vctx, qwen_rack, node,
                                                                     monkeypatch):
    """`far`: the table only across the network (donor `d` over TCP), its
    rows through an engine ring served by this process's own `Tables` or
    (`far-socket`) the host's `inference-node engines`."""
    rack = qwen_rack
    emulation.fake_streams(monkeypatch)
    typed_byte_pointers(monkeypatch)
    with vllms_own_classes():
        ref = build(rack.dtype)
    assert type(ref.ngram_embedding) is C.Qwen4ExpPLEDeviceEmbedding
    ref.load_weights(checkpoint(rack))
    plug(rack, node)
    plugin.install()
    got = build(rack.dtype)
    emb = got.ngram_embedding
    assert type(emb).__name__ == "RackPLEEmbedding" and emb.supports_prefetch
    if node.startswith("far"):
        # No rows here: an engine ring of the table's row size brings them.
        assert emb.rack_ring.row_bytes == ROW_BYTES[rack.dtype]
        assert emb.weight.shape[0] == 0
    else:
        # The table is the rack's memory, not a copy: a host-local donor's
        # (shared by every process on the host) or the node's own.
        assert not emb.rack_ring
        view = rack_plugin.tables().table_view(1)
        assert view.shared == (node != "own")
        if node == "socket":  # a mapping of its own of the donor's memfd
            assert mapping_of(emb.weight.data_ptr()).startswith("/memfd:")
        else:  # an NVFP4 table's values start each row, its block scales after them
            assert emb.weight.data_ptr() == np.frombuffer(view, dtype=np.uint8).ctypes.data
            if rack.dtype == "nvfp4":
                assert emb.weight_scale.data_ptr() == emb.weight.data_ptr() + HEAD_DIM // 2
    assert not emb.weight.is_pinned()
    # The checkpoint's shards are skipped; its scale is the table's.
    loaded = got.load_weights(checkpoint(rack))
    assert "ngram_embedding.weight" in loaded
    if rack.scale:
        name = "weight_scale_2" if rack.dtype == "nvfp4" else "weight_scale"
        assert float(getattr(emb, name)) == float(getattr(ref.ngram_embedding, name))
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, VOCAB, 30).tolist()
    prompt[12] = prompt[20] = prompt[21] = EOS  # EOS inside, two in a row
    cases = {
        "decode": [(prompt[:k], [prompt[k]]) for k in (3, 13, 22)],
        "first chunk": [([], prompt[:9])],
        "chunked prefill": [(prompt[:9], prompt[9:25])],
        "mixed": [(prompt[:5], [prompt[5]]), (prompt[:10], prompt[10:24]), ([], prompt[:3])],
        "after an EOS": [(prompt[:21], prompt[21:30])],
    }
    for name, requests in cases.items():
        ids, qsl, ctx = batch(requests)
        hidden = torch.zeros(len(ids), 8, dtype=torch.bfloat16)
        assert torch.equal(got.compute_ngram_ids(ids, qsl, ctx), ref.compute_ngram_ids(ids, qsl, ctx))
        got.start_prefetch(ids, qsl, ctx)
        out = got(hidden, ids, qsl, ctx)
        want = ref(hidden, ids, qsl, ctx)
        assert out.shape == (len(ids), HEADS * HEAD_DIM), name
        assert same(out, want), name
        values = emb.dequantize(out.view(len(ids), HEADS, HEAD_DIM), torch.bfloat16)
        assert same(values, ref.ngram_embedding.dequantize(
            want.view(len(ids), HEADS, HEAD_DIM), torch.bfloat16)), name
        assert bool((values != 0).any()), name


def test_a_remote_tables_rows_that_do_not_come_are_a_fault_not_wrong_rows(vctx, qwen_rack,
                                                                          monkeypatch):
    """The table across the network only, its donor killed: the ring's
    answer (every source failed, policy `fail`) gives zeros on the device,
    counted there, and a fault in the ring's log naming the PLE layer, for
    the plugin to fail the step's requests."""
    from engram_rack import ring as rack_ring

    rack = qwen_rack
    emulation.fake_streams(monkeypatch)
    plug(rack, "far")
    plugin.install()
    got = build(rack.dtype)
    emb = got.ngram_embedding
    ids, qsl, ctx = batch([([], list(range(100, 109)))])
    hidden = torch.zeros(len(ids), 8, dtype=torch.bfloat16)
    got.start_prefetch(ids, qsl, ctx)
    assert bool((got(hidden, ids, qsl, ctx) != 0).any())
    rack.donors[1].stop()  # donor `d`, the table's only source
    got.start_prefetch(ids, qsl, ctx)
    out = got(hidden, ids, qsl, ctx)
    assert not bool((out.view(torch.uint8) != 0).any())
    assert int(emb.rack_ring.failures.sum()) == 1
    faults = emb.rack_ring.take_faults()
    assert [(f.layer, rack_ring.STATUS_NAMES[f.status]) for f in faults] == [(LAYER, "failed")]


def test_what_the_plugin_cannot_serve_is_refused_by_name(vctx, qwen_rack):
    rack = qwen_rack
    plugin.install()
    other = {"float8_e4m3fn": "bf16x160", None: "fp8_per_tensorx160",
             "nvfp4": "fp8_per_tensorx160"}[rack.dtype]
    model = {"float8_e4m3fn": None, None: "float8_e4m3fn", "nvfp4": "float8_e4m3fn"}

    def refused(node, dtype, match, base=BASE):
        plug(rack, node)
        with pytest.raises(plugin.PluginError, match=match):
            build(dtype, base)

    # The model's encoding is not the table's; NVFP4; another hashing.
    refused("hl", model[rack.dtype], other)
    if rack.dtype != "nvfp4":
        refused("hl", "nvfp4", "nvfp4_e4m3_16x160")
    refused("hl", rack.dtype, "hashing", base=2 * BASE)
    if rack.scale:
        # A checkpoint of another table version (its scale differs).
        plug(rack, "hl")
        got = build(rack.dtype)
        with pytest.raises(plugin.PluginError, match="not the same table"):
            name = "weight_scale_2" if rack.dtype == "nvfp4" else "weight_scale"
            got.load_weights([(f"ngram_embedding.{name}", torch.tensor([0.5]))])


RANK = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
import numpy as np, torch
from _pytest.monkeypatch import MonkeyPatch
rank, port, config, table, dtype, node = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
dtype = None if dtype == "none" else dtype
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.config.engram import EngramConfig
from vllm.distributed import parallel_state as ps
import emulation
import test_vllm_qwen4exp as T
from conftest import read_rows
mp = MonkeyPatch()
emulation.fake_streams(mp)
T.typed_byte_pointers(mp)
cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
cfg.engram_config = EngramConfig(cpu_offload=True)
cfg.parallel_config.tensor_parallel_size = 2
os.environ.update(ENGRAM_RACK_CONFIG=config, ENGRAM_RACK_NODE=node, ENGRAM_RACK_METRICS="off")
with set_current_vllm_config(cfg):
    ps.init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel(2, 1)
    from engram_rack import vllm as plugin
    plugin.install()
    got = T.build(dtype)
    emb = got.ngram_embedding
    assert type(emb).__name__ == "RackPLEEmbedding"
    rows = T.table_rows()
    lo, hi = emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index
    assert (lo, hi) == ((0, rows // 2), (rows // 2, rows))[rank], (rank, lo, hi)
    if node == "far":  # the rank asks its ring for the rows it owns only
        assert emb.weight.shape[0] == 0 and emb._rack_own == (lo, hi)
    else:
        assert emb.weight.shape[0] == rows // 2
    full = torch.from_numpy(np.ascontiguousarray(read_rows(table, np.arange(rows))))
    if dtype == "nvfp4":  # vLLM's own decoding of the table's rows
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
            dequantize_to_dtype)
        full = dequantize_to_dtype(full[:, :80].contiguous(),
                                   full[:, 80:].contiguous().view(torch.float8_e4m3fn),
                                   torch.tensor([T.NVFP4_SCALE]), torch.bfloat16, swizzle=False)
    else:
        full = full.view(torch.float8_e4m3fn) if dtype else full.view(torch.bfloat16)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, T.VOCAB, 24).tolist()
    prompt[9] = T.EOS
    for requests in ([(prompt[:5], [prompt[5]]), (prompt[:10], prompt[10:20])],
                     [([], prompt[:12])]):
        ids, qsl, ctx = T.batch(requests)
        got.start_prefetch(ids, qsl, ctx)
        out = got(torch.zeros(len(ids), 8, dtype=torch.bfloat16), ids, qsl, ctx)
        # Each rank's rows, reduced over the two: every row, whichever rank owns it.
        want = full[got.compute_ngram_ids(ids, qsl, ctx)].flatten(-2)
        if want.dtype == torch.bfloat16:
            # vLLM sums decoded rows over the ranks (the owner's and the
            # other's zeros), which makes a -0 value +0.
            want = want + torch.zeros_like(want)
        assert T.same(out, want), rank
    ps.get_tp_group().barrier()
print("ok", rank, flush=True)
"""


@pytest.mark.parametrize("node", ["hl", "far"])
def test_two_etp_ranks_each_map_their_rows_and_reduce_to_the_table(qwen_rack, node):
    """vLLM with TP = ETP = 2 (two gloo ranks): each rank's table is its
    half of the rack's (rows [0, R/2) and [R/2, R)) over the donor's
    memory, or (`far`) its half through its engine ring (the rows it
    owns asked, the rest zeros), and vLLM's own ETP reduction gives every
    row of the table."""
    import subprocess
    import sys
    from pathlib import Path

    rack = qwen_rack
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("ENGRAM_RACK_SOCKET", None)  # each rank opens the node's tables itself
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port), str(rack.config),
                               str(rack.path), rack.dtype or "none", node],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=str(here))
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append((p.returncode, *p.communicate(timeout=600)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung")
    for p, (_, out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.startswith("ok"), err[-3000:]
