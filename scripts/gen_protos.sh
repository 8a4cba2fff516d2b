#!/usr/bin/env bash
# Generates Python stubs (+ mypy .pyi) from protos/ into gen/python. Reproducible: pinned grpcio-tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf gen/python
mkdir -p gen/python
mapfile -t files < <(cd protos && find embedmesh -name '*.proto' | sort)
(cd protos && "../$PY" -m grpc_tools.protoc -I. \
  --python_out=../gen/python --grpc_python_out=../gen/python \
  --mypy_out=../gen/python --mypy_grpc_out=../gen/python "${files[@]}")
echo "generated ${#files[@]} protos into gen/python"
