#!/usr/bin/env bash
# The plugins inside the engines on a GPU host with network (docs/engines.md,
# "What only a GPU shows"), one command:
#
# 1. layers: vLLM's offloaded Engram table in pinned DRAM against the
#    plugin's host-local and ring paths inside vLLM's own classes, each
#    captured in a CUDA graph with vLLM's side stream: outputs bit for bit,
#    step time and stall p50/p99 (tests/engines/gpu_check.py);
# 2. whole engines: vLLM and SGLang serving a small V4.1-shaped model (the
#    real config cut to 16 blocks, dummy weights, random tables) under their
#    defaults, their own host table against the plugin's host-local and
#    remote paths: greedy outputs compared per engine, TPOT p50/p99 against
#    the engine's own path, the GPU's ring waits (tests/engines/
#    engine_serve_check.py; arguments after the script go to it, --help
#    lists them).
#
# Needs an NVIDIA GPU and driver, network (the model's config and tokenizer
# from Hugging Face, unless --model names a local checkpoint directory), and
# the engines' venvs of scripts/engine-suite.sh (ENGRAM_ENGINE_VENVS), or
# ENGRAM_VLLM_PYTHON / ENGRAM_SGLANG_PYTHON, pythons with torch (CUDA), the
# engine and engram_rack installed. An engine with no python is skipped.
# Untested on hardware.
set -euo pipefail
cd "$(dirname "$0")/.."

VENVS=${ENGRAM_ENGINE_VENVS:-/tmp/engram-engine-venvs}
declare -A PY=(
    [vllm]=${ENGRAM_VLLM_PYTHON:-${ENGRAM_ENGINE_PYTHON:-$VENVS/vllm/bin/python}}
    [sglang]=${ENGRAM_SGLANG_PYTHON:-$VENVS/sglang/bin/python}
)
if ! command -v nvidia-smi >/dev/null; then
    echo "no nvidia-smi: this check needs an NVIDIA GPU host (scripts/gpu-rack-check.sh --cpu runs what runs on a CPU)" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cargo build --release -p memory-donor -p inference-node -p cluster-config
export ENGRAM_BIN_DIR="$PWD/target/release"
status=0 ran=0
for engine in vllm sglang; do
    py=${PY[$engine]}
    if [ ! -x "$py" ]; then
        echo "== $engine: no python at $py (scripts/engine-suite.sh makes one): skipped"
        continue
    fi
    if ! "$py" -c 'import engram_rack.ring' 2>/dev/null; then
        "$py" -m pip install -q ./inference-node/python
    fi
    ran=1
    if [ "$engine" = vllm ]; then
        echo "== vLLM: one Engram layer, three ways, in CUDA graphs"
        "$py" inference-node/python/tests/engines/gpu_check.py || status=1
    fi
    echo "== $engine: the whole engine, three ways"
    "$py" inference-node/python/tests/engines/engine_serve_check.py --engines "$engine" "$@" || status=1
done
if [ "$ran" = 0 ]; then
    echo "no engine python found: run scripts/engine-suite.sh first, or set ENGRAM_VLLM_PYTHON / ENGRAM_SGLANG_PYTHON" >&2
    exit 2
fi
exit $status
