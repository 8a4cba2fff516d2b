"""The mTLS component (deploy/k8s/components/mtls, generated from deploy/mesh.yaml) as rendered: in the mtls overlay,
and composed onto the gpu overlay the way its README says.

cert-manager's kinds have no schema in kubernetes-validate (test_manifests.py checks that and skips them by name), so
their fields are checked here: a self-signed root issues the mesh CA, a CA Issuer signs one certificate per service,
valid for server and client use and naming every address a peer dials (its Services, each pod under its headless
Service, and 127.0.0.1 where its app reaches its own sidecar). Each pod mounts its certificate where its env and its
Envoy config point; the mesh token and the API keys come from Secrets the operator creates (the README says how)."""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy._support import (
    DEPLOY,
    by_kind,
    env_of,
    grpc_services,
    load_script,
    mesh,
    render,
    render_dir,
    workloads,
)

README = DEPLOY / "k8s" / "overlays" / "mtls" / "README.md"


def _gpu_with_mtls(tmp: Path) -> list[dict[str, Any]]:
    """The gpu overlay with the component added, as an operator would (README: `components: [...]`)."""
    k8s = os.path.relpath(DEPLOY / "k8s", tmp)
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": mesh()["namespace"],
        "resources": [f"{k8s}/overlays/gpu"], "components": [f"{k8s}/components/mtls"]}))
    return render_dir(tmp)


@pytest.fixture(params=["mtls", "gpu+mtls"])
def docs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if request.param == "mtls":
        return render("mtls")
    return _gpu_with_mtls(tmp_path_factory.mktemp("gpu-mtls"))


def _certs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}


def _issuers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Issuer"}


