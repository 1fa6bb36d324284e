#!/usr/bin/env bash
# The Debian packages (engram-rack-cluster, engram-rack-donor,
# engram-rack-node) from the release build that
# `cargo build --release --workspace` made: each command writes its man
# pages and shell completions from its own clap definitions, then cargo-deb
# packages them with the binaries (`--no-build`: nothing is compiled
# again). The packages land in target/debian/. Needs cargo-deb
# (`cargo install cargo-deb --locked`).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
for bin in engram-cluster memory-donor inference-node; do
  rm -rf "$target/release/manuals/$bin"
  "$target/release/$bin" manuals "$target/release/manuals/$bin"
  gzip -9n "$target/release/manuals/$bin"/man/*.1
done
mkdir -p "$target/debian"
rm -f "$target"/debian/engram-rack-*.deb
for crate in cluster-config memory-donor inference-node; do
  cargo deb --no-build --strip --quiet -p "$crate" --output "$target/debian/" >/dev/null
done
ls "$target"/debian/engram-rack-*.deb
