#!/usr/bin/env bash
# Builds the container images with podman, tagged with pyproject.toml's version (the tag the manifests use):
#   scripts/images.sh [services] [worker-hf] [worker-vllm] [worker-sglang]     (default: all four)
# What is particular to a build host that cannot pull from a registry lives here, not in the Dockerfiles:
#   - BASE_IMAGE unset: the base is made locally by scripts/base_image.sh (debootstrap, cached under
#     $EMBEDMESH_CACHE/images) and every build runs with --pull=never. BASE_IMAGE=python:3.11-slim-bookworm builds
#     on the official image instead (pulled as usual).
#   - CONTAINERS_CONF defaults to deploy/podman/containers.conf (runc, ulimits this VM accepts).
#   - The CA bundle pip must trust ($EMBEDMESH_BUILD_CA, else $PIP_CERT, else the system bundle, when the file
#     exists) is handed to the build as the secret `pip-cert`: used by pip during the build, never stored in a layer.
#   - A CPU torch wheel in $TORCH_WHEEL_DIR (default /opt/wheels) is copied to deploy/docker/wheels/ and the
#     worker images are built with TORCH_INDEX empty (no PyTorch index needed).
# Each build's time is printed; the logs are in $EMBEDMESH_CACHE/images/logs/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
CACHE="${EMBEDMESH_CACHE:-$HOME/.cache/embedmesh}"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$ROOT/deploy/podman/containers.conf}"
VERSION="$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
KINDS=("$@")
[[ ${#KINDS[@]} -gt 0 ]] || KINDS=(services worker-hf worker-vllm worker-sglang)
step() { echo "[images] $(date +%H:%M:%S) $*"; }

ARGS=(--layers --force-rm)
if [[ -z "${BASE_IMAGE:-}" ]]; then
  bash scripts/base_image.sh
  ARGS+=(--pull=never --build-arg "BASE_IMAGE=${EMBEDMESH_BASE_IMAGE:-localhost/embedmesh/python:3.11-slim-bookworm}")
else
  ARGS+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
fi
CA="${EMBEDMESH_BUILD_CA:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}"
[[ -s "$CA" ]] && ARGS+=(--secret "id=pip-cert,src=$CA")
TORCH_WHEEL_DIR="${TORCH_WHEEL_DIR:-/opt/wheels}"
shopt -s nullglob
torch_wheels=("$TORCH_WHEEL_DIR"/torch-2.13.0+cpu-cp311-*.whl)
if [[ ${#torch_wheels[@]} -gt 0 ]]; then
  cp -u "${torch_wheels[@]}" deploy/docker/wheels/
  ARGS+=(--build-arg TORCH_INDEX=)
fi

# A digest of what the builds read, so the runtime stages (which install the build stage's wheels through a bind
# mount, invisible to podman's layer cache) are rebuilt when the sources change.
digest="$(find pyproject.toml README.md protos scripts/gen_protos.sh services gateway deploy/docker/requirements \
  -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"
ARGS+=(--build-arg "SOURCE_DIGEST=$digest")

mkdir -p "$CACHE/images/logs"
for kind in "${KINDS[@]}"; do
  [[ -f "deploy/docker/Dockerfile.$kind" ]] || { echo "no deploy/docker/Dockerfile.$kind" >&2; exit 2; }
  log="$CACHE/images/logs/$kind.log"
  step "building embedmesh/$kind:$VERSION (log: $log)"
  start=$SECONDS
  if ! podman build "${ARGS[@]}" -f "deploy/docker/Dockerfile.$kind" \
      --ignorefile "deploy/docker/Dockerfile.$kind.dockerignore" -t "embedmesh/$kind:$VERSION" . >"$log" 2>&1; then
    tail -40 "$log" >&2
    step "embedmesh/$kind:$VERSION FAILED after $((SECONDS - start)) s"
    exit 1
  fi
  size="$(podman image inspect --format '{{.Size}}' "embedmesh/$kind:$VERSION")"
  step "built embedmesh/$kind:$VERSION in $((SECONDS - start)) s, $((size / 1000000)) MB"
done
