"""Deployment artefacts checked for real here: every kustomize overlay renders (kubectl's kustomize) and every
object validates against the Kubernetes schema (kubernetes-validate, strict); gRPC Deployments probe
grpc.health.v1 with their service name and drain on preStop; every Envoy config passes `envoy --mode validate`;
generated files match their one source; Dockerfiles pass hadolint; the dashboard only uses exported metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
OVERLAYS = ["cpu-demo", "gpu"]


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run([str(BIN / "kubectl"), "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str) -> None:
    import kubernetes_validate

    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "StatefulSet", "ConfigMap", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "Namespace"} <= kinds
    for d in docs:
        kubernetes_validate.validate(d, "1.33.0", strict=True)
        assert d["metadata"].get("namespace", "embedmesh") == "embedmesh" or d["kind"] == "Namespace"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grpc_deployments_have_probes_and_drain(overlay: str) -> None:
    docs = render(overlay)
    services = yaml.safe_load((ROOT / "deploy/envoy/services.yaml").read_text())["services"]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == set(services)
    for name, dep in deployments.items():
        app = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name)
        assert app["lifecycle"]["preStop"], name
        if services[name].get("http"):
            assert app["readinessProbe"]["httpGet"]["path"] == "/health"
            continue
        assert app["readinessProbe"]["grpc"] == {"port": services[name]["port"], "service": services[name]["health"]}
        assert app["livenessProbe"]["grpc"]["port"] == services[name]["port"]
        envoy = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "envoy")
        assert envoy["image"].startswith("envoyproxy/envoy:")


def test_gpu_overlay_requests_gpus() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render("gpu")}
    for name in ("worker", "worker-embed"):
        c = docs[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "vllm" in docs[("Deployment", "worker")]["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("script", ["deploy/envoy/generate.py", "deploy/k8s/generate.py"])
def test_generated_files_match_their_source(script: str) -> None:
    r = subprocess.run([sys.executable, str(ROOT / script), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("config", sorted((ROOT / "deploy/k8s/base/envoy").glob("*.yaml")), ids=lambda p: p.stem)
def test_envoy_configs_validate(config: Path) -> None:
    r = subprocess.run([str(BIN / "envoy"), "--mode", "validate", "-c", str(config)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_envoy_retries_only_idempotent_rpcs() -> None:
    cfg = yaml.safe_load((ROOT / "deploy/k8s/base/envoy/gateway.yaml").read_text())
    routes = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    retried = {r["match"].get("path") for r in routes if "retry_policy" in r["route"]}
    assert "/embedmesh.inference.v1.InferenceService/ListModels" in retried
    assert not any("Complete" in p or "Chat" in p for p in retried if p)


@pytest.mark.parametrize("dockerfile", sorted((ROOT / "deploy/docker").glob("Dockerfile.*")), ids=lambda p: p.name)
def test_dockerfiles_lint_clean(dockerfile: Path) -> None:
    r = subprocess.run([str(BIN / "hadolint"), "--ignore", "DL3008", str(dockerfile)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout
    text = dockerfile.read_text()
    assert "USER 10001" in text
    if dockerfile.name == "Dockerfile.services":
        assert "torch==" not in text and "[hf]" not in text


def test_dashboard_uses_only_exported_metrics() -> None:
    dash = json.loads((ROOT / "deploy/grafana/embedmesh.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"embedmesh_[a-z_]+", t["expr"])}
    source = "\n".join(p.read_text() for p in (ROOT / "services").rglob("*.py")) + \
        "\n".join(p.read_text() for p in (ROOT / "gateway").rglob("*.py"))
    defined = set(re.findall(r'"(embedmesh_[a-z_]+)"', source))
    suffixes = ("_bucket", "_total", "_sum", "_count")
    missing = set()
    for m in used:
        base = m
        for s in suffixes:
            if m.endswith(s) and m[: -len(s)] in defined:
                base = m[: -len(s)]
        if base not in defined and m not in defined:
            missing.add(m)
    assert not missing, missing
