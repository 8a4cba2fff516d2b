"""Least privilege inside the mesh: a mesh certificate is a mesh credential only for the calls its identity may make
(``core/callers.py``), the identity is read the same from the launcher's and the cert-manager overlay's certificates,
and on ports that demand certificates the mesh token is no credential at all."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from embedmesh.core import callers, tls
from embedmesh.core.auth import Access
from embedmesh.core.certs import make_mesh_certs
from embedmesh.core.errors import from_rpc_error
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

from .conftest import ServeEcho

ROUTER = "embedmesh.router.v1.RouterService"
WORKER = "embedmesh.worker.v1.WorkerService"


@pytest.mark.parametrize("cn, who", [
    (b"embedmesh-gateway", "gateway"),
    (b"embedmesh-vector-store", "vector-store"),
    (b"preprocessor.embedmesh.svc.cluster.local", "preprocessor"),
    (b"embedmesh-worker.prod.svc.cluster.local", "worker"),
    ("Worker", "worker"),
])
def test_the_identity_is_the_first_label_of_the_common_name(cn: bytes | str, who: str) -> None:
    assert callers.identity({"x509_common_name": [cn]}) == who


def test_no_common_name_is_no_identity() -> None:
    assert callers.identity({}) is None
    assert callers.identity({"x509_common_name": [b""]}) is None


@pytest.mark.parametrize("method, allowed", [
    (f"/{ROUTER}/WorkerStream", {"worker"}),
    (f"/{ROUTER}/RouteMany", {"preprocessor"}),
    (f"/{ROUTER}/ListWorkers", {"preprocessor"}),
    (f"/{WORKER}/GenerateMany", {"preprocessor"}),
    (f"/{WORKER}/LoadLoraAdapter", {"preprocessor"}),
    ("/embedmesh.cache.v1.EncoderCacheService/Put", {"preprocessor"}),
    ("/embedmesh.vectorstore.v1.VectorStoreService/UploadFile", set()),
])
def test_each_internal_call_is_for_its_callers_only(method: str, allowed: set[str]) -> None:
    for who in ("gateway", "preprocessor", "worker", "embed-worker", "vector-store", "router", None):
        assert callers.may_call(method, who) == (who in allowed), (method, who)
    assert callers.may_call(method, callers.OPERATOR)  # the operator's certificate, like an admin key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_mesh_certs(out, names=["worker", "preprocessor", "gateway", "embed-worker", "client"])
    return out


def _tls(certs: Path, name: str, token: str = "") -> tls.Security:
    return tls.Security(tls=tls.TlsFiles(certs / f"{name}.pem", certs / f"{name}-key.pem", certs / "ca.pem"),
                        mesh_token=token)


def _channel(certs: Path, port: int, name: str) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(), private_key=(certs / f"{name}-key.pem").read_bytes(),
        certificate_chain=(certs / f"{name}.pem").read_bytes()))


async def test_a_worker_answers_the_preprocessor_and_the_operator_and_refuses_other_certificates(
        certs: Path, plain_security: None, serve_echo: ServeEcho) -> None:
    token = "mesh-token-0123456789"
    tls.configure(_tls(certs, "worker", token))
    server = await serve_echo(Access.MESH)
    try:
        for name in ("preprocessor", "client"):
            async with _channel(certs, server.port, name) as ch:
                got = await worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
                assert got.engine == "admin", name  # a mesh caller
        for name in ("gateway", "embed-worker"):
            async with _channel(certs, server.port, name) as ch:
                for md in ((), ((tls.MESH_TOKEN_HEADER, token),)):  # the token is no credential on this port
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(),
                                                                            metadata=md, timeout=10)
                    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
                    err = from_rpc_error(info.value)
                    assert err.reason == "CALLER_NOT_ALLOWED"
                    assert name in err.message and "preprocessor" in err.message
    finally:
        await server.drain()


@pytest.mark.parametrize("xfcc, who", [
    ('Hash=ab12;Subject="CN=preprocessor.embedmesh.svc.cluster.local";DNS=preprocessor', "preprocessor"),
    ('By=spiffe://mesh/worker;Hash=ab12;Subject="O=team,CN=embedmesh-worker"', "worker"),
    ('Hash=1;Subject="CN=gateway",Hash=2;Subject="CN=vector-store.ns.svc"', "vector-store"),  # the last hop
    ("Hash=ab12", None),
    ("", None),
])
def test_the_forwarded_caller_is_the_cn_of_the_last_element(xfcc: str, who: str | None) -> None:
    assert callers.forwarded_identity(xfcc) == who


async def test_behind_its_sidecar_a_service_authorizes_the_caller_the_sidecar_names(
        certs: Path, plain_security: None, serve_echo: ServeEcho) -> None:
    """The Kubernetes mTLS overlay: the app's peer is its own sidecar, holding the app's own certificate, and the
    real caller is in x-forwarded-client-cert. Trusted only with the sidecar setting, and only from a peer holding
    the app's own identity: anyone else's header is ignored."""
    xfcc = (callers.XFCC_HEADER, 'Hash=00;Subject="CN=preprocessor.embedmesh.svc.cluster.local"')
    gw_xfcc = (callers.XFCC_HEADER, 'Hash=00;Subject="CN=gateway.embedmesh.svc.cluster.local"')
    tls.configure(tls.Security(tls=_tls(certs, "worker").tls, sidecar=True))
    assert tls.current().identity == "worker"
    server = await serve_echo(Access.MESH)

    async def code(name: str, md: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
        async with _channel(certs, server.port, name) as ch:
            try:
                await worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), metadata=md,
                                                                    timeout=10)
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

    try:
        assert await code("worker", (xfcc,)) == grpc.StatusCode.OK  # the sidecar, forwarding the preprocessor
        assert await code("worker", (gw_xfcc,)) == grpc.StatusCode.PERMISSION_DENIED  # forwarding the gateway
        assert await code("worker", ()) == grpc.StatusCode.PERMISSION_DENIED  # itself: a worker may not
        assert await code("gateway", (xfcc,)) == grpc.StatusCode.PERMISSION_DENIED  # not our sidecar: ignored
        tls.configure(tls.Security(tls=_tls(certs, "worker").tls, sidecar=False))
        assert await code("worker", (xfcc,)) == grpc.StatusCode.PERMISSION_DENIED  # no sidecar: header ignored
    finally:
        await server.drain()


def test_the_sidecar_setting_needs_the_pods_certificate() -> None:
    with pytest.raises(ValueError, match="tls-sidecar"):
        tls.from_values("", "", "", "", sidecar=True)
