#!/usr/bin/env bash
# Brings up a local opendsec cluster (IAM, watcher, apiserver, 100 sim edges) in the
# background, runs the main job against it through opendsecctl, and stops it again.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${PROFILE:-release}
EDGES=${EDGES:-100}
if [ "$PROFILE" = release ]; then cargo build --release -p opendsec-cli; BIN=target/release; else cargo build -p opendsec-cli; BIN=target/debug; fi
STATE=$(mktemp -d /tmp/opendsec-demo.XXXXXX)
LOG=$STATE/cluster.log
"$BIN/opendsecctl" cluster up --state-dir "$STATE" --sim-edges "$EDGES" >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do grep -q 'export OPENDSEC_ADDR' "$LOG" && break; sleep 0.1; done
cat "$LOG"
export OPENDSEC_ADDR=$(sed -n 's/^  apiserver: *//p' "$LOG")
export OPENDSEC_TOKEN=$(cat "$STATE/admin.token")
ctl() { echo "+ opendsecctl $*" >&2; "$BIN/opendsecctl" "$@"; }
export OPENDSEC_IMAGE_STORE=$STATE/images
ctl whoami
ctl image store-check "$STATE/images" || echo "(the store lacks a capability real backends need; sim does not care)"
ctl project create root/team-a --sandboxes 50000
ctl project create root/team-a/rl --cpu 2000000
# An image: a tiny root file system imported into the store and registered in root/team-a.
mkdir -p "$STATE/rootfs/etc" && echo "hello from the demo" >"$STATE/rootfs/etc/motd"
ctl --project root/team-a image import --rootfs "$STATE/rootfs" --name tools:1
ctl --project root/team-a image compose tools:full scratch tools:1
ctl --project root/team-a image list --recursive
ctl sandbox create --project root/team-a/rl --image tools:full --label job=demo
ctl sandbox create --project root/team-a/rl --count 5 --label job=demo
ctl sandbox list --project root/team-a --label job=demo
ctl usage root/team-a
ctl --project root/team-a/rl bench create --count 20000 --batch 1000 --concurrency 4
ctl --project root/team-a/rl bench create --count 5000 --concurrency 64
ctl --project root/team-a/rl bench create --count 1000 --concurrency 1
