#!/usr/bin/env bash
# Stops the cluster scripts/up.sh started (its sandboxes stay until their TTLs end, and are
# adopted again by the next `make up`).
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${OPENDSEC_STATE:-$PWD/opendsec-state}
PIDFILE=$STATE/cluster.pid
if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  kill "$(cat "$PIDFILE")"
  for _ in $(seq 1 100); do kill -0 "$(cat "$PIDFILE")" 2>/dev/null || break; sleep 0.1; done
  echo "stopped the cluster of $STATE"
else
  echo "no cluster running from $STATE"
fi
rm -f "$PIDFILE"
