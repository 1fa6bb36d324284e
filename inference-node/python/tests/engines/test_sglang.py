"""engram_rack.sglang against SGLang's own V4.1 Engram code, on CPU.

SGLang's hasher makes the row ids; SGLang's `Engram` over its own table
(loaded through its own weight loader from the same table file) is the
reference; the same `Engram`, built after the plugin's hooks are applied by
SGLang's own `HookRegistry`, reads the rack: a host-local donor's planar
memory through SGLang's own gather kernel, or a remote table through the
engine ring. Rows and `Engram.forward` must be bit-identical, for decode,
prefill, mixed batches, with and without the hasher's early publish; the
plugin joins no collective under DP attention (two gloo ranks with unequal
and idle batches); a captured decode has no host sync.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import signal  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
sglang = pytest.importorskip("sglang")
SE = pytest.importorskip("sglang.srt.layers.engram")

from conftest import HASH_BASE, point_plugins_at, read_rows  # noqa: E402
from torch import nn  # noqa: E402

import engram_rack as er  # noqa: E402
from engram_rack import plugin as rack_plugin  # noqa: E402
from engram_rack import sglang as plugin  # noqa: E402

HIDDEN = 64
HC = 4
V41_COMPRESSED_VOCAB = 99_092


@pytest.fixture(autouse=True, scope="module")
def one_rank():
    """One tensor-parallel rank, as a single-GPU SGLang process publishes."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=1, tp_rank=0, attn_dp_size=1, attn_cp_size=1,
                                        tp_group=None)
    yield
    get_parallel().clear_stamp()


