"""A token-paced engine loop over engram_rack, the way a V4.1 forward pass
uses it (docs/engines.md): each step prefetches both tables' rows of the
step's token before block 0, waits for layer 1's rows at block 1 and for
layer 14's at block 14, and dequantizes them with numpy-side buffers. The
blocks' compute is a precise wait of 1/40 of the step each (a stand-in for
the GPU), so the loop runs at the node's token rate unless rows are late;
a late row stalls the step by the time it arrived after its block, which is
how the node's own loop (`inference-node run`) measures it.

    python3 paced.py rack.toml gpu-node-1 --rate 100 --tokens 400 [--json]

Prints the measured tokens/s, the stalls and where rows came from.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import engram_rack

BLOCKS = 40  # V4.1's blocks per token
WAIT_AT = {1: 1, 14: 14}  # the block whose input needs each layer's rows
WARM_LEAD = 300e-6  # how long before each step the path to its rows is woken


def wait_until(t: float) -> None:
    """Sleep until 150 us before `t`, then spin (sleeps overshoot by tens of us)."""
    left = t - time.perf_counter()
    if left > 150e-6:
        time.sleep(left - 150e-6)
    while time.perf_counter() < t:
        pass


def run(mem: engram_rack.Memory, rate: float, tokens: int) -> dict:
    step_s = 1.0 / rate
    block_s = step_s / BLOCKS
    rows = {layer: mem.row_buffer(1) for layer in WAIT_AT}
    values = np.empty((1, engram_rack.COLUMNS, engram_rack.ROW_VALUES), dtype=np.float32)
    ids = np.zeros(1, dtype=np.int64)
    history: list[int] = []
    stalls = []
    sources: dict[str, int] = {}
    late = 0
    start = time.perf_counter()
    t = start  # where the step's compute has got to
    for i in range(tokens):
        ids[0] = (i * 7919 + 17) % 99092
        prefetched = time.perf_counter()
        ticket = mem.prefetch(ids, history)
        stall = 0.0
        block = 0
        for layer, at in WAIT_AT.items():
            t += (at - block) * block_s  # blocks before the one that needs the rows
            block = at
            wait_until(t)
            served = ticket.wait(layer, rows[layer])
            arrived = prefetched + served.elapsed
            if arrived > t:  # the rows came after their block was due: stall
                stall += arrived - t
                t = arrived
            late += served.late
            for s in served.sources:
                sources[s] = sources.get(s, 0) + 1
            engram_rack.dequantize(rows[layer], out=values)
        t += (BLOCKS - block) * block_s
        # Wake the path to the next step's rows before it starts, as the
        # node's loop does (`--warm-us`, 300 us by default).
        if WARM_LEAD > 0:
            wait_until(t - WARM_LEAD)
            mem.warm(WARM_LEAD)
        wait_until(t)
        stalls.append(stall)
        history = history[-2:] + [int(ids[0])]
    elapsed = time.perf_counter() - start
    s_us = np.sort(np.array(stalls)) * 1e6
    return {
        "rate": rate,
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_second": tokens / elapsed,
        "stalled_steps": int((s_us > 0).sum()),
        "stall_p50_us": float(s_us[len(s_us) // 2]),
        "stall_p99_us": float(s_us[int(len(s_us) * 0.99)]),
        "late": late,
        "sources": sources,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("node")
    p.add_argument("--rate", type=float, default=None, help="tokens/s (default: the node's)")
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    with engram_rack.Memory(a.config, a.node, metrics="off") as mem:
        r = run(mem, a.rate or mem.tokens_per_second, a.tokens)
    if a.json:
        print(json.dumps(r))
    else:
        print(
            f"{r['tokens']} tokens at {r['rate']:g} tokens/s: measured {r['tokens_per_second']:.2f} tokens/s, "
            f"{r['stalled_steps']} stalled steps (p99 stall {r['stall_p99_us']:.0f} us), "
            f"{r['late']} late fetches, rows from {r['sources']}"
        )


if __name__ == "__main__":
    main()
