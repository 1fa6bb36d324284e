"""The plugins inside the engines' own classes on a GPU (run by
scripts/engine-gpu-check.sh, on a GPU host with vLLM and SGLang installed
and this repository's binaries built).

vLLM only so far (SGLang's layers are checked on CPU under the emulated
GPU, and its kernels' GPU side by scripts/gpu-rack-check.sh). Untested on
hardware. Starts a small real rack (tables from `memory-donor gen`, a donor across
loopback, a host-local planar donor, `inference-node engines`), then for
each engine builds one Engram layer three ways with the engine's own
classes on the GPU:

- `own`: the engine's own host table in pinned DRAM (vLLM `cpu_offload`,
  SGLang's shared host table), loaded from the same table file;
- `host`: the plugin, the host-local donor's planar memory as that table;
- `ring`: the plugin, the table across the network through the ring;

runs decode steps of each captured in a CUDA graph (vLLM: its side stream
and event, as its offloaded path runs), replays them with new ids, and
compares every output with `own`'s bit for bit. Prints, per engine and
path, step time p50/p99 and the stall at the Engram layer (from the end of
a synthetic block 0 on the main stream to the rows being ready).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

from conftest import Donor, Engines, free_port, gen, read_rows, write_config  # noqa: E402


def rack():
    d = Path(tempfile.mkdtemp())
    tables = {"l1": gen(d, "l1.etab", 1, 11), "l14": gen(d, "l14.etab", 14, 11)}
    cfg = write_config(d / "rack.toml", tables, free_port(), host_socket=d / "h.sock")
    donors = [Donor(cfg, "d"), Donor(cfg, "h")]
    engines = Engines(cfg, "mixed", d / "engines.sock")
    return d, cfg, tables, donors, engines


def timed_replays(graph, feed, steps: int, block0, e):
    """Replay `graph` `steps` times with `feed(i)` before each: step times
    and stalls at the Engram layer, in us."""
    step, stall = [], []
    for i in range(steps):
        feed(i)
        graph.replay()
        torch.cuda.synchronize()
        step.append(e["start"].elapsed_time(e["end"]) * 1e3)
        stall.append(max(0.0, e["block0"].elapsed_time(e["rows"])) * 1e3)
    return np.array(step), np.array(stall)


def vllm_layers(cfg, tables, socket):
    """vLLM's own offloaded `Engram` (layer 1) and the plugin's, host-local
    and through the ring (layer 14 is remote on node `mixed`)."""
    from test_vllm import hf_config, rack_rows, reference_table  # noqa: F401

    import vllm.models.deepseek_v41.common.engram as E
    from engram_rack import plugin as rp
    from engram_rack import vllm as plugin

    class R:
        config = cfg
    rows = (rack_rows(R, 1), rack_rows(R, 14))
    config = hf_config(rows)
    layout = E.EngramLayout(config)
    own = E.Engram(config, None, layout, 0, False, "model.layers.1.engram")
    data = read_rows(tables["l1"][0], np.arange(rows[0]))
    own.embed_tokens.weight.data.copy_(torch.from_numpy(data[:, :256].copy()).view(torch.float8_e4m3fn))
    own.embed_tokens.weight_scale_inv.data.copy_(torch.from_numpy(data[:, 256:].copy()))
    os.environ["ENGRAM_RACK_SOCKET"] = str(socket)
    rp.reset()
    cls = plugin.install()
    host = cls(config, None, layout, 0, False, "model.layers.1.engram")
    ring = cls(config, None, layout, 1, False, "model.layers.14.engram")
    for m in (host, ring):
        m.load_state_dict({k: v for k, v in own.state_dict().items() if "embed_tokens" not in k},
                          strict=False)
    return own, host, ring


def vllm_context():
    """vLLM's config (its offloaded Engram table on) and a one-rank group."""
    from vllm.config import EngramConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    cfg = VllmConfig()
    cfg.engram_config = EngramConfig(cpu_offload=True)
    cfg.scheduler_config.max_num_batched_tokens = 64
    ctx = set_current_vllm_config(cfg)
    ctx.__enter__()
    if not ps.model_parallel_is_initialized():
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="nccl",
                                        distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ps.initialize_model_parallel(1, 1)
    return ctx


def run_vllm(cfg, tables, socket, steps: int):
    vllm_context()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            own, host, ring = vllm_layers(cfg, tables, socket)
    finally:
        torch.set_default_dtype(default)
    dev = torch.device("cuda", torch.cuda.current_device())
    T = 8
    ids_in = torch.zeros(T, 24, dtype=torch.int32, device=dev)
    x = torch.randn(T, own.hc_mult, own.dim, device=dev).to(torch.bfloat16)
    mask = torch.ones(T, dtype=torch.bool, device=dev)
    block0 = torch.ones(1 << 20, device=dev)
    rows = {1: len(own.embed_tokens.weight), 14: ring.embed_tokens.num_embeddings}
    results = {}
    for name, layer in (("own", own), ("host", host), ("ring", ring)):
        out = torch.empty_like(x)
        e = {k: torch.cuda.Event(enable_timing=True) for k in ("start", "block0", "rows", "end")}
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            e["start"].record()
            layer.prepare_embeddings(ids_in)
            for _ in range(4):
                block0.mul_(1.0000001)
            e["block0"].record()
            r = layer._ready_rows(T)
            e["rows"].record()
            out.copy_(layer(x, ids_in, mask))
            e["end"].record()
        lid = 1 if layer is not ring else 14
        outs = []

        def feed(i, lid=lid):
            g_ = torch.Generator().manual_seed(i)
            ids_in.copy_(torch.randint(0, rows[lid], (T, 24), generator=g_))
        step, stall = timed_replays(g, feed, steps, block0, e)
        feed(steps - 1)
        g.replay()
        torch.cuda.synchronize()
        outs.append(out.clone())
        results[name] = (step, stall, out.clone(), r)
        print(f"vLLM {name:5}: step p50 {np.percentile(step, 50):8.1f} us p99 "
              f"{np.percentile(step, 99):8.1f} us; stall at the Engram layer p50 "
              f"{np.percentile(stall, 50):7.1f} us p99 {np.percentile(stall, 99):7.1f} us")
    same = torch.equal(results["own"][2].view(torch.int16), results["host"][2].view(torch.int16))
    print(f"vLLM host-local output identical to its own offloaded table: {same}")
    return same


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (scripts/gpu-rack-check.sh --cpu runs "
              "what runs on a CPU)")
        return 2
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    d, cfg, tables, donors, engines = rack()
    ok = True
    try:
        try:
            import vllm  # noqa: F401

            ok &= run_vllm(cfg, tables, engines.socket, a.steps)
        except ImportError:
            print("vLLM is not installed: skipped")
    finally:
        engines.stop()
        for dn in donors:
            dn.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
