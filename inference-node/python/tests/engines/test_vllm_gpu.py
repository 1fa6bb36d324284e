"""engram_rack.vllm under what a GPU engine does to it, on CPU
(engines/emulation.py): the model built inside vLLM's default CUDA device
context; vLLM's own breakable CUDA graph capture in FULL and PIECEWISE
modes, where any host sync inside the captured region raises, eager breaks
run over never-run memory at capture and again at every replay; rows still
bit-identical to vLLM's own table after each replay; registration that
never copies a table; Ray workers that inherit the rack's settings; one
/metrics per process by global rank."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import types  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")
E = pytest.importorskip("vllm.models.deepseek_v41.common.engram")

import emulation  # noqa: E402
from conftest import point_plugins_at  # noqa: E402
from test_vllm import (  # noqa: E402, F401
    Pair,
    hash_state,
    hf_config,
    hidden,
    rack_rows,
    vctx,
    vllm_hashes,
)

from engram_rack import plugin as rack_plugin  # noqa: E402
from engram_rack import vllm as plugin  # noqa: E402


def build(rack, node: str, layer_index: int):
    """The plugin's Engram layer, built as vLLM builds the model."""
    point_plugins_at(rack, node)
    rack_plugin.reset()
    cls = plugin.install()
    config = hf_config((rack_rows(rack, 1), rack_rows(rack, 14)))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return cls(config, None, E.EngramLayout(config), layer_index, False,
                   "model.layers.1.engram")
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("node", ["hl", "n"])
def test_the_model_builds_inside_a_cuda_device_context(host_rack, vctx, monkeypatch, node):
    """vLLM builds its model under `with torch.device("cuda")`: nothing may
    be pinned without a device (a CUDA tensor cannot be), and each table is
    registered once, read-only for a host-local donor's memory."""
    host_rack.start()
    driver = emulation.FakeDriver()
    with emulation.cuda_context(monkeypatch, driver):
        layers = [build(host_rack, node, i) for i in (0, 1)]
        ro = [r for r in driver.registered if r[2]]
        assert len(ro) == 0, "registration waits for the first lookup's storage"
        if node == "hl":
            for layer in layers:
                layer.embed_tokens._storage()
                layer.embed_tokens._storage()
    for layer in layers:
        assert layer.embed_tokens.weight.engram_rack
        assert layer.embed_tokens.cpu_offload, "vLLM's side stream and event are kept"
    if node == "hl":
        ro = [r for r in driver.registered if r[2]]
        assert len(ro) == 2 and len({r[0] for r in ro}) == 2, driver.registered
        for (addr, size, _), layer in zip(ro, layers):
            t = layer.embed_tokens.table
            assert (addr, size) == (t.address, t.nbytes), "the whole table, once"
    else:
        rw = [r for r in driver.registered if not r[2]]
        assert len(rw) == 2, "each layer's ring, registered once"


REGISTER = """
import json, os, sys
from pathlib import Path
import torch
import emulation
from engram_rack.host import HostLink

class Patch:  # what pytest's monkeypatch does, for a script
    def setattr(self, obj, name, value):
        setattr(obj, name, value)

def anon_kb():
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1])
    return 0

link = HostLink(config=sys.argv[1], node="hl")
table = link.table(1)
emulation.FakeDriver().install(Patch())
out = {"table": table.nbytes}
before = anon_kb()
views = table.on("cuda")
out["readonly_kb"] = anon_kb() - before
os.environ["ENGRAM_RACK_HOST_REGISTER"] = "copy"
real_empty = torch.empty
torch.empty = lambda *a, pin_memory=False, **k: real_empty(*a, **k)  # no CUDA to pin with
before = anon_kb()
kept = table.on("cuda")
out["copy_kb"] = anon_kb() - before
print(json.dumps(out), flush=True)
link.close()
"""


