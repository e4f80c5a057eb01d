#!/usr/bin/env bash
# Builds the guest kernel of the microvm and fullvm backends from Debian's kernel package, once:
# an uncompressed vmlinux (QEMU boots its PVH entry directly, far faster than a bzImage under
# TCG) and the modules the guest needs (Debian builds virtio, ext4, erofs and overlay as
# modules), with their load order per bus. Cached under a content-keyed directory (the key
# hashes this script and the package's version) and reused by later runs. Prints the directory.
#
#   <dir>/vmlinux            the kernel
#   <dir>/modules/*.ko       the modules (uncompressed; the guest's init loads them itself)
#   <dir>/mmio.order         load order for -M microvm (virtio-mmio devices)
#   <dir>/pci.order          load order for q35 (virtio-pci devices, virtio-pmem)
#   <dir>/release            the kernel release, e.g. 6.1.0-57-amd64
#
# usage: scripts/vm-kernel.sh            build if absent, print the directory
#        scripts/vm-kernel.sh --path     print the directory only (empty if never built)
# The edge finds it through `edge.vm.kernel_dir` or this script's --path.
set -euo pipefail
cache="${OPENDSEC_CACHE:-/var/cache/opendsec}"
pkg="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')"
[ -n "$pkg" ] || { echo "vm-kernel: no linux-image-amd64 in the package lists (apt-get update)" >&2; exit 1; }
ver="$(apt-cache policy "$pkg" | awk '/Candidate:/ {print $2}')"
key="$( (cat "$0"; echo "$pkg $ver") | sha256sum | cut -c1-16)"
dir="$cache/vmkernel-$key"
if [ "${1:-}" = "--path" ]; then echo "$dir"; exit 0; fi
if [ -f "$dir/complete" ]; then echo "$dir"; exit 0; fi
for tool in dpkg-deb depmod modprobe python3; do
  command -v "$tool" >/dev/null || { echo "vm-kernel: $tool is missing (make setup)" >&2; exit 1; }
done
rm -rf "$dir"
mkdir -p "$dir/modules"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -qq -o APT::Sandbox::User=root "$pkg" >/dev/null)
dpkg-deb -x "$work"/"$pkg"_*.deb "$work/root"
release="${pkg#linux-image-}"

# The vmlinux inside the bzImage: the header says where the compressed payload lies (boot
# protocol 2.08+), its first bytes which compressor made it.
python3 - "$work/root/boot/vmlinuz-$release" "$dir/vmlinux" <<'EOF'
import lzma, struct, sys, zlib
img = open(sys.argv[1], "rb").read()
if img[0x202:0x206] != b"HdrS" or struct.unpack_from("<H", img, 0x206)[0] < 0x208:
    sys.exit("vm-kernel: not a bzImage of boot protocol 2.08 or later")
start = ((img[0x1F1] or 4) + 1) * 512
offset, length = struct.unpack_from("<II", img, 0x248)
payload = img[start + offset:start + offset + length]
if payload.startswith(b"\xfd7zXZ\x00"):
    elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
elif payload.startswith(b"\x1f\x8b"):
    elf = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(payload)
else:
    sys.exit(f"vm-kernel: payload compressed with an unknown method ({payload[:4].hex()})")
if elf[:4] != b"\x7fELF":
    sys.exit("vm-kernel: the payload is not an ELF file")
open(sys.argv[2], "wb").write(elf)
EOF

# The .deb carries no modules.dep (its postinst makes it): make one, then take each module's
# dependencies (softdeps included) in load order.
depmod -b "$work/root" "$release"
order() {
  local seen=" "
  for m in "$@"; do
    for ko in $(modprobe -d "$work/root" -S "$release" --show-depends "$m" | awk '$1 == "insmod" {print $2}'); do
      case "$seen" in *" $ko "*) continue ;; esac
      seen="$seen$ko "
      cp "$ko" "$dir/modules/"
      basename "$ko"
    done
  done
}
# crc32c_generic first: ext4 and jbd2 ask for crc32c through request_module, and the guest
# has no modprobe.
common="crc32c_generic ext4 erofs overlay virtio_console virtio_net"
order virtio_mmio virtio_blk $common >"$dir/mmio.order"
order virtio_pci virtio_blk virtio_pmem nd_pmem $common >"$dir/pci.order"
echo "$release" >"$dir/release"
touch "$dir/complete"
echo "$dir"