@pytest.fixture
def hooks(monkeypatch):
    """The plugin's hooks applied by SGLang's own registry (undone after),
    and the GPU queries SGLang's host table makes answered for CPU."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    originals = {name: getattr(mod, attr) for name, (mod, attr) in _targets().items()}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(SE, "_sorted_host_reads", lambda device: False)
    HookRegistry.reset()
    plugin._registered = False
    yield HookRegistry
    for name, (mod, attr) in _targets().items():
        setattr(mod, attr, originals[name])
        if mod is not SE and hasattr(SE, attr):
            setattr(SE, attr, originals[name])
    HookRegistry.reset()
    plugin._registered = False
    plugin._remote.clear()
    plugin._ring = None
    for k in ("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"):
        os.environ.pop(k, None)


def _targets():
    import sglang.kernels.ops.embeddings.engram_gather as G
    import sglang.srt.layers.engram_staging as ST
    import sglang.srt.model_loader.weight_utils as W

    targets = {"host": (SE, "_HostTable"), "gather": (G, "engram_gather"),
               "hash": (SE.EngramHasher, "forward"), "load": (SE.EngramEmbedding, "_load_rows"),
               "dummy": (W, "initialize_dummy_weights"), "stager": (ST, "EngramRowStager")}
    try:  # the plugin's Qwen4Exp hooks (engram_rack.sglang_qwen4exp), where SGLang has it
        import sglang.srt.models.qwen4_exp as Q
        import sglang.srt.models.qwen4_exp_ple_table as QT
    except ImportError:
        return targets
    return {**targets, "ple init": (Q.Qwen4ExpNGramEmbedding, "__init__"),
            "ple table": (Q, "allocate_ple_host_table"),
            "ple table source": (QT, "allocate_ple_host_table"),
            "ple load": (Q.Qwen4ExpForConditionalGeneration, "load_weights"),
            "ple gather": (Q.Qwen4ExpPinnedHostEmbedding, "gather")}


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


def reference_rows(rack, layer, ids):
    """SGLang's own gather kernel over SGLang's own table (loaded from the
    table file): `[T, 24, 256]` bf16."""
    rows = read_rows(rack.tables[layer], np.arange(table_rows(rack, layer)))
    w = torch.from_numpy(np.ascontiguousarray(rows[:, :256]))
    s = torch.from_numpy(np.ascontiguousarray(rows[:, 256:]))
    out = torch.empty(ids.numel(), 256, dtype=torch.bfloat16)
    plugin.gather_on_cpu(w.data_ptr(), s.data_ptr(), ids.reshape(-1), out, 256, 32)
    return out.view(*ids.shape, 256)


class Pair:
    """SGLang's `Engram` over its own table and the same class built with
    the plugin's hooks applied, sharing the projection and gate weights."""

    def __init__(self, rack, layer_id: int, node: str, hooks, socket=None, fresh=True):
        rows = [table_rows(rack, 1), table_rows(rack, 14)]
        self.layout = layout(rows)
        self.rack_ref = rack
        self.layer_id = layer_id
        torch.manual_seed(layer_id)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            self.ref = SE.Engram(hf_config(), layer_id, self.layout, prefix="e")
            for p in (self.ref.wkv.weight, self.ref.q_weight, self.ref.k_weight):
                p.data.copy_(torch.randn(p.shape) * 0.05)
            point_plugins_at(rack, node, socket)
            if fresh:  # else: the same link and hooks as the pair before
                rack_plugin.reset()
                plugin.register()
                hooks.apply_hooks()
            self.rack = SE.Engram(hf_config(), layer_id, self.layout, prefix="e")
        finally:
            torch.set_default_dtype(default)
        self.rack.load_state_dict(
            {k: v for k, v in self.ref.state_dict().items() if not k.startswith("embed.")},
            strict=False)
        self.index = self.layout.layer_ids.index(layer_id)

    @property
    def remote(self) -> bool:
        return self.rack.embed.host_table.table is None

    def step(self, ids, x, publish: bool):
        layer_ids = ids[:, self.index]
        if publish:
            plugin.publish_after_hash(ids)
        got_rows = self.rack.embed(layer_ids)
        want_rows = reference_rows(self.rack_ref, self.layer_id, layer_ids)
        assert torch.equal(got_rows.view(torch.int16), want_rows.view(torch.int16))
        assert bool((got_rows != 0).any())
        if publish:
            plugin.publish_after_hash(ids)
        got = self.rack(x, layer_ids, None, input_ids=torch.zeros(ids.shape[0], dtype=torch.int64))
        # The reference's gate over the reference rows.
        kv, _ = self.ref.wkv(want_rows.flatten(-2))
        want = SE.engram_gate(x, kv, self.ref.q_weight, self.ref.k_weight, self.ref.eps,
                              self.ref.clamp_value)
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


@pytest.mark.parametrize("where", ["remote", "host-local", "engine socket"])
@pytest.mark.parametrize("layer_id", [1, 14])
def test_decode_prefill_and_mixed_batches_match_sglangs_own_table(host_rack, hooks, layer_id,
                                                                  where):
    rack = host_rack
    rack.start()
    socket = rack.engines("mixed").socket if where == "engine socket" else None
    node = {"remote": "n", "host-local": "hl", "engine socket": "mixed"}[where]
    pair = Pair(rack, layer_id, node, hooks, socket)
    assert pair.remote == (where == "remote" or (where == "engine socket" and layer_id == 14))
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
        pair.step(ids, hidden(ids.shape[0], i), publish=i % 2 == 0)


def test_a_donor_killed_mid_run_changes_nothing(host_rack, hooks):
    donor = host_rack.start()
    pair = Pair(host_rack, 1, "n", hooks)
    assert pair.remote
    h = hasher(pair.layout)
    seq = np.random.default_rng(8).integers(0, 5000, 30).tolist()
    for k in range(4, 20):
        if k == 10:
            donor.signal(signal.SIGKILL)
        ids, _ = h.hash_windows(*windows([(seq[:k], [seq[k]]), (seq[:2], seq[2:k])]))
        pair.step(ids, hidden(ids.shape[0], k), publish=True)
    assert rack_plugin.link().memory.stats()[0]["failovers"] > 0


