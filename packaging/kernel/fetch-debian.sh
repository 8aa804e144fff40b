#!/usr/bin/env bash
# Unpacks Debian's cloud kernel (the package linux-image-cloud-amd64 depends on) into DIR,
# as DIR/boot/vmlinuz-<release> and DIR/lib/modules/<release>/, without installing it on
# this machine: the microVM guest kernel for tests and for nodes that keep their own
# (docs/microvm.md "Guest kernel"). Idempotent: a DIR that has a kernel is left alone.
# Usage: packaging/kernel/fetch-debian.sh DIR
set -euo pipefail
dir=${1:?usage: fetch-debian.sh DIR}
if compgen -G "$dir/boot/vmlinuz-*" > /dev/null; then
  ls "$dir"/boot/vmlinuz-*
  exit 0
fi
latest() { apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'; }
pkg=$(latest)
[ -n "$pkg" ] || { apt-get update -qq >/dev/null 2>&1 || true; pkg=$(latest); }
if [ -z "$pkg" ]; then
  echo "fetch-debian.sh: apt knows no linux-image-cloud-amd64 (run apt-get update)" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -q "$pkg" > /dev/null 2>&1) || (cd "$work" && apt-get download "$pkg")
mkdir -p "$dir"
dpkg -x "$work"/*.deb "$work/root"
mkdir -p "$dir/boot" "$dir/lib/modules"
cp "$work"/root/boot/vmlinuz-* "$dir/boot/"
cp -a "$work"/root/lib/modules/* "$dir/lib/modules/"
ls "$dir"/boot/vmlinuz-*
