#!/usr/bin/env bash
# The control-plane benchmark: a release build of `opendsecctl cluster up --sim-edges 100` on
# this machine, then `opendsecctl bench create` batched, one by one (concurrent), and one at a
# time (the latency of a single creation); each run also stops what it created. Prints JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
EDGES=${EDGES:-100}
BATCHED=${BATCHED:-20000}
SINGLE=${SINGLE:-5000}
SEQUENTIAL=${SEQUENTIAL:-1000}
cargo build --release -p opendsec-cli
BIN=target/release
STATE=$(mktemp -d /tmp/opendsec-bench.XXXXXX)
LOG=$STATE/cluster.log
"$BIN/opendsecctl" cluster up --state-dir "$STATE" --sim-edges "$EDGES" >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true; rm -rf "$STATE"' EXIT
for _ in $(seq 1 600); do grep -q 'export OPENDSEC_ADDR' "$LOG" && break; sleep 0.1; done
export OPENDSEC_ADDR=$(sed -n 's/^  apiserver: *//p' "$LOG")
export OPENDSEC_TOKEN=$(cat "$STATE/admin.token")
export OPENDSEC_CA=$STATE/pki/ca.pem
echo "# batched: $BATCHED sandboxes, batches of 1000, 4 calls at a time"
"$BIN/opendsecctl" bench create --count "$BATCHED" --batch 1000 --concurrency 4 --json
echo "# one by one: $SINGLE sandboxes, 64 calls at a time"
"$BIN/opendsecctl" bench create --count "$SINGLE" --concurrency 64 --json
echo "# single creation latency: $SEQUENTIAL sandboxes, one at a time"
"$BIN/opendsecctl" bench create --count "$SEQUENTIAL" --concurrency 1 --json
