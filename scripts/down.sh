#!/usr/bin/env bash
# Stops the cluster scripts/up.sh started, and with it its sandboxes (the cluster stops them
# as it exits; `cluster up --keep-sandboxes` would leave them for the next `make up`).
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${OPENDSEC_STATE:-$PWD/opendsec-state}
PIDFILE=$STATE/cluster.pid
if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  kill "$(cat "$PIDFILE")"
  # Stopping a thousand container sandboxes takes a while: wait up to two minutes.
  for _ in $(seq 1 1200); do kill -0 "$(cat "$PIDFILE")" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "the cluster of $STATE is still stopping (pid $(cat "$PIDFILE")); see $STATE/cluster.log" >&2
    exit 1
  fi
  tail -n 1 "$STATE/cluster.log" 2>/dev/null | grep '^stopped' || true
  echo "stopped the cluster of $STATE"
else
  echo "no cluster running from $STATE"
fi
rm -f "$PIDFILE"