def test_registration_goes_through_sglangs_hook_registry(monkeypatch, rack, hooks):
    from sglang.srt.plugins.hook_registry import HookType

    monkeypatch.delenv("ENGRAM_RACK_CONFIG", raising=False)
    monkeypatch.delenv("ENGRAM_RACK_SOCKET", raising=False)
    plugin.register()  # off
    assert not plugin._registered
    monkeypatch.setenv("ENGRAM_RACK_CONFIG", str(rack.config))
    monkeypatch.setenv("ENGRAM_RACK_NODE", "n")
    plugin.register()
    h = hooks._hooks
    assert [t for t, _, _ in h[plugin.HOST_TABLE]] == [HookType.REPLACE]
    assert [t for t, _, _ in h[plugin.GATHER]] == [HookType.AROUND]
    assert [t for t, _, _ in h[plugin.HASHER_FORWARD]] == [HookType.AFTER]
    assert [t for t, _, _ in h[plugin.RUNNER_FORWARD]] == [HookType.BEFORE]
    assert [t for t, _, _ in h[plugin.STAGER]] == [HookType.REPLACE]
    with pytest.raises(plugin.PluginError, match="not supported"):
        plugin.check_version("0.5.22")
    plugin.check_version(sglang.__version__)


def test_plugin_errors_stop_sglang(monkeypatch, tmp_path, hooks):
    """SGLang logs and ignores a plugin's exceptions: a misconfigured rack
    must end the process instead of running SGLang without it."""
    monkeypatch.delenv("ENGRAM_RACK_SOCKET", raising=False)
    monkeypatch.setenv("ENGRAM_RACK_CONFIG", str(tmp_path / "missing.toml"))
    monkeypatch.setenv("ENGRAM_RACK_NODE", "n")
    with pytest.raises(SystemExit, match="no such file"):
        plugin.register()


def test_sglang_loads_the_plugin_through_its_entry_point(monkeypatch, rack, hooks):
    from importlib.metadata import entry_points

    import sglang.srt.plugins as loader

    eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "engram_rack"]
    assert eps and eps[0].value == "engram_rack.sglang:register"
    monkeypatch.delenv("ENGRAM_RACK_SOCKET", raising=False)
    monkeypatch.setenv("ENGRAM_RACK_CONFIG", str(rack.config))
    monkeypatch.setenv("ENGRAM_RACK_NODE", "n")
    monkeypatch.setattr(loader, "_plugins_loaded", False)
    loader.load_plugins()
    assert SE._HostTable is plugin.RackHostTable
    assert os.environ["SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"] == "shared"


def test_a_donor_serving_another_table_version_is_refused(rack, tables, hooks):
    from conftest import write_config

    port = int(rack.config.read_text().split('listen = ["127.0.0.1:')[1].split('"')[0])
    rack.start(config=write_config(rack.dir / "other.toml", tables, port, l1="l1-other"))
    with pytest.raises(er.SetupError, match="another version"):
        Pair(rack, 1, "only-donor", hooks)


