#!/usr/bin/env bash
# Container benchmark: OpenDsec's container backend against crun and bwrap (bench/containers.py).
# Builds the release binary, installs crun and bubblewrap if missing, starts a single-node
# cluster whose container backend is runtime linux (image `host`), runs the measurement,
# stops the cluster. Needs root. Arguments go to containers.py, e.g.
#
#   bench/containers.sh                  # -n 50 -exec-n 500 -k 50, table
#   bench/containers.sh -n 10 -json
#   OPENDSEC_BENCH_NETWORK=on bench/containers.sh -only create
#                                        # the edge with networking: each sandbox gets its
#                                        # veth, /30 and rules (docs/network.md)
#
# docs/benchmarks.md records a run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "containers.sh: needs root (real containers, crun, cgroups)" >&2
  exit 1
fi
if ! command -v crun >/dev/null || ! command -v bwrap >/dev/null; then
  apt-get install -y -q crun bubblewrap >/dev/null
fi
cargo build --release -q
BIN=$PWD/target/x86_64-unknown-linux-gnu/release/opendsec
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check ./sdk/python

# Short: each sandbox's aether socket path lives under it and must fit a unix socket name.
STATE=$(mktemp -d /tmp/odb.XXXXXX)
OUT=$STATE.env
# The edge gets an id of its own, so that its cgroups are easy to tell from any other
# cluster's on this host. So the config is written by a sim-only cluster (which touches no
# cgroup) and turned into `-runtime linux`'s here.
"$BIN" cluster up -sim-edges 1 -addr 127.0.0.1:0 -state-dir "$STATE" -log warn \
  -write-config "$STATE/cluster.json" >"$OUT" &
PID=$!
for _ in $(seq 1 300); do grep -q OPENDSEC_PROJECT "$OUT" && break; sleep 0.1; done
kill $PID; wait $PID 2>/dev/null || true
python3 - "$STATE/cluster.json" "bench$$" <<'PY'
import json, os, sys
path, edge = sys.argv[1], sys.argv[2]
with open(path) as f:
    c = json.load(f)
for k in ("iam", "watcher"):
    c[k]["addr"] = "127.0.0.1:0"
for a in c["apiserver"]:
    a["addr"] = "127.0.0.1:0"
e = c["edges"][0]
# What `cluster up -runtime linux` writes: the machine's own capacity, state kept on disk.
e.update(id=edge, addr="127.0.0.1:0", mem_reserve_mb=0, persist_state=True,
         capacity={"cpu_cores": 0.0, "memory_mb": 0, "gpus": 0, "disk_mb": 0})
e["backends"]["container"]["runtime"] = "linux"
if os.environ.get("OPENDSEC_BENCH_NETWORK") == "on":
    e["network"] = {"enabled": True}
e.setdefault("images", {})["host"] = ["/"]
with open(path, "w") as f:
    json.dump(c, f)
PY
"$BIN" cluster up -config "$STATE/cluster.json" -log warn >"$OUT" &
PID=$!
# The edge leaves its (empty) parent cgroup behind; rmdir removes only an empty one.
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$STATE" "$OUT"
  rmdir /sys/fs/cgroup/*/opendsec/bench$$ /sys/fs/cgroup/opendsec/bench$$ 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  grep -q OPENDSEC_PROJECT "$OUT" && break
  kill -0 $PID 2>/dev/null || { echo "cluster up failed" >&2; exit 1; }
  sleep 0.1
done
# shellcheck disable=SC1090
. "$OUT"
OPENDSEC_BIN=$BIN .venv/bin/python bench/containers.py "$@"
