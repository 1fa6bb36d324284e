"""GPU check of the engine row paths (run by scripts/engine-gpu-check.sh).

Starts a small real rack (tables from `memory-donor gen`, one donor), then on
the GPU, for each Engram layer and several batch sizes, produces bf16 rows
`[T, 24, 256]` three ways and compares them bit for bit and in step time:

- `table`: the whole table in GPU memory, read by vLLM's own lookup kernel
  when vLLM is installed (else gathered by index and dequantized with torch):
  the engine's in-memory reference;
- `fetch`: `LayerRows`, what the plugins do: ids to pinned host memory,
  `prefetch_rows`, wait into a pinned buffer, copy without blocking,
  dequantize on the GPU;
- `view`: `LayerRows(view=True)`: the node's mapped table registered with
  CUDA and gathered on the GPU by the Triton kernel, no copy.

Prints one line per (layer, T) with the median step time of each path over
`--rounds` rounds; exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import Donor, free_port, gen, read_rows, write_config  # noqa: E402

import engram_rack as er  # noqa: E402
from engram_rack import engine  # noqa: E402


def reference(rows: np.ndarray, device):
    """The table on the GPU and a function ids -> bf16 rows."""
    data = torch.from_numpy(rows).to(device)
    try:
        import vllm.models.deepseek_v41.common.engram as E
        from torch import nn

        t = E.ParallelEngramEmbedding.__new__(E.ParallelEngramEmbedding)
        nn.Module.__init__(t)
        for k, v in dict(cpu_offload=False, dp_shared_memory=False, use_thp=False, _packed=None,
                         _shared_memory=None, _views=None, _view_src=None, peer_rows=0,
                         dp_size=1, tp_size=1, num_embeddings=len(rows), dim=256, block_size=32,
                         n_hash_cols=24, part_n_hash_cols=24, head_start=0, vocab_start_idx=0,
                         vocab_end_idx=len(rows), part_num_embeddings=len(rows),
                         _num_sms=torch.cuda.get_device_properties(device).multi_processor_count
                         ).items():
            setattr(t, k, v)
        t.weight = nn.Parameter(data[:, :256].contiguous().view(torch.float8_e4m3fn),
                                requires_grad=False)
        t.weight_scale_inv = nn.Parameter(data[:, 256:].contiguous(), requires_grad=False)

        def lookup(ids):
            out = torch.empty(ids.shape[0], 24, 256, dtype=torch.bfloat16, device=device)
            t.lookup(ids.to(torch.int32), out)
            return out

        return lookup, "vLLM's lookup kernel"
    except ImportError:
        return (lambda ids: engine.dequantize_rows(data[ids.long()])), "torch index + dequantize"


def timed(fn, rounds: int):
    times, out = [], None
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--hash-base", type=int, default=20_000)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (the CPU suite is scripts/engine-suite.sh)")
        return 2
    device = torch.device("cuda", 0)
    print(f"GPU: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tables = {name: gen(d, f"{name}.etab", layer, 11, args.hash_base)
                  for name, layer in (("l1", 1), ("l14", 14), ("l1-other", 1))}
        config = write_config(d / "rack.toml", tables, free_port())
        text = config.read_text().replace("hash_base = 1000", f"hash_base = {args.hash_base}")
        config.write_text(text)
        donor = Donor(config, "d")
        try:
            with er.Memory(config, "n", metrics="off") as mem, \
                    er.Memory(config, "ref", metrics="off") as own:
                for layer, name in ((1, "l1"), (14, "l14")):
                    path, _, nrows = tables[name]
                    lookup, how = reference(read_rows(path, np.arange(nrows)), device)
                    print(f"layer {layer}: {nrows} rows; reference: {how}")
                    tokens = [int(t) for t in args.tokens.split(",")]
                    fetch = engine.LayerRows(mem, layer, max_tokens=max(tokens), device=device)
                    view = engine.LayerRows(own, layer, max_tokens=max(tokens), device=device,
                                            view=True)
                    rng = np.random.default_rng(layer)
                    for t in tokens:
                        ids = torch.tensor(rng.integers(0, nrows, (t, 24)), device=device)
                        want, t_ref = timed(lambda: lookup(ids), args.rounds)

                        def via(rows):
                            rows.start(ids)
                            return rows.ready()

                        got_fetch, t_fetch = timed(lambda: via(fetch), args.rounds)
                        got_view, t_view = timed(lambda: via(view), args.rounds)
                        same = [torch.equal(g.view(torch.int16), want.view(torch.int16))
                                for g in (got_fetch, got_view)]
                        bad += same.count(False)
                        print(f"  T={t:4}: table {t_ref:8.1f} us | fetch {t_fetch:8.1f} us "
                              f"identical={same[0]} | view {t_view:8.1f} us identical={same[1]}")
        finally:
            donor.stop()
    print("all identical" if not bad else f"{bad} MISMATCHES")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
