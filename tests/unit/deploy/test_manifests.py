"""The Kubernetes manifests, checked for real: every overlay renders with kubectl's kustomize, every rendered object
validates (strict) against pinned Kubernetes schemas, and the objects say what deploy/mesh.yaml says (probes on the
right port and health name, the drain timing, every service told its host, the Envoy sidecar, budgets, autoscalers,
headless Services)."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.unit.deploy._support import (
    CERT_MANAGER_KINDS,
    DEPLOY,
    K8S_VERSIONS,
    OVERLAYS,
    TLS_OVERLAYS,
    by_kind,
    duration_seconds,
    env_of,
    envoy_configs,
    grpc_services,
    load_script,
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


def test_drift_check_notices_a_hand_edit_and_a_leftover(tmp_path: Any) -> None:
    gen = load_script("k8s/generate.py")
    files = gen.render()
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert gen.stale_files(files, tmp_path) == []
    edited = "components/mtls/patches/worker.yaml"
    (tmp_path / edited).write_text(files[edited].replace("worker-headless", "worker"))
    (tmp_path / "components/mtls/patches/old-service.yaml").write_text("{}\n")
    assert gen.stale_files(files, tmp_path) == ["components/mtls/patches/old-service.yaml", edited]


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
        if (doc["apiVersion"], doc["kind"]) in CERT_MANAGER_KINDS:
            # No schema ships for cert-manager's CRDs: confirm that is still why, then skip only these kinds.
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
            continue
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
def test_the_image_encoder_is_a_deployment_the_preprocessor_reaches_through_its_sidecar(overlay: str) -> None:
    """The encode stage runs in the cluster like every other service (mesh.yaml lists it among them, though the
    launcher starts it only when asked): its Deployment from worker-hf, its headless Service, and the preprocessor
    dialling its own sidecar's egress for it."""
    docs = render(overlay)
    assert {"gateway", "preprocessor", "worker", "worker-embed", "vector-store", "image-encoder"} <= set(
        by_kind(docs, "Deployment"))
    enc = by_kind(docs, "Deployment")["image-encoder"]
    app = _app("image-encoder", enc)
    assert app["image"].split(":")[0] == "embedmesh/worker-hf"
    assert app["command"] == ["python3", "-m", "embedmesh.services.image_encoder.main"]
    assert app["args"][app["args"].index("--port") + 1] == "50111"
    assert app["readinessProbe"]["grpc"]["service"] == "embedmesh.imageencoder.v1.ImageEncoderService"
    assert "image-encoder-headless" in by_kind(docs, "Service")
    pre = _app("preprocessor", workloads(docs)["preprocessor"])["args"]
    assert pre[pre.index("--image-encoder-address") + 1] == "127.0.0.1:15111"  # egress_base + 50111 % 1000


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grpc_workloads_probe_their_health_name_and_drain(overlay: str) -> None:
    found = workloads(render(overlay))
    for name in grpc_services():
        svc = mesh()["services"][name]
        app = _app(name, found[name])
        # With mTLS the app serves TLS only, which the kubelet's gRPC probes cannot speak: they go through the
        # sidecar's plaintext probe listener (test_mtls.py checks that it forwards Health/Check to the app).
        port = mesh()["envoy"]["probe_port"] if overlay in TLS_OVERLAYS else svc["port"]
        want = {"port": port, "service": svc["health"]}
        for probe in ("readinessProbe", "startupProbe"):
            assert app[probe]["grpc"] == want, (name, probe)
        # Liveness asks the process-alive name, never the readiness one: a preprocessor without workers is alive,
        # not broken (embedmesh.core.server.LIVENESS stays SERVING while the process runs).
        assert app["livenessProbe"]["grpc"] == {"port": port, "service": "embedmesh.Liveness"}, name


