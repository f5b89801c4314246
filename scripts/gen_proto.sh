#!/usr/bin/env bash
# Regenerate src/ance_train/infra/proto/*_pb2*.py from proto/. The generated files are committed;
# tests/test_rpc.py checks they match what this script produces.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-src/ance_train/infra/proto}"
python -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/ance/v1/ance.proto
# protoc writes ance/v1/ance_pb2.py; flatten into the package and make the import relative.
mv "$out/ance/v1/"ance_pb2* "$out/"
rm -rf "$out/ance"
sed -i 's/^from ance\.v1 import ance_pb2 as/from . import ance_pb2 as/' "$out/ance_pb2_grpc.py"
