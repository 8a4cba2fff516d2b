#!/usr/bin/env bash
# Builds (once) the virtual environment NVIDIA Dynamo's frontend and mocker engine run in, the peer that
# bench/bench_peers.py measures the mesh against (issue 34):
#   ${EMBEDMESH_CACHE:-$HOME/.cache/embedmesh}/venvs/dynamo-1.6.1
# Everything from PyPI, no GPU, no etcd, no NATS (file discovery, TCP request plane). A `.complete` marker makes
# reruns a no-op; a half-built venv (no marker) is removed and rebuilt.
#
# Why not `pip install ai-dynamo==1.6.1` as is: it requires `aisimulate==0.13.0`, a stub on PyPI that downloads its
# real package from a vendor index at install time (unreachable here) and that only an option the bench does not use
# imports. So: ai-dynamo-runtime (the Rust frontend/runtime wheel) with its requirements, then ai-dynamo with
# --no-deps, then ai-dynamo's other requirements as its metadata pins them.
set -euo pipefail

CACHE="${EMBEDMESH_CACHE:-$HOME/.cache/embedmesh}"
DYNAMO_VERSION=1.6.1
VENV="${EMBEDMESH_DYNAMO_VENV:-$CACHE/venvs/dynamo-$DYNAMO_VERSION}"
PYTHON="${PYTHON:-python3}"

if [[ -f "$VENV/.complete" ]]; then
  echo "[dynamo-venv] reusing $VENV"
  exit 0
fi
if [[ -d "$VENV" ]]; then
  echo "[dynamo-venv] removing an unfinished build at $VENV"
  rm -rf "$VENV"
fi

step() { echo "[dynamo-venv] $(date +%H:%M:%S) $*"; }
step "creating $VENV with $($PYTHON --version)"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --progress-bar off)
"${PIP[@]}" -q --upgrade pip

step "installing ai-dynamo-runtime==$DYNAMO_VERSION"
"${PIP[@]}" "ai-dynamo-runtime==$DYNAMO_VERSION"
step "installing ai-dynamo==$DYNAMO_VERSION (--no-deps: its aisimulate requirement is a vendor-index stub)"
"${PIP[@]}" --no-deps "ai-dynamo==$DYNAMO_VERSION"
# ai-dynamo 1.6.1's requirements (its METADATA) less ai-dynamo-runtime (above) and aisimulate (left out).
DYNAMO_DEPS=(
  'aiohttp>=3.14.3,<4.0' 'certifi>=2026.10.19' 'kubernetes>=32.0.1,<33.0.0' 'msgspec>=0.19.0'
  'prometheus-client>=0.23.1,<1.0' 'pyzmq>=26.0.0' 'redis>=6.2.0,<9.0.0' 'tqdm>=4.0.0' 'transformers>=4.56.0'
  'typing-extensions>=4.10.0' 'zstandard>=0.23,<1.0'
)
step "installing ai-dynamo's other requirements (${#DYNAMO_DEPS[@]} packages)"
"${PIP[@]}" "${DYNAMO_DEPS[@]}"

step "checking the install"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import importlib.util

for module in ("dynamo.frontend", "dynamo.mocker"):
    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"[dynamo-venv] {module} is missing")
print(f"[dynamo-venv] ai-dynamo {md.version('ai-dynamo')}, ai-dynamo-runtime {md.version('ai-dynamo-runtime')}")
PY
touch "$VENV/.complete"
step "done: $(du -sh "$VENV" | cut -f1) in $VENV"
