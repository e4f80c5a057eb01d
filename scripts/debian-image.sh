#!/usr/bin/env bash
# Builds the Debian test image's root file system (bookworm, minbase, with bash and python3)
# with debootstrap, once: it is cached under a content-keyed directory (the key hashes this
# script, so changing what goes in makes a new one) and reused by later runs. Prints the path
# of the root file system. Tests find it through the same rule (`debian_rootfs()` in
# crates/cli/tests/common), or through OPENDSEC_DEBIAN_ROOTFS. The `systemd` variant adds
# systemd as /sbin/init (full VMs that boot the image's own init, `full_init`).
#
# usage: scripts/debian-image.sh [systemd]            build if absent, print the rootfs path
#        scripts/debian-image.sh [systemd] --path     print the path only
set -euo pipefail
cache="${OPENDSEC_CACHE:-/var/cache/opendsec}"
key="$(sha256sum "$0" | cut -c1-16)"
variant="" include="python3,procps,ca-certificates"
if [ "${1:-}" = "systemd" ]; then
  variant="-systemd" include="$include,systemd-sysv"
  shift
fi
dir="$cache/debian-bookworm$variant-$key"
if [ "${1:-}" = "--path" ]; then echo "$dir/rootfs"; exit 0; fi
if [ -f "$dir/complete" ]; then echo "$dir/rootfs"; exit 0; fi
rm -rf "$dir"
mkdir -p "$dir"
debootstrap --variant=minbase --include="$include" \
  bookworm "$dir/rootfs" http://deb.debian.org/debian >"$dir/debootstrap.log" 2>&1 || {
  tail -20 "$dir/debootstrap.log" >&2; exit 1; }
# Smaller and reproducible enough: no package caches or lists.
rm -rf "$dir/rootfs/var/cache/apt/archives/"*.deb "$dir/rootfs/var/lib/apt/lists/"*
touch "$dir/complete"
echo "$dir/rootfs"
