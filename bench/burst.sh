#!/usr/bin/env bash
# A burst of container sandboxes on this one node (bench/burst.py): N sandboxes of 0.1 core
# and 128 MB created at once, a command in each, one stop_task for all. Builds the release
# binary, starts a single-node cluster whose container backend is runtime linux (image
# `host`) with the edge's overcommit raised to admit N of them, runs the burst, stops the
# cluster. Needs root. Arguments go to burst.py, e.g.
#
#   bench/burst.sh                 # -n 2000 -c 200
#   bench/burst.sh -n 200 -json    # a quick check
#
# docs/benchmarks.md records a run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "burst.sh: needs root (real containers, cgroups, loop devices)" >&2
  exit 1
fi
N=2000
prev=""
for a in "$@"; do
  [ "$prev" = "-n" ] && N=$a
  prev=$a
done
cargo build --release -q
BIN=$PWD/target/x86_64-unknown-linux-gnu/release/opendsec
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check ./sdk/python

# Many sandboxes, each a few fds in the edge and in the client (set before either starts).
ulimit -n 65536 2>/dev/null || true
# Short: each sandbox's aether socket path lives under it and must fit a unix socket name.
STATE=$(mktemp -d /tmp/odb.XXXXXX)
OUT=$STATE.env
# As bench/containers.sh: the config is written by a sim-only cluster (which touches no
# cgroup) and turned into `-runtime linux`'s here, with an edge id of its own.
"$BIN" cluster up -sim-edges 1 -addr 127.0.0.1:0 -state-dir "$STATE" -log warn \
  -write-config "$STATE/cluster.json" >"$OUT" &
PID=$!
for _ in $(seq 1 300); do grep -q OPENDSEC_PROJECT "$OUT" && break; sleep 0.1; done
kill $PID; wait $PID 2>/dev/null || true
python3 - "$STATE/cluster.json" "burst$$" "$N" <<'PY'
import json, os, sys
path, edge, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(path) as f:
    c = json.load(f)
for k in ("iam", "watcher"):
    c[k]["addr"] = "127.0.0.1:0"
for a in c["apiserver"]:
    a["addr"] = "127.0.0.1:0"
# A burst is what is measured, not the per-principal rate limits.
c.setdefault("admission", {})
c["admission"]["create_rate"] = -1
c["admission"]["request_rate"] = -1
e = c["edges"][0]
cores = os.cpu_count() or 1
mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)
# Admit N sandboxes of 0.1 core and 128 MB (plus headroom) on this machine's capacity.
e.update(id=edge, addr="127.0.0.1:0", mem_reserve_mb=0, persist_state=True,
         capacity={"cpu_cores": 0.0, "memory_mb": 0, "gpus": 0, "disk_mb": 0},
         cpu_overcommit=max(1.0, 0.1 * n * 1.2 / cores),
         mem_overcommit=max(1.0, 128 * n * 1.2 / mem_mb),
         disk_overcommit=100.0)
b = e["backends"]["container"]
b["runtime"] = "linux"
b["max_sandboxes"] = 0
b["default_disk_mb"] = 64
e.setdefault("images", {})["host"] = ["/"]
with open(path, "w") as f:
    json.dump(c, f)
PY
# Failed probes of the edge are logged (info): a burst must not make the edge look dead.
"$BIN" cluster up -config "$STATE/cluster.json" -log warn,opendsec::roles::watcher::probe=info >"$OUT" &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$STATE" "$OUT"' EXIT
for _ in $(seq 1 300); do
  grep -q OPENDSEC_PROJECT "$OUT" && break
  kill -0 $PID 2>/dev/null || { echo "cluster up failed" >&2; exit 1; }
  sleep 0.1
done
# shellcheck disable=SC1090
. "$OUT"
.venv/bin/python bench/burst.py "$@"
