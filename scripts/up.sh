#!/usr/bin/env bash
# Brings up a local opendsec cluster with container sandboxes and leaves it running:
# installs the Debian packages needed (as root), builds the release binaries and the static
# agent, builds the Debian image (bash, python3; debootstrap, cached), starts `opendsecctl
# cluster up` in the background (IAM, watcher, apiserver, one edge offering `container` and
# `sim`) with its state in ./opendsec-state, imports the image as `debian:bookworm` and prints
# how to connect. `make down` (scripts/down.sh) stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "run as root: container sandboxes need namespaces, cgroups and loop devices" >&2; exit 1; }
STATE=${OPENDSEC_STATE:-$PWD/opendsec-state}
make setup >/dev/null
cargo build --release -p opendsec-cli
make agent >/dev/null
ROOTFS=$(./scripts/debian-image.sh)
if [ -f "$STATE/cluster.pid" ] && kill -0 "$(cat "$STATE/cluster.pid")" 2>/dev/null; then
  echo "a cluster is already running from $STATE (pid $(cat "$STATE/cluster.pid")); make down stops it" >&2
  exit 1
fi
mkdir -p "$STATE"
cat >"$STATE/config.json" <<JSON
{"sim_edges": 1, "edge": {"backends": ["container", "sim"]}}
JSON
nohup target/release/opendsecctl cluster up --config "$STATE/config.json" --state-dir "$STATE" \
  >"$STATE/cluster.log" 2>&1 &
echo $! >"$STATE/cluster.pid"
for _ in $(seq 1 600); do grep -q 'export OPENDSEC_ADDR' "$STATE/cluster.log" && break; sleep 0.1; done
grep -q 'export OPENDSEC_ADDR' "$STATE/cluster.log" || { cat "$STATE/cluster.log" >&2; exit 1; }
ADDR=$(sed -n 's/^  apiserver: *//p' "$STATE/cluster.log")
export OPENDSEC_ADDR=$ADDR OPENDSEC_TOKEN=$(cat "$STATE/admin.token") OPENDSEC_IMAGE_STORE=$STATE/images
target/release/opendsecctl image import --rootfs "$ROOTFS" --name debian:bookworm >/dev/null
cat <<MSG

opendsec is running (pid $(cat "$STATE/cluster.pid"), state and log in $STATE).
Connect with:

  export OPENDSEC_ADDR=$ADDR
  export OPENDSEC_TOKEN=\$(cat $STATE/admin.token)
  export OPENDSEC_IMAGE_STORE=$STATE/images

  target/release/opendsecctl sandbox create --backend container --image debian:bookworm
  target/release/opendsecctl exec <id> -- "python3 -c 'print(6*7)'"

Python: pip install ./sdk/python (see sdk/python/README.md). Stop it with: make down
MSG
