"""engram_rack.vllm against vLLM's own V4.1 Engram code, on CPU.

vLLM's hash kernel makes the row ids; vLLM's `Engram` with its in-memory
table (loaded from the same table file) is the reference; `RackEngram`, the
plugin's subclass built through vLLM's own constructor, fetches the rows from
a real donor. Rows, vLLM's packed lookup and `Engram.forward` must be
bit-identical, for decode, a chunked prefill, a mixed batch, DEAD positions,
a donor killed mid-run, and a donor serving another table version.
"""

from __future__ import annotations

import os

# Before torch or Triton is imported: Triton's interpreter runs vLLM's kernels
# on CPU tensors, and no CUDA device is looked for.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import copy  # noqa: E402
import signal  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

from conftest import (  # noqa: E402
    HASH_BASE,
    free_port,
    point_plugins_at,
    read_rows,
    write_config,
)

import engram_rack as er  # noqa: E402

E = pytest.importorskip("vllm.models.deepseek_v41.common.engram")
from torch import nn  # noqa: E402

from engram_rack import plugin as rack_plugin  # noqa: E402
from engram_rack import vllm as plugin  # noqa: E402

HIDDEN = 64
HC = 4
V41_COMPRESSED_VOCAB = 99_092


@pytest.fixture(scope="module")
def vctx():
    """vLLM's config and a one-rank process group, for the module."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    cfg.scheduler_config.max_num_batched_tokens = 64
    with set_current_vllm_config(cfg):
        if not ps.model_parallel_is_initialized():
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            ps.initialize_model_parallel(1, 1)
        yield cfg


def hf_config(rows=(0, 0)):
    return types.SimpleNamespace(
        engram_layer_ids=[1, 14], engram_num_embeddings=list(rows), engram_max_ngram_size=4,
        engram_n_heads=8, engram_head_dim=256,
        engram_compressed_vocab_size=V41_COMPRESSED_VOCAB, engram_pad_token_id=2,
        engram_vocab_size=HASH_BASE, hidden_size=HIDDEN, hc_mult=HC, rms_norm_eps=1e-6)


def hash_state(layout):
    """vLLM's `NgramHashState` on the V2 runner's path (every lookback id
    given), with an identity token map: ids are compressed ids."""
    hs = E.NgramHashState.__new__(E.NgramHashState)
    nn.Module.__init__(hs)
    hs.layout = layout
    hs.use_slot_cache = False
    hs.lookback_depth = layout.max_ngram_size - 1
    hs.block_size = 16
    hs._cache = None
    hs._kv_cache_ref = None
    hs.pad_id = layout.pad_token_id
    hs.register_buffer("token_map", torch.arange(V41_COMPRESSED_VOCAB, dtype=torch.int32))
    hs.register_buffer("primes", torch.tensor(layout.primes))
    hs.register_buffer("offsets", layout.offsets)
    hs.register_buffer("multipliers", E.compute_hash_multipliers(
        layout.layer_ids, layout.max_ngram_size, V41_COMPRESSED_VOCAB))
    return hs


def reference_table(path, rows: int, data=None):
    """vLLM's `ParallelEngramEmbedding` holding the table in memory, one rank."""
    t = E.ParallelEngramEmbedding.__new__(E.ParallelEngramEmbedding)
    nn.Module.__init__(t)
    if data is None:
        data = read_rows(path, np.arange(rows))
    t.cpu_offload = False
    t.dp_shared_memory = False
    t.use_thp = False
    t._packed = None
    t._shared_memory = None
    t._views = None
    t._view_src = None
    t.peer_rows = 0
    t.dp_size = 1
    t.tp_size = 1
    t.num_embeddings = rows
    t.dim = 256
    t.block_size = 32
    t.n_hash_cols = 24
    t.part_n_hash_cols = 24
    t.head_start = 0
    t.vocab_start_idx = 0
    t.vocab_end_idx = rows
    t.part_num_embeddings = rows
    t._num_sms = 4
    values = torch.from_numpy(np.ascontiguousarray(data[:, :256])).view(torch.float8_e4m3fn)
    t.weight = nn.Parameter(values, requires_grad=False)
    t.weight_scale_inv = nn.Parameter(torch.from_numpy(np.ascontiguousarray(data[:, 256:])),
                                      requires_grad=False)
    return t


