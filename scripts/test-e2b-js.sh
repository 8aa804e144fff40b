#!/usr/bin/env bash
# The E2B compatibility suite for E2B's JavaScript SDK (tests/e2b-js, node:test) against each
# supported release of the npm package `e2b` (tests/e2b-js/versions.txt), with the release
# binary of this checkout: one real-container cluster (`opendsec cluster up -runtime linux`,
# so root is needed) serves every release in turn. Each release is installed once under
# .npm-e2b/<version>/ and tests/e2b-js/node_modules is pointed at it while its run lasts.
# Exits non-zero when any test of any release fails.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

binary=${OPENDSEC_BIN:-target/x86_64-unknown-linux-gnu/release/opendsec}
[ -x "$binary" ] || { echo "test-e2b-js: no opendsec binary at $binary (cargo build --release, or set OPENDSEC_BIN)" >&2; exit 1; }
# node:test with --test-concurrency and --test-timeout: Node 20.10 or later.
node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 20 || (a === 20 && b >= 10) ? 0 : 1)' 2>/dev/null ||
  { echo "test-e2b-js: Node.js 20.10 or later is required" >&2; exit 1; }

versions=()
while read -r line; do
  line=${line%%#*}
  line=${line//[[:space:]]/}
  [ -n "$line" ] && versions+=("$line")
done < tests/e2b-js/versions.txt
[ "${#versions[@]}" -gt 0 ] || { echo "test-e2b-js: tests/e2b-js/versions.txt names no release" >&2; exit 1; }

# Installing first, before any cluster runs: npm is the only network this needs, and a
# release already installed at exactly that version is not fetched again.
installed_version() { # the version of `e2b` installed under $1, or nothing
  node -e 'try { console.log(require(process.argv[1]).version) } catch {}' \
    "$repo/$1/node_modules/e2b/package.json"
}
for v in "${versions[@]}"; do
  dir=.npm-e2b/$v
  if [ "$(installed_version "$dir")" != "$v" ]; then
    echo "== installing e2b@$v into $dir"
    npm install --no-audit --no-fund --prefix "$dir" "e2b@$v"
  fi
  [ "$(installed_version "$dir")" = "$v" ] || { echo "test-e2b-js: $dir does not hold e2b $v" >&2; exit 1; }
done

# The test files import 'e2b' by name, so Node resolves it from tests/e2b-js/node_modules:
# a symbolic link this script owns (ESM imports ignore NODE_PATH). A real directory there
# would be someone's own install, which is not replaced.
link=tests/e2b-js/node_modules
if [ -e "$link" ] && [ ! -L "$link" ]; then
  echo "test-e2b-js: $link is not a symbolic link; remove it (the script links it to .npm-e2b/<version>)" >&2
  exit 1
fi

state=$(mktemp -d -t opendsec-e2b-js-state.XXXXXX)
logs=$(mktemp -d -t opendsec-e2b-js-logs.XXXXXX)
cluster=
# Stops the cluster (its whole process group: it runs in a session of its own) and removes
# its state, whatever way the script ends. SIGTERM lets it stop its sandboxes; what has not
# ended 10 s later is killed.
stop_cluster() {
  local status=$?
  if [ -n "$cluster" ] && kill -0 "$cluster" 2>/dev/null; then
    kill -TERM -- "-$cluster" 2>/dev/null || true
    for _ in $(seq 100); do
      kill -0 "$cluster" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL -- "-$cluster" 2>/dev/null || true
  fi
  rm -rf "$state" || echo "test-e2b-js: could not remove the cluster's state $state" >&2
  if [ "$status" -eq 0 ]; then
    rm -rf "$logs"
  else
    echo "test-e2b-js: the cluster's output is kept in $logs" >&2
  fi
  exit "$status"
}
trap stop_cluster EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# setsid puts the cluster in a session (and process group) of its own, so stopping it stops
# every process it started. A script's background job is no group leader, so setsid runs the
# cluster in place and $! is the group's id (checked below).
setsid "$binary" cluster up -addr 127.0.0.1:0 -state-dir "$state" -sim-edges 1 -runtime linux \
  -network off -disk-reserve-mb -1 </dev/null >"$logs/stdout" 2>"$logs/stderr" &
cluster=$!

# cluster up prints `export NAME=value` lines (values shell-quoted) once it serves; the three
# E2B_* ones point E2B's SDKs at its gateway (docs/e2b.md "For callers").
wanted='^export (E2B_API_URL|E2B_SANDBOX_URL|E2B_API_KEY)='
deadline=$((SECONDS + 90))
until [ "$(grep -cE "$wanted" "$logs/stdout")" -eq 3 ]; do
  if ! kill -0 "$cluster" 2>/dev/null; then
    echo "test-e2b-js: cluster up exited before printing E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY" >&2
    tail -n 40 "$logs/stderr" >&2
    exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "test-e2b-js: cluster up printed no E2B_* lines within 90 s" >&2
    tail -n 40 "$logs/stderr" >&2
    exit 1
  fi
  sleep 0.2
done
# Only those three lines are evaluated: they are written to be read by a shell.
eval "$(grep -E "$wanted" "$logs/stdout")"
export E2B_API_URL E2B_SANDBOX_URL E2B_API_KEY
[ "$(ps -o pgid= -p "$cluster" | tr -d ' ')" = "$cluster" ] ||
  { echo "test-e2b-js: the cluster is not the leader of its process group" >&2; exit 1; }

failed=()
for v in "${versions[@]}"; do
  ln -sfn "../../.npm-e2b/$v/node_modules" "$link"
  got=$(cd tests/e2b-js && node -e 'console.log(require("e2b/package.json").version)')
  [ "$got" = "$v" ] || { echo "test-e2b-js: tests/e2b-js resolves e2b $got, not $v" >&2; exit 1; }
  echo "== tests/e2b-js with e2b@$v"
  # One test file at a time (the machines running this may have two cores, and the
  # containers' start-up competes with the tests); a test that hangs fails after 2 minutes.
  # The files are named, not the directory: later Node releases take globs there.
  if ! node --test --test-concurrency=1 --test-timeout=120000 tests/e2b-js/*.test.mjs; then
    failed+=("$v")
  fi
done

if [ "${#failed[@]}" -gt 0 ]; then
  echo "test-e2b-js: tests failed with e2b ${failed[*]}" >&2
  exit 1
fi
echo "test-e2b-js: every test passed with e2b ${versions[*]}"
