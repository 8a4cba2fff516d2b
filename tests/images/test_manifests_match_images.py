"""The manifests against the images they name. Every overlay is rendered by ``kubectl kustomize``; for each container
running an embedmesh image:

* the image is one ``make images`` builds, tagged with the package version, and the pod runs as the image's user;
* its command exists in the image and accepts every flag the manifest passes (run with ``--help`` in the image);
* started in the image as the manifest starts it (command, args, env and ConfigMaps; no network but the container's
  own loopback, so nothing it dials can leave), it listens on every port the manifest declares, and its probes are
  answered: the gRPC probes' service names are registered (SERVING or NOT_SERVING, never NOT_FOUND), the HTTP
  probe's path exists, the TCP probes' ports accept.

Started here: the cpu-demo overlay's workloads except the vector store (it needs its PostgreSQL). The gpu overlay's
workers need GPUs and the mTLS overlay's probes go through the Envoy sidecar: their commands and flags are checked,
not started."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.images.conftest import KINDS, USER_ID, VERSION, Containers, image, podman, run_to_exit
from tests.unit.deploy._support import OVERLAYS, TLS_OVERLAYS, render, workloads

STARTED = {"cpu-demo": {"gateway", "preprocessor", "router", "worker", "worker-embed", "image-encoder"}}
"""Overlay -> the workloads started in their image (the rest are checked statically, see the module docstring)."""


def _ours(overlay: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload name, pod spec, app container) for every container running an embedmesh image."""
    out = []
    for name, w in sorted(workloads(render(overlay)).items()):
        pod = w["spec"]["template"]["spec"]
        out += [(name, pod, c) for c in pod["containers"] if c["image"].startswith("embedmesh/")]
    return out


def _cases() -> list[tuple[str, str]]:
    return [(overlay, name) for overlay in OVERLAYS for name, _, _ in _ours(overlay)]


def _find(overlay: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return next((pod, c) for n, pod, c in _ours(overlay) if n == name)


def _kind(container: dict[str, Any]) -> str:
    repo, _, tag = container["image"].rpartition(":")
    assert tag == VERSION, f"{container['image']}: the tag is the package version {VERSION}"
    kind = repo.removeprefix("embedmesh/")
    assert kind in KINDS, f"{container['image']} is not an image make images builds"
    return kind


def _case(overlay: str, name: str) -> tuple[str, str, dict[str, Any], dict[str, Any], str]:
    pod, container = _find(overlay, name)
    return overlay, name, pod, container, image(_kind(container))


@pytest.fixture(scope="module", params=_cases(), ids=lambda c: f"{c[0]}-{c[1]}")
def case(request: pytest.FixtureRequest) -> tuple[str, str, dict[str, Any], dict[str, Any], str]:
    return _case(*request.param)


@pytest.fixture(scope="module", params=[(o, n) for o, names in STARTED.items() for n in sorted(names)],
                ids=lambda c: f"{c[0]}-{c[1]}")
def started_case(request: pytest.FixtureRequest) -> tuple[str, str, dict[str, Any], dict[str, Any], str]:
    return _case(*request.param)


def test_the_pod_runs_as_the_images_unprivileged_user(case: tuple[str, str, dict[str, Any], dict[str, Any], str]
                                                       ) -> None:
    _, _, pod, _, ref = case
    assert pod["securityContext"]["runAsUser"] == USER_ID and pod["securityContext"]["runAsNonRoot"] is True
    assert podman("image", "inspect", "--format", "{{.Config.User}}", ref).stdout.strip() == str(USER_ID)
    r = run_to_exit(ref, "-c", f"import pwd; print(pwd.getpwuid({USER_ID}).pw_name)", entrypoint="python3")
    assert r.stdout.strip() == "embedmesh", r.stderr


def test_the_command_exists_in_the_image_and_takes_every_flag(case: tuple[str, str, dict[str, Any],
                                                                           dict[str, Any], str]) -> None:
    _, _, _, c, ref = case
    command, args = c["command"], c["args"]
    r = run_to_exit(ref, *command[1:], *args, "--help", entrypoint=command[0], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    for flag in (a for a in args if a.startswith("--")):
        assert re.search(rf"(^|\s){re.escape(flag)}\b", r.stdout), f"{flag} is not an option of {command}"
    port = next(p["containerPort"] for p in c["ports"] if p["name"] in ("grpc", "http"))
    assert args[args.index("--port") + 1] == str(port), "the declared port is the one the process is told to bind"


def _env(container: dict[str, Any], docs: list[dict[str, Any]]) -> dict[str, str]:
    """What the kubelet would put in the environment: the ConfigMaps (envFrom), then the literal and field values,
    $(VAR) expanded; the pod's IP and name are made up (the container has only its loopback)."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        env.update(maps[ref["configMapRef"]["name"]])
    fields = {"status.podIP": "127.0.0.1", "metadata.name": "pod-0"}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


_PROBE = r"""
import json, socket, sys, time, urllib.error, urllib.request
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
checks, deadline = json.loads(sys.argv[1]), time.monotonic() + float(sys.argv[2])
result = {}
while time.monotonic() < deadline and len(result) < len(checks):
    for key, (kind, port, arg) in checks.items():
        if key in result:
            continue
        try:
            if kind == "tcp":
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                result[key] = "open"
            elif kind == "http":
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}{arg}", timeout=3)
                    result[key] = 200
                except urllib.error.HTTPError as e:
                    result[key] = e.code
            else:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=arg), timeout=3)
                result[key] = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                result[key] = "NOT_FOUND"
        except OSError:
            pass
    time.sleep(0.5)