class Pair:
    """The plugin's `Engram` (vLLM's class after `install()`) and vLLM's own
    `Engram` over its own in-memory table, one layer, sharing every weight
    but the table. `node` picks the route: `n` (a donor across the network:
    the ring), `hl` (a host-local planar donor: vLLM's kernel over its
    memory); `socket` reaches the rack through `inference-node engines`."""

    def __init__(self, vctx, rack, layer_index: int, node: str, socket=None):
        self.config = hf_config((rack_rows(rack, 1), rack_rows(rack, 14)))
        layout = E.EngramLayout(self.config)
        self.layout = layout
        point_plugins_at(rack, node, socket)
        rack_plugin.reset()
        cls = plugin.install()
        assert E.Engram is cls and cls.__module__ == "engram_rack.vllm"
        torch.manual_seed(7 + layer_index)
        # vLLM builds a V4.1 model with bf16 as the default dtype.
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            self.rack_layer = cls(self.config, None, layout, layer_index, False,
                                  f"model.layers.{layout.layer_ids[layer_index]}.engram")
        finally:
            torch.set_default_dtype(default)
        for p in (self.rack_layer.wkv.weight, self.rack_layer.q_weight, self.rack_layer.k_weight):
            p.data.copy_(torch.randn(p.shape) * 0.05)  # bf16: rounds
        ref = copy.copy(self.rack_layer)
        ref.__class__ = cls.__mro__[1]
        ref._modules = dict(self.rack_layer._modules)
        layer = layout.layer_ids[layer_index]
        ref._modules["embed_tokens"] = reference_table(rack.tables[layer], rack_rows(rack, layer))
        ref.staged_rows = torch.empty_like(self.rack_layer.staged_rows)
        ref._prefetch_stream = None
        ref._prefetch_done = None
        self.ref = ref
        self.layer_index = layer_index

    @property
    def remote(self) -> bool:
        return self.rack_layer.embed_tokens.ring is not None

    def step(self, hashes, hidden, mask):
        ids = hashes[:, self.layer_index]
        self.rack_layer.prepare_embeddings(ids)
        self.ref.prepare_embeddings(ids)
        got_rows = self.rack_layer._ready_rows(ids.shape[0]).clone()
        want_rows = self.ref._ready_rows(ids.shape[0]).clone()
        assert torch.equal(got_rows.view(torch.int16), want_rows.view(torch.int16))
        live = (ids >= 0).all(dim=1)
        assert bool((got_rows[live] != 0).any()) or not bool(live.any())
        # vLLM's packed lookup (FP8 bytes, then scales): the same bytes.
        want = torch.zeros(ids.shape[0], 24, 264, dtype=torch.uint8)
        got = torch.zeros(ids.shape[0], 24, 264, dtype=torch.uint8)
        self.ref.embed_tokens.lookup(ids, want)
        self.rack_layer.embed_tokens.lookup(ids, got)
        assert torch.equal(want, got)
        self.rack_layer.prepare_embeddings(ids)
        got = self.rack_layer(hidden, ids, mask)
        want = self.ref(hidden, ids, mask)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        return got


def rack_rows(rack, layer: int) -> int:
    text = rack.config.read_text()
    block = text.split(f"layer = {layer}\n", 1)[1]
    return int(block.split("rows = ", 1)[1].split("\n", 1)[0])


def vllm_hashes(hs, seqs):
    """vLLM's hash kernel for a batch: `seqs` is [(history, new_tokens, dead)]
    per request (history: the tokens before the chunk; dead: indices into
    new_tokens that are DEAD). Returns [T, 2, 24] int32 and the token mask."""
    ids, pos, starts, dead, lb, lbd = [], [], [0], [], [], []
    for history, new, dead_at in seqs:
        ids += list(new)
        pos += list(range(len(history), len(history) + len(new)))
        starts.append(len(ids))
        dead += [i in dead_at for i in range(len(new))]
        back = list(reversed(history[-3:])) + [-1] * (3 - len(history[-3:]))
        lb.append(back)
        lbd.append([False] * 3)
    out = hs(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
             torch.tensor(starts, dtype=torch.int32), torch.tensor(dead),
             torch.tensor(lb, dtype=torch.int64), torch.tensor(lbd), None, None)
    return out, ~torch.tensor(dead)


def hidden(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HC, HIDDEN, generator=g).to(torch.bfloat16)


