#!/usr/bin/env bash
# Control-plane benchmark: single and batched sim creations through the whole stack
# (client → apiserver → IAM → edge), random placement against power-of-2, on an in-process
# simulated cluster. Prints JSON; docs/benchmarks.md records a run.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q
B=target/x86_64-unknown-linux-gnu/release/opendsec
"$B" ctl bench -compare -runs "${RUNS:-5}" -edges "${EDGES:-8}" -count "${COUNT:-20000}" -concurrency "${CONC:-64}" -batch "${BATCH:-32768}" -json
