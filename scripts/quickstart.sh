#!/usr/bin/env bash
# Builds OpenDsec, starts a single-node cluster with real Linux containers in the background,
# imports a base image into its image store, and runs the SDK quickstart against it: a
# container sandbox from that image runs python3 -c 'print(6*7)' and this prints 42. Stops the
# cluster at the end. Needs root (namespaces, cgroups, loop devices), as the edge of a real
# cluster does.
#
# The image: by default a minimal Debian with python3 built from the host's own package
# sources (scripts/build-base-image.sh, about a minute the first time; kept in
# target/quickstart-image for the next run). OPENDSEC_IMAGE=SRC imports SRC instead: a
# registry image (python:3.12, host:5000/app:1) or a local path starting with / or . (an OCI
# layout or archive, a docker save tar, FILE#name:tag); OPENDSEC_IMAGE=host uses the
# development image `host` (the host's own /) and imports nothing. Progress goes to stderr;
# stdout is the sandbox's output alone.
#
# OPENDSEC_BACKEND=microvm runs the sandbox in a microVM instead (docs/microvm.md): it needs
# QEMU and a guest kernel, OPENDSEC_MICROVM_KERNEL=FILE or else the newest installed
# /boot/vmlinuz-* (packaging/kernel/fetch-debian.sh DIR unpacks Debian's without installing it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "quickstart: real containers need root; run it as root (sudo -E $0)" >&2
  exit 1
fi

cargo build --release
BIN=target/x86_64-unknown-linux-gnu/release/opendsec
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check ./sdk/python

SRC=${OPENDSEC_IMAGE:-}
if [ -z "$SRC" ]; then
  # ./ : a local source must start with / or . (anything else is a registry reference).
  LAYOUT=./target/quickstart-image
  if [ ! -f "$LAYOUT/index.json" ]; then
    bash scripts/build-base-image.sh "$LAYOUT"
  fi
  SRC="$LAYOUT#python3"
fi

STATE=$(mktemp -d)
# In the state directory, which no sandbox sees (the token is the cluster's admin's).
OUT=$STATE/cluster.env
KERNEL=()
if [ -n "${OPENDSEC_MICROVM_KERNEL:-}" ]; then
  KERNEL=(-microvm-kernel "$OPENDSEC_MICROVM_KERNEL")
fi
"$BIN" cluster up -runtime linux -sim-edges 1 -addr 127.0.0.1:0 -state-dir "$STATE" -log warn \
  "${KERNEL[@]}" >"$OUT" &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$STATE" "$OUT"' EXIT
for _ in $(seq 1 300); do
  grep -q OPENDSEC_PROJECT "$OUT" && break
  kill -0 $PID 2>/dev/null || { echo "cluster up failed" >&2; exit 1; }
  sleep 0.1
done
# shellcheck disable=SC1090
. "$OUT"
if [ "$SRC" = host ]; then
  export OPENDSEC_IMAGE=host
else
  "$BIN" ctl image import "$SRC" -as root/quickstart:1 -overwrite >/dev/null
  export OPENDSEC_IMAGE=root/quickstart:1
fi
.venv/bin/python sdk/python/examples/quickstart.py
