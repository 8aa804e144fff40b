#!/usr/bin/env bash
# Builds OpenDsec, starts a single-node cluster in the background, and runs the SDK quickstart
# against it. Stops the cluster at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release
BIN=target/x86_64-unknown-linux-gnu/release/opendsec
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check ./sdk/python

STATE=$(mktemp -d)
OUT=$(mktemp)
"$BIN" cluster up -sim-edges 1 -addr 127.0.0.1:0 -state-dir "$STATE" -log warn >"$OUT" &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$STATE" "$OUT"' EXIT
for _ in $(seq 1 300); do
  grep -q OPENDSEC_PROJECT "$OUT" && break
  kill -0 $PID 2>/dev/null || { echo "cluster up failed" >&2; exit 1; }
  sleep 0.1
done
# shellcheck disable=SC1090
. "$OUT"
# The container quickstart (sdk/python/examples/quickstart.py, which prints 42) needs the
# container backend, which is not built yet; until then this runs the control-plane tour.
.venv/bin/python sdk/python/examples/control_plane.py
