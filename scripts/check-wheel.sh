#!/usr/bin/env bash
# Build the engram_rack wheel (abi3, manylinux) with maturin, install it
# with pip from the file into a fresh virtual environment, and run the
# package's pytest suite there against the installed wheel (the donors
# the suite starts come from target/release: run after
# `cargo build --release --workspace`). The wheel lands in target/wheels/.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
rm -f "$target"/wheels/engram_rack-*.whl
maturin build --release --manifest-path inference-node/python/Cargo.toml --out "$target/wheels"
wheel=$(ls "$target"/wheels/engram_rack-*-cp311-abi3-manylinux_*.whl)
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$wheel" pytest
# From another directory, so `import engram_rack` can only be the installed one.
(cd "$venv" && "$venv/bin/python" -c 'import engram_rack, sys; print(engram_rack.__file__); assert sys.prefix in engram_rack.__file__')
bin_dir=$(cd "$target/release" && pwd)
ENGRAM_BIN_DIR="$bin_dir" "$venv/bin/python" -m pytest -q -p no:cacheprovider inference-node/python/tests
rm -rf "$(dirname "$venv")"
echo "wheel checked: $wheel"
