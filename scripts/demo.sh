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
export OPENDSEC_CA=$STATE/pki/ca.pem
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
ctl sandbox create --backend sim --project root/team-a/rl --image tools:full --label job=demo
ctl sandbox create --backend sim --project root/team-a/rl --count 5 --label job=demo
ctl sandbox list --project root/team-a --label job=demo
ctl usage root/team-a
ctl --project root/team-a/rl bench create --count 20000 --batch 1000 --concurrency 4
ctl --project root/team-a/rl bench create --count 5000 --concurrency 64
ctl --project root/team-a/rl bench create --count 1000 --concurrency 1

# Container sandboxes (root only: namespaces, cgroups, loop devices): a second cluster with one
# edge offering the container backend, the static agent as PID 1, a busybox image from the
# host's busybox-static, and a shell session, files and a process through the public API.
if [ "$(id -u)" != 0 ]; then echo "(not root: skipping the container part)"; exit 0; fi
make agent >/dev/null
kill $PID 2>/dev/null; wait $PID 2>/dev/null || true
STATE2=$(mktemp -d /tmp/opendsec-demo-ctr.XXXXXX)
LOG2=$STATE2/cluster.log
echo '{"sim_edges": 1, "apiserver": {"listen": "127.0.0.1:0"}, "edge": {"backends": ["sim", "container"]}}' >"$STATE2/config.json"
"$BIN/opendsecctl" cluster up --config "$STATE2/config.json" --state-dir "$STATE2" >"$LOG2" 2>&1 &
PID=$!
for _ in $(seq 1 600); do grep -q 'export OPENDSEC_ADDR' "$LOG2" && break; sleep 0.1; done
export OPENDSEC_ADDR=$(sed -n 's/^  apiserver: *//p' "$LOG2")
export OPENDSEC_TOKEN=$(cat "$STATE2/admin.token")
export OPENDSEC_CA=$STATE2/pki/ca.pem
export OPENDSEC_IMAGE_STORE=$STATE2/images
ROOTFS=$STATE2/busybox
mkdir -p "$ROOTFS/bin" "$ROOTFS/etc" "$ROOTFS/tmp"
cp /bin/busybox "$ROOTFS/bin/busybox"
for a in $(/bin/busybox --list); do [ "$a" = busybox ] || ln -s busybox "$ROOTFS/bin/$a"; done
echo 'root:x:0:0:root:/root:/bin/sh' >"$ROOTFS/etc/passwd"
ctl image import --rootfs "$ROOTFS" --name busybox:demo
ID=$(ctl sandbox create --backend container --image busybox:demo --cpu 500 --memory 128)
echo "container sandbox: $ID"
ctl exec "$ID" --session s1 -- 'cd /tmp && export GREETING=hello && echo in $(pwd)'
ctl exec "$ID" --session s1 -- 'echo $GREETING from $(pwd) as $(id -u) on $(hostname)'
echo "a file from the host" >"$STATE2/note.txt"
ctl cp "$STATE2/note.txt" "$ID:/tmp/note.txt"
ctl exec "$ID" -- cat /tmp/note.txt
ctl run "$ID" --tag sleeper --detach -- sleep 600
ctl ps "$ID"
ctl kill "$ID" sleeper --signal 15
ctl sandbox pause "$ID"
ctl exec "$ID" -- 'echo resumed transparently'
ctl sandbox stop "$ID"
