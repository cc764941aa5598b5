#!/usr/bin/env bash
# Regenerate the Python gRPC stubs from proto/ into jaxserve/v1/.
# Compiling with -I proto at the package root makes protoc write `from jaxserve.v1 import ...`.
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  echo "usage: scripts/gen_proto.sh [-h|--help] [OUT_DIR]  (OUT_DIR default: the checkout; PYTHON: the interpreter)"
  exit 0
fi
cd "$(dirname "$0")/.."
out="${1:-.}"
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -Iproto --python_out="$out" --grpc_python_out="$out" \
  --pyi_out="$out" proto/jaxserve/v1/jaxserve.proto
