"""engram_rack.sglang against SGLang's own Qwen4Exp n-gram embedding, on CPU.

SGLang's `Qwen4ExpNGramEmbedding` with its offloaded table in SGLang's own
host storage (its file-backed mapping), written row shard by row shard as
SGLang's loader writes the checkpoint's `ngram_embedding.shard_N`, is the
reference; the same class built after the plugin's hooks are applied by
SGLang's own `HookRegistry` reads the rack's table (a host-local donor's
memory, or the node's local copy) through SGLang's own gather kernel
(Triton's interpreter). SGLang's hashing gives the ids (decode windows,
a chunk, EOS inside); the lookup and `_embed_ngram_ids` (rows times the
table's scale) must be bit-identical, for FP8 and BF16 tables; the
model's loader skips the rack's shards and checks its scale.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
sglang = pytest.importorskip("sglang")
S = pytest.importorskip("sglang.srt.models.qwen4_exp")

from conftest import mapping_of, ple_rack, plug, read_rows  # noqa: E402

from engram_rack import plugin as rack_plugin  # noqa: E402
from engram_rack import sglang as plugin  # noqa: E402
from engram_rack import sglang_qwen4exp as ple  # noqa: E402

VOCAB = 248_320
BASE = 1_000
EOS = 248_044
HEAD_DIM = 160
HEADS = 16
PARTS = 4
SCALE = 0.0123
LAYER = 3
PREFIX = f"model.layers.{LAYER - 1}.ple.ple_embedding"
DTYPES = {"float8_e4m3fn": "fp8_per_tensorx160", None: "bf16x160"}


@pytest.fixture(autouse=True, scope="module")
def one_rank():
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=1, tp_rank=0, attn_dp_size=1, attn_cp_size=1,
                                        tp_group=None)
    yield
    get_parallel().clear_stamp()


@pytest.fixture
def hooks():
    """The plugin's Qwen4Exp hooks applied by SGLang's own registry (undone after)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    import sglang.srt.models.qwen4_exp_ple_table as T

    cls = S.Qwen4ExpNGramEmbedding
    saved = (cls.__init__, S.allocate_ple_host_table,
             S.Qwen4ExpForConditionalGeneration.load_weights, S.Qwen4ExpPinnedHostEmbedding.gather)
    HookRegistry.reset()
    ple.install(HookRegistry, HookType)
    HookRegistry.apply_hooks()
    yield
    cls.__init__, S.allocate_ple_host_table = saved[0], saved[1]
    T.allocate_ple_host_table = saved[1]
    S.Qwen4ExpForConditionalGeneration.load_weights = saved[2]
    S.Qwen4ExpPinnedHostEmbedding.gather = saved[3]
    HookRegistry.reset()


def hf_config(dtype, tmp_path, base=BASE):
    return types.SimpleNamespace(
        ngram_size=3, heads_per_ngram=8, vocab_size=VOCAB, ngram_vocab_size_base=base,
        make_ngram_vocab_size_divisible_by=128, eos_token_id=EOS, seed=1234,
        ple_offload_embedding=True, ple_offload_backend="file", ple_offload_dir=str(tmp_path),
        ple_embedding_dtype=dtype, ple_layer_ids=[LAYER, 9])


def build(cfg):
    return S.Qwen4ExpNGramEmbedding(cfg, HEADS * HEAD_DIM, ple_layer_index=0, quant_config=None,
                                    prefix=PREFIX)


