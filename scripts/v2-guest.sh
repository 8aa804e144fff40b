#!/usr/bin/env bash
# Runs a command as root in a Linux guest whose cgroups are v2 only (docs/testing.md "cgroup v2
# in a guest"). Our test machines are v1-hybrid hosts while production is v2, so the container
# backend's v2 paths (cgroup.kill, cgroup.freeze, memory.events, one hierarchy) would otherwise
# never run before a user's machine does.
#
# The guest is Debian's stock kernel under QEMU (TCG where KVM cannot boot it), with the host's
# own / shared read-only over 9p as its root, so the guest runs the very binaries of this work
# tree; /tmp, /run and /var/tmp are the guest's own tmpfs. Nothing leaves the machine: the guest
# has no network device.
#
#   scripts/v2-guest.sh [-mem MB] [-cpus N] [-timeout S] [-modules "M ..."] -- COMMAND [ARGS...]
#
# -modules loads more of the kernel's modules at boot (with their dependencies), e.g. "nfsd
# nfsv4" for scripts/test-nfs.sh.
#
# Exit status: the command's, or 125 when the guest did not report one (boot failure,
# timeout). Needs root, qemu-system-x86 and Debian's package sources (the kernel package is
# fetched once into target/v2-guest).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

mem=4096
cpus=2
timeout=1200
extra=""
while [ $# -gt 0 ]; do
  case "$1" in
    -mem) mem=$2; shift 2 ;;
    -cpus) cpus=$2; shift 2 ;;
    -timeout) timeout=$2; shift 2 ;;
    -modules) extra=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [-mem MB] [-cpus N] [-timeout S] [-modules \"M ...\"] -- COMMAND [ARGS...]" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "$0: no command given" >&2; exit 2; }

work=$root/target/v2-guest
mkdir -p "$work"

