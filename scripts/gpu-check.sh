#!/usr/bin/env bash
# GPU fusion check, for a machine with an NVIDIA GPU and driver (libcuda)
# and NVRTC (libnvrtc, from the CUDA toolkit or the nvidia-cuda-nvrtc wheel):
# builds inference-node with --features cuda, runs the GPU tests (which
# compare the GPU with the CPU path), then prints GPU-vs-CPU agreement and
# GPU throughput at V4.1 shapes (hidden 5120, 4 streams). A few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
else
    echo "nvidia-smi not found: the tests below will report themselves skipped"
fi

cargo build --release -p inference-node --features cuda
# --nocapture shows "skipped: ..." lines where no GPU is usable.
cargo test --release -p inference-node --features cuda --lib engram::gpu -- --nocapture
./target/release/inference-node gpu-check --hidden 5120 --streams 4 --positions 256 --cpu-positions 4 --rounds 20