def _pod(w: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = w["spec"]["template"]["spec"]
    return spec


def _app(name: str, w: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in _pod(w)["containers"] if c["name"] == name)


def _secret_of(name: str, pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at ``path`` in ``container``: the volume mounted over it."""
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert mount.get("readOnly") is True, (name, path)
    return volume["secret"]["secretName"], path[len(mount["mountPath"].rstrip("/")) + 1:]


def _cert_matches(cert: dict[str, Any], host: str) -> bool:
    return any(fnmatch.fnmatchcase(host, n) if n.startswith("*.") and host.count(".") == n.count(".") else host == n
               for n in cert["spec"]["dnsNames"])


def test_a_self_signed_root_issues_the_mesh_ca_which_signs_every_service(docs: list[dict[str, Any]]) -> None:
    issuers, certs = _issuers(docs), _certs(docs)
    roots = [n for n, i in issuers.items() if "selfSigned" in i["spec"]]
    cas = [n for n, i in issuers.items() if "ca" in i["spec"]]
    assert len(roots) == 1 and len(cas) == 1
    ca_cert = next(c for c in certs.values() if c["spec"].get("isCA"))
    assert ca_cert["spec"]["issuerRef"] == {"name": roots[0], "kind": "Issuer", "group": "cert-manager.io"}
    assert issuers[cas[0]]["spec"]["ca"]["secretName"] == ca_cert["spec"]["secretName"]
    services = [c for c in certs.values() if not c["spec"].get("isCA")]
    assert len(services) == len(mesh()["services"])
    for c in services:
        assert c["spec"]["issuerRef"] == {"name": cas[0], "kind": "Issuer", "group": "cert-manager.io"}
        assert {"server auth", "client auth"} <= set(c["spec"]["usages"]), c["metadata"]["name"]
        assert c["spec"]["privateKey"]["rotationPolicy"] == "Always"
        assert c["spec"]["renewBefore"] and c["spec"]["duration"]
    for d in [*issuers.values(), *certs.values()]:
        assert d["metadata"]["namespace"] == mesh()["namespace"]


def test_each_pod_mounts_its_own_certificate_where_env_and_envoy_point(docs: list[dict[str, Any]]) -> None:
    certs = {c["spec"]["secretName"]: c for c in _certs(docs).values()}
    config_maps = by_kind(docs, "ConfigMap")
    ns = mesh()["namespace"]
    for name, w in workloads(docs).items():
        if name not in mesh()["services"]:
            continue
        pod, app = _pod(w), _app(name, w)
        env = env_of(app)
        files = {var: env[var]["value"] for var in ("EMBEDMESH_TLS_CERT", "EMBEDMESH_TLS_KEY", "EMBEDMESH_TLS_CA")}
        secrets = {var: _secret_of(name, pod, app, path) for var, path in files.items()}
        assert {s for s, _ in secrets.values()} == {secrets["EMBEDMESH_TLS_CERT"][0]}, name
        assert [k for _, k in secrets.values()] == ["tls.crt", "tls.key", "ca.crt"], name  # cert-manager's keys
        cert = certs[secrets["EMBEDMESH_TLS_CERT"][0]]
        assert _cert_matches(cert, f"{name}.{ns}.svc.cluster.local"), name  # its own certificate
        assert "127.0.0.1" in cert["spec"]["ipAddresses"]  # the app dials its own sidecar's egress there
        # The sidecar reads the same files, through the same Secret, at the paths its config names.
        envoy = next(c for c in pod["initContainers"] if c["name"] == "envoy")
        volume = next(v for v in pod["volumes"] if v["name"] == "envoy-config")
        config = config_maps[volume["configMap"]["name"]]["data"]["envoy.yaml"]
        paths = set(re.findall(r"filename: (\S+)", config))
        assert paths == set(files.values()), name
        for path in paths:
            assert _secret_of(name, pod, envoy, path)[0] == cert["spec"]["secretName"], (name, path)
        # Readable by the service's user (the pod's fsGroup), by nobody else.
        mode = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == cert["spec"]["secretName"])
        assert mode["secret"]["defaultMode"] == 0o440


def test_every_address_a_peer_dials_is_named_by_the_certificate_there(docs: list[dict[str, Any]]) -> None:
    """Envoy egress clusters (SNI/SAN of the callee's headless Service), the routers the workers stream to by
    name, and the worker address the router hands out: each must be in the certificate served there, or the
    TLS handshake fails."""
    gen = load_script("envoy/generate.py")
    certs = {c["metadata"]["name"]: c for c in _certs(docs).values()}
    for caller, svc in mesh()["services"].items():
        for callee in svc.get("calls", []):
            assert _cert_matches(certs[f"embedmesh-{callee}"], gen.headless_host(mesh(), callee)), (caller, callee)
    found = workloads(docs)
    config = next(c for n, c in by_kind(docs, "ConfigMap").items() if n.startswith("embedmesh-worker-"))
    for addr in config["data"]["EMBEDMESH_ROUTERS"].split(","):
        assert _cert_matches(certs["embedmesh-router"], addr.rsplit(":", 1)[0]), addr
    worker = _app("worker", found["worker"])
    advertise = env_of(worker)["EMBEDMESH_WORKER_ADVERTISE"]["value"]
    host, port = advertise.rsplit(":", 1)
    assert host.startswith("$(POD_NAME).")
    pod_name = "worker-7d9c6b5f4-x2x9q"  # what $(POD_NAME) expands to
    assert _cert_matches(certs["embedmesh-worker"], host.replace("$(POD_NAME)", pod_name))
    # That name resolves: the pod's subdomain is the headless Service (<pod>.<subdomain>.<ns>.svc...).
    subdomain = _pod(found["worker"])["subdomain"]
    assert host == f"$(POD_NAME).{subdomain}.{mesh()['namespace']}.svc.cluster.local"
    assert by_kind(docs, "Service")[subdomain]["spec"]["clusterIP"] == "None"
    assert int(port) == mesh()["services"]["worker"]["port"] + mesh()["envoy"]["ingress_offset"]


def test_mesh_token_and_api_keys_come_from_operator_secrets(docs: list[dict[str, Any]]) -> None:
    m = mesh()["mtls"]
    rendered_secrets = set(by_kind(docs, "Secret"))
    assert not any(s.startswith(m["mesh_token_secret"]) or s.startswith(m["api_keys_secret"])
                   for s in rendered_secrets), "operator-created Secrets must not be rendered with placeholders"
    found = workloads(docs)
    holders = set()
    for name, svc in mesh()["services"].items():
        pod, app = _pod(found[name]), _app(name, found[name])
        env = env_of(app)
        if "EMBEDMESH_MESH_TOKEN" in env:
            holders.add(name)
            assert env["EMBEDMESH_MESH_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": m["mesh_token_secret"],
                                                                                 "key": "token"}}, name
        # every gRPC app sits behind its own sidecar, which names the caller it authorizes (core/callers.py)
        assert (env.get("EMBEDMESH_TLS_SIDECAR", {}).get("value") == "1") == \
            (svc.get("protocol", "grpc") == "grpc"), name
        if svc.get("api_keys"):
            path = env["EMBEDMESH_API_KEYS_FILE"]["value"]
            assert _secret_of(name, pod, app, path) == (m["api_keys_secret"], "keys.json"), name
        else:
            assert "EMBEDMESH_API_KEYS_FILE" not in env, name
    assert {n for n, s in mesh()["services"].items() if s.get("api_keys")} == {"gateway", "preprocessor",
                                                                               "vector-store"}
    # least privilege: with mTLS the token is only the public port's credential — its checker and its one caller;
    # the client-facing gateway above all never holds it
    assert holders == {"preprocessor", "vector-store"}


def test_readme_tells_the_operator_how_to_create_the_secrets() -> None:
    text = README.read_text()
    m = mesh()["mtls"]
    assert re.search(rf"kubectl -n {mesh()['namespace']} create secret generic {m['mesh_token_secret']} "
                     r"--from-literal=token=", text)
    assert re.search(rf"kubectl -n {mesh()['namespace']} create secret generic {m['api_keys_secret']} "
                     r"--from-file=keys\.json=", text)


def test_probes_reach_the_tls_only_app_through_the_sidecar(docs: list[dict[str, Any]]) -> None:
    config_maps = by_kind(docs, "ConfigMap")
    probe_port = mesh()["envoy"]["probe_port"]
    found = workloads(docs)
    for name in grpc_services():
        pod, app = _pod(found[name]), _app(name, found[name])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert app[probe]["grpc"]["port"] == probe_port, (name, probe)
        envoy = next(c for c in pod["initContainers"] if c["name"] == "envoy")
        assert probe_port in [p["containerPort"] for p in envoy["ports"]], name
        volume = next(v for v in pod["volumes"] if v["name"] == "envoy-config")
        config = yaml.safe_load(config_maps[volume["configMap"]["name"]]["data"]["envoy.yaml"])
        listener = next(lst for lst in config["static_resources"]["listeners"] if lst["name"] == "probe")
        assert listener["address"]["socket_address"]["port_value"] == probe_port
        local = next(c for c in config["static_resources"]["clusters"] if c["name"] == "local_app")
        addr = local["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        assert addr["port_value"] == mesh()["services"][name]["port"]


def test_gpu_engines_survive_the_component(tmp_path: Path) -> None:
    found = workloads(_gpu_with_mtls(tmp_path))
    worker = _app("worker", found["worker"])
    assert worker["image"].startswith("embedmesh/worker-vllm:")
    assert worker["args"][worker["args"].index("--engine") + 1] == "vllm"
    assert worker["startupProbe"]["failureThreshold"] == 180  # the gpu overlay's, kept
    assert {m["mountPath"] for m in worker["volumeMounts"]} >= {"/models", mesh()["mtls"]["mount"]}
