"""Generate the kustomize base (deploy/k8s/base/*.yaml) from deploy/envoy/services.yaml plus the per-service
settings below, so every Deployment gets the same probes, drain, sidecar, budgets and labels.

    python deploy/k8s/generate.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
BASE = HERE / "base"
SERVICES = yaml.safe_load((HERE.parent / "envoy" / "services.yaml").read_text())["services"]
ENVOY_IMAGE = "envoyproxy/envoy:v1.40.0"

APPS: dict[str, dict[str, Any]] = {
    "gateway": {"image": "embedmesh/services:0.1.0", "module": "embedmesh.gateway.main", "replicas": 2,
                "args": ["--host", "0.0.0.0", "--port", "8000", "--preprocessor", "127.0.0.1:15051",
                         "--vector-store", "127.0.0.1:15101"],
                "cpu": "500m", "memory": "512Mi", "hpa": True},
    "preprocessor": {"image": "embedmesh/services:0.1.0", "module": "embedmesh.services.preprocessor.main",
                     "replicas": 2,
                     "args": ["--host", "0.0.0.0", "--port", "50051", "--workers", "127.0.0.1:15061,127.0.0.1:15091",
                              "--routers", "127.0.0.1:15081", "--metrics-port", "9100"],
                     "cpu": "1", "memory": "2Gi", "hpa": True},
    "router": {"image": "embedmesh/services:0.1.0", "module": "embedmesh.services.router.main", "replicas": 2,
               "args": ["--host", "0.0.0.0", "--port", "50081", "--metrics-port", "9100"],
               "cpu": "500m", "memory": "1Gi"},
    "worker": {"image": "embedmesh/worker-hf:0.1.0", "module": "embedmesh.services.worker.main", "replicas": 2,
               "args": ["--host", "0.0.0.0", "--port", "50061", "--engine", "hf", "--model", "default",
                        "--routers", "router-headless:50081", "--advertise", "$(POD_IP):50061",
                        "--metrics-port", "9100"],
               "cpu": "2", "memory": "4Gi", "startup_seconds": 600},
    "worker-embed": {"image": "embedmesh/worker-hf:0.1.0", "module": "embedmesh.services.worker.main", "replicas": 1,
                     "args": ["--host", "0.0.0.0", "--port", "50091", "--engine", "hf-embed", "--metrics-port",
                              "9100"],
                     "cpu": "1", "memory": "2Gi", "startup_seconds": 300},
    "vector-store": {"image": "embedmesh/services:0.1.0", "module": "embedmesh.services.vector_store.main",
                     "replicas": 1,
                     "args": ["--host", "0.0.0.0", "--port", "50101", "--backend", "pgvector",
                              "--inference-addr", "127.0.0.1:15051"],
                     "cpu": "500m", "memory": "1Gi"},
}


def deployment(name: str, app: dict[str, Any], svc: dict[str, Any]) -> list[dict[str, Any]]:
    port = svc["port"]
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "embedmesh"}
    container: dict[str, Any] = {
        "name": name,
        "image": app["image"],
        "command": ["python", "-m", app["module"]],
        "args": app["args"],
        "envFrom": [{"configMapRef": {"name": "embedmesh-config"}}],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "grpc" if not svc.get("http") else "http", "containerPort": port}],
        "resources": {"requests": {"cpu": app["cpu"], "memory": app["memory"]},
                      "limits": {"cpu": app["cpu"], "memory": app["memory"]}},
        # preStop: keep serving while the endpoint is removed everywhere; SIGTERM then makes the app flip its
        # health to NOT_SERVING and drain in-flight calls (terminationGracePeriodSeconds covers both).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False},
    }
    if svc.get("http"):
        container["readinessProbe"] = {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 5}
        container["livenessProbe"] = {"tcpSocket": {"port": port}, "periodSeconds": 10}
    else:
        container["readinessProbe"] = {"grpc": {"port": port, "service": svc["health"]}, "periodSeconds": 5}
        container["livenessProbe"] = {"grpc": {"port": port}, "periodSeconds": 10, "failureThreshold": 3}
        if app.get("startup_seconds"):
            container["startupProbe"] = {"grpc": {"port": port}, "periodSeconds": 10,
                                         "failureThreshold": app["startup_seconds"] // 10}
    sidecar = {
        "name": "envoy",
        "image": ENVOY_IMAGE,
        "args": ["-c", "/etc/envoy/envoy.yaml", "--drain-time-s", "5"],
        "ports": [{"name": "admin", "containerPort": 9901}]
        + ([] if svc.get("http") else [{"name": "ingress", "containerPort": port + 1000}]),
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "500m", "memory": "256Mi"}},
        "volumeMounts": [{"name": "envoy-config", "mountPath": "/etc/envoy"}],
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
    }
    dep = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": app["replicas"],
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {"prometheus.io/scrape": "true",
                                                               "prometheus.io/port": "9100"}},
                "spec": {
                    "terminationGracePeriodSeconds": 30,
                    "securityContext": {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
                    "containers": [container, sidecar],
                    "volumes": [{"name": "envoy-config", "configMap": {
                        "name": f"envoy-{name}", "items": [{"key": f"{name}.yaml", "path": "envoy.yaml"}]}}],
                },
            },
        },
    }
    ports = [{"name": "grpc" if not svc.get("http") else "http", "port": port, "targetPort": port}]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"selector": labels, "ports": ports}}
    headless = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-headless", "labels": labels},
                "spec": {"clusterIP": "None", "selector": labels, "ports": ports}}
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name},
           "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}}}
    out = [dep, service, headless, pdb]
    if app.get("hpa"):
        out.append({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": name},
                    "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                             "minReplicas": app["replicas"], "maxReplicas": 10,
                             "metrics": [{"type": "Resource", "resource": {
                                 "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}]}})
    return out


def render() -> dict[str, str]:
    files = {}
    for name, app in APPS.items():
        docs = deployment(name, app, SERVICES[name])
        files[f"{name}.yaml"] = "# Generated by deploy/k8s/generate.py; do not edit.\n" + \
            yaml.safe_dump_all(docs, sort_keys=False)
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    files = render()
    if a.check:
        stale = [n for n, t in files.items() if not (BASE / n).exists() or (BASE / n).read_text() != t]
        if stale:
            print(f"out of date: {stale}; run python deploy/k8s/generate.py", file=sys.stderr)
            return 1
        return 0
    for n, t in files.items():
        (BASE / n).write_text(t)
    print(f"wrote {len(files)} files to {BASE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
