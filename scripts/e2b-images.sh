#!/usr/bin/env bash
# Builds the root file systems of the E2B gateway's default templates from Debian packages,
# once each: cached under a content-keyed directory (the key hashes this script, so changing
# what goes in makes new ones), reused by later runs. Prints the root file system's path.
#   base              e2b-base: Debian bookworm with bash, python3 (also as `python`), curl,
#                     git, sudo and the `user` account (uid 1000, home /home/user, sudo
#                     without a password) E2B's templates have
#   code-interpreter  code-interpreter-v1: that plus python3-ipykernel, matplotlib, numpy,
#                     pandas (the Jupyter kernel the code interpreter runs), installed with
#                     apt inside the new root (debootstrap's own resolver cannot take them)
#
# usage: scripts/e2b-images.sh base|code-interpreter [--path]
set -euo pipefail
which="${1:-}"
pkgs="bash,python3,python-is-python3,curl,git,procps,ca-certificates,less,sudo"
case "$which" in
  base) extra="" ;;
  code-interpreter) extra="python3-ipykernel python3-matplotlib python3-numpy python3-pandas" ;;
  *) echo "usage: $0 base|code-interpreter [--path]" >&2; exit 2 ;;
esac
cache="${OPENDSEC_CACHE:-/var/cache/opendsec}"
key="$(sha256sum "$0" | cut -c1-16)"
dir="$cache/e2b-$which-$key"
if [ "${2:-}" = "--path" ]; then echo "$dir/rootfs"; exit 0; fi
if [ -f "$dir/complete" ]; then echo "$dir/rootfs"; exit 0; fi
# A run killed while /proc was mounted in the new root leaves that mount behind: take it
# away first, and never cross into another file system while removing.
umount -l "$dir/rootfs/proc" 2>/dev/null || true
rm -rf --one-file-system "$dir"
mkdir -p "$dir"
debootstrap --variant=minbase --include="$pkgs" \
  bookworm "$dir/rootfs" http://deb.debian.org/debian >"$dir/debootstrap.log" 2>&1 || {
  tail -20 "$dir/debootstrap.log" >&2; exit 1; }
if [ -n "$extra" ]; then
  cp /etc/resolv.conf "$dir/rootfs/etc/resolv.conf"
  mount -t proc proc "$dir/rootfs/proc"
  trap 'umount "$dir/rootfs/proc" 2>/dev/null || true' EXIT
  { chroot "$dir/rootfs" apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive chroot "$dir/rootfs" apt-get install -y -qq --no-install-recommends $extra
  } >"$dir/apt.log" 2>&1 || { tail -20 "$dir/apt.log" >&2; exit 1; }
  umount "$dir/rootfs/proc"
  trap - EXIT
  chroot "$dir/rootfs" apt-get clean
  : >"$dir/rootfs/etc/resolv.conf"
fi
# E2B's `user`: uid 1000, a home of its own, bash as its shell, sudo without a password.
chroot "$dir/rootfs" useradd --create-home --uid 1000 --user-group --shell /bin/bash user
echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' >"$dir/rootfs/etc/sudoers.d/user"
chmod 0440 "$dir/rootfs/etc/sudoers.d/user"
rm -rf "$dir/rootfs/var/cache/apt/archives/"*.deb "$dir/rootfs/var/lib/apt/lists/"*
touch "$dir/complete"
echo "$dir/rootfs"
