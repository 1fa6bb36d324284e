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
# Before all that, a preflight says what would keep RDMA from being used
# and how to fix each: the devices and their ports' state, the device the
# IP is on and its GIDs, `ulimit -l`, the kernel, and the systemd units'
# device policy. `scripts/rdma-check.sh --preflight IP` runs only it and
# exits 1 when something blocks.
#
# Where no device exists every step still runs and says so: the floor's
# RDMA part is skipped with its reason, and the donor says which address
# nodes use instead of rdma://.
set -euo pipefail
PREFLIGHT_ONLY=
if [ "${1:-}" = --preflight ]; then
    PREFLIGHT_ONLY=1
    shift
fi
IP=${1:?usage: scripts/rdma-check.sh [--preflight] IP (an IP address on the RDMA device)}
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/rdma}
BIN=$CARGO_TARGET_DIR/release
# Where the devices are (a test points this at a fake tree).
SYS=${RDMA_CHECK_SYSFS:-/sys/class/infiniband}
# Bytes the floor below registers: its two tables and their check words.
NEED_BYTES=$(( ${FLOOR_ROWS:-4200000} * 2 * (264 + 8) ))

blocks=0
block() { echo "BLOCKS: $1"; echo "  fix: $2"; blocks=$((blocks + 1)); }
warn() { echo "warning: $1"; }

echo "== preflight"
devices=()
if [ -d "$SYS" ]; then
    for d in "$SYS"/*; do
        [ -e "$d" ] && devices+=("$(basename "$d")")
    done
fi
if [ ${#devices[@]} -eq 0 ]; then
    block "no RDMA device ($SYS is empty or missing)" \
        "load the NIC's driver (mlx5_ib, irdma, ...), or for a test soft-RoCE: rdma link add rxe0 type rxe netdev eth0"
fi
# The netdev that carries IP, and the device and port whose GIDs name it.
netdev=
if command -v ip >/dev/null; then
    netdev=$(ip -o addr show 2>/dev/null | awk -v ip="$IP" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}')
fi
[ -n "$netdev" ] || warn "$IP is not an address of this host (ip -o addr): rdma:// must name one"
on_ip=
for dev in "${devices[@]}"; do
    for port in "$SYS/$dev"/ports/*; do
        [ -d "$port" ] || continue
        p=$(basename "$port")
        state=$(cat "$port/state" 2>/dev/null || echo "?")
        layer=$(cat "$port/link_layer" 2>/dev/null || echo "?")
        gids=0
        for g in "$port"/gids/*; do
            [ -e "$g" ] || continue
            v=$(cat "$g" 2>/dev/null || true)
            [ -n "$v" ] && [ "$v" != "0000:0000:0000:0000:0000:0000:0000:0000" ] && gids=$((gids + 1))
        done
        ndevs=$(cat "$port"/gid_attrs/ndevs/* 2>/dev/null | sort -u | tr '\n' ' ' || true)
        echo "$dev port $p: state $state, link layer $layer, $gids GIDs${ndevs:+, on $ndevs}"
        if [ -n "$netdev" ] && [[ " $ndevs " == *" $netdev "* ]]; then
            on_ip="$dev port $p"
            case "$state" in
                *ACTIVE*) ;;
                *) block "$dev port $p (the one $IP is on) is $state, not ACTIVE" \
                    "bring the link up (cable, switch port, ip link set $netdev up) and check: rdma link show" ;;
            esac
            [ "$gids" -gt 0 ] || block "$dev port $p has no GID" \
                "give $netdev its address (RoCE GIDs follow the interface's IP addresses)"
        fi
    done
done
if [ ${#devices[@]} -gt 0 ] && [ -n "$netdev" ] && [ -z "$on_ip" ]; then
    block "$IP is on $netdev, which no RDMA device's port carries" \
        "use an address on the RDMA NIC's interface (rdma link show lists them)"
fi
# Registered memory is pinned: the limit must cover the tables.
memlock=$(ulimit -l)
if [ "$memlock" != unlimited ] && [ $((memlock * 1024)) -lt "$NEED_BYTES" ]; then
    block "ulimit -l is $memlock KiB; this check registers about $((NEED_BYTES >> 20)) MiB" \
        "ulimit -l unlimited (as root), or memlock in /etc/security/limits.conf; the systemd units set LimitMEMLOCK=infinity"
else
    echo "ulimit -l: $memlock"
fi
kernel=$(uname -r)
echo "kernel: $kernel"
IFS=. read -r kmaj kmin _ <<<"$kernel"
if [ "${kmaj:-0}" -lt 6 ] || { [ "${kmaj:-0}" -eq 6 ] && [ "${kmin%%[!0-9]*}" -lt 2 ]; }; then
    warn "kernels before 6.2 pin a read-only registration for writing: under systemd (tables kept in the fd store, mapped read-only) the donor's registration may fail and nodes read over TLS (docs/rdma.md)"
fi
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    sd=$(systemctl --version | awk 'NR == 1 {print $2}')
    echo "systemd: $sd"
    for unit in memory-donor inference-node; do
        systemctl cat "$unit.service" >/dev/null 2>&1 || continue
        if ! systemctl cat "$unit.service" 2>/dev/null | grep -q "^DeviceAllow=char-infiniband"; then
            block "$unit.service does not let in /dev/infiniband (the RDMA drop-in is not installed)" \
                "install -D -m 644 systemd/rdma.conf /etc/systemd/system/$unit.service.d/rdma.conf && systemctl daemon-reload"
        fi
    done
fi
if [ "$blocks" -eq 0 ]; then
    echo "preflight: nothing blocks RDMA here"
else
    echo "preflight: $blocks thing(s) block RDMA here (above, each with its fix)"
fi
if [ -n "$PREFLIGHT_ONLY" ]; then
    [ "$blocks" -eq 0 ]
    exit
fi

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
    # RDMA is set up after the ready line (the tables' check words and
    # registration): wait for its own line, up to 10 minutes.
    for _ in $(seq 6000); do
        grep -qE "serving one-sided reads|is not served" "$dir/donor.log" 2>/dev/null && break
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
