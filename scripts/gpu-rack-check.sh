#!/usr/bin/env bash
# engram_rack's engine path on a GPU host with torch and Triton alone (no
# engine, no network, no rack binaries: what a lent GPU machine has), one
# command: the device's facts and which read-only registrations succeed,
# host-table gather bandwidth by page size against GPU memory, the ring
# inside replayed CUDA graphs behind a synthetic block 0 under injected
# round trips (stall at block 1, p50 and p99), a memory-ordering stress
# test, deadlines firing, rows bit for bit, rings of any row size (Qwen4Exp's,
# an ETP rank's shard, in a CUDA graph) (docs/engines.md, "What only a
# GPU shows"). A few minutes on one H100.
#
# It installs the engram_rack wheel found in target/engine-wheels (build it
# with `pip wheel --no-deps -w target/engine-wheels ./inference-node/python`
# and carry that folder) unless engram_rack.ring already imports.
# `--cpu` runs the checks that need no GPU under Triton's interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${ENGRAM_GPU_PYTHON:-python3}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! "$PY" -c 'import engram_rack.ring' 2>/dev/null; then
    wheel=$(ls target/engine-wheels/engram_rack-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$wheel" ]; then
        echo "no engram_rack and no wheel in target/engine-wheels: build one first (see above)" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-deps "$wheel"
fi
exec "$PY" inference-node/python/tests/engines/gpu_rack_check.py "$@"
