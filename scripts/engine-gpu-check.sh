#!/usr/bin/env bash
# The plugins inside vLLM's own classes on a GPU host: vLLM's offloaded
# Engram table in pinned DRAM against the plugin's host-local and ring paths,
# each captured in a CUDA graph with vLLM's side stream; outputs bit for bit
# and step time and stall p50/p99 (docs/engines.md, "What only a GPU shows").
# Needs an NVIDIA GPU and driver, this repository's binaries (cargo build
# --release --workspace) and the vLLM venv of scripts/engine-suite.sh
# (ENGRAM_ENGINE_VENVS), or ENGRAM_ENGINE_PYTHON, a python with torch (CUDA),
# vLLM and engram_rack installed. Untested on hardware.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${ENGRAM_ENGINE_PYTHON:-${ENGRAM_ENGINE_VENVS:-/tmp/engram-engine-venvs}/vllm/bin/python}
if [ ! -x "$PY" ]; then
    echo "no python at $PY: run scripts/engine-suite.sh first, or set ENGRAM_ENGINE_PYTHON" >&2
    exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cargo build --release -p memory-donor -p inference-node -p cluster-config
if ! "$PY" -c 'import engram_rack.ring' 2>/dev/null; then
    "$PY" -m pip install -q ./inference-node/python
fi
ENGRAM_BIN_DIR="$PWD/target/release" "$PY" inference-node/python/tests/engines/gpu_check.py "$@"
