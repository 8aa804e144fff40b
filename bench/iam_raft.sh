#!/usr/bin/env bash
# Replicated IAM (bench/iam_raft.py): the same control plane (one watcher, one apiserver, 8
# sim edges, every role a process of its own on 127.0.0.1, plaintext with a service token)
# with a standalone durable IAM (`iam.state`) and with IAM as three Raft replicas
# (`iam.replicas`, `opendsec iam -replica N`), in one run:
#   compare   single creations/s and their p50/p99 (Python SDK, 64 callers) and the wall
#             time of one 32768-sandbox batch (`opendsec ctl sandbox create -count`), on fresh
#             clusters of each kind in turn (S R R S S R);
#   failover  three replicas under a steady stream of creations: the leader is killed with
#             SIGKILL 20 times; time from the kill to the first creation sent after it that
#             succeeds, then the replica is restarted and caught up before the next round.
# Builds the release binary unless OPENDSEC_BIN names one, and runs a copy of it (a rebuild
# during the run changes nothing). No root needed. Arguments go to iam_raft.py, e.g.
#
#   bench/iam_raft.sh                          # -runs 3 -count 5000 -batch 32768 -rounds 20
#   bench/iam_raft.sh -only failover -rounds 5
#   bench/iam_raft.sh -json -out /tmp/iam_raft.json
#   KEEP_LOGS=/tmp/iam_raft_logs bench/iam_raft.sh   # keep every role's log and config
#   bench/iam_raft.sh -only compare -sides standalone,replicated,leader-first
#                                              # + the other roles calling the leader first
#
# About 2 minutes on the 2-core test machine. docs/benchmarks.md "Replicated IAM" records runs.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${OPENDSEC_BIN:-}" ]; then
  SRC_BIN=$OPENDSEC_BIN
else
  cargo build --release -q
  SRC_BIN=$PWD/target/x86_64-unknown-linux-gnu/release/opendsec
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# The SDK from this tree (PYTHONPATH below); installed only for its dependencies.
.venv/bin/python -c 'import grpc, google.protobuf' 2>/dev/null ||
  .venv/bin/pip install -q --disable-pip-version-check ./sdk/python

WORK=$(mktemp -d /tmp/odir.XXXXXX)
PIDS=$WORK/pids
: >"$PIDS"
PY=
cleanup() {
  [ -n "$PY" ] && kill "$PY" 2>/dev/null || true
  # Every role process the helper started, by pid (each was started in a session of its
  # own); only those still running our copy of the binary.
  while read -r p; do
    [ -n "$p" ] || continue
    if [ "$(readlink "/proc/$p/exe" 2>/dev/null)" = "$WORK/opendsec" ]; then
      kill -KILL "$p" 2>/dev/null || true
    fi
  done <"$PIDS"
  rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cp "$SRC_BIN" "$WORK/opendsec"
# A 32768 batch is many streams and sockets in the roles and the client.
ulimit -n 65536 2>/dev/null || true
KEEP=()
[ -n "${KEEP_LOGS:-}" ] && KEEP=(-keep-logs "$KEEP_LOGS")
# In the background, so that an INT or TERM reaches the trap at once (which ends it and
# every role by pid); its exit status is the script's.
OPENDSEC_BIN_SRC=$SRC_BIN OPENDSEC_BIN=$WORK/opendsec PYTHONPATH=$PWD/sdk/python \
  .venv/bin/python bench/iam_raft.py -work "$WORK" -pids "$PIDS" ${KEEP[@]+"${KEEP[@]}"} "$@" &
PY=$!
wait "$PY"
