#!/usr/bin/env bash
# Runs every test: the Rust unit and integration tests, then the Python SDK's suite against a
# real `opendsec cluster up`. One release build serves both (cargo test --release builds the
# binary the SDK tests start).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each long stage says how long it took, so a slow CI run shows where its time went.
timed() {
  local t=$SECONDS rc=0
  "$@" || rc=$?
  echo "scripts/test.sh: $* took $((SECONDS - t)) s$([ $rc = 0 ] || echo ", and failed ($rc)")" >&2
  return $rc
}

# Formatting first: it takes a second and fails before anything is built.
cargo fmt --check
cargo build --release
# The codebase's rules (the [lints] table in Cargo.toml, clippy.toml for tests) on every
# target. --release shares the build scripts and proc macros of the build above; clippy adds a
# metadata-only check of the dependencies (about a minute cold on 2 cores) and of our crate.
cargo clippy --release --all-targets -- -D warnings
timed cargo test --release

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check ./sdk/python pytest pytest-asyncio pytest-timeout \
  ruff==0.17.6 mypy==2.4.1 types-protobuf==7.35.1.20260906 types-grpcio==1.85.0.20261028
# Lint and type-check the SDK (settings in sdk/python/pyproject.toml; the generated stubs in
# opendsec/_pb are excluded there). The pins keep a new release's checks out of CI until chosen.
(cd sdk/python && ../../.venv/bin/ruff check opendsec && ../../.venv/bin/mypy --strict opendsec)
timed bash -c 'cd sdk/python && ../../.venv/bin/python -m pytest -q --durations=10 tests'

# E2B's own SDKs against the gateway, each supported release (tests/e2b/versions.txt).
timed bash scripts/test-e2b.sh
# And E2B's JavaScript SDK (npm `e2b`, tests/e2b-js/versions.txt) with node:test.
timed bash scripts/test-e2b-js.sh

# The container backend on cgroup v2, which production runs and our v1-hybrid machines do not
# (docs/testing.md "cgroup v2 in a guest"). About 6 minutes under emulation.
timed bash scripts/test-v2.sh

# The image store's tests again with the store on NFS 4.2, which production uses and our
# machines' kernel lacks (docs/testing.md "The image store on NFS"). Also in a guest.
timed bash scripts/test-nfs.sh

# The README's first command, end to end: it must print exactly 42.
out=$(bash scripts/quickstart.sh)
if [ "$out" != "42" ]; then
  echo "scripts/quickstart.sh printed ${out@Q}, not 42" >&2
  exit 1
fi
echo "scripts/quickstart.sh printed 42"
# And again in a microVM (under emulation here), with the kernel the Rust tests fetched.
kernel=$(ls "$PWD"/target/guest-kernel/boot/vmlinuz-* | head -n 1)
out=$(OPENDSEC_BACKEND=microvm OPENDSEC_MICROVM_KERNEL="$kernel" bash scripts/quickstart.sh)
if [ "$out" != "42" ]; then
  echo "scripts/quickstart.sh in a microVM printed ${out@Q}, not 42" >&2
  exit 1
fi
echo "scripts/quickstart.sh in a microVM printed 42"
