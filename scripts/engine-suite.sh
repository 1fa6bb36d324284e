#!/usr/bin/env bash
# The engine suite: engram_rack's vLLM and SGLang plugins against the engines'
# own V4.1 Engram code, on CPU (docs/engines.md, "Tested against the engines").
#
# Each engine gets a venv of its own (torch and the engine's dependencies:
# about 10 GB each, downloaded once), the engram_rack wheel is built once and
# installed in both (so the plugins load through their real entry points),
# and pytest runs tests/engines with rows from real donors. vLLM's Triton
# kernels run under the Triton interpreter. About 10 minutes once the venvs
# exist. Remove the venvs afterwards with ENGRAM_ENGINE_CLEAN=1.
set -euo pipefail
cd "$(dirname "$0")/.."

VENVS=${ENGRAM_ENGINE_VENVS:-/tmp/engram-engine-venvs}
VLLM=${ENGRAM_VLLM_VERSION:-0.33.0}
SGLANG=${ENGRAM_SGLANG_VERSION:-0.5.23}
WHEELS=target/engine-wheels

# What the tests start: the donors, the PKI tool, and `inference-node
# engines` behind the engine socket.
cargo build --release -p memory-donor -p cluster-config -p inference-node

venv() { # name, requirement
    local dir=$VENVS/$1
    if [ ! -x "$dir/bin/python" ]; then
        echo "== $1: a venv at $dir (torch and $2 are large: this takes a while)"
        python3 -m venv "$dir"
        "$dir/bin/pip" install -q --upgrade pip
    fi
    "$dir/bin/pip" install -q "$2" pytest
}
venv vllm "vllm==$VLLM"
venv sglang "sglang==$SGLANG"

# One wheel for both (maturin builds the extension in this workspace's target).
rm -rf "$WHEELS"
"$VENVS/vllm/bin/pip" wheel -q --no-deps -w "$WHEELS" ./inference-node/python
status=0
for engine in vllm sglang; do
    py=$VENVS/$engine/bin/python
    "$py" -m pip install -q --force-reinstall --no-deps "$WHEELS"/engram_rack-*.whl
    echo "== $engine $("$py" -c "import $engine; print($engine.__version__)"), torch $("$py" -c 'import torch; print(torch.__version__)')"
    (cd inference-node/python/tests &&
        ENGRAM_BIN_DIR="$PWD/../../../target/release" "$py" -m pytest -v -p no:cacheprovider \
            -W ignore::DeprecationWarning engines/test_engine.py engines/test_ring.py engines/test_faults.py engines/test_qwen4exp.py "engines/test_$engine.py" "engines/test_${engine}_gpu.py" "engines/test_${engine}_qwen4exp.py") || status=1
done
if [ "${ENGRAM_ENGINE_CLEAN:-0}" = 1 ]; then
    rm -rf "$VENVS"
fi
exit $status