def _drain_env(container: dict[str, Any]) -> float | None:
    entry = env_of(container).get("EMBEDMESH_DRAIN_GRACE_SECONDS")
    return None if entry is None else float(entry["value"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_covers_prestop_drain_and_margin_for_every_workload(overlay: str) -> None:
    """terminationGracePeriodSeconds >= preStop sleep + drain + margin, for every Deployment and StatefulSet: the
    kubelet's SIGKILL must never land while the app still finishes calls (the services drain on SIGTERM for
    EMBEDMESH_DRAIN_GRACE_SECONDS, which every embedmesh container sets explicitly)."""
    margin = mesh()["drain"]["margin_seconds"]
    assert margin > 0
    found = workloads(render(overlay))
    assert set(mesh()["services"]) <= set(found)
    for name, workload in found.items():
        pod = _pod(workload)
        grace = pod.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default where none is set
        for c in pod["containers"]:
            sleep = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
            drain = _drain_env(c)
            if c["image"].startswith("embedmesh/"):
                assert drain is not None, f"{name}/{c['name']}: EMBEDMESH_DRAIN_GRACE_SECONDS is not set explicitly"
                assert drain > 0, (name, c["name"])
            assert grace >= sleep + (drain or 0) + margin, (
                f"{name}/{c['name']}: terminationGracePeriodSeconds {grace} < preStop {sleep} + drain {drain} + "
                f"margin {margin}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prestop_waits_for_callers_to_notice_then_the_service_drains(overlay: str) -> None:
    """The preStop sleep only has to outlast the callers' view of the endpoints (a headless-Service DNS refresh
    and one health check); the drain itself is the service's, on SIGTERM, so the sleep stays short."""
    env = mesh()["envoy"]
    notice = duration_seconds(env["dns_refresh"]) + duration_seconds(env["health_check_interval"])
    found = workloads(render(overlay))
    for name in mesh()["services"]:
        app = _app(name, found[name])
        sleep = app["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert notice <= sleep < _drain_env(app), (name, sleep)  # type: ignore[operator]
        assert sleep == mesh()["drain"]["prestop_seconds"], name
        want = mesh()["services"][name].get("drain_seconds", mesh()["drain"]["grace_seconds"])
        assert _drain_env(app) == want, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_container_is_told_its_host(overlay: str) -> None:
    """Services bind 127.0.0.1 unless told otherwise; in a pod that would make them unreachable for the kubelet's
    probes, the sidecar's peers and the public ports. Every embedmesh container says --host 0.0.0.0 (or sets its
    EMBEDMESH_*_HOST to it) explicitly."""
    found = workloads(render(overlay))
    checked = 0
    for name, workload in found.items():
        for c in _pod(workload)["containers"]:
            if not c["image"].startswith("embedmesh/"):
                continue
            args = [str(a) for a in c.get("args", [])]
            hosts = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--host"]
            hosts += [a.split("=", 1)[1] for a in args if a.startswith("--host=")]
            hosts += [e["value"] for n, e in env_of(c).items() if re.fullmatch(r"EMBEDMESH_\w*HOST", n)]
            assert hosts, f"{name}/{c['name']}: no --host or EMBEDMESH_*_HOST; it would bind 127.0.0.1"
            assert hosts[-1] == "0.0.0.0", (name, c["name"], hosts)
            checked += 1
    assert checked >= len(mesh()["services"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_reference_is_defined(overlay: str) -> None:
    """$(VAR) in an env value expands only variables defined earlier in the list, and in args only the container's
    variables; anything else stays literal (a worker would advertise "$(POD_NAME)...")."""
    for name, workload in workloads(render(overlay)).items():
        for c in _pod(workload)["containers"]:
            seen: list[str] = []
            for e in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", str(e.get("value", ""))):
                    assert ref in seen, f"{name}/{c['name']}: {e['name']} uses $({ref}) before it is defined"
                seen.append(e["name"])
            for arg in c.get("args", []):
                for ref in re.findall(r"\$\((\w+)\)", str(arg)):
                    assert ref in seen, f"{name}/{c['name']}: argument {arg!r} uses undefined $({ref})"


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
        variant = "mtls/" if overlay in TLS_OVERLAYS else ""
        generated = (DEPLOY / "envoy" / "generated" / f"{variant}{name}.yaml").read_text()
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
