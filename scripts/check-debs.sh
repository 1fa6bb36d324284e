#!/usr/bin/env bash
# Check the Debian packages that scripts/build-debs.sh made, on this
# machine, as root: lintian, install (dpkg -i), the installed units
# (systemd-analyze verify), the installed example config
# (engram-cluster check), a donor and a node run from the installed paths
# as the packages' user, then remove and purge, checking that the data
# stays. CI runs it after the README's test command; it leaves the machine
# without the packages (the engram-rack user and /var/lib/engram-rack stay,
# as they would for an operator).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
debs=("$target"/debian/engram-rack-*.deb)
packages=(engram-rack-node engram-rack-donor engram-rack-cluster)

# Every tag lintian shows at info level and above fails, except those the
# packages override with a reason (systemd/debian/*.lintian-overrides).
lintian --fail-on error,warning,info --display-info "${debs[@]}"

dpkg -i "${debs[@]}"
trap 'dpkg --purge "${packages[@]}" >/dev/null 2>&1 || true' EXIT
id engram-rack
test -d /var/lib/engram-rack/tables && test -d /var/lib/engram-rack/ssd
# An unknown key is only a warning (exit code 0): any output fails too.
said=$(SYSTEMD_LOG_LEVEL=warning systemd-analyze verify --man=no --generators=no \
  /usr/lib/systemd/system/memory-donor.service \
  /usr/lib/systemd/system/inference-node.service \
  /usr/lib/systemd/system/engram-engines.service 2>&1)
[ -z "$said" ] || { echo "$said"; exit 1; }
engram-cluster check /etc/engram-rack/rack.toml
ls /usr/share/man/man1/{memory-donor-serve,inference-node-serve,engram-cluster-check}.1.gz >/dev/null
test -f /usr/share/bash-completion/completions/engram-cluster

# A donor and a node from the installed binaries, as user engram-rack: a
# TLS rack on loopback with one table, its PKI made by the installed
# engram-cluster; the node's canary must read every row from the donor.
smoke=$(mktemp -d)
digest=$(/usr/bin/memory-donor gen --rows 10000 --layer 1 --seed 7 --out "$smoke/l1.etab" | sed -n 's/.* digest //p')
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$smoke/rack.toml" <<TOML
version = 1
[rack]
name = "smoke"
[rack.tls]
operators = ["ops"]
[[table]]
id = 1
layer = 1
path = "$smoke/l1.etab"
rows = 10000
digest = "$digest"
[[donor]]
name = "d"
listen = ["tls://127.0.0.1:$port"]
tables = [1]
ram_gib = 1.0
[[node]]
name = "n"
[[node.route]]
table = 1
sources = ["d"]
TOML
engram-cluster pki init --config "$smoke/rack.toml" >/dev/null
engram-cluster pki issue --config "$smoke/rack.toml" >/dev/null
engram-cluster check "$smoke/rack.toml"
chown -R engram-rack:engram-rack "$smoke"
runuser -u engram-rack -- /usr/bin/memory-donor serve --config "$smoke/rack.toml" --name d 2>"$smoke/donor.log" &
donor=$!
for _ in $(seq 300); do
  grep -q ' ready ' "$smoke/donor.log" && break
  kill -0 "$donor" 2>/dev/null || break
  sleep 0.1
done
grep ' ready ' "$smoke/donor.log" || { cat "$smoke/donor.log"; exit 1; }
runuser -u engram-rack -- /usr/bin/inference-node canary --config "$smoke/rack.toml" --name n \
  --tokens 100 --tokens-per-second 500 2>"$smoke/node.log"
tail -1 "$smoke/node.log"
tail -1 "$smoke/node.log" | grep -q 'failed 0 \[d=100\]'
kill -TERM "$donor"
wait "$donor" || true  # runuser ends on the signal it passed on
rm -rf "$smoke"

# An upgrade (here the same packages again) keeps an edited config.
echo '# edited here' >>/etc/engram-rack/rack.toml
dpkg -i "${debs[@]}" >/dev/null
grep -q '^# edited here$' /etc/engram-rack/rack.toml

# Removing keeps the config and the data; purging removes the config only.
touch /var/lib/engram-rack/tables/kept
dpkg -r "${packages[@]}"
test -f /etc/engram-rack/rack.toml && test -f /var/lib/engram-rack/tables/kept
dpkg --purge "${packages[@]}"
test ! -e /etc/engram-rack/rack.toml && test -f /var/lib/engram-rack/tables/kept
rm /var/lib/engram-rack/tables/kept
trap - EXIT
echo "packages checked: ${debs[*]}"
