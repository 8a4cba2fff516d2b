#!/usr/bin/env bash
# Generates Python stubs (+ mypy .pyi) from protos/ into gen/python. Reproducible: pinned grpcio-tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(realpath -s "${PYTHON:-.venv/bin/python}")
# protoc finds the mypy-protobuf plugins on PATH, next to the interpreter.
export PATH="$(dirname "$PY"):$PATH"
rm -rf gen/python
mkdir -p gen/python
mapfile -t files < <(cd protos && find embedmesh -name '*.proto' | sort)
(cd protos && "$PY" -m grpc_tools.protoc -I. \
  --python_out=../gen/python --grpc_python_out=../gen/python \
  --mypy_out=../gen/python --mypy_grpc_out=../gen/python "${files[@]}") 2> >(grep -v "^Writing mypy" >&2)
echo "generated ${#files[@]} protos into gen/python"
