"""Whole engines on a GPU host (run by scripts/engine-gpu-check.sh): vLLM
and SGLang serving a small V4.1-shaped model under their defaults (FULL
CUDA graphs, async scheduling), each three ways:

- `own`: the engine's own host table in pinned DRAM (vLLM `cpu_offload`,
  SGLang's shared host table), filled with the rack's table rows;
- `host`: the plugin, the host-local donor's planar memory as that table;
- `remote`: the plugin, both tables across loopback TCP through the ring.

The model is the real V4.1 config (from the checkpoint's directory or its
Hugging Face repository: config and tokenizer files only) cut to its first
`--layers` blocks (Engram layers 1 and 14 kept), with dummy weights (the
engine's own, seeded: the same in every run) and random tables from
`memory-donor gen` at `--hash-base`. Each run is a process of its own.
Prints per engine and path: TPOT p50/p99 over decode steps (a batch of
`--requests`), its ratio to `own`, the GPU's ring waits at layers 1 and 14
(p50/p99 from the rack client's /metrics: an upper bound for the stall at
block 1, the wait overlapping block 0), and whether every request's greedy
tokens are identical to `own`'s. Exit status 0 when they all are.

Untested on hardware.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

from conftest import Donor, Engines, free_port, gen, read_rows  # noqa: E402, F401

PATHS = ("own", "host", "remote")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "tokenizer.model")


# --- the model --------------------------------------------------------------

def fetch_config(model: str, into: Path) -> Path:
    """A directory with the checkpoint's config and tokenizer files: `model`
    itself when it is one, else those files of its Hugging Face repository."""
    if (Path(model) / "config.json").is_file():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_dir=into / "hf",
                                  allow_patterns=["*.json", "*.model", "*.jinja", "*.txt"]))


def small_model(src: Path, out: Path, layers: int, experts: int, hash_base: int,
                rows: tuple[int, int]) -> Path:
    """The config cut to its first `layers` blocks: every per-layer list
    (one entry per block, MTP blocks after) cut alike, the routed experts
    to `experts` (0: as they are), the Engram tables to the rack's."""
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    n = int(text["num_hidden_layers"])
    mtp = int(text.get("num_nextn_predict_layers", 0) or 0)
    engram = [int(x) for x in text.get("engram_layer_ids") or []]
    if engram != [1, 14]:
        raise SystemExit(f"{src}/config.json: engram_layer_ids {engram}, not V4.1's [1, 14]")
    if not max(engram) < layers <= n:
        raise SystemExit(f"--layers {layers}: from {max(engram) + 1} to {n}")
    for k, v in list(text.items()):
        if k.startswith("engram_") or not isinstance(v, list):
            continue
        if len(v) == n + mtp and n + mtp > 0:
            text[k] = v[:layers] + v[n:]
        elif len(v) == n:
            text[k] = v[:layers]
    text["num_hidden_layers"] = layers
    if "num_hash_layers" in text:
        text["num_hash_layers"] = min(int(text["num_hash_layers"]), layers)
    if experts:
        text["n_routed_experts"] = experts
        text["num_experts_per_tok"] = min(int(text.get("num_experts_per_tok", experts)), experts)
    text["engram_vocab_size"] = hash_base
    text["engram_num_embeddings"] = list(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return out


# --- the rack ---------------------------------------------------------------

def make_rack(d: Path, hash_base: int, seed: int):
    """Both tables from `gen`, donor `d` (TCP) and the host-local planar
    donor `h`; node `hl` reads both from `h`, node `remote` both from `d`
    (each then its SSD copy)."""
    t = {1: gen(d, "l1.etab", 1, seed, hash_base), 14: gen(d, "l14.etab", 14, seed, hash_base)}
    gib = 2 * max(r for _, _, r in t.values()) * 264 / 2**30 + 1
    tables = "".join(f'[[table]]\nid = {k}\nlayer = {k}\npath = "{p}"\nrows = {r}\n'
                     f'digest = "{dg}"\n' for k, (p, dg, r) in t.items())

    def node(name, src):
        return (f'[[node]]\nname = "{name}"\ntokens_per_second = 100\n'
                + "".join(f'[[node.route]]\ntable = {k}\nsources = ["{src}", "ssd"]\n'
                          f'ssd_path = "{p}"\n' for k, (p, _, _) in t.items()))

    sock = d / "host.sock"
    text = ('version = 1\n[rack]\nname = "serve-check"\n' + tables
            + f'[[donor]]\nname = "d"\nlisten = ["127.0.0.1:{free_port()}"]\ntables = [1, 14]\n'
            f'ram_gib = {gib:.1f}\n'
            + f'[[donor]]\nname = "h"\nlisten = ["127.0.0.1:{free_port()}", "unix://{sock}"]\n'
            f'tables = [1, 14]\nram_gib = {gib:.1f}\nhost_layout = "planar"\n'
            + node("hl", "h") + node("remote", "d")
            + f"[model]\nhash_base = {hash_base}\n")
    cfg = d / "rack.toml"
    cfg.write_text(text)
    return cfg, t


def ring_waits(metrics_url: str) -> dict[str, np.ndarray]:
    """Cumulative ring-wait bucket counts per layer from a /metrics page."""
    return parse_ring_waits(urllib.request.urlopen(metrics_url, timeout=5).read().decode())


def parse_ring_waits(text: str) -> dict[str, np.ndarray]:
    """Per layer, `[[le seconds, cumulative count], ...]` by `le`."""
    out: dict[str, list[tuple[float, float]]] = {}
    for m in re.finditer(r'^engram_node_ring_gpu_wait_seconds_bucket\{(.*?)\} (\S+)$', text,
                         re.M):
        labels = dict(kv.split("=", 1) for kv in m.group(1).split(","))
        layer, le = labels["layer"].strip('"'), labels["le"].strip('"')
        out.setdefault(layer, []).append((float(le), float(m.group(2))))
    return {k: np.array(sorted(v)) for k, v in out.items()}


def quantile(before: np.ndarray | None, after: np.ndarray, q: float) -> float:
    """The `q` quantile of the waits between two readings, in us (the
    upper bound of its bucket)."""
    counts = after[:, 1] - (before[:, 1] if before is not None else 0)
    if counts[-1] <= 0:
        return 0.0
    i = int(np.searchsorted(counts, q * counts[-1]))
    return float(after[min(i, len(after) - 1), 0]) * 1e6


# --- one run ---------------------------------------------------------------

def table_rows(path: Path, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A table's planar halves, values [rows, 256] and scales [rows, 8],
    from its .etab file (a safetensors header, then 4 KiB pages of 15
    rows). Numpy only: it also runs inside an engine's worker."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    start = 8 + int.from_bytes(bytes(data[:8]), "little")
    pages = -(-rows // 15)
    body = np.asarray(data[start:start + pages * 4096]).reshape(pages, 4096)
    packed = body[:, :15 * 264].reshape(pages * 15, 264)[:rows]
    return np.ascontiguousarray(packed[:, :256]), np.ascontiguousarray(packed[:, 256:])


def fill_vllm(model, tables) -> int:
    """vLLM's own tables (`cpu_offload`) filled with the rack's rows: the
    Engram modules' `embed_tokens` of layers 1 and 14. Runs in the worker."""
    import torch

    filled = 0
    for name, mod in model.named_modules():
        m = re.search(r"layers\.(\d+)\.engram$", name)
        if not m or int(m.group(1)) not in tables:
            continue
        values, scales = table_rows(Path(tables[int(m.group(1))][0]), tables[int(m.group(1))][2])
        emb = mod.embed_tokens
        emb.weight.data.copy_(torch.from_numpy(values).view(torch.float8_e4m3fn))
        emb.weight_scale_inv.data.copy_(
            torch.from_numpy(scales).view(emb.weight_scale_inv.dtype))
        filled += 1
    return filled


def fill_sglang(tables) -> int:
    """SGLang's shared host tables (memfds `sglang_engram_<layer>` of the
    scheduler) filled with the rack's rows, through /proc: weights, then
    scales, as SGLang lays them out."""
    filled = 0
    for fd_link in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            target = os.readlink(fd_link)
        except OSError:
            continue
        m = re.match(r"/memfd:sglang_engram_(\d+)", target)
        if not m or int(m.group(1)) not in tables:
            continue
        p, _, rows = tables.pop(int(m.group(1)))
        values, scales = table_rows(Path(p), rows)
        with open(fd_link, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            mm[: values.nbytes] = values.tobytes()
            mm[values.nbytes: values.nbytes + scales.nbytes] = scales.tobytes()
        filled += 1
    return filled


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 100_000, length).tolist() for _ in range(n)]


def run_vllm(a, tables) -> dict:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model's function
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=a.model_dir, load_format="dummy", seed=0,
              max_model_len=a.prompt + a.tokens + 64, gpu_memory_utilization=a.gpu_memory,
              engram_config={"cpu_offload": True})
    if a.path == "own":
        filled = llm.apply_model(lambda model: fill_vllm(model, tables))
        assert all(f == 2 for f in filled), f"vLLM's Engram tables filled: {filled}"
    sp = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(a.requests, a.prompt, 1)]
    llm.generate(ps[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine = llm.llm_engine
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, sp)
    before = ring_waits(a.metrics_url) if a.metrics_url else {}
    steps, outs = [], {}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        steps.append(time.perf_counter() - t0)
    after = ring_waits(a.metrics_url) if a.metrics_url else {}
    return result(steps[3:-1], [outs[str(i)] for i in range(len(ps))], before, after)


def run_sglang(a, tables) -> dict:
    import sglang as sgl

    if a.path == "own":
        os.environ["SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"] = "1"
    eng = sgl.Engine(model_path=a.model_dir, load_format="dummy", random_seed=0,
                     mem_fraction_static=a.gpu_memory,
                     context_length=a.prompt + a.tokens + 64)
    try:
        if a.path == "own":
            filled = fill_sglang(dict(tables))
            assert filled == 2, f"SGLang's shared host tables found: {filled} of 2"
        sp = {"temperature": 0.0, "max_new_tokens": a.tokens, "ignore_eos": True}
        ps = prompts(a.requests, a.prompt, 1)
        eng.generate(input_ids=ps[:2], sampling_params={**sp, "max_new_tokens": 8})
        before = ring_waits(a.metrics_url) if a.metrics_url else {}

        async def timed(ids):
            gaps, last = [], None
            async for chunk in await eng.async_generate(input_ids=ids, sampling_params=sp,
                                                        stream=True):
                now, done = time.perf_counter(), chunk["meta_info"]["completion_tokens"]
                if last is not None and done > last[1]:
                    gaps += [(now - last[0]) / (done - last[1])] * (done - last[1])
                last = (now, done)
            return gaps

        async def all_timed():
            return await asyncio.gather(*(timed(p) for p in ps))

        gaps = [g for r in asyncio.run(all_timed()) for g in r[1:]]
        after = ring_waits(a.metrics_url) if a.metrics_url else {}
        outs = [o["output_ids"] for o in eng.generate(input_ids=ps, sampling_params=sp)]
        return result(gaps, outs, before, after)
    finally:
        eng.shutdown()


def result(step_s, outs, before, after) -> dict:
    s = np.array(step_s) * 1e6
    waits = {layer: [quantile(before.get(layer), w, q) for q in (0.5, 0.99)]
             for layer, w in after.items()}
    return {"tpot_us": [float(np.percentile(s, 50)), float(np.percentile(s, 99))],
            "outputs": outs, "ring_wait_us": waits}


def one(a) -> int:
    tables = {int(k): v for k, v in json.loads(a.tables).items()}
    if a.path != "own":
        os.environ["ENGRAM_RACK_SOCKET"] = a.socket
        os.environ["ENGRAM_RACK_METRICS"] = "off"
    r = (run_vllm if a.engine == "vllm" else run_sglang)(a, tables)
    Path(a.out).write_text(json.dumps(r))
    return 0


# --- the check --------------------------------------------------------------

def check(a) -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: a whole engine needs a GPU (scripts/gpu-rack-check.sh --cpu "
              "runs what runs on a CPU)")
        return 2
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    d = Path(tempfile.mkdtemp(prefix="engram-serve-check-"))
    cfg, tables = make_rack(d, a.hash_base, a.seed)
    model = small_model(fetch_config(a.model, d), d / "model", a.layers, a.experts,
                        a.hash_base, (tables[1][2], tables[14][2]))
    print(f"model: {a.model} cut to {a.layers} blocks at {model}; tables: "
          f"{tables[1][2]:,} and {tables[14][2]:,} rows")
    donors = [Donor(cfg, "d"), Donor(cfg, "h")]
    ok = True
    try:
        for engine in a.engines:
            try:
                __import__(engine)
            except ImportError:
                print(f"{engine} is not installed here: skipped")
                continue
            res = {}
            for path in PATHS:
                node = {"host": "hl", "remote": "remote"}.get(path)
                port = free_port()
                eng = (Engines(cfg, node, d / f"{engine}-{path}.sock", f"127.0.0.1:{port}")
                       if node else None)
                out = d / f"{engine}-{path}.json"
                cmd = [sys.executable, str(HERE), "--one", "--engine", engine, "--path", path,
                       "--model-dir", str(model), "--tables",
                       json.dumps({k: [str(p), dg, r] for k, (p, dg, r) in tables.items()}),
                       "--out", str(out), "--requests", str(a.requests), "--prompt",
                       str(a.prompt), "--tokens", str(a.tokens), "--gpu-memory",
                       str(a.gpu_memory)]
                if eng:
                    cmd += ["--socket", str(eng.socket),
                            "--metrics-url", f"http://127.0.0.1:{port}/metrics"]
                try:
                    rc = subprocess.run(cmd, timeout=a.timeout).returncode
                finally:
                    if eng:
                        eng.stop()
                if rc != 0 or not out.is_file():
                    print(f"{engine} {path}: the run failed (exit {rc})")
                    ok = False
                    continue
                res[path] = json.loads(out.read_text())
            ok &= report(engine, res)
    finally:
        for dn in donors:
            dn.stop()
    return 0 if ok else 1


def report(engine: str, res: dict) -> bool:
    own = res.get("own")
    ok = own is not None and len(res) == len(PATHS)
    for path, r in res.items():
        p50, p99 = r["tpot_us"]
        line = f"{engine:6} {path:6}: TPOT p50 {p50:8.1f} us p99 {p99:8.1f} us"
        if own and path != "own":
            line += f" ({p50 / own['tpot_us'][0]:.3f}x / {p99 / own['tpot_us'][1]:.3f}x own)"
            same = sum(a == b for a, b in zip(r["outputs"], own["outputs"]))
            line += f"; outputs identical to own: {same}/{len(own['outputs'])}"
            ok &= same == len(own["outputs"])
        for layer, (w50, w99) in sorted(r["ring_wait_us"].items(), key=lambda x: int(x[0])):
            line += f"; ring wait layer {layer} p50 {w50:.1f} us p99 {w99:.1f} us"
        print(line)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-ai/DeepSeek-V4.1-Flash",
                    help="a checkpoint directory or Hugging Face repository (its config and "
                    "tokenizer only)")
    ap.add_argument("--engines", nargs="+", default=["vllm", "sglang"],
                    choices=["vllm", "sglang"])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=0, help="routed experts (0: the model's)")
    ap.add_argument("--hash-base", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gpu-memory", type=float, default=0.8)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per engine run")
    # One run (the check starts itself once per engine and path).
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--tables", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--metrics-url", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    return one(a) if a.one else check(a)


if __name__ == "__main__":
    sys.exit(main())