def test_vllm_hashes_are_engram_racks_row_ids(rack, vctx):
    rack.start()
    hs = hash_state(E.EngramLayout(hf_config()))
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 5000, 12).tolist()
    got, _ = vllm_hashes(hs, [(tokens[:5], tokens[5:], ())])
    with er.Memory(rack.config, "n", metrics="off") as mem:
        want = mem.addresses(tokens[5:], context=tokens[:5])
    np.testing.assert_array_equal(got.numpy().astype(np.uint64), want)


@pytest.mark.parametrize("where", ["remote", "host-local", "engine socket"])
@pytest.mark.parametrize("layer_index", [0, 1])
def test_decode_prefill_and_mixed_batches_match_vllms_own_table(host_rack, vctx, layer_index,
                                                               where):
    rack = host_rack
    rack.start()
    socket = rack.engines("mixed").socket if where == "engine socket" else None
    node = {"remote": "n", "host-local": "hl", "engine socket": "mixed"}[where]
    pair = Pair(vctx, rack, layer_index, node, socket)
    assert pair.remote == (where == "remote" or (where == "engine socket" and layer_index == 1))
    hs = hash_state(pair.layout)
    rng = np.random.default_rng(11 + layer_index)
    prompt = rng.integers(0, 5000, 20).tolist()
    cases = {
        "decode": [(prompt[:k], [prompt[k]], ()) for k in (3, 9, 15)],
        "chunked prefill": [(prompt[:8], prompt[8:20], ())],
        "first chunk": [([], prompt[:8], ())],
        "mixed": [(prompt[:5], [prompt[5]], ()), (prompt[:10], prompt[10:18], ()),
                  ([], prompt[:3], ())],
        "dead positions": [(prompt[:6], prompt[6:14], (1, 2, 5)), (prompt[:2], [prompt[2]], (0,))],
        # MTP / speculative decoding: a verify step carries k + 1 positions
        # per request (the last accepted token and k = 2 drafts) ...
        "verify": [(prompt[:10], prompt[10:13], ()), (prompt[:4], prompt[4:7], ())],
        # ... and after a rejected draft the next step starts from the
        # accepted tokens only.
        "after a rejection": [(prompt[:11], [prompt[11], prompt[12], prompt[13]], ()),
                              (prompt[:5], prompt[5:8], ())],
    }
    for i, (name, seqs) in enumerate(cases.items()):
        hashes, mask = vllm_hashes(hs, seqs)
        out = pair.step(hashes, hidden(hashes.shape[0], i), mask)
        assert out.shape == (hashes.shape[0], HC, HIDDEN), name
    # vLLM's dummy hashes (a DP replica with no tokens): -1 everywhere, zero rows.
    dummy, keep = hs.dummy_hashes(torch.zeros(4, dtype=torch.int64))
    pair.step(dummy, hidden(4, 99), keep)


