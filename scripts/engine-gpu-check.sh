#!/usr/bin/env bash
# Engine rows on a GPU host: the plugins' two row paths (fetch through the
# rack into pinned memory and dequantize on the GPU; gather from the mapped
# table with the Triton kernel) against the table in GPU memory read by
# vLLM's own lookup kernel, bit for bit, with the median step time of each
# (docs/engines.md, "What only a GPU shows"). Needs an NVIDIA GPU and driver;
# uses the vLLM venv of scripts/engine-suite.sh (ENGRAM_ENGINE_VENVS), or
# ENGRAM_ENGINE_PYTHON, a python with torch (CUDA) and engram_rack installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${ENGRAM_ENGINE_PYTHON:-${ENGRAM_ENGINE_VENVS:-/tmp/engram-engine-venvs}/vllm/bin/python}
if [ ! -x "$PY" ]; then
    echo "no python at $PY: run scripts/engine-suite.sh first, or set ENGRAM_ENGINE_PYTHON" >&2
    exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cargo build --release -p memory-donor -p cluster-config
if ! "$PY" -c 'import engram_rack.engine' 2>/dev/null; then
    "$PY" -m pip install -q ./inference-node/python
fi
ENGRAM_BIN_DIR="$PWD/target/release" "$PY" inference-node/python/tests/engines/gpu_check.py "$@"