def _abort_on_a_rank(abort, reqs):
    """SGLang's own `Scheduler.abort_request` applied to running requests
    `reqs` (what every rank does with an abort the broadcast brought)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler

    rank = types.SimpleNamespace(
        chunked_req=None, mm_receiver=None, waiting_queue=[], dllm_config=None,
        grammar_manager=types.SimpleNamespace(abort_requests=lambda r: None),
        disaggregation_mode=DisaggregationMode.NULL, collect_inflight_reqs=lambda: reqs)
    Scheduler.abort_request(rank, abort)


def test_a_forward_without_its_rows_aborts_its_requests_and_sglang_serves_on(
        rack, hooks, tmp_path, monkeypatch):
    """`ModelRunner.forward` and `Scheduler._poll_timeout_aborts` through the
    registry's BEFORE and AFTER hooks, with a ring served by a donor under
    the `fail` policy: the donor freezes during the forward of r3, so
    before the next forward its requests go to the fault board, and the
    group leader's poll turns them into aborts with the rack's message
    (HTTP 503) that SGLang's own `abort_request` applies on every rank;
    r4 runs on. A fault no request can be named for stops SGLang."""
    from http import HTTPStatus

    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    from engram_rack import faults
    from engram_rack.ring import STATUS_OK, RingFault, RingLookup

    board = tmp_path / "board"
    board.write_bytes(b"")
    monkeypatch.setenv(faults.BOARD_ENV, str(board))
    monkeypatch.setattr(faults, "_steps", None)
    donor = rack.start()
    mem = er.Memory(rack.config, "only-donor", metrics="off")
    ring = RingLookup((14,), (0, 24), positions=4, device="cpu", deadline=3.0)
    handle = mem.serve_ring(ring.native)  # noqa: F841 - kept: dropping it lets the ring go

    def model_forward(self, batch):
        out = torch.zeros(2, 24, 256, dtype=torch.bfloat16)
        ring.lookup(14, torch.zeros(2, 24, dtype=torch.int64), out, scale0_zero=False)
        return int(ring.state[1])

    forward = _wrap_fn(model_forward, plugin.check_rings, HookType.BEFORE)
    poll = _wrap_fn(lambda self: [], plugin.board_aborts, HookType.AFTER)
    batch = lambda *rids: types.SimpleNamespace(rids=list(rids))  # noqa: E731
    try:
        assert forward(None, batch("r1", "r2")) == STATUS_OK
        assert poll(None) == []
        donor.hang()
        assert forward(None, batch("r3")) != STATUS_OK
        assert forward(None, types.SimpleNamespace(rids=None)) != STATUS_OK  # idle: fails none
        donor.signal(signal.SIGCONT)
        for _ in range(100):
            if forward(None, batch("r4")) == STATUS_OK:
                break
        aborts = poll(None)
        assert [a.rid for a in aborts] == ["r3"], aborts
        assert all(isinstance(a, AbortReq) for a in aborts)
        assert "rows did not come (request " in aborts[0].abort_message
        assert poll(None) == [], "each is aborted once"
        running = [types.SimpleNamespace(rid=r, to_finish=None, finished=lambda: False)
                   for r in ("r3", "r4")]
        _abort_on_a_rank(aborts[0], running)
        r3, r4 = running
        assert r3.to_finish is not None and r4.to_finish is None
        assert r3.to_finish.status_code == HTTPStatus.SERVICE_UNAVAILABLE
        assert r3.to_finish.message == aborts[0].abort_message
        # A fault whose step the client could not tell (tag 0).
        h64 = np.frombuffer(memoryview(ring.native), dtype=np.int64, count=512)
        n = int(h64[13])
        at = (2304 + (n % 32) * 32) // 8
        h64[at], h64[at + 1], h64[at + 2] = 9, 0, 2 << 32
        h64[13] = n + 1
        with pytest.raises(RingFault, match="request 9, layer 14, failed"):
            forward(None, batch("r5"))
    finally:
        donor.signal(signal.SIGCONT)
        ring.close()
        mem.close()


def test_a_prefill_without_its_rows_fails_its_requests(rack, hooks, tmp_path, monkeypatch):
    """The scheduler's stager with the donor frozen under `fail`: zeros are
    staged and the batch's requests go to the fault board; with no board,
    RingFault stops SGLang."""
    import sglang.srt.layers.engram_staging as ST
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from engram_rack import faults
    from engram_rack.ring import RingFault

    board = tmp_path / "board"
    board.write_bytes(b"")
    monkeypatch.setenv(faults.BOARD_ENV, str(board))
    donor = rack.start()
    p1 = Pair(rack, 1, "only-donor", hooks)
    p14 = Pair(rack, 14, "only-donor", hooks, fresh=False)
    assert p1.remote and p14.remote
    h = hasher(p1.layout)
    stager = ST.EngramRowStager.from_model(nn.ModuleList([p14.rack, p1.rack]), h,
                                          torch.device("cpu"))
    tokens = list(range(10, 19))
    req = lambda rid: types.SimpleNamespace(rid=rid, full_untruncated_fill_ids=tokens)  # noqa
    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=[req("p1"), req("p2")],
                                  prefix_lens=[0, 0], extend_lens=[9, 9],
                                  encoder_swa_reset=None)
    try:
        assert bool(stager.stage(batch)[0][0].any())
        donor.hang()
        staged = stager.stage(batch)
        for values, scales, _ in staged:
            assert values.shape == (18 * 24, 256) and not bool(values.any())
            assert not bool(scales.any())
        got = faults.board().take()
        assert [r for r, _ in got] == ["p1", "p2"] * 2  # each layer's rows
        assert "prefill, layer " in got[0][1]
        monkeypatch.setenv(faults.BOARD_ENV, str(tmp_path / "gone" / "board"))
        with pytest.raises(RingFault, match="prefill's rows did not come"):
            stager.stage(batch)
    finally:
        donor.signal(signal.SIGCONT)


def test_a_prefills_remote_rows_are_staged_by_the_scheduler(rack, hooks):
    """SGLang's scheduler stager, replaced where the tables are remote: an
    extend batch's rows come from the rack before the forward, as SGLang's
    own dequantization of staged rows reads them; decode batches are left
    to the ring, and a staged batch publishes no ring request."""
    import sglang.srt.layers.engram_staging as ST
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rack.start()
    p1 = Pair(rack, 1, "n", hooks)
    p14 = Pair(rack, 14, "n", hooks, fresh=False)
    assert p1.remote and p14.remote
    assert ST.EngramRowStager.__name__ == "RackRowStager"
    h = hasher(p1.layout)
    stager = ST.EngramRowStager.from_model(nn.ModuleList([p14.rack, p1.rack]), h,
                                          torch.device("cpu"))
    assert stager is not None and p1.rack.embed.staged_by_scheduler
    rng = np.random.default_rng(8)
    a = rng.integers(0, V41_COMPRESSED_VOCAB, 9).tolist()
    b = rng.integers(0, V41_COMPRESSED_VOCAB, 600).tolist()  # two turns of the host ring
    req = lambda ids: types.SimpleNamespace(full_untruncated_fill_ids=ids)  # noqa: E731
    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=[req(a), req(b)],
                                  prefix_lens=[3, 0], extend_lens=[6, 600],
                                  encoder_swa_reset=None)
    staged = stager.stage(batch)
    ids, _ = h.hash_windows(*windows([(a[:3], a[3:]), ([], b)]))
    assert ids.shape[0] == 606
    for i, layer in enumerate((1, 14)):
        values, scales, copied = staged[i]
        layer_ids = ids[:, i].reshape(-1)
        want = rack.rows(layer, layer_ids.numpy()).reshape(-1, 264)
        assert (values.numpy() == want[:, :256]).all() and (scales.numpy() == want[:, 256:]).all()
        # SGLang's dequantization of staged rows: its gather, row k from row k.
        n = layer_ids.numel()
        out = torch.empty(n, 256, dtype=torch.bfloat16)
        plugin.gather_on_cpu(values.data_ptr(), scales.data_ptr(), torch.arange(n), out, 256, 32)
        ref = reference_rows(rack, layer, layer_ids)
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    batch.forward_mode = ForwardMode.DECODE
    assert stager.stage(batch) is None
    ring = plugin._ring
    before = int(ring.counter[0])
    fb = types.SimpleNamespace(engram_staged_rows=staged)
    plugin.publish_after_hash(ids[:4], None, None, fb)
    assert int(ring.counter[0]) == before, "no ring request for a staged batch"
    plugin.publish_after_hash(ids[:4], None, None, types.SimpleNamespace(engram_staged_rows=None))
    assert int(ring.counter[0]) == before + 1
    ring.pending.clear()
