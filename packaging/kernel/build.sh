#!/usr/bin/env bash
# Builds OpenDsec's microVM guest kernel from Debian's linux-source package, with
# everything a guest needs built in and no modules (packaging/kernel/microvm.config, merged
# over `make tinyconfig` and the kernel's kvm_guest.config; docs/microvm.md "Guest kernel").
#
#   packaging/kernel/build.sh [--config-only] [OUT_DIR]     default: target/guest-kernel-built
#
# --config-only resolves and checks the config and leaves it in OUT_DIR, without building.
#
# Environment: LINUX_SOURCE (the Debian package, default linux-source-6.12), JOBS (make -j,
# default nproc). Installs what it needs with apt-get when missing (as root). Prints the
# kernel's path; use it as `opendsec cluster up -microvm-kernel FILE` or a microvm
# backend's `kernel`. OUT_DIR also gets the resolved config as config-<release>.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
config_only=
if [ "${1:-}" = --config-only ]; then
  config_only=1
  shift
fi
out=$(realpath -m "${1:-$here/../../target/guest-kernel-built}")
pkg=${LINUX_SOURCE:-linux-source-6.12}
jobs=${JOBS:-$(nproc)}

# kconfig needs a compiler, bison and flex; the build also bc, perl, libelf and libssl.
need=()
tools=(make gcc bison flex)
[ -n "$config_only" ] || tools+=(bc perl)
for t in "${tools[@]}"; do command -v "$t" >/dev/null 2>&1 || need+=("$t"); done
if [ -z "$config_only" ]; then
  for p in libelf-dev libssl-dev; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
fi
compgen -G "/usr/src/$pkg.tar.*" >/dev/null || need+=("$pkg")
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
tarball=$(compgen -G "/usr/src/$pkg.tar.*" | head -n1)
version=$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null || stat -c %Y "$tarball")

mkdir -p "$out/src"
if [ -n "$config_only" ]; then
  # What kconfig reads: a tenth of the tree, unpacked in seconds.
  src="$out/src/$pkg-$version.kconfig"
  if [ ! -d "$src" ]; then
    rm -rf "$src.part" && mkdir -p "$src.part"
    tar -C "$src.part" --strip-components=1 -xf "$tarball" --wildcards \
      '*/Kconfig*' '*Makefile*' '*/Kbuild*' "$pkg/scripts/*" '*/configs/*' '*.sh' \
      "$pkg/include/*" "$pkg/arch/x86/include/*" "$pkg/arch/x86/tools/*"
    mv "$src.part" "$src"
  fi
else
  # A tree per package version, unpacked whole before it is used: an interrupted unpack
  # or an upgraded package never builds from a stale or partial tree.
  src="$out/src/$pkg-$version"
  if [ ! -d "$src" ]; then
    rm -rf "$src.part" && mkdir -p "$src.part"
    tar -C "$src.part" --strip-components=1 -xf "$tarball"
    mv "$src.part" "$src"
  fi
fi
cd "$src"
make -s tinyconfig
make -s kvm_guest.config
scripts/kconfig/merge_config.sh -m .config "$here/microvm.config" >/dev/null
make -s olddefconfig

# A line the kernel's dependencies overruled would be silently dropped: every one must hold.
missing=()
while IFS= read -r line; do
  case "$line" in '' | '#'*) continue ;; esac
  key=${line%%=*}
  if [ "${line#*=}" = n ]; then
    if grep -q "^$key=" .config; then missing+=("$line (is $(grep "^$key=" .config))"); fi
  elif ! grep -qx "$line" .config; then
    missing+=("$line (is $(grep -E "^$key=|^# $key is not set" .config || echo absent))")
  fi
done < "$here/microvm.config"
if [ ${#missing[@]} -gt 0 ]; then
  printf 'not in the resolved config: %s\n' "${missing[@]}" >&2
  exit 1
fi

release=$(make -s kernelrelease)
cp .config "$out/config-$release"
if [ -n "$config_only" ]; then
  echo "$out/config-$release"
  exit 0
fi
make -s -j"$jobs" bzImage
cp arch/x86/boot/bzImage "$out/vmlinuz-$release"
echo "$out/vmlinuz-$release"