# The kernel: Debian's current stock image, unpacked (not installed) once.
if [ ! -f "$work/kernel.ok" ]; then
  command -v qemu-system-x86_64 >/dev/null 2>&1 || {
    apt-get update -qq && apt-get install -y -qq qemu-system-x86 >/dev/null
  }
  pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')
  [ -n "$pkg" ] || { apt-get update -qq; pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/ {print $2; exit}'); }
  rm -rf "$work/deb" "$work/x" && mkdir -p "$work/deb"
  (cd "$work/deb" && apt-get download -q "$pkg" >/dev/null 2>&1)
  dpkg-deb -x "$work"/deb/*.deb "$work/x"
  rm -rf "$work/deb"
  touch "$work/kernel.ok"
fi
command -v qemu-system-x86_64 >/dev/null 2>&1 || apt-get install -y -qq qemu-system-x86 >/dev/null
kver=$(ls "$work/x/lib/modules" | head -1)
kernel=$work/x/boot/vmlinuz-$kver
moddir=$work/x/lib/modules/$kver

# The initramfs: a static busybox, the modules a 9p root, loop devices, ext4 and overlayfs
# need (dependencies first, read from each module's own `depends=`), those -modules names,
# and /init. One image per module list, so guests of both kinds can be booted in turn.
modules="virtio_pci 9pnet_virtio 9p loop ext4 crc32c_generic overlay $extra"
initrd=$work/initrd-$(printf '%s' "$modules" | cksum | cut -d' ' -f1).img
if [ ! -f "$initrd" ] || [ "$0" -nt "$initrd" ]; then
  # busybox-static's (Debian's busybox package is linked dynamically).
  [ -x /bin/busybox ] || apt-get install -y -qq busybox-static >/dev/null
  bb=/bin/busybox
  ird=$work/initrd
  rm -rf "$ird" && mkdir -p "$ird"/{bin,proc,sys,dev,newroot,mod}
  cp "$bb" "$ird/bin/busybox"
  declare -A seen=()
  order=()
  add() {
    local m=$1 f deps d
    [ -n "${seen[$m]:-}" ] && return 0
    seen[$m]=1
    f=$(find "$moddir/kernel" -name "$m.ko" -o -name "${m//_/-}.ko" | head -1)
    [ -n "$f" ] || { echo "$0: module $m not in $kver" >&2; exit 1; }
    deps=$(strings -a "$f" | sed -n 's/^depends=//p' | head -1)
    for d in ${deps//,/ }; do add "$d"; done
    cp "$f" "$ird/mod/$m.ko"
    order+=("$m")
  }
  for m in $modules; do add "$m"; done
  printf '%s\n' "${order[@]}" > "$ird/modules"
  cat > "$ird/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t devtmpfs dev /dev
for m in $(cat /modules); do insmod /mod/$m.ko || echo "v2-guest: insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576,cache=loose,ro hostroot /newroot || {
  echo "V2GUEST-RC=125 (no 9p root)"; poweroff -f; }
stage2=$(sed -n 's/.*v2stage2=\([^ ]*\).*/\1/p' /proc/cmdline)
umount /proc
exec switch_root /newroot /bin/bash "$stage2"
EOF
  chmod +x "$ird/init"
  (cd "$ird" && find . | "$bb" cpio -o -H newc 2>/dev/null) | gzip -1 > "$initrd.tmp"
  mv "$initrd.tmp" "$initrd"
fi

# The command, run by scripts/v2-guest-init.sh inside the guest.
printf '%q ' "$@" > "$work/command"
echo "$root" > "$work/cwd"
env | grep -E '^(CI|RUST_LOG|RUST_BACKTRACE|PYTHONDONTWRITEBYTECODE|OPENDSEC_TEST_[A-Z_]*)=' > "$work/env" || true
# Emulation is several times slower than the host: tests widen the time they give a command
# to do something by this much (never what they assert of its outcome).
grep -q '^OPENDSEC_TEST_TIME_SCALE=' "$work/env" || echo OPENDSEC_TEST_TIME_SCALE=8 >> "$work/env"

accel=tcg,thread=multi
log=$work/console.log
# A guest kernel that locks up under emulation (a vCPU stuck for minutes: "soft lockup") is
# a fault of the emulated machine, not of the tests: softlockup_panic ends such a guest at
# once, and it is booted once more. So is a guest whose tasks hang in the kernel for four
# minutes (hung_task_panic): the NFS guest serves its own mount over 127.0.0.1, a loopback
# that can deadlock in memory reclaim, and no test's own time limit can end a task stuck
# in the kernel. Any other run without an exit status fails, with the console's last lines.
for try in 1 2; do
  set +e
  timeout --foreground -k 10 "$timeout" qemu-system-x86_64 \
    -machine q35 -accel "$accel" -cpu max -smp "$cpus" -m "$mem" \
    -nographic -no-reboot -nic none \
    -kernel "$kernel" -initrd "$initrd" \
    -append "console=ttyS0 quiet panic=-1 softlockup_panic=1 sysctl.kernel.hung_task_panic=1 sysctl.kernel.hung_task_timeout_secs=240 v2stage2=$root/scripts/v2-guest-init.sh" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap \
    < /dev/null 2>&1 | tee "$log" | sed -u 's/\x1b\[[0-9;?]*[a-zA-Z]//g; s/\x1bc//g' | grep --line-buffered -v '^V2GUEST-RC='
  set -e
  rc=$(sed -n 's/^V2GUEST-RC=\([0-9]*\).*/\1/p' "$log" | tail -1 | tr -d '\r')
  if [ -z "$rc" ] && [ "$try" = 1 ] && grep -qE 'soft lockup|blocked for more than' "$log"; then
    grep -E -A3 'soft lockup|blocked for more than' "$log" | head -40 >&2 || true
    echo "$0: the guest's kernel locked up or hung (above): booting it once more" >&2
    continue
  fi
  break
done
if [ -z "$rc" ]; then
  echo "$0: the guest reported no exit status (see $log); its console's last lines:" >&2
  sed 's/\x1b\[[0-9;?]*[a-zA-Z]//g' "$log" | tail -n 40 >&2 || true
  exit 125
fi
exit "$rc"