def test_a_donor_killed_mid_run_changes_nothing(rack, vctx):
    donor = rack.start()
    pair = Pair(vctx, rack, 0, "n")
    assert pair.remote
    hs = hash_state(pair.layout)
    rng = np.random.default_rng(21)
    seq = rng.integers(0, 5000, 40).tolist()
    for k in range(4, 24):
        if k == 12:
            donor.signal(signal.SIGKILL)
        hashes, mask = vllm_hashes(hs, [(seq[:k], [seq[k]], ()), (seq[:k // 2], seq[k // 2:k], ())])
        pair.step(hashes, hidden(hashes.shape[0], k), mask)
    stats = rack_plugin.link().memory.stats()[0]
    assert stats["failovers"] > 0, stats
    assert int(pair.rack_layer.embed_tokens.ring.failures.sum()) == 0


def test_a_donor_serving_another_table_version_is_refused(rack, vctx, tables):
    port = int(rack.config.read_text().split('listen = ["127.0.0.1:')[1].split('"')[0])
    other = write_config(rack.dir / "other.toml", tables, port, l1="l1-other")
    rack.start(config=other)
    # The donor alone: its version differs, so the node refuses to start on it.
    with pytest.raises(er.SetupError, match="another version"):
        Pair(vctx, rack, 0, "only-donor")
    hs = hash_state(E.EngramLayout(hf_config()))
    hashes, _ = vllm_hashes(hs, [([1, 2, 3], [4, 5], ())])
    # With the SSD copy behind it, the copy serves the right rows.
    pair = Pair(vctx, rack, 0, "n")
    pair.step(hashes, hidden(2, 5), torch.ones(2, dtype=torch.bool))


def test_the_plugin_is_off_without_config_and_refuses_what_it_cannot_run(monkeypatch, tmp_path):
    monkeypatch.delenv("ENGRAM_RACK_CONFIG", raising=False)
    monkeypatch.delenv("ENGRAM_RACK_SOCKET", raising=False)
    assert plugin.settings() is None
    plugin.register()  # off: nothing happens
    monkeypatch.setenv("ENGRAM_RACK_CONFIG", str(tmp_path / "missing.toml"))
    monkeypatch.setenv("ENGRAM_RACK_NODE", "n")
    with pytest.raises(plugin.PluginError, match="no such file"):
        plugin.register()
    monkeypatch.delenv("ENGRAM_RACK_NODE")
    with pytest.raises(plugin.PluginError, match="ENGRAM_RACK_NODE"):
        plugin.settings()
    with pytest.raises(plugin.PluginError, match="not supported"):
        plugin.check_version("0.32.1")
    plugin.check_version(vllm.__version__)


def test_vllm_loads_the_plugin_through_its_entry_point(monkeypatch, rack, vctx):
    """vLLM's own loader finds the entry point and runs register(), which
    rebinds `Engram` in the common and nvidia model modules."""
    from importlib.metadata import entry_points

    import vllm.plugins as loader

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "engram_rack"]
    assert eps and eps[0].value == "engram_rack.vllm:register"
    monkeypatch.setenv("ENGRAM_RACK_CONFIG", str(rack.config))
    monkeypatch.setenv("ENGRAM_RACK_NODE", "n")
    monkeypatch.setattr(loader, "plugins_loaded", False)
    loader.load_general_plugins()
    import vllm.models.deepseek_v41.nvidia.model as nvidia

    assert E.Engram.__module__ == "engram_rack.vllm"
    assert nvidia.Engram is E.Engram


def test_vllms_kernel_reads_a_scale_byte_of_0_as_0_where_the_reference_reads_2_to_the_minus_127():
    """The one difference from the V4.1 reference (docs/ENGRAM.md): vLLM's
    lookup builds a scale from its byte as an f32 exponent field, so byte 0
    is 0.0. engram_rack, SGLang and torch's float8_e8m0fnu give 2^-127."""
    row = np.zeros((1, 264), np.uint8)
    row[0, :256] = 0x38  # 1.0
    row[0, 256:] = [0, 127, 0, 127, 0, 127, 0, 127]
    table = reference_table(None, 1, data=row)
    out = torch.empty(1, 24, 256, dtype=torch.bfloat16)
    table.lookup(torch.zeros(1, 24, dtype=torch.int32), out)
    vllm_values = out[0, 0].float().numpy()
    ours = er.dequantize(row)[0]
    assert vllm_values[0] == 0.0 and ours[0] == 2.0 ** -127
    np.testing.assert_array_equal(vllm_values[32:64], ours[32:64])  # byte 127: both 1.0


def _scheduler(tmp_path):
    """vLLM's own scheduler for a tiny model config (no weights, no
    tokenizer): what fails a request on the engine core's side."""
    import json

    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}))
    cache = CacheConfig(block_size=16)
    cache.num_gpu_blocks = 64
    cfg = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, max_model_len=512,
                                 dtype="bfloat16"),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                         max_model_len=512, is_encoder_decoder=False),
        cache_config=cache, device_config=DeviceConfig(device="cpu"))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=16)


