#!/usr/bin/env bash
# microVM benchmark (bench/microvm.py): cold boot, pause, resume, snapshot, restore, fork and
# the memory of an idle VM through the cluster's `microvm` backend (runtime qemu), each beside
# QEMU's own mechanism (a plain migration to a file, `-incoming`) on the same VM's command line.
# Builds the release binary unless OPENDSEC_BIN names one, starts a single-node
# `cluster up -runtime linux`-style cluster from a config with a microvm backend, runs the
# measurement, stops the cluster. Needs root and qemu-system-x86_64. Arguments go to
# microvm.py, except -kernel FILE (the guest kernel; else OPENDSEC_TEST_KERNEL, else the
# newest target/guest-kernel/boot/vmlinuz-*, else the newest /boot/vmlinuz-*), e.g.
#
#   bench/microvm.sh                     # -n 8 -forks 3, table
#   bench/microvm.sh -n 3 -json
#   bench/microvm.sh -only fork -forks 1 # fork(count=1, 4, 8) only (or boot, pause, snapshot)
#
# OPENDSEC_BENCH_KEEP_LOG=FILE keeps the cluster's log (-log info) there. docs/benchmarks.md
# "microVMs" records a run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "microvm.sh: needs root (cgroups, QEMU in them, the store's owners)" >&2
  exit 1
fi
command -v qemu-system-x86_64 >/dev/null || { echo "microvm.sh: no qemu-system-x86_64 on PATH" >&2; exit 1; }

KERNEL=${OPENDSEC_TEST_KERNEL:-}
ARGS=()
while [ $# -gt 0 ]; do
  case $1 in
    -kernel) KERNEL=${2:?-kernel needs a file}; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
newest() { ls -1 "$@" 2>/dev/null | sort -V | tail -n 1 || true; }
[ -n "$KERNEL" ] || KERNEL=$(newest target/guest-kernel/boot/vmlinuz-*)
[ -n "$KERNEL" ] || KERNEL=$(newest /boot/vmlinuz-*)
if [ ! -f "$KERNEL" ]; then
  echo "microvm.sh: no guest kernel (-kernel, OPENDSEC_TEST_KERNEL, target/guest-kernel or /boot)" >&2
  exit 1
fi
KERNEL=$(readlink -f "$KERNEL")

if [ -n "${OPENDSEC_BIN:-}" ]; then
  BIN=$OPENDSEC_BIN
else
  cargo build --release -q
  BIN=$PWD/target/x86_64-unknown-linux-gnu/release/opendsec
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# The SDK from this tree (PYTHONPATH below); installed only for its dependencies.
.venv/bin/python -c 'import grpc, google.protobuf' 2>/dev/null ||
  .venv/bin/pip install -q --disable-pip-version-check ./sdk/python

# Short: the VMs' sockets live under it and must fit a unix socket name. The edge's id is
# this run's own, so are its cgroups (/sys/fs/cgroup/*/opendsec/<id>).
STATE=$(mktemp -d /tmp/odv.XXXXXX)
EDGE=mvbench-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
OUT=$STATE/cluster.env
hex() { od -An -N20 -tx1 /dev/urandom | tr -d ' \n'; }
cat >"$STATE/opendsec.json" <<EOF
{
  "service_token": "$(hex)",
  "iam": {"addr": "127.0.0.1:0", "admin_token": "dsk.admin.$(hex)"},
  "watcher": {"addr": "127.0.0.1:0", "probe_interval": 0.25, "reconcile_interval": 5.0},
  "apiserver": [{"addr": "127.0.0.1:0", "snapshot_refresh": 0.25}],
  "image_store": {"root": "$STATE/images"},
  "edges": [{
    "id": "$EDGE", "addr": "127.0.0.1:0", "state_dir": "$STATE/state", "persist_state": true,
    "cpu_overcommit": 32, "mem_reserve_mb": 0, "disk_reserve_mb": 512,
    "backends": {
      "container": {"runtime": "linux", "default_disk_mb": 256},
      "microvm": {"runtime": "qemu", "kernel": "$KERNEL", "default_disk_mb": 64}
    }
  }]
}
EOF
chmod 600 "$STATE/opendsec.json"
# A session of its own: a Ctrl-C reaches the measurement, which then stops its sandboxes
# through the cluster; the trap stops the cluster after.
setsid "$BIN" cluster up -config "$STATE/opendsec.json" -log info >"$OUT" 2>"$STATE/cluster.log" &
PID=$!
cleanup() {
  kill "$PID" 2>/dev/null || true
  wait "$PID" 2>/dev/null || true
  # QEMUs left of this run (the peer's, or VMs the edge left behind): their command lines
  # name files under $STATE, which is this run's alone.
  for p in $(pgrep -f "qemu-system-x86_64 .*$STATE/" || true); do kill -9 "$p" 2>/dev/null || true; done
  sleep 0.5
  find /sys/fs/cgroup/*/opendsec/"$EDGE" -depth -type d -exec rmdir {} + 2>/dev/null || true
  if [ -n "${OPENDSEC_BENCH_KEEP_LOG:-}" ]; then cp "$STATE/cluster.log" "$OPENDSEC_BENCH_KEEP_LOG" || true; fi
  rm -rf "$STATE"
}
trap cleanup EXIT
for _ in $(seq 1 300); do
  grep -q OPENDSEC_PROJECT "$OUT" && break
  kill -0 "$PID" 2>/dev/null || { echo "cluster up failed:" >&2; tail -20 "$STATE/cluster.log" >&2; exit 1; }
  sleep 0.1
done
# shellcheck disable=SC1090
. "$OUT"
export OPENDSEC_ADDR OPENDSEC_TOKEN OPENDSEC_PROJECT OPENDSEC_IMAGE_STORE
OPENDSEC_BIN=$BIN OPENDSEC_BENCH_STATE=$STATE OPENDSEC_BENCH_LOG=$STATE/cluster.log PYTHONPATH=$PWD/sdk/python \
  .venv/bin/python bench/microvm.py ${ARGS[@]+"${ARGS[@]}"}
