#!/usr/bin/env bash
# What mutual TLS costs (bench/tls.py): the same calls against a cluster started with
# `cluster up -tls` (mutual TLS between the roles, TLS on the public port, the SDK checking the
# apiserver against OPENDSEC_CA) and one without (plaintext, service token), in one run,
# interleaved in blocks so that the machine's drift falls on both alike:
#   exec     two single-node clusters of real containers (`-runtime linux -network off`):
#            run_shell("true") round trips on a warm sandbox of image `host`;
#   control  two sim clusters: single creations one at a time through the SDK, and a fresh
#            DSecClient's first whoami (new connection, TLS handshake) against a warm one's.
# The linux pair is stopped before the sim pair starts. Builds the release binary unless
# OPENDSEC_BIN names one. Needs root. Arguments go to tls.py, e.g.
#
#   bench/tls.sh                          # -exec-n 1000 -create-n 300 -first-n 50, table
#   bench/tls.sh -exec-n 200 -json
#   bench/tls.sh -only exec               # or control
#
# About 15 s on the 2-core test machine. docs/benchmarks.md "Mutual TLS" records runs.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "tls.sh: needs root (real containers, cgroups)" >&2
  exit 1
fi
ONLY=exec,control
prev=
for a in "$@"; do
  case $prev in -only | --only) ONLY=$a ;; esac
  prev=$a
done
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
PY() { OPENDSEC_BIN=$BIN PYTHONPATH=$PWD/sdk/python .venv/bin/python bench/tls.py "$@"; }

RES=$(mktemp -d /tmp/odb.XXXXXX)
PIDS=()
STATES=()
cleanup() {
  for p in ${PIDS[@]+"${PIDS[@]}"}; do kill "$p" 2>/dev/null || true; done
  for p in ${PIDS[@]+"${PIDS[@]}"}; do wait "$p" 2>/dev/null || true; done
  # --one-file-system: never into a mount a sandbox might have left behind.
  for s in ${STATES[@]+"${STATES[@]}"}; do rm -rf --one-file-system "$s"; done
  rm -rf "$RES"
}
trap cleanup EXIT

# up ARGS...: starts `cluster up ARGS` on a fresh state dir (short: each sandbox's aether
# socket path lives under it and must fit a unix socket name), waits for its env block in
# $STATE/cluster.env; leaves STATE and PID set.
up() {
  STATE=$(mktemp -d /tmp/odb.XXXXXX)
  STATES+=("$STATE")
  "$BIN" cluster up "$@" -addr 127.0.0.1:0 -e2b-addr off -state-dir "$STATE" -log warn \
    -write-config "$STATE/cluster.json" >"$STATE/cluster.env" 2>"$STATE/cluster.log" &
  PID=$!
  PIDS+=("$PID")
  for _ in $(seq 1 300); do
    grep -qs OPENDSEC_PROJECT "$STATE/cluster.env" && [ -s "$STATE/cluster.json" ] && return 0
    kill -0 "$PID" 2>/dev/null || break
    sleep 0.1
  done
  echo "tls.sh: cluster up $* failed:" >&2
  tail -20 "$STATE/cluster.log" >&2
  exit 1
}
# down PID...: stops clusters (SIGTERM: a clean shutdown, the edge removes its cgroups).
down() {
  for p in "$@"; do kill "$p" 2>/dev/null || true; done
  for p in "$@"; do wait "$p" 2>/dev/null || true; done
}

PARTS=()
if [[ ,$ONLY, == *,exec,* ]]; then
  up -runtime linux -sim-edges 1 -network off
  PLAIN=$STATE P1=$PID
  up -runtime linux -sim-edges 1 -network off -tls
  PY -part exec -plain "$PLAIN" -tls "$STATE" -out "$RES/exec.json" "$@"
  down "$P1" "$PID"
  PARTS+=("$RES/exec.json")
fi
if [[ ,$ONLY, == *,control,* ]]; then
  up -sim-edges 1
  PLAIN=$STATE P1=$PID
  up -sim-edges 1 -tls
  PY -part control -plain "$PLAIN" -tls "$STATE" -out "$RES/control.json" "$@"
  down "$P1" "$PID"
  PARTS+=("$RES/control.json")
fi
[ ${#PARTS[@]} -gt 0 ] || { echo "tls.sh: -only: exec, control or both" >&2; exit 2; }
PY -report "${PARTS[@]}" "$@"
