#!/usr/bin/env bash
# Unpacks Debian's cloud kernel (the package linux-image-cloud-amd64 depends on) into DIR,
# as DIR/boot/vmlinuz-<release> and DIR/lib/modules/<release>/, without installing it on
# this machine: the microVM guest kernel for tests and for nodes that keep their own
# (docs/microvm.md "Guest kernel"). Idempotent: a DIR that has a kernel is left alone. The
# kernel is unpacked beside DIR and renamed into place, so runs at the same time (tests in
# parallel) never see or write a half-copied DIR.
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
parent=$(dirname "$dir")
mkdir -p "$parent"
new=$(mktemp -d "$parent/.fetch-debian.XXXXXX")
trap 'rm -rf "$work" "$new"' EXIT
(cd "$work" && apt-get download -q "$pkg" > /dev/null 2>&1) || (cd "$work" && apt-get download "$pkg")
dpkg -x "$work"/*.deb "$work/root"
mkdir -p "$new/boot" "$new/lib/modules"
cp "$work"/root/boot/vmlinuz-* "$new/boot/"
cp -a "$work"/root/lib/modules/* "$new/lib/modules/"
chmod 755 "$new"
# An empty DIR (made by hand) gives way; one another run filled meanwhile stays.
rmdir "$dir" 2>/dev/null || true
mv -T "$new" "$dir" 2>/dev/null || compgen -G "$dir/boot/vmlinuz-*" > /dev/null || {
  echo "fetch-debian.sh: cannot put the kernel at $dir" >&2
  exit 1
}
ls "$dir"/boot/vmlinuz-*
