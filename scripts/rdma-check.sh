#!/usr/bin/env bash
# RDMA hardware check: run on a host with an RDMA device (InfiniBand, RoCE,
# or soft-RoCE where the kernel has it: `rdma link add rxe0 type rxe netdev
# eth0`), with libibverbs-dev, librdmacm-dev, libclang-dev and pkg-config
# installed. Usage:
#
#   scripts/rdma-check.sh IP        (an IP address on the RDMA device)
#
# 1. Lists the devices, builds the daemons and the bench with --features
#    rdma (into target/rdma, beside the normal build).
# 2. engram-bench floor --transports tcp,tls,rdma --rdma-addr IP: lookups
#    over RDMA against TLS on the same donor, and the node's CPU per lookup.
# 3. A kill -9 drill: a donor serving TLS and rdma://IP, the node's canary
#    at 100 tokens/s reading it (then its SSD copy); the donor is killed
#    with SIGKILL after 4 s and started again after 8 s. The canary's
#    status lines show where rows came from each second; the summary must
#    show 0 failed lookups, and the donor serving again over RDMA.
#
# Where no device exists every step still runs and says so: the floor's
# RDMA part is skipped with its reason, and the donor says which address
# nodes use instead of rdma://.
set -euo pipefail
IP=${1:?usage: scripts/rdma-check.sh IP (an IP address on the RDMA device)}
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/rdma}
BIN=$CARGO_TARGET_DIR/release

echo "== RDMA devices"
command -v ibv_devices >/dev/null && ibv_devices || echo "(ibv_devices not installed: apt-get install ibverbs-utils)"
command -v rdma >/dev/null && rdma link show || true

echo "== build with --features rdma"
cargo build --release --workspace \
    --features memory-donor/rdma,inference-node/rdma,engram-bench/rdma

echo "== floor: RDMA against TLS and TCP"
"$BIN/engram-bench" floor --transports tcp,tls,rdma --rdma-addr "$IP" \
    --rows-per-table "${FLOOR_ROWS:-4200000}" --rounds 3 --restarts 0

echo "== kill -9 drill over RDMA"
dir=$(mktemp -d)
donor_pid=
cleanup() {
    [ -n "$donor_pid" ] && kill -9 "$donor_pid" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
TLS_PORT=$(port)
RDMA_PORT=$(port)
for id in 1 14; do
    "$BIN/memory-donor" gen --rows 1000000 --layer "$id" --seed 7 --out "$dir/t$id.etab" \
        | tee "$dir/gen$id.txt"
done
digest() { awk '{print $NF}' "$dir/gen$1.txt"; }
cat >"$dir/rack.toml" <<TOML
version = 1
[rack]
name = "rdma-check"
[rack.tls]
[[table]]
id = 1
layer = 1
path = "t1.etab"
rows = 1000000
digest = "$(digest 1)"
[[table]]
id = 14
layer = 14
path = "t14.etab"
rows = 1000000
digest = "$(digest 14)"
[[donor]]
name = "donor-a"
listen = ["tls://127.0.0.1:$TLS_PORT", "rdma://$IP:$RDMA_PORT"]
tables = [1, 14]
ram_gib = 4.0
headroom_gib = 0.5
[[node]]
name = "node-a"
tokens_per_second = 100
probe_interval_ms = 200
[[node.route]]
table = 1
sources = ["donor-a", "ssd"]
ssd_path = "t1.etab"
[[node.route]]
table = 14
sources = ["donor-a", "ssd"]
ssd_path = "t14.etab"
TOML
"$BIN/engram-cluster" pki init --config "$dir/rack.toml" >/dev/null
"$BIN/engram-cluster" pki issue --config "$dir/rack.toml" >/dev/null
"$BIN/engram-cluster" check "$dir/rack.toml"
"$BIN/engram-cluster" plan "$dir/rack.toml" | grep -i rdma || true

start_donor() {
    "$BIN/memory-donor" serve --config "$dir/rack.toml" --name donor-a 2>>"$dir/donor.log" &
    donor_pid=$!
    for _ in $(seq 100); do
        grep -q "ready listen=" "$dir/donor.log" 2>/dev/null && break
        sleep 0.1
    done
}
start_donor
grep -E "rdma|ready" "$dir/donor.log" || true
"$BIN/inference-node" canary --config "$dir/rack.toml" --name node-a --tokens 1500 \
    2>"$dir/canary.log" &
canary=$!
sleep 4
echo "-- kill -9 the donor"
kill -9 "$donor_pid"
sleep 4
echo "-- start it again"
: >"$dir/donor.log"
start_donor
wait "$canary"
grep -E "rdma://|tokens in" "$dir/canary.log" | sed "s/^.*\(INFO\|WARN\) [^:]*: //" || cat "$dir/canary.log"
if grep -E "failed [1-9]" "$dir/canary.log" >/dev/null; then
    echo "FAILED: lookups failed during the drill"
    exit 1
fi
echo "ok: 0 failed lookups through the kill -9 and the restart"