@pytest.fixture(params=list(DTYPES), ids=["fp8", "bf16"])
def qwen_rack(request, tmp_path):
    """One PLE table (model layer 3), donor `h` (TCP and a host socket),
    nodes `hl` (h), `own` (a local copy) and `far` (donor `d` only)."""
    dtype = request.param
    enc = DTYPES[dtype]
    ref = build(hf_config(dtype, tmp_path / "ref"))  # SGLang's own, before any hook
    rows = ref.ngram_embedding.weight.shape[0]
    scale = SCALE if dtype else None
    config, path, donors = ple_rack(tmp_path, LAYER, rows, enc, scale, EOS, BASE)
    # The reference's table: the checkpoint's shards, written as SGLang's loader does.
    data = read_rows(path, np.arange(rows))
    t = torch.from_numpy(np.ascontiguousarray(data))
    t = t.view(torch.float8_e4m3fn) if dtype else t.view(torch.bfloat16)
    size = -(-rows // PARTS)
    shards = [(f"{PREFIX}.ngram_embedding.shard_{i}.weight", t[i * size:(i + 1) * size].clone())
              for i in range(PARTS)]
    for i, (_, w) in enumerate(shards):
        ref.ngram_embedding.weight.data[i * size:i * size + w.shape[0]].copy_(w)
    if scale:
        ref.ngram_embedding.weight_scale.fill_(scale)
    rack = types.SimpleNamespace(config=config, dtype=dtype, scale=scale, ref=ref, rows=rows,
                                 shards=shards, tmp=tmp_path, donors=donors)
    yield rack
    rack_plugin.reset()
    if getattr(rack, "engines", None) is not None:
        rack.engines.stop()
    for d in donors:
        d.stop()


def windows(seq_before, tokens):
    """SGLang's hash windows of a chunk: each position's last 2n tokens of
    its request, EOS before the start."""
    seq = [EOS, EOS] + list(seq_before) + list(tokens)
    start = len(seq) - len(tokens)
    return [seq[max(0, p - 6):p + 1] for p in range(start, len(seq))]


def ids_of(m, requests):
    rows = []
    for before, tokens in requests:
        for w in windows(before, tokens):
            w = [EOS] * (7 - len(w)) + w
            rows.append(w)
    S.get_req_to_token_pool = lambda: types.SimpleNamespace(ple_window_cache=None)
    return m._hash_contexts(torch.tensor(rows, dtype=torch.long))


def same(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("node", ["hl", "own", "socket", "far", "far-socket"])
def test_lookups_equal_sglangs_own_offloaded_table(qwen_rack, hooks, node):
    """`far`: the table only across the network (donor `d` over TCP), its
    rows through an engine ring served by this process's own `Tables` or
    (`far-socket`) the host's `inference-node engines`."""
    rack = qwen_rack
    plug(rack, node)
    cfg = hf_config(rack.dtype, rack.tmp / "rack")
    cfg.ple_offload_embedding = False  # the plugin offloads: the rack's memory is host memory
    got = build(cfg)
    emb = got.ngram_embedding
    assert type(emb) is S.Qwen4ExpPinnedHostEmbedding and emb.engram_rack["table"] == 1
    if node.startswith("far"):
        # No rows here: an engine ring of the table's row size brings them.
        assert emb.engram_ring.row_bytes == HEAD_DIM * (1 if rack.dtype else 2)
        assert emb.weight.shape[0] == 0
    else:
        assert emb.engram_ring is None
        view = rack_plugin.tables().table_view(1)
        assert view.shared == (node != "own")
        if node == "socket":  # a mapping of its own of the donor's memfd
            assert mapping_of(emb.weight.data_ptr()).startswith("/memfd:")
        else:
            assert emb.weight.data_ptr() == np.frombuffer(view, dtype=np.uint8).ctypes.data
    assert same(emb.weight_scale, rack.ref.ngram_embedding.weight_scale)
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, VOCAB, 30).tolist()
    prompt[12] = prompt[20] = prompt[21] = EOS
    cases = {
        "decode": [(prompt[:k], [prompt[k]]) for k in (3, 13, 22)],
        "first chunk": [([], prompt[:9])],
        "chunked prefill": [(prompt[:9], prompt[9:25])],
        "after an EOS": [(prompt[:21], prompt[21:30])],
    }
    for name, requests in cases.items():
        ids = ids_of(got, requests)
        assert torch.equal(ids, ids_of(rack.ref, requests)), name
        out = emb(ids)
        assert same(out, rack.ref.ngram_embedding(ids)), name
        assert bool((out != 0).any()), name
        fb = types.SimpleNamespace()
        assert same(got._embed_ngram_ids(ids, fb, ids.shape[0]),
                    rack.ref._embed_ngram_ids(ids, fb, ids.shape[0])), name


def test_the_loader_skips_the_racks_rows_and_checks_its_scale(qwen_rack, hooks):
    rack = qwen_rack
    plug(rack, "hl")
    model = S.Qwen4ExpForConditionalGeneration.__new__(S.Qwen4ExpForConditionalGeneration)
    torch.nn.Module.__init__(model)
    model.add_module("ple", build(hf_config(rack.dtype, rack.tmp / "m")))
    seen = []

    def original(self, weights):
        seen.extend(name for name, _ in weights)

    prefix = "ple"
    weights = [(n.replace(PREFIX, prefix), w) for n, w in rack.shards]
    weights.append(("other.weight", torch.zeros(1)))
    if rack.scale:
        weights.append((f"{prefix}.ngram_embedding.weight_scale", torch.tensor([rack.scale])))
    ple.load_weights(original, model, weights)
    assert all(".shard_" not in n for n in seen) and "other.weight" in seen
    if rack.scale:
        with pytest.raises(plugin.PluginError, match="not the same table"):
            ple.load_weights(original, model,
                             [(f"{prefix}.ngram_embedding.weight_scale", torch.tensor([0.5]))])


def test_what_the_plugin_cannot_serve_is_refused_by_name(qwen_rack, hooks):
    rack = qwen_rack
    other = "bf16x160" if rack.dtype else "fp8_per_tensorx160"

    def refused(node, dtype, match, base=BASE):
        plug(rack, node)
        with pytest.raises(plugin.PluginError, match=match):
            build(hf_config(dtype, rack.tmp / "x", base))

    refused("hl", None if rack.dtype else "float8_e4m3fn", other)
    refused("hl", rack.dtype, "hashing", base=2 * BASE)


def test_a_remote_tables_rows_that_do_not_come_are_a_fault_not_wrong_rows(qwen_rack, hooks):
    """The table across the network only, its donor killed: zeros from
    the ring's gather, counted on the device, and a fault naming the PLE
    layer in the ring's log (policy `fail`), for the plugin to fail the
    step's requests."""
    from engram_rack import ring as rack_ring

    rack = qwen_rack
    plug(rack, "far")
    cfg = hf_config(rack.dtype, rack.tmp / "rack")
    emb = build(cfg).ngram_embedding
    ids = torch.randint(0, rack.rows, (5, HEADS))
    assert bool((emb(ids) != 0).any())
    rack.donors[1].stop()  # donor `d`, the table's only source
    out = emb(ids)
    assert not bool((out.view(torch.int16) != 0).any())
    assert int(emb.engram_ring.failures.sum()) == 1
    faults = emb.engram_ring.take_faults()
    assert [(f.layer, rack_ring.STATUS_NAMES[f.status]) for f in faults] == [(LAYER, "failed")]
