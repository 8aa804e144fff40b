#!/usr/bin/env bash
# Runs every test: the Rust unit and integration tests, then the Python SDK's suite against a
# real `opendsec cluster up`. One release build serves both (cargo test --release builds the
# binary the SDK tests start).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release
cargo test --release

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check ./sdk/python pytest pytest-asyncio
(cd sdk/python && ../../.venv/bin/python -m pytest -q tests)

# The README's first command, end to end: it must print exactly 42.
out=$(bash scripts/quickstart.sh)
if [ "$out" != "42" ]; then
  echo "scripts/quickstart.sh printed ${out@Q}, not 42" >&2
  exit 1
fi
echo "scripts/quickstart.sh printed 42"
