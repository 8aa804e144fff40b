#!/usr/bin/env bash
# The E2B compatibility suite (tests/e2b) against each supported release of E2B's SDKs
# (tests/e2b/versions.txt), each in a virtual environment of its own under .venv-e2b/, with
# the release binary of this checkout (docs/testing.md "E2B's SDKs").
set -euo pipefail
cd "$(dirname "$0")/.."
# The code interpreter's image, built before the suite (a few minutes the first time, which
# no single test's time limit should have to hold); later runs keep it.
if [ ! -f target/code-interpreter-image/index.json ]; then
  bash packaging/code-interpreter/build.sh target/code-interpreter-image
fi
while read -r pin; do
  case "$pin" in ''|'#'*) continue ;; esac
  # A line may name more than one package (the code interpreter's SDK beside `e2b`); the
  # first names the environment. Test files after ` -- ` narrow the run to them.
  tests=.
  case "$pin" in *' -- '*) tests=${pin#* -- }; pin=${pin%% -- *} ;; esac
  first=${pin%% *}
  venv=".venv-e2b/${first//[^a-zA-Z0-9.]/_}"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  # shellcheck disable=SC2086 # one word per package
  "$venv/bin/pip" install -q --disable-pip-version-check $pin pytest pytest-asyncio pytest-timeout
  echo "== tests/e2b/$tests with $pin"
  # shellcheck disable=SC2086 # one word per test file
  (cd tests/e2b && "../../$venv/bin/python" -m pytest -q $tests)
done < tests/e2b/versions.txt
