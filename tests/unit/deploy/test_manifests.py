"""The Kubernetes manifests, checked for real: every overlay renders with kubectl's kustomize, every rendered object
validates (strict) against pinned Kubernetes schemas, and the objects say what deploy/mesh.yaml says (probes on the
right port and health name, drain on preStop, the Envoy sidecar, budgets, autoscalers, headless Services)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.unit.deploy._support import (
    DEPLOY,
    K8S_VERSIONS,
    OVERLAYS,
    by_kind,
    envoy_configs,
    grpc_services,
    mesh,
    render,
    workloads,
)


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def _app(name: str, workload: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in _pod(workload)["containers"] if c["name"] == name)


def test_base_manifests_are_generated_from_mesh_yaml() -> None:
    r = subprocess.run([sys.executable, str(DEPLOY / "k8s" / "generate.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_every_kind(overlay: str) -> None:
    kinds = {d["kind"] for d in render(overlay)}
    assert {"Namespace", "Deployment", "StatefulSet", "Service", "ConfigMap", "Secret", "PodDisruptionBudget",
            "HorizontalPodAutoscaler"} <= kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates(overlay: str, version: str) -> None:
    import kubernetes_validate

    failures = []
    for doc in render(overlay):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: {err.message}")
    assert not failures, failures


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_lands_in_the_namespace_the_envoy_configs_resolve(overlay: str) -> None:
    ns = mesh()["namespace"]
    for doc in render(overlay):
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == ns, doc["metadata"]["name"]
    assert set(by_kind(render(overlay), "Namespace")) == {ns}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_workload_and_service_per_mesh_service(overlay: str) -> None:
    docs = render(overlay)
    names = set(mesh()["services"])
    assert names <= set(workloads(docs))
    assert names <= set(by_kind(docs, "Service"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grpc_workloads_probe_their_health_name_and_drain(overlay: str) -> None:
    found = workloads(render(overlay))
    for name in grpc_services():
        svc = mesh()["services"][name]
        app = _app(name, found[name])
        want = {"port": svc["port"], "service": svc["health"]}
        for probe in ("readinessProbe", "startupProbe"):
            assert app[probe]["grpc"] == want, (name, probe)
        # Liveness asks the process-alive name, never the readiness one: a preprocessor without workers is alive,
        # not broken (embedmesh.core.server.LIVENESS stays SERVING while the process runs).
        assert app["livenessProbe"]["grpc"] == {"port": svc["port"], "service": "embedmesh.Liveness"}, name
        sleep = app["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert sleep >= 5, name
        assert _pod(found[name])["terminationGracePeriodSeconds"] >= sleep + 10, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_probes_http_and_drains(overlay: str) -> None:
    app = _app("gateway", workloads(render(overlay))["gateway"])
    assert app["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in app["livenessProbe"]
    assert app["lifecycle"]["preStop"]["sleep"]["seconds"] >= 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_a_native_envoy_sidecar_with_its_generated_config(overlay: str) -> None:
    docs = render(overlay)
    config_maps = by_kind(docs, "ConfigMap")
    for name in mesh()["services"]:
        pod = _pod(workloads(docs)[name])
        envoy = next(c for c in pod["initContainers"] if c["name"] == "envoy")
        assert envoy["restartPolicy"] == "Always"  # started before the app, stopped after it
        assert envoy["image"] == mesh()["envoy"]["image"]
        volume = next(v for v in pod["volumes"] if v["name"] == "envoy-config")
        config = config_maps[volume["configMap"]["name"]]  # the kustomize hash suffix resolved
        generated = (DEPLOY / "envoy" / "generated" / f"{name}.yaml").read_text()
        assert config["data"]["envoy.yaml"] == generated, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_non_root(overlay: str) -> None:
    for name, workload in workloads(render(overlay)).items():
        pod = _pod(workload)
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert "resources" in c and c["resources"]["requests"] and c["resources"]["limits"], (name, c["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_budgets_and_autoscalers(overlay: str) -> None:
    docs = render(overlay)
    budgets = by_kind(docs, "PodDisruptionBudget")
    for name, workload in workloads(docs).items():
        if name in mesh()["services"]:
            assert budgets[name]["spec"]["selector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {"gateway", "preprocessor"}
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert "replicas" not in workloads(docs)[name]["spec"]  # the HPA owns the count


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_envoy_cluster_resolves_a_headless_service(overlay: str) -> None:
    """Each STRICT_DNS cluster names <svc>-headless.<ns>.svc.cluster.local:<port>: that Service must exist, be
    headless (one A record per pod, so Envoy balances per pod) and select pods whose sidecar listens there."""
    docs = render(overlay)
    services = by_kind(docs, "Service")
    for path in envoy_configs():
        for cluster in yaml.safe_load(path.read_text())["static_resources"]["clusters"]:
            if cluster["type"] != "STRICT_DNS":
                continue
            addr = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            host, port = addr["socket_address"]["address"], addr["socket_address"]["port_value"]
            svc_name, ns = host.split(".")[:2]
            assert ns == mesh()["namespace"]
            svc = services[svc_name]
            assert svc["spec"]["clusterIP"] == "None", svc_name
            assert port in [p["port"] for p in svc["spec"]["ports"]], (svc_name, port)
            target = next(w for w in workloads(docs).values()
                          if w["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"])
            sidecar_ports = [p["containerPort"] for c in _pod(target)["initContainers"] for p in c["ports"]]
            assert port in sidecar_ports, (svc_name, port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_stream_to_every_router_replica(overlay: str) -> None:
    docs = render(overlay)
    router = by_kind(docs, "StatefulSet")["router"]
    assert router["spec"]["serviceName"] == "router-headless"
    ns = mesh()["namespace"]
    config = next(c for n, c in by_kind(docs, "ConfigMap").items() if n.startswith("embedmesh-worker-"))
    routers = config["data"]["EMBEDMESH_ROUTERS"].split(",")
    assert routers == [f"router-{i}.router-headless.{ns}.svc.cluster.local:{mesh()['services']['router']['port']}"
                       for i in range(router["spec"]["replicas"])]
    worker = _app("worker", workloads(docs)["worker"])
    assert {"configMapRef": {"name": config["metadata"]["name"]}} in worker["envFrom"]


def test_gpu_overlay_runs_vllm_and_sglang_on_gpus() -> None:
    found = workloads(render("gpu"))
    for name, image, engine in (("worker", "embedmesh/worker-vllm", "vllm"),
                                ("worker-embed", "embedmesh/worker-sglang", "sglang")):
        app = _app(name, found[name])
        assert app["image"].startswith(image + ":")
        assert app["args"][app["args"].index("--engine") + 1] == engine
        assert app["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert app["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert any(v["mountPath"] == "/models" and v.get("readOnly") for v in app["volumeMounts"])
        assert _app(name, found[name])["readinessProbe"]["grpc"]["service"] == mesh()["services"][name]["health"]


def test_cpu_demo_requests_no_gpu_and_runs_one_of_each() -> None:
    docs = render("cpu-demo")
    for name, workload in workloads(docs).items():
        for c in _pod(workload)["containers"]:
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {}), name
        assert workload["spec"].get("replicas", 1) == 1, name
    assert all(h["spec"]["minReplicas"] == 1 for h in by_kind(docs, "HorizontalPodAutoscaler").values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_and_postgres_keep_their_data_on_volumes(overlay: str) -> None:
    sets = by_kind(render(overlay), "StatefulSet")
    for name in ("redis", "postgres"):
        claims = sets[name]["spec"]["volumeClaimTemplates"]
        assert claims and claims[0]["spec"]["resources"]["requests"]["storage"], name
    assert sets["postgres"]["spec"]["template"]["spec"]["containers"][0]["image"].startswith("pgvector/pgvector:")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_the_four_built_here(overlay: str) -> None:
    ours = {c["image"].split(":")[0] for w in workloads(render(overlay)).values() for c in _pod(w)["containers"]
            if c["image"].startswith("embedmesh/")}
    kinds = {"embedmesh/services", "embedmesh/worker-hf", "embedmesh/worker-vllm", "embedmesh/worker-sglang"}
    assert ours <= kinds
    for image in kinds:
        assert (DEPLOY / "docker" / f"Dockerfile.{image.split('/')[1]}").is_file()
