"""Shared helpers for the deployment tests: the mesh description, the real tools (installed into the venv by
scripts/deploy_tools.sh), and each overlay rendered once by `kubectl kustomize`."""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
OVERLAYS = ["cpu-demo", "gpu", "mtls"]
TLS_OVERLAYS = {"mtls"}
"""Overlays that include the mTLS component (deploy/k8s/components/mtls)."""
CERT_MANAGER_KINDS = {("cert-manager.io/v1", "Certificate"), ("cert-manager.io/v1", "Issuer")}
"""Kinds kubernetes-validate has no schema for (cert-manager CRDs): it raises SchemaNotFoundError for them, which the
validation test checks and then skips by name; test_mtls.py checks their fields instead."""
K8S_VERSIONS = ["1.33.0", "1.37.0"]
"""Schemas validated against: the oldest Kubernetes the manifests target (native sidecars and the preStop sleep
action are on by default there) and the newest kubernetes-validate ships."""


def tool(name: str) -> str:
    """Path of a tool binary: the venv's first (where scripts/deploy_tools.sh puts it), then PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed; run scripts/deploy_tools.sh")
    return found


@functools.cache
def mesh() -> dict[str, Any]:
    """deploy/mesh.yaml as the generators read it."""
    data: dict[str, Any] = load_script("envoy/generate.py").load_mesh()
    return data


def grpc_services() -> list[str]:
    return [n for n, s in mesh()["services"].items() if s.get("protocol", "grpc") == "grpc"]


@functools.cache
def _render(overlay: str, kubectl: str) -> str:
    return subprocess.run([kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)], capture_output=True,
                          text=True, check=True, timeout=120).stdout


@functools.cache
def _render_dir(path: Path, kubectl: str) -> str:
    return subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, check=True,
                          timeout=120).stdout


def render(overlay: str) -> list[dict[str, Any]]:
    """Every object `kubectl kustomize` renders for an overlay."""
    return [d for d in yaml.safe_load_all(_render(overlay, tool("kubectl"))) if d]


def render_dir(path: Path) -> list[dict[str, Any]]:
    """Every object `kubectl kustomize` renders for a kustomization directory anywhere (e.g. a test's tmp dir)."""
    return [d for d in yaml.safe_load_all(_render_dir(path, tool("kubectl"))) if d]


def duration_seconds(text: str) -> float:
    """Seconds of an Envoy/Go duration such as "5s", "0.25s" or "2160h"."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in ("ms", "s", "m", "h"):
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return float(text[: -len(unit)]) * units[unit]
    raise ValueError(f"not a duration: {text!r}")


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's env entries by name."""
    return {e["name"]: e for e in container.get("env", [])}


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


def load_script(relative: str) -> ModuleType:
    """Import a generator script (deploy/ is not a package) as a module."""
    path = DEPLOY / relative
    spec = importlib.util.spec_from_file_location(f"_deploy_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def envoy_configs() -> list[Path]:
    return sorted(p for p in (DEPLOY / "envoy" / "generated").rglob("*.yaml") if p.name != "kustomization.yaml")