print(json.dumps(result))
"""


def _checks(c: dict[str, Any]) -> dict[str, tuple[str, int, str]]:
    checks = {f"port {p['containerPort']}": ("tcp", p["containerPort"], "") for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = c[probe]
        if "grpc" in spec:
            checks[probe] = ("grpc", spec["grpc"]["port"], spec["grpc"].get("service", ""))
        elif "httpGet" in spec:
            checks[probe] = ("http", spec["httpGet"]["port"], spec["httpGet"]["path"])
        else:
            checks[probe] = ("tcp", spec["tcpSocket"]["port"], "")
    return checks


def test_started_as_the_manifest_starts_it_it_answers_its_ports_and_probes(
        started_case: tuple[str, str, dict[str, Any], dict[str, Any], str]) -> None:
    overlay, _, _, c, ref = started_case
    assert overlay not in TLS_OVERLAYS, "probes of the mTLS overlays go through the Envoy sidecar"
    checks = _checks(c)
    pods = Containers()
    try:
        started = pods.start(ref, *c["command"][1:], *c["args"], networks=("none",), entrypoint=c["command"][0],
                             env=_env(c, render(overlay)))
        r = podman("exec", started, "python3", "-c", _PROBE, json.dumps(checks), "150", timeout=200)
        logs = pods.logs(started)
    finally:
        pods.close()
    assert r.returncode == 0, r.stderr + logs[-3000:]
    got = json.loads(r.stdout)
    missing = {k: v for k, v in checks.items() if k not in got}
    assert not missing, f"no answer on {missing}; the process listens elsewhere?\n{logs[-3000:]}"
    for key, (kind, _, _) in checks.items():
        if kind == "grpc":
            assert got[key] in ("SERVING", "NOT_SERVING"), (key, got[key])
        elif kind == "http":
            assert got[key] in (200, 503), (key, got[key], "the probe's path must exist")


def _flag(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_preprocessors_images_go_to_an_image_encoder_of_the_image_that_has_the_vision_packages(
        overlay: str) -> None:
    docs = render(overlay)
    pre = next(c for n, _, c in _ours(overlay) if n == "preprocessor")
    encoders = [(n, c) for n, _, c in _ours(overlay) if "embedmesh.services.image_encoder.main" in c["command"]]
    assert [n for n, _ in encoders] == ["image-encoder"], "one image encoder Deployment"
    _, enc = encoders[0]
    assert _kind(enc) == "worker-hf", "torch and the vision packages are in worker-hf only"
    # Images are on in the manifests (the services image's default is off) and the encoder the preprocessor keys its
    # cache with is the one the service runs.
    assert _flag(pre["args"], "--image-encoder") == _flag(enc["args"], "--encoder") == "efficientnet-lite0"
    # The address is the preprocessor sidecar's egress for the encoder's port (deploy/README.md, "Traffic"), and that
    # sidecar's config sends it to the image-encoder pods' ingress.
    port = int(_flag(enc["args"], "--port"))
    host, _, egress = _flag(pre["args"], "--image-encoder-address").rpartition(":")
    assert host == "127.0.0.1" and int(egress) == 15000 + port % 1000
    envoy = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("envoy-preprocessor"))
    config = next(iter(envoy["data"].values()))
    assert f"port_value: {egress}" in config and "image-encoder-headless" in config and f"port_value: {port + 1000}" \
        in config, "the preprocessor's sidecar has an egress listener to the image encoders"
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "image-encoder-headless")
    assert port + 1000 in [p["port"] for p in service["spec"]["ports"]]
