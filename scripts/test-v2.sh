#!/usr/bin/env bash
# The container backend's Rust suite and the SDK's fork-bomb tests again, as root in a guest
# whose cgroups are v2 only (docs/testing.md "cgroup v2 in a guest"): production runs v2, our
# test machines are v1-hybrid. Needs the release build and .venv of scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export CI="${CI:-true}"
suite=$(cargo test --release --no-run --test container_backend --message-format=json 2>/dev/null |
  .venv/bin/python -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "container_backend":
        print(m["executable"])')
[ -x "$suite" ] || { echo "no container_backend test binary" >&2; exit 1; }
PYTHONDONTWRITEBYTECODE=1 bash scripts/v2-guest.sh -timeout 1500 -- bash -c "
  set -e
  $(printf %q "$suite") --test-threads=1
  cd sdk/python
  ../../.venv/bin/python -m pytest -p no:cacheprovider -q --timeout 600 tests/test_containers.py \
    -k 'fork_bomb_does_not_starve or fork_bomb_at_the_memory_limit'"
echo "the v2 guest's tests passed"

