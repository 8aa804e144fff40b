#!/usr/bin/env bash
# Builds a minimal Debian image with python3 as an OCI layout, tagged `python3`, from the
# host's own configured package sources (no public registry): debootstrap into a directory,
# then umoci turns the directory into one layer of an OCI image. About a minute and 260 MB.
#
#   bash scripts/build-base-image.sh OUT_LAYOUT        # then: opendsec ctl image import OUT_LAYOUT#python3 ...
#
# Needs root, debootstrap and umoci (.ci/run installs them). The suite is the host's own
# (VERSION_CODENAME in /etc/os-release), the mirror the first `deb` source the host's apt
# configuration names for it; OPENDSEC_DEBIAN_MIRROR and OPENDSEC_DEBIAN_SUITE override them.
set -euo pipefail
out=${1:?usage: build-base-image.sh OUT_LAYOUT}
if [ "$(id -u)" != 0 ]; then
  echo "build-base-image: debootstrap needs root" >&2
  exit 1
fi
for tool in debootstrap umoci; do
  command -v "$tool" >/dev/null 2>&1 || { echo "build-base-image: $tool is not installed (apt-get install $tool)" >&2; exit 1; }
done

suite=${OPENDSEC_DEBIAN_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-}")}
[ -n "$suite" ] || { echo "build-base-image: no VERSION_CODENAME in /etc/os-release; set OPENDSEC_DEBIAN_SUITE" >&2; exit 1; }

# The host's mirror for its own suite: deb822 files first (URIs:/Suites:), then one-line ones.
mirror_of_host() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v suite="$suite" '
      /^[[:space:]]*$/ { if (uri != "" && ok && deb) { print uri; exit } uri=""; ok=0; deb=0; next }
      tolower($1) == "types:" { for (i = 2; i <= NF; i++) if ($i == "deb") deb=1 }
      tolower($1) == "uris:" { uri=$2 }
      tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == suite) ok=1 }
      END { if (uri != "" && ok && deb) print uri }' "$f"
  done
  { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true; } \
    | awk -v suite="$suite" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ } if ($(i+1) == suite) { print $i; exit } }'
}
mirror=${OPENDSEC_DEBIAN_MIRROR:-$(mirror_of_host | sed -n 1p)}
[ -n "$mirror" ] || { echo "build-base-image: the host's apt sources name no mirror for $suite; set OPENDSEC_DEBIAN_MIRROR" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
echo "build-base-image: debootstrap $suite from $mirror (about a minute)" >&2
# OPENDSEC_EXTRA_PACKAGES: more Debian packages, comma-separated (the code interpreter's
# image adds python3-venv).
if ! debootstrap --variant=minbase --include="python3${OPENDSEC_EXTRA_PACKAGES:+,$OPENDSEC_EXTRA_PACKAGES}" "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1; then
  tail -n 30 "$work/debootstrap.log" >&2
  exit 1
fi
# What an image does not carry: device nodes (the sandbox gets its own /dev, and the importer
# refuses devices), the package cache and lists, logs of the build.
find "$rootfs/dev" -mindepth 1 -delete
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/* \
  "$rootfs"/proc/* "$rootfs"/sys/* "$rootfs"/run/* "$rootfs"/tmp/*

rm -rf "$out.tmp"
umoci init --layout "$out.tmp"
umoci new --image "$out.tmp:python3"
umoci insert --image "$out.tmp:python3" "$rootfs" /
umoci config --image "$out.tmp:python3" --os linux --architecture amd64 \
  --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.env LANG=C.UTF-8 --config.workingdir /root
umoci gc --layout "$out.tmp"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "build-base-image: $out ($(du -sh "$out" | cut -f1))" >&2