def test_registration_never_copies_a_table_and_a_copy_would_show(host_rack):
    """A fresh process maps a host-local table and registers it (the driver
    faked): its private memory does not grow by the table; the `copy`
    policy (a private pinned copy) grows it by the rows, which the same
    measurement sees."""
    import json
    import subprocess
    import sys

    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent)]))
    out = subprocess.run([sys.executable, "-c", REGISTER, str(host_rack.config)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["readonly_kb"] * 1024 < m["table"] // 10, m
    assert m["copy_kb"] * 1024 >= m["table"] * 9 // 10, m


def _graph_context(monkeypatch, mode):
    from vllm.compilation import breakable_cudagraph as bcg
    from vllm.config import CUDAGraphMode

    emulation.emulate_graphs(monkeypatch)
    runtime = getattr(CUDAGraphMode, mode)
    monkeypatch.setattr(bcg, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(bcg, "get_forward_context",
                        lambda: types.SimpleNamespace(cudagraph_runtime_mode=runtime))
    monkeypatch.setattr(E, "is_forward_context_available", lambda: False)
    # vLLM's weak references need its CUDA extension: an alias stands in.
    monkeypatch.setattr(bcg, "_weak_ref_capture_arg",
                        lambda a: a.view(a.shape) if isinstance(a, torch.Tensor) else a)
    return bcg


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
@pytest.mark.parametrize("node", ["hl", "n"])
def test_captured_decode_has_no_host_sync_and_replays_stay_identical(host_rack, vctx,
                                                                     monkeypatch, mode, node):
    """A decode step captured by vLLM's own breakable capture (its CUDA
    graphs emulated), vLLM's side stream in use: nothing in the captured
    region syncs with the host, and every replay with new ids gives vLLM's
    own table's output, bit for bit."""
    host_rack.start()
    pair = Pair(vctx, host_rack, 0, node)
    layer = pair.rack_layer
    bcg = _graph_context(monkeypatch, mode)
    # vLLM's offloaded path: a side stream and an event around the lookup.
    layer.embed_tokens.cpu_offload = True
    layer._prefetch_stream = torch.cuda.Stream()
    layer._prefetch_done = torch.cuda.Event()
    hs = hash_state(pair.layout)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 5000, 12).tolist() for _ in range(4)]
    steps = [vllm_hashes(hs, [(s[:k], [s[k]], ()) for s in seqs]) for k in (3, 6, 9, 11)]
    ids_in = torch.full((4, 24), -1, dtype=torch.int32)
    x_in = hidden(4, 0)
    mask_in = torch.ones(4, dtype=torch.bool)
    out = torch.empty(4, pair.config.hc_mult, pair.config.hidden_size, dtype=torch.bfloat16)

    def forward():
        ids = ids_in + 0  # made inside the graph, as the hash kernel makes it
        layer.prepare_embeddings(ids)
        out.copy_(layer(x_in, ids, mask_in))

    with bcg.BreakableCUDAGraphCapture() as cap:
        forward()
    for i, (hashes, _) in enumerate(steps):
        ids = hashes[:, 0]
        ids_in.copy_(ids)
        x_in.copy_(hidden(4, i + 1))
        cap.replay()
        pair.ref.prepare_embeddings(ids)
        want = pair.ref(x_in, ids, mask_in)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), f"replay {i}"


def test_plugin_errors_stop_vllm_and_ray_workers_get_the_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("ENGRAM_RACK_CONFIG", str(tmp_path / "missing.toml"))
    monkeypatch.setenv("ENGRAM_RACK_NODE", "n")
    with pytest.raises(plugin.PluginError, match="no such file"):
        plugin.register()  # vLLM does not catch it: the engine stops
    monkeypatch.delenv("ENGRAM_RACK_CONFIG")
    monkeypatch.setenv("ENGRAM_RACK_SOCKET", str(tmp_path / "engines.sock"))
    monkeypatch.setenv("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "MY_")
    plugin.copy_env_to_ray()
    plugin.copy_env_to_ray()
    assert os.environ["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MY_,ENGRAM_RACK_"
    from vllm.ray.ray_env import get_env_vars_to_copy

    assert "ENGRAM_RACK_SOCKET" in get_env_vars_to_copy()


def test_only_global_rank_0_serves_metrics(monkeypatch):
    """DP replicas each have a TP rank 0: the global rank decides who
    serves /metrics (before the process group exists, from RANK)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "3")
    assert rack_plugin.global_rank() == 3
    monkeypatch.setenv("RANK", "0")
    assert rack_plugin.global_rank() == 0
