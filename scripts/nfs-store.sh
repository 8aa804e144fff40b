#!/usr/bin/env bash
# Inside the guest of scripts/test-nfs.sh: serves an ext4 file system over NFS 4.2 from the
# guest's own kernel nfsd on 127.0.0.1, mounts it with the options docs/images.md recommends
# for the image store, and runs COMMAND with OPENDSEC_TEST_NFS_STORE set to the mount point.
# Everything lives in the guest's tmpfs: nothing outlives the guest.
#
#   scripts/nfs-store.sh COMMAND [ARGS...]
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }

# The server and its client share one kernel: writeback to the mount waits on nfsd, which
# needs memory of its own to answer. Keep a reserve free and dirty pages few, so reclaim
# never waits on a write that waits on reclaim.
sysctl -q -w vm.min_free_kbytes=131072 vm.dirty_background_bytes=33554432 vm.dirty_bytes=134217728

# The server's disk: ext4 on a loop device, as a NAS would keep its share on a real file system.
srv=/run/nfs-export
mkdir -p "$srv"
truncate -s 3G /tmp/nfs-export.img
mkfs.ext4 -q -F /tmp/nfs-export.img
mount -o loop /tmp/nfs-export.img "$srv"

# nfsd's state (etab, v4 recovery) on tmpfs: the guest's / is the host's, read-only.
mount -t tmpfs -o mode=0755 tmpfs /var/lib/nfs
mkdir -p /var/lib/nfs/v4recovery /var/lib/nfs/rpc_pipefs
touch /var/lib/nfs/etab /var/lib/nfs/rmtab
mount -t rpc_pipefs sunrpc /var/lib/nfs/rpc_pipefs
mountpoint -q /proc/fs/nfsd || mount -t nfsd nfsd /proc/fs/nfsd
# NFSv4 only, TCP only: no rpcbind, no statd, no lockd over UDP.
exportfs -o rw,sync,no_subtree_check,no_root_squash,fsid=0 "127.0.0.1:$srv"
rpc.mountd --no-nfs-version 3 --no-udp
rpc.nfsd --no-nfs-version 3 --nfs-version 4.2 --no-udp 4
# A fresh nfsd holds new opens for its grace period (90 s by default) to let clients reclaim
# state; there are no clients to wait for.
echo Y > /proc/fs/nfsd/v4_end_grace 2>/dev/null || true

store=/run/opendsec-images
mkdir -p "$store"
mount -t nfs4 -o vers=4.2,hard,timeo=600,lookupcache=positive 127.0.0.1:/ "$store"
opts=$(awk -v m="$store" '$2 == m {print $3 " " $4}' /proc/mounts)
case "$opts" in
  nfs4\ *vers=4.2*) echo "nfs-store: $store is $opts" ;;
  *) echo "nfs-store: $store is not NFS 4.2: '$opts'" >&2; exit 1 ;;
esac
export OPENDSEC_TEST_NFS_STORE=$store
"$@"
