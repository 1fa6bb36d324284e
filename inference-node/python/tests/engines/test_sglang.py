"""engram_rack.sglang against SGLang's own V4.1 Engram code, on CPU.

SGLang's hasher (its host path, as the scheduler's stager runs it) makes the
row ids; SGLang's `Engram` with its own `EngramEmbedding` (loaded through its
own weight loader from the same table file) is the reference; the same
`Engram` built after the plugin's REPLACE hook fetches rows from a real
donor. Rows and `Engram.forward` (projection and gate) must be bit-identical.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import signal  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
sglang = pytest.importorskip("sglang")
SE = pytest.importorskip("sglang.srt.layers.engram")

from conftest import HASH_BASE, read_rows  # noqa: E402
from torch import nn  # noqa: E402

import engram_rack as er  # noqa: E402
from engram_rack import sglang as plugin  # noqa: E402
from engram_rack import vllm as common  # noqa: E402

HIDDEN = 64
HC = 4
V41_COMPRESSED_VOCAB = 99_092
ORIGINAL = SE.EngramEmbedding


@pytest.fixture(autouse=True, scope="module")
def one_rank():
    """One tensor-parallel rank, as a single-GPU SGLang process publishes."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=1, tp_rank=0, attn_dp_size=1, attn_cp_size=1)
    yield
    get_parallel().clear_stamp()


def hf_config():
    return types.SimpleNamespace(
        engram_layer_ids=[1, 14], engram_num_embeddings=[0, 0], engram_max_ngram_size=4,
        engram_n_heads=8, engram_head_dim=256,
        engram_compressed_vocab_size=V41_COMPRESSED_VOCAB, engram_pad_token_id=2,
        engram_vocab_size=HASH_BASE, hidden_size=HIDDEN, hc_mult=HC, rms_norm_eps=1e-6)


def layout(rows):
    base = SE.EngramLayout.from_config(hf_config())
    return SE.EngramLayout(max_ngram_size=base.max_ngram_size, layer_ids=base.layer_ids,
                           num_embeddings=tuple(rows), primes=base.primes,
                           n_heads=base.n_heads, head_dim=base.head_dim)


def hasher(lay):
    """SGLang's `EngramHasher` with an identity token map."""
    h = SE.EngramHasher.__new__(SE.EngramHasher)
    nn.Module.__init__(h)
    h.max_ngram_size = lay.max_ngram_size
    h.pad_id = 2
    flat = [[p for per in layer for p in per] for layer in lay.primes]
    offsets = np.array([np.cumsum([0, *sizes[:-1]]) for sizes in flat])
    h.register_buffer("token_map", torch.arange(V41_COMPRESSED_VOCAB))
    h.register_buffer("multipliers", SE.compute_hash_multipliers(
        lay.layer_ids, lay.max_ngram_size, V41_COMPRESSED_VOCAB))
    h.register_buffer("primes", torch.tensor(lay.primes))
    h.register_buffer("offsets", torch.tensor(offsets))
    h.image_token_id = None
    h.history = None
    h._cpu_hash_params = None
    return h


def windows(seqs, n=4):
    """The stager's host windows: [(history, new_tokens)] -> tokens [T, n]
    (column s the s-th predecessor), blocked [T, n]."""
    tokens, positions = [], []
    for history, new in seqs:
        seq = list(history) + list(new)
        for i in range(len(history), len(seq)):
            tokens.append([seq[i - s] if i - s >= 0 else 0 for s in range(n)])
            positions.append(i)
    pos = torch.tensor(positions)
    return torch.tensor(tokens, dtype=torch.int64), pos.unsqueeze(-1) < torch.arange(n)


def table_rows(rack, layer):
    text = rack.config.read_text()
    block = text.split(f"layer = {layer}\n", 1)[1]
    return int(block.split("rows = ", 1)[1].split("\n", 1)[0])


class Pair:
    """SGLang's `Engram` over its own table and the same class built with the
    plugin's embedding, sharing the projection and gate weights."""

    def __init__(self, rack, layer_id: int, node: str):
        rows = [table_rows(rack, 1), table_rows(rack, 14)]
        self.layout = layout(rows)
        SE.EngramEmbedding = ORIGINAL
        torch.manual_seed(layer_id)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            self.ref = SE.Engram(hf_config(), layer_id, self.layout, prefix="e")
            data = torch.from_numpy(read_rows(rack.tables[layer_id], np.arange(rows[layer_id != 1])))
            emb = self.ref.embed
            emb.weight.weight_loader(emb.weight, data[:, :256].contiguous().view(torch.float8_e4m3fn))
            emb.scale.weight_loader(emb.scale, data[:, 256:].contiguous().view(torch.float8_e8m0fnu))
            for p in (self.ref.wkv.weight, self.ref.q_weight, self.ref.k_weight):
                p.data.copy_(torch.randn(p.shape) * 0.05)
            os.environ.update(ENGRAM_RACK_CONFIG=str(rack.config), ENGRAM_RACK_NODE=node,
                              ENGRAM_RACK_METRICS="off")
            common._memory = None
            SE.EngramEmbedding = plugin.embedding_class()
            self.rack = SE.Engram(hf_config(), layer_id, self.layout, prefix="e")
        finally:
            torch.set_default_dtype(default)
            SE.EngramEmbedding = ORIGINAL
        self.rack.load_state_dict(
            {k: v for k, v in self.ref.state_dict().items() if not k.startswith("embed.")},
            strict=False)
        self.index = self.layout.layer_ids.index(layer_id)

    def step(self, ids, x, prefetch: bool):
        layer_ids = ids[:, self.index]
        if prefetch:
            plugin.prefetch_after_hash(ids)
        got_rows = self.rack.embed(layer_ids)
        want_rows = self.ref.embed(layer_ids)
        assert torch.equal(got_rows.view(torch.int16), want_rows.view(torch.int16))
        assert bool((got_rows != 0).any())
        if prefetch:
            plugin.prefetch_after_hash(ids)
        got = self.rack(x, layer_ids, None, input_ids=torch.zeros(ids.shape[0], dtype=torch.int64))
        want = self.ref(x, layer_ids, None, input_ids=torch.zeros(ids.shape[0], dtype=torch.int64))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def hidden(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HC, HIDDEN, generator=g).to(torch.bfloat16)


