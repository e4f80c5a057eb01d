#!/usr/bin/env bash
# Builds the root file systems of the E2B gateway's default templates from Debian packages,
# once each: cached under a content-keyed directory (the key hashes this script, so changing
# what goes in makes new ones), reused by later runs. Prints the root file system's path.
#   base              e2b-base: Debian bookworm with bash, python3, curl, git and the `user`
#                     account (uid 1000, home /home/user) E2B's templates have
#   code-interpreter  code-interpreter-v1: that plus python3-ipykernel, matplotlib, numpy,
#                     pandas (the Jupyter kernel the code interpreter runs)
#
# usage: scripts/e2b-images.sh base|code-interpreter [--path]
set -euo pipefail
which="${1:-}"
case "$which" in
  base) pkgs="bash,python3,curl,git,procps,ca-certificates,less" ;;
  code-interpreter) pkgs="bash,python3,curl,git,procps,ca-certificates,less,python3-ipykernel,python3-matplotlib,python3-numpy,python3-pandas" ;;
  *) echo "usage: $0 base|code-interpreter [--path]" >&2; exit 2 ;;
esac
cache="${OPENDSEC_CACHE:-/var/cache/opendsec}"
key="$(sha256sum "$0" | cut -c1-16)"
dir="$cache/e2b-$which-$key"
if [ "${2:-}" = "--path" ]; then echo "$dir/rootfs"; exit 0; fi
if [ -f "$dir/complete" ]; then echo "$dir/rootfs"; exit 0; fi
rm -rf "$dir"
mkdir -p "$dir"
debootstrap --variant=minbase --include="$pkgs" \
  bookworm "$dir/rootfs" http://deb.debian.org/debian >"$dir/debootstrap.log" 2>&1 || {
  tail -20 "$dir/debootstrap.log" >&2; exit 1; }
# E2B's `user`: uid 1000, a home of its own, bash as its shell.
chroot "$dir/rootfs" useradd --create-home --uid 1000 --user-group --shell /bin/bash user
rm -rf "$dir/rootfs/var/cache/apt/archives/"*.deb "$dir/rootfs/var/lib/apt/lists/"*
touch "$dir/complete"
echo "$dir/rootfs"
