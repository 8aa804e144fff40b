#!/usr/bin/env bash
# Image benchmark (bench/images.py): import into the store against umoci unpack, and
# create -> first output from a composed store image against the development image `host`.
# Builds the release binary and, if missing, the base image (scripts/build-base-image.sh),
# starts a single-node `cluster up -runtime linux`, runs the measurement, stops the cluster.
# Needs root. Arguments go to images.py, e.g.
#
#   bench/images.sh                  # -n 30 -imports 3, table
#   bench/images.sh -n 10 -json
#   bench/images.sh -only pack -packs 5   # pack_diff of 100 MB only (or -only fork)
#
# docs/benchmarks.md records a run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "images.sh: needs root (real containers, the store's owners)" >&2
  exit 1
fi
cargo build --release -q
BIN=$PWD/target/x86_64-unknown-linux-gnu/release/opendsec
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check ./sdk/python
[ -f target/quickstart-image/index.json ] || bash scripts/build-base-image.sh target/quickstart-image

# Short: each sandbox's aether socket path lives under it and must fit a unix socket name.
STATE=$(mktemp -d /tmp/odi.XXXXXX)
OUT=$STATE/cluster.env
"$BIN" cluster up -runtime linux -sim-edges 1 -addr 127.0.0.1:0 -state-dir "$STATE" -log warn >"$OUT" &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$STATE"' EXIT
for _ in $(seq 1 300); do
  grep -q OPENDSEC_PROJECT "$OUT" && break
  kill -0 $PID 2>/dev/null || { echo "cluster up failed" >&2; exit 1; }
  sleep 0.1
done
# shellcheck disable=SC1090
. "$OUT"
export OPENDSEC_ADDR OPENDSEC_TOKEN OPENDSEC_PROJECT OPENDSEC_IMAGE_STORE
OPENDSEC_BIN=$BIN OPENDSEC_BENCH_STATE=$STATE .venv/bin/python bench/images.py "$@"