def test_sglang_hashes_are_engram_racks_row_ids(rack):
    rack.start()
    h = hasher(layout([0, 0]))
    rng = np.random.default_rng(4)
    seq = rng.integers(0, 5000, 12).tolist()
    ids, _ = h.hash_windows(*windows([(seq[:5], seq[5:])]))
    with er.Memory(rack.config, "n", metrics="off") as mem:
        want = mem.addresses(seq[5:], context=seq[:5])
    np.testing.assert_array_equal(ids.numpy().astype(np.uint64), want)


@pytest.mark.parametrize("layer_id", [1, 14])
def test_decode_prefill_and_mixed_batches_match_sglangs_own_table(rack, layer_id):
    rack.start()
    pair = Pair(rack, layer_id, "n")
    h = hasher(pair.layout)
    rng = np.random.default_rng(30 + layer_id)
    p = rng.integers(0, 5000, 20).tolist()
    cases = [
        [(p[:k], [p[k]]) for k in (3, 9, 15)],  # decode
        [(p[:8], p[8:20])],  # a chunked prefill
        [([], p[:8])],  # a first chunk
        [(p[:5], [p[5]]), (p[:10], p[10:18]), ([], p[:3])],  # mixed
    ]
    for i, seqs in enumerate(cases):
        ids, _ = h.hash_windows(*windows(seqs))
        pair.step(ids, hidden(ids.shape[0], i), prefetch=i % 2 == 0)


def test_a_donor_killed_mid_run_changes_nothing(rack):
    donor = rack.start()
    pair = Pair(rack, 1, "n")
    h = hasher(pair.layout)
    seq = np.random.default_rng(8).integers(0, 5000, 30).tolist()
    served = []
    for k in range(4, 20):
        if k == 10:
            donor.signal(signal.SIGKILL)
        ids, _ = h.hash_windows(*windows([(seq[:k], [seq[k]]), (seq[:2], seq[2:k])]))
        pair.step(ids, hidden(ids.shape[0], k), prefetch=True)
        served.append(set(pair.rack.embed._rows.last_served.sources))
    assert "d" in set().union(*served[:6]), served
    assert "d" not in set().union(*served[7:]) and "ssd" in set().union(*served[7:]), served


def test_registration_goes_through_sglangs_hook_registry(monkeypatch, rack):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    monkeypatch.delenv("ENGRAM_RACK_CONFIG", raising=False)
    plugin.register()  # off
    assert not plugin._registered
    monkeypatch.setenv("ENGRAM_RACK_CONFIG", str(rack.config))
    monkeypatch.setenv("ENGRAM_RACK_NODE", "n")
    plugin.register()
    hooks = HookRegistry._hooks
    assert [t for t, _, _ in hooks[plugin.EMBEDDING]] == [HookType.REPLACE]
    assert [t for t, _, _ in hooks[plugin.HASHER_FORWARD]] == [HookType.AFTER]
    with pytest.raises(common.PluginError, match="not supported"):
        plugin.check_version("0.5.22")
    plugin.check_version(sglang.__version__)


def test_sglang_loads_the_plugin_through_its_entry_point(monkeypatch, rack):
    """SGLang's own loader finds the entry point, runs register(), and its
    `apply_hooks` puts the plugin's embedding where `Engram` looks it up."""
    from importlib.metadata import entry_points

    import sglang.srt.plugins as loader
    from sglang.srt.plugins.hook_registry import HookRegistry

    eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "engram_rack"]
    assert eps and eps[0].value == "engram_rack.sglang:register"
    monkeypatch.setenv("ENGRAM_RACK_CONFIG", str(rack.config))
    monkeypatch.setenv("ENGRAM_RACK_NODE", "n")
    monkeypatch.setattr(loader, "_plugins_loaded", False)
    loader.load_plugins()
    HookRegistry.apply_hooks()
    try:
        assert SE.EngramEmbedding.__module__ == "engram_rack.sglang"
    finally:
        SE.EngramEmbedding = ORIGINAL


def test_a_donor_serving_another_table_version_is_refused(rack, tables):
    from conftest import write_config

    port = int(rack.config.read_text().split('listen = ["127.0.0.1:')[1].split('"')[0])
    rack.start(config=write_config(rack.dir / "other.toml", tables, port, l1="l1-other"))
    with pytest.raises(er.SetupError, match="another version"):
        Pair(rack, 1, "only-donor").step(*_one_step(), prefetch=False)
    pair = Pair(rack, 1, "n")  # the SSD copy behind it serves the right rows
    pair.step(*_one_step(), prefetch=False)


def _one_step():
    h = hasher(layout([0, 0]))
    ids, _ = h.hash_windows(*windows([([1, 2, 3], [4, 5])]))
    return ids, hidden(2, 3)
