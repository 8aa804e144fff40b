#!/bin/bash
# PID 1 of the guest scripts/v2-guest.sh boots, after its initramfs switched to the host's /
# (read-only over 9p): mounts what a host has, cgroup v2 alone at /sys/fs/cgroup with every
# controller enabled at the root, runs the command written to target/v2-guest/command, and
# reports its exit status on the console as V2GUEST-RC=N before powering off.
set -u
report() {
  echo "V2GUEST-RC=$1"
  sync
  busybox poweroff -f
}
trap 'report 125' ERR
set -e
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
# The work tree, found before the guest's own tmpfs hide what was under them: a clone under
# /tmp (as CI makes) is bound back at its own path from a plain bind of the 9p root.
tree=$(cd "$(dirname "$0")/.." && pwd -P)
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/hostroot
mount --bind / /run/hostroot
for d in /tmp /var/tmp; do mount -t tmpfs -o mode=1777 tmpfs "$d"; done
case "$tree" in
  /tmp/* | /var/tmp/* | /run/*)
    mkdir -p "$tree"
    mount --bind "/run/hostroot$tree" "$tree"
    ;;
esac
mount -t cgroup2 cgroup2 /sys/fs/cgroup
for c in $(cat /sys/fs/cgroup/cgroup.controllers); do
  echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control
done
ip link set lo up 2>/dev/null || busybox ip link set lo up
work=$tree/target/v2-guest
set -a
# shellcheck disable=SC1091
. "$work/env"
set +a
export HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
cd "$(cat "$work/cwd")"
echo "v2-guest: $(uname -r), cgroup2 controllers: $(cat /sys/fs/cgroup/cgroup.subtree_control)"
trap - ERR
set +e
eval "$(cat "$work/command")"
report $?
