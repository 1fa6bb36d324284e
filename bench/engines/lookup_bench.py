"""engram-bench engines, the Python side: N steps through engram_rack, each a
prefetch of one token (after its three predecessors) and the waits for both
layers' rows into preallocated numpy buffers, timed from the prefetch to
the second wait's return. Prints {"p50_us":..,"p99_us":..,"mean_us":..} on stdout.

    python3 lookup_bench.py CONFIG NODE STEPS WARMUP
"""

import json
import sys
import time

import numpy as np

import engram_rack


def main() -> None:
    config, node, steps, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with engram_rack.Memory(config, node, metrics="off") as mem:
        rows1, rows14 = mem.row_buffer(1), mem.row_buffer(1)
        ids = np.zeros(1, dtype=np.int64)
        hist: list[int] = []
        lat = np.empty(steps)
        clock = time.perf_counter_ns
        for i in range(warmup + steps):
            ids[0] = (i * 7919 + 17) % 99092
            t0 = clock()
            t = mem.prefetch(ids, hist)
            t.wait(1, rows1)
            t.wait(14, rows14)
            t1 = clock()
            if i >= warmup:
                lat[i - warmup] = (t1 - t0) / 1e3
            hist = hist[-2:] + [int(ids[0])]
    lat.sort()
    print(json.dumps({
        "p50_us": float(lat[steps // 2]),
        "p99_us": float(lat[int(steps * 0.99)]),
        "mean_us": float(lat.mean()),
        "steps": steps,
    }))


if __name__ == "__main__":
    main()
