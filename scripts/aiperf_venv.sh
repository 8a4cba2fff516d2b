#!/usr/bin/env bash
# Builds (once) the virtual environment of aiperf, NVIDIA's benchmark client (the one Dynamo's router benchmarks
# use), which bench/bench_fleet.py drives to replay its mooncake_trace through the mesh (issue 32):
#   ${EMBEDMESH_CACHE:-$HOME/.cache/embedmesh}/venvs/aiperf-0.13.0
# Everything from PyPI. A `.complete` marker makes reruns a no-op; a half-built venv (no marker) is removed and
# rebuilt. Offline use: aiperf needs a local tokenizer folder (bench_fleet.py hands it the default model's) and must
# run without HF_HUB_OFFLINE=1; its `--tokenizer builtin` needs the network.
set -euo pipefail

CACHE="${EMBEDMESH_CACHE:-$HOME/.cache/embedmesh}"
AIPERF_VERSION=0.13.0
VENV="${EMBEDMESH_AIPERF_VENV:-$CACHE/venvs/aiperf-$AIPERF_VERSION}"
PYTHON="${PYTHON:-python3}"

if [[ -f "$VENV/.complete" ]]; then
  echo "[aiperf-venv] reusing $VENV"
  exit 0
fi
if [[ -d "$VENV" && -x "$VENV/bin/aiperf" && -z "${CI:-}" ]] \
   && "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('aiperf') != '$AIPERF_VERSION')" 2>/dev/null; then
  # A venv made by hand before this script existed: keep it, mark it.
  echo "[aiperf-venv] adopting $VENV (aiperf $AIPERF_VERSION already installed)"
  touch "$VENV/.complete"
  exit 0
fi
if [[ -d "$VENV" ]]; then
  echo "[aiperf-venv] removing an unfinished build at $VENV"
  rm -rf "$VENV"
fi

step() { echo "[aiperf-venv] $(date +%H:%M:%S) $*"; }
step "creating $VENV with $($PYTHON --version)"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --progress-bar off)
"${PIP[@]}" -q --upgrade pip
step "installing aiperf==$AIPERF_VERSION"
"${PIP[@]}" -q "aiperf==$AIPERF_VERSION"
step "checking the install"
"$VENV/bin/aiperf" --help >/dev/null || { echo "[aiperf-venv] aiperf does not start; see above" >&2; exit 1; }
"$VENV/bin/python" -c "import importlib.metadata as m; print('[aiperf-venv] aiperf', m.version('aiperf'))"
touch "$VENV/.complete"
step "done: $(du -sh "$VENV" | cut -f1) in $VENV"
