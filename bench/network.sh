#!/usr/bin/env bash
# Sandbox networking benchmark (examples/netpol_bench.rs): rule updates with 1,000 sandboxes
# on the node against `nft -f`, DNS through the edge's proxy against the upstream asked
# directly, iperf3 TCP throughput through a sandbox's chains against the same path without
# them, and the steps networking adds to a creation. Everything runs in network namespaces
# the program creates and removes; no packet leaves them. Builds the examples (release),
# installs iperf3 and nftables if missing, runs it. Needs root. Arguments go to the program:
#
#   bench/network.sh                      # -sandboxes 1000 -updates 500 -dns-n 2000, table
#   bench/network.sh -only update -json
#
# docs/benchmarks.md records runs.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "network.sh: needs root (network namespaces, nftables, veths)" >&2
  exit 1
fi
missing=""
command -v iperf3 >/dev/null || missing="$missing iperf3"
command -v nft >/dev/null || missing="$missing nftables"
command -v nsenter >/dev/null || missing="$missing util-linux"
command -v ip >/dev/null || missing="$missing iproute2"
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086
  apt-get install -y -q $missing >/dev/null
fi
cargo build --release --examples -q
exec target/x86_64-unknown-linux-gnu/release/examples/netpol_bench "$@"