def test_a_step_without_its_rows_fails_its_requests_and_vllm_serves_on(
        monkeypatch, rack, vctx, tmp_path):
    """vLLM's model runner and scheduler after install(), with a ring served
    by a donor under the `fail` policy: the donor freezes during step 2,
    so step 2's ring request has no rows; before step 3 the runner posts
    step 2's requests (a, b) to the fault board, and vLLM's own scheduler
    finishes them with a retryable request error, while c, scheduled
    after, runs on; dummy runs (graph capture, profiling) fail nothing."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.worker import gpu_model_runner as runner

    from engram_rack import faults
    from engram_rack.ring import STATUS_OK, RingLookup

    board = tmp_path / "board"
    board.write_bytes(b"")
    monkeypatch.setenv(faults.BOARD_ENV, str(board))
    donor = rack.start()
    mem = er.Memory(rack.config, "only-donor", metrics="off")
    ring = RingLookup((1,), (0, 24), positions=4, device="cpu", deadline=3.0)
    handle = mem.serve_ring(ring.native)  # noqa: F841 - kept: dropping it lets the ring go

    def lookup():
        out = torch.zeros(2, 24, 256, dtype=torch.bfloat16)
        ring.lookup(1, torch.zeros(2, 24, dtype=torch.int64), out, scale0_zero=True)
        return int(ring.state[1])

    def execute_model(self, scheduler_output):
        lookup()  # the forward's Engram layer
        ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=[[7] for _ in ids])

    def dummy_run(self, *args, **kwargs):
        return lookup()

    monkeypatch.setattr(runner.GPUModelRunner, "execute_model", execute_model)
    monkeypatch.setattr(runner.GPUModelRunner, "_dummy_run", dummy_run)
    monkeypatch.setattr(faults, "_steps", None)
    plugin.install()
    step = runner.GPUModelRunner.execute_model
    dummy = runner.GPUModelRunner._dummy_run
    assert getattr(step, "engram_rack_wrapped", False)
    sched = _scheduler(tmp_path)
    assert getattr(type(sched).update_from_output, "engram_rack_wrapped", False)

    def one_step():
        out = sched.schedule()
        return out, sched.update_from_output(out, step(None, out))

    def finished(outputs):
        return {o.request_id: o for v in outputs.values() for o in v.outputs
                if o.finish_reason is not None}

    try:
        for r in "ab":
            sched.add_request(Request(r, list(range(1, 20)), SamplingParams(max_tokens=8), None))
        assert dummy(None) == STATUS_OK  # capture and profile runs: rows come
        out, res = one_step()
        assert set(out.num_scheduled_tokens) == {"a", "b"} and not finished(res)
        donor.hang()
        out, res = one_step()  # step 2: no rows (the donor is frozen)
        assert int(ring.state[1]) != STATUS_OK and not finished(res)
        assert dummy(None) != STATUS_OK  # a dummy run without rows: no request fails
        donor.signal(signal.SIGCONT)
        for _ in range(100):
            if dummy(None) == STATUS_OK:
                break
        sched.add_request(Request("c", list(range(1, 20)), SamplingParams(max_tokens=8), None))
        out, res = one_step()  # step 3: the runner posts step 2's requests first
        assert set(out.num_scheduled_tokens) == {"a", "b", "c"}
        assert int(ring.state[1]) == STATUS_OK
        done = finished(res)
        assert set(done) == {"a", "b"}, done
        for o in done.values():
            assert o.finish_reason.name == "ERROR"
            assert o.error.code == plugin.ERROR_CODE and o.error.retryable
            assert "rows did not come (request " in o.error.message
            assert "policy is fail" in o.error.message
        assert sched.requests["c"].status == RequestStatus.RUNNING
        assert "a" not in sched.requests and "b" not in sched.requests
        out, res = one_step()  # c serves on, alone
        assert set(out.num_scheduled_tokens) == {"c"} and not finished(res)
    finally:
        donor.signal(signal.SIGCONT)
        ring.close()
        mem.close()


def test_a_fault_no_request_can_be_named_for_stops_the_step(monkeypatch, rack, vctx):
    """A fault whose step the client could not tell (tag 0: a request it
    never took) stops the step with RingFault before it runs."""
    from vllm.v1.worker import gpu_model_runner as runner

    from engram_rack.ring import RingFault, RingLookup

    monkeypatch.setattr(runner.GPUModelRunner, "execute_model", lambda self, out: out)
    plugin.install()
    step = runner.GPUModelRunner.execute_model
    ring = RingLookup((1,), (0, 24), positions=2, device="cpu")
    try:
        assert step(None, "ran") == "ran"
        h64 = np.frombuffer(memoryview(ring.native), dtype=np.int64, count=512)
        h64[2304 // 8] = 7  # the log's first entry: request 7, step 0, section 0, failed
        h64[2304 // 8 + 2] = 2 << 32
        h64[13] += 1
        with pytest.raises(RingFault, match="request 7, layer 1, failed"):
            step(None, "ran")
        assert step(None, "ran") == "ran"
    finally:
        ring.close()
