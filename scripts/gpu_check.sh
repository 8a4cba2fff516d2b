#!/usr/bin/env bash
# The hf engine on an NVIDIA GPU, in one short run (under 8 minutes, nothing fetched from outside): tokens/s in
# process and through the mesh at 1 and 32 clients, bf16, prompt_embeds equal to text; the device's name beside every
# figure (scripts/gpu_check.py does the measuring).
#
#   scripts/gpu_check.sh              on a machine with CUDA (torch with CUDA and transformers already installed)
#   scripts/gpu_check.sh --dry-run    the same steps on the CPU with tiny settings (no GPU needed)
#   --model DIR                       serve a local Hugging Face folder instead of the default model
#   --random-weights                  DIR's config and tokenizer with seeded random weights (speed figures only)
#   --profile                         diagnose: the model's decode step alone, then the engine thread under cProfile
#
# PYTHON picks the interpreter (default: python3). The project is installed into it from this checkout
# (pip install --no-deps --no-build-isolation -e .) unless it already imports from here; when that install cannot
# run offline, the checkout's source folders go on PYTHONPATH instead. Exit status: 0 ok, 1 a check failed, 2 the
# machine cannot run it (no CUDA, a missing package), each with a message saying which.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DRY=0
MODEL=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --model) [ $# -ge 2 ] || { echo "gpu_check: --model needs a folder" >&2; exit 2; }
             [ -f "$2/config.json" ] || { echo "gpu_check: --model $2 holds no config.json" >&2; exit 2; }
             MODEL+=(--model "$(cd "$2" && pwd -P)"); shift ;;
    --random-weights) MODEL+=(--random-weights) ;;
    --profile) MODEL+=(--profile) ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (use --dry-run, --model DIR, --random-weights, --profile)" >&2; exit 2 ;;
  esac
  shift
done
say() { echo "gpu_check: $*" >&2; }

command -v "$PY" >/dev/null || { say "no python at '$PY' (set PYTHON)"; exit 2; }
if ! "$PY" -c 'import torch, transformers' 2>/dev/null; then
  say "$PY cannot import torch and transformers; install them (torch with CUDA) first"; exit 2
fi

# CUDA first: on a machine without it, say so before doing anything else.
if [ "$DRY" = 0 ]; then
  if ! "$PY" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    build = torch.version.cuda or "none (a CPU-only build)"
    sys.stderr.write(f"gpu_check: CUDA is not available: torch {torch.__version__}, CUDA build {build}, "
                     f"{torch.cuda.device_count()} device(s) visible; this check needs an NVIDIA GPU and a CUDA "
                     "build of torch (scripts/gpu_check.sh --dry-run runs it on the CPU)\n")
    sys.exit(2)
EOF
  then exit 2; fi
fi

# Generated protobuf code (gen/python, part of the wheel).
if [ ! -f gen/python/embedmesh/worker/v1/worker_pb2.py ]; then
  if "$PY" -c 'import grpc_tools' 2>/dev/null; then
    PYTHON="$PY" bash scripts/gen_protos.sh
  else
    say "gen/python is missing and grpcio-tools is not installed to generate it (make proto on a build machine)"; exit 2
  fi
fi

# The project from this checkout.
here="$(pwd -P)"
from_here() { "$PY" -c "import embedmesh.launcher as m, sys; sys.exit(0 if m.__file__.startswith('$here/') else 1)" 2>/dev/null; }
if ! from_here; then
  if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/tmp/gpu_check_pip.log 2>&1 || ! from_here; then
    say "pip could not install the checkout offline (see /tmp/gpu_check_pip.log); using its source folders"
    export PYTHONPATH="$here/services:$here/gateway:$here/gen/python${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
missing=$(GPU_CHECK_MODEL="${MODEL[*]:-}" "$PY" - <<'EOF'
import importlib.util
import os
mods = ["grpc", "grpc_health", "google.protobuf", "numpy", "tokenizers", "starlette", "uvicorn", "httptools",
        "orjson", "pybase64", "prometheus_client", "opentelemetry.sdk", "blake3", "msgspec", "jsonschema", "yaml",
        "cryptography", "multipart", "PIL", "httpx", "safetensors"]
if not os.environ.get("GPU_CHECK_MODEL"):
    mods.append("gguf")  # converting the default model's GGUF
print(" ".join(m for m in mods if importlib.util.find_spec(m.split(".")[0]) is None))
EOF
)
if [ -n "$missing" ]; then
  say "missing Python packages the mesh needs: $missing (install the project's dependencies: pip install -e '.[hf]')"
  exit 2
fi

if [ "$DRY" = 1 ]; then
  args=(--device cpu --dtype float32 --max-tokens 4 --clients 1,2 --threads 2)
else
  args=(--device cuda --dtype bfloat16 --max-tokens 128 --clients 1,32 --threads 4)
fi
exec timeout 470 "$PY" scripts/gpu_check.py "${args[@]}" ${MODEL[@]+"${MODEL[@]}"}
