#!/usr/bin/env bash
# Regenerates the committed protobuf/gRPC stubs under opendsec/_pb/ from ../../proto.
#
# grpcio-tools is a development tool only, never a runtime dependency. It is pinned to
# 1.73.1 on purpose: its protoc (31.x) writes gencode that protobuf>=6.31 accepts and its
# _grpc.py files require grpcio>=1.73.1, which are exactly the SDK's minimum versions.
# Newer grpcio-tools would raise both floors.
#
# Usage: sdk/python/scripts/gen_protos.sh            (uses $PYTHON or a private venv)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
sdk="$(dirname "$here")"
repo="$(cd "$sdk/../.." && pwd)"
proto_root="$repo/proto"
out="$sdk/opendsec/_pb"
tools_version="1.73.1"

py="${PYTHON:-}"
if [ -z "$py" ]; then
  venv="${GEN_VENV:-$sdk/build/gen-venv}"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "grpcio-tools==$tools_version"
  fi
  py="$venv/bin/python"
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# The SDK calls only the public service (DSec); it needs its messages and the ones it imports.
"$py" -m grpc_tools.protoc -I "$proto_root" \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  opendsec/v1/types.proto opendsec/v1/runtime.proto opendsec/v1/opendsec.proto

rm -f "$out"/*_pb2.py "$out"/*_pb2.pyi "$out"/*_pb2_grpc.py
for f in "$tmp"/opendsec/v1/*; do
  base="$(basename "$f")"
  # types.proto and runtime.proto define no service the SDK uses: drop their grpc stubs.
  case "$base" in
    types_pb2_grpc.py|runtime_pb2_grpc.py) continue ;;
  esac
  # Generated code imports siblings as `from opendsec.v1 import x_pb2`: point it at _pb.
  sed -e 's/^from opendsec\.v1 import /from opendsec._pb import /' \
      -e 's/^import opendsec\.v1\./import opendsec._pb./' "$f" > "$out/$base"
done

# The SDK is a client: keep the Stub, drop the generated server half (a Servicer whose every
# method answers UNIMPLEMENTED, its registration helper, and the experimental static API).
python3 - "$out/opendsec_pb2_grpc.py" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
s = s[: s.index("class DSecServicer(object):")].rstrip() + "\n"
s = s.replace("Client and server classes", "Client classes")
open(p, "w").write(s)
PY

cat > "$out/__init__.py" <<'PY'
"""Generated protobuf and gRPC stubs of opendsec.v1 (scripts/gen_protos.sh). Do not edit."""
PY
echo "generated into $out:"
ls "$out"
