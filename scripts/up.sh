#!/usr/bin/env bash
# Brings up a local opendsec cluster with container sandboxes and leaves it running:
# installs the Debian packages needed (as root), builds the release binaries and the static
# agent, builds the Debian image (bash, python3; debootstrap, cached), starts `opendsecctl
# cluster up` in the background (IAM, watcher, apiserver, one edge offering `container` and
# `sim`) and its E2B gateway with its state in ./opendsec-state, imports the image as
# `debian:bookworm` and the E2B templates' images (scripts/e2b-images.sh), installs
# the Python SDK into a venv there, writes opendsec-state/env (the variables to connect) and
# runs examples/quickstart.py against the cluster. `make down` (scripts/down.sh) stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
[ "$(id -u)" = 0 ] || { echo "run as root: container sandboxes need namespaces, cgroups and loop devices" >&2; exit 1; }
STATE=${OPENDSEC_STATE:-$PWD/opendsec-state}
mkdir -p "$STATE" && STATE=$(cd "$STATE" && pwd)
command -v cargo >/dev/null || {
  echo "cargo not found: install Rust first (rustup, https://rustup.rs); under sudo, is ~/.cargo/bin on root's PATH?" >&2
  exit 1
}
PY=$(command -v python3) || { echo "python3 not found: apt-get install python3" >&2; exit 1; }

connect_help() {
  cat <<MSG

opendsec is running (pid $(cat "$STATE/cluster.pid"); state and log in $STATE).
Connect from a shell (addresses, token, opendsecctl and the SDK's Python on PATH):

  . $(printf %q "$STATE/env")
  opendsecctl sandbox create --backend container --image debian:bookworm
  opendsecctl exec <id> -- "python3 -c 'print(6*7)'"
  python3 examples/quickstart.py

E2B's SDKs (pip install e2b e2b-code-interpreter) run against it unchanged: the env file
sets E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY, and SSL_CERT_FILE and NODE_EXTRA_CA_CERTS
so that they trust the gateway's certificate (docs/e2b.md).

Stop it with: make down
MSG
}

if [ -f "$STATE/cluster.pid" ] && kill -0 "$(cat "$STATE/cluster.pid")" 2>/dev/null; then
  echo "a cluster is already running from $STATE"
  connect_help
  exit 0
fi

echo "== packages"
make setup
echo "== build (release; a first build takes several minutes)"
cargo build --release -p opendsec-cli
make agent >/dev/null
echo "== the Debian image (bash, python3) and the E2B templates' images"
ROOTFS=$(./scripts/debian-image.sh)
E2B_BASE=$(./scripts/e2b-images.sh base)
E2B_INTERP=$(./scripts/e2b-images.sh code-interpreter)

echo "== cluster"
cat >"$STATE/config.json" <<JSON
{"sim_edges": 1, "edge": {"backends": ["container", "fncall", "sim"]}, "e2b": {"listen": "127.0.0.1:7080"}}
JSON
nohup target/release/opendsecctl cluster up --config "$STATE/config.json" --state-dir "$STATE" \
  >"$STATE/cluster.log" 2>&1 &
echo $! >"$STATE/cluster.pid"
# From here a failure stops the cluster again, so that running make up once more starts over
# rather than finding a half-prepared cluster "already running".
UP_OK=0
stop_unless_up() {
  [ "$UP_OK" = 1 ] && return
  echo "make up failed; stopping the cluster (its log: $STATE/cluster.log)" >&2
  kill "$(cat "$STATE/cluster.pid")" 2>/dev/null || true
  rm -f "$STATE/cluster.pid"
}
trap stop_unless_up EXIT
for _ in $(seq 1 600); do grep -q 'export OPENDSEC_ADDR' "$STATE/cluster.log" && break; sleep 0.1; done
grep -q 'export OPENDSEC_ADDR' "$STATE/cluster.log" || { cat "$STATE/cluster.log" >&2; exit 1; }
ADDR=$(sed -n 's/^  apiserver: *//p' "$STATE/cluster.log")
E2B_URL=$(sed -n 's/^  e2b gateway: *//p' "$STATE/cluster.log")
{
  echo "# Written by make up: . this file to use the local cluster."
  printf 'export OPENDSEC_ADDR=%q\n' "$ADDR"
  printf 'export OPENDSEC_TOKEN="$(cat %q)"\n' "$STATE/admin.token"
  printf 'export OPENDSEC_CA=%q\n' "$STATE/pki/ca.pem"
  printf 'export OPENDSEC_IMAGE_STORE=%q\n' "$STATE/images"
  printf 'export E2B_API_URL=%q E2B_SANDBOX_URL=%q\n' "$E2B_URL" "$E2B_URL"
  # The admin token as an E2B key (e2b_ + hex), the shape every E2B SDK release accepts.
  printf 'export E2B_API_KEY="$(cat %q)"\n' "$STATE/admin.e2b-key"
  # The gateway speaks HTTPS with the cluster's certificate: E2B's Python SDK trusts the
  # file in SSL_CERT_FILE (the system's CAs and the cluster's), Node adds NODE_EXTRA_CA_CERTS.
  printf 'export SSL_CERT_FILE=%q NODE_EXTRA_CA_CERTS=%q\n' "$STATE/pki/trust-bundle.pem" "$STATE/pki/ca.pem"
  printf 'export PATH=%q:%q:"$PATH"\n' "$REPO/target/release" "$STATE/venv/bin"
} >"$STATE/env"
. "$STATE/env"
# (Its warning that /dev's device nodes were left out is expected: sandboxes get their own /dev.)
target/release/opendsecctl image import --rootfs "$ROOTFS" --name debian:bookworm --replace \
  >/dev/null 2>"$STATE/import.log" || { cat "$STATE/import.log" >&2; exit 1; }
echo "imported debian:bookworm"
for pair in "e2b-base:latest=$E2B_BASE" "code-interpreter-v1:latest=$E2B_INTERP"; do
  target/release/opendsecctl image import --rootfs "${pair#*=}" --name "${pair%%=*}" --replace \
    >/dev/null 2>>"$STATE/import.log" || { cat "$STATE/import.log" >&2; exit 1; }
  echo "imported ${pair%%=*} (E2B template)"
done

echo "== the Python SDK (venv in $STATE/venv)"
"$PY" -m venv "$STATE/venv"
"$STATE/venv/bin/pip" install -q --upgrade pip
"$STATE/venv/bin/pip" install -q ./sdk/python

echo "== a container sandbox runs Python (examples/quickstart.py)"
"$STATE/venv/bin/python" examples/quickstart.py
UP_OK=1
connect_help
