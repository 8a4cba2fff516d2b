"""The trust boundary at the gRPC bootstrap: API keys name tenants, admin and mesh-only RPCs refuse plain clients,
mutual TLS refuses peers without a mesh certificate, the mesh token is compared exactly, per-tenant limits refuse
with a retry hint, and bytes that are not a protobuf are INVALID_ARGUMENT."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from embedmesh.core import auth, tls
from embedmesh.core.auth import Access, Principal, TenantLimiter
from embedmesh.core.certs import make_mesh_certs
from embedmesh.core.errors import PermissionDenied, ResourceExhausted, Unauthenticated, from_rpc_error
from embedmesh.core.server import Server, ServerOptions, mesh_channel
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

WORKER = "embedmesh.worker.v1.WorkerService"


class Echo(worker_pb2_grpc.WorkerServiceServicer):
    """GetInfo answers with the caller's tenant; ClearKvBlocks is the 'admin' call in these tests."""

    async def GetInfo(self, request: Any, context: Any) -> worker_pb2.GetInfoResponse:  # noqa: N802
        p = auth.current_principal()
        return worker_pb2.GetInfoResponse(model=p.tenant, engine="admin" if p.admin else "user")

    async def ClearKvBlocks(self, request: Any, context: Any) -> Any:  # noqa: N802
        return worker_pb2.ClearKvBlocksResponse(cleared=True)

    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802 - a unary-stream call
        yield worker_pb2.GenerateResponse(text=auth.current_principal().tenant)


@pytest.fixture
def keys() -> Iterator[None]:
    auth.configure_keys(auth.keyring_from_values(api_keys="ka-12345678=alpha,kb-12345678=beta",
                                                 admin_keys="adm-12345678"))
    yield
    auth.configure_keys(auth.KeyRing())


@pytest.fixture
def plain_security() -> Iterator[None]:
    tls.configure(tls.Security())
    yield
    tls.configure(tls.Security())


async def _serve(access: Access, methods: dict[str, Access] | None = None, public: bool = False) -> Server:
    server = Server("test", ServerOptions(port=0, grace_seconds=0.2, public=public))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, Echo(), WORKER, access=access, methods=methods)
    await server.start()
    return server


def _md(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")] if key else []


# --- key ring ----------------------------------------------------------------------------------------------------


def test_keyring_maps_each_key_to_its_tenant_and_nothing_else(keys: None) -> None:
    ring = auth.keyring()
    assert ring.lookup("ka-12345678").tenant == "alpha"  # type: ignore[union-attr]
    assert ring.lookup("kb-12345678").tenant == "beta"  # type: ignore[union-attr]
    admin = ring.lookup("adm-12345678")
    assert admin is not None and admin.admin
    for wrong in ("", "ka-1234567", "ka-123456789", "KA-12345678", "alpha"):
        assert ring.lookup(wrong) is None, wrong


@pytest.mark.parametrize("doc,message", [
    ({"keys": [{"key": "short", "tenant": "a"}]}, "at least 8"),
    ({"keys": [{"key": "long-enough-key", "tenant": "bad tenant!"}]}, "tenant must be"),
    ({"keys": [{"key": "long-enough-key", "tenant": "mesh"}]}, "reserved"),
    ({"keys": [{"key": "long-enough-key", "requests_per_second": -1}]}, "requests_per_second"),
    ({"nokeys": 1}, "expected"),
])
def test_bad_key_files_are_refused_naming_the_entry(tmp_path: Path, doc: Any, message: str) -> None:
    f = tmp_path / "keys.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        auth.keyring_from_values(keys_file=str(f))


def test_key_file_takes_hashed_keys_and_limits(tmp_path: Path) -> None:
    import hashlib

    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"keys": [
        {"key_sha256": hashlib.sha256(b"hashed-key-1").hexdigest(), "tenant": "t1", "max_concurrent_requests": 2},
        {"key": "plain-key-22", "tenant": "t2", "admin": True, "requests_per_second": 5, "tokens_per_minute": 100},
    ]}))
    ring = auth.keyring_from_values(keys_file=str(f))
    k1, k2 = ring.lookup("hashed-key-1"), ring.lookup("plain-key-22")
    assert k1 is not None and (k1.tenant, k1.max_concurrent_requests, k1.admin) == ("t1", 2, False)
    assert k2 is not None and (k2.tenant, k2.requests_per_second, k2.tokens_per_minute, k2.admin) == ("t2", 5, 100,
                                                                                                        True)


# --- decisions ---------------------------------------------------------------------------------------------------


def _decide(access: Access, authorization: str = "", mesh_cert: bool = False, token_ok: bool = False,
            tenant_header: str = "", security_enabled: bool = True) -> Principal:
    return auth.authenticate(access, authorization=authorization, mesh_cert=mesh_cert, mesh_token="",
                             tenant_header=tenant_header, security_enabled=security_enabled, token_ok=token_ok)


def test_public_calls_need_a_valid_key_when_keys_are_configured(keys: None) -> None:
    assert _decide(Access.PUBLIC, "Bearer ka-12345678").tenant == "alpha"
    with pytest.raises(Unauthenticated):
        _decide(Access.PUBLIC)
    with pytest.raises(Unauthenticated):
        _decide(Access.PUBLIC, "Bearer wrong-key-123")
    with pytest.raises(Unauthenticated):
        _decide(Access.PUBLIC, "Basic ka-12345678")
    # A wrong key is refused even from a mesh peer: a forwarded credential must be valid.
    with pytest.raises(Unauthenticated):
        _decide(Access.PUBLIC, "Bearer wrong-key-123", mesh_cert=True)
    # A mesh caller may act for a tenant it names; a plain caller may not.
    assert _decide(Access.PUBLIC, mesh_cert=True, tenant_header="beta").tenant == "beta"
    with pytest.raises(Unauthenticated):
        _decide(Access.PUBLIC, tenant_header="beta")
    assert _decide(Access.PUBLIC, token_ok=True).tenant == auth.MESH_TENANT


def test_without_keys_public_calls_are_the_default_tenant() -> None:
    p = _decide(Access.PUBLIC, security_enabled=False)
    assert p.tenant == auth.DEFAULT_TENANT and not p.mesh


def test_admin_and_mesh_calls_need_a_mesh_credential_or_an_admin_key(keys: None) -> None:
    for access in (Access.ADMIN, Access.MESH):
        assert _decide(access, mesh_cert=True).mesh
        assert _decide(access, token_ok=True).mesh
        assert _decide(access, "Bearer adm-12345678").admin
        with pytest.raises(PermissionDenied):
            _decide(access, "Bearer ka-12345678")
        with pytest.raises(Unauthenticated):
            _decide(access)
    # Local use (no TLS, no token): the internal plane is open, on 127.0.0.1 only.
    assert _decide(Access.MESH, security_enabled=False).mesh


# --- limits ------------------------------------------------------------------------------------------------------


def _principal(tenant: str, **limits: Any) -> Principal:
    return Principal(tenant, key=auth.ApiKey(b"x" * 32, tenant, **limits))


def test_concurrency_limit_refuses_with_retry_after_and_recovers() -> None:
    lim = TenantLimiter()
    a, b = _principal("a", max_concurrent_requests=1), _principal("b", max_concurrent_requests=1)
    assert lim.acquire(a)
    with pytest.raises(ResourceExhausted) as info:
        lim.acquire(a)
    assert info.value.reason == "RATE_LIMIT_EXCEEDED" and info.value.retry_after_seconds
    assert lim.acquire(b)  # another tenant is not affected
    lim.release(a)
    assert lim.acquire(a)


def test_requests_per_second_is_a_token_bucket() -> None:
    now = [100.0]
    lim = TenantLimiter(clock=lambda: now[0])
    a = _principal("a", requests_per_second=2)
    for _ in range(2):
        assert lim.acquire(a)
        lim.release(a)
    with pytest.raises(ResourceExhausted) as info:
        lim.acquire(a)
    assert 0 < info.value.retry_after_seconds <= 0.5  # type: ignore[operator]
    now[0] += 0.5
    assert lim.acquire(a)


def test_tokens_per_minute_counts_charged_tokens() -> None:
    now = [0.0]
    lim = TenantLimiter(clock=lambda: now[0])
    a = _principal("a", tokens_per_minute=100)
    assert lim.acquire(a)
    lim.release(a)
    lim.charge_tokens(a, 100)
    with pytest.raises(ResourceExhausted):
        lim.acquire(a)
    now[0] += 61
    assert lim.acquire(a)


# --- over the wire -----------------------------------------------------------------------------------------------


async def test_grpc_keys_tenants_and_admin_methods(keys: None, plain_security: None) -> None:
    server = await _serve(Access.PUBLIC, methods={"ClearKvBlocks": Access.ADMIN}, public=True)
    channel = mesh_channel(server.address)
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetInfo(worker_pb2.GetInfoRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert from_rpc_error(info.value).reason == "INVALID_API_KEY"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=_md("nope-12345678"))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=_md("ka-12345678"))).model == "alpha"
        assert (await stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=_md("kb-12345678"))).model == "beta"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ClearKvBlocks(worker_pb2.ClearKvBlocksRequest(), metadata=_md("ka-12345678"))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (await stub.ClearKvBlocks(worker_pb2.ClearKvBlocksRequest(), metadata=_md("adm-12345678"))).cleared
    finally:
        await channel.close()
        await server.drain()


async def test_mesh_token_opens_internal_rpcs_only_when_exact(plain_security: None) -> None:
    tls.configure(tls.Security(mesh_token="s3cret-token-value"))
    server = await _serve(Access.MESH)
    good = mesh_channel(server.address)  # carries the configured token
    bare = grpc.aio.insecure_channel(server.address)
    try:
        assert (await worker_pb2_grpc.WorkerServiceStub(good).GetInfo(worker_pb2.GetInfoRequest())).engine == "admin"
        # Streaming calls carry the token too (each call kind has its own interceptor).
        assert [r.text async for r in worker_pb2_grpc.WorkerServiceStub(good).Generate(
            worker_pb2.GenerateRequest())] == [auth.DEFAULT_TENANT]
        stub = worker_pb2_grpc.WorkerServiceStub(bare)
        for md in ([], [(tls.MESH_TOKEN_HEADER, "s3cret-token-valuX")], [(tls.MESH_TOKEN_HEADER, "")]):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=md)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await good.close()
        await bare.close()
        await server.drain()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_mesh_certs(out, names=["worker", "client"])
    other = out / "other"
    make_mesh_certs(other, names=["client"])  # a certificate from a CA the mesh does not trust
    return out


def _tls_for(certs: Path, name: str) -> tls.Security:
    return tls.Security(tls=tls.TlsFiles(certs / f"{name}.pem", certs / f"{name}-key.pem", certs / "ca.pem"))


async def test_mutual_tls_refuses_peers_without_a_mesh_certificate(certs: Path, plain_security: None) -> None:
    tls.configure(_tls_for(certs, "worker"))
    server = await _serve(Access.MESH)
    port = server.port
    ca = (certs / "ca.pem").read_bytes()
    no_cert = grpc.aio.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(root_certificates=ca))
    foreign = grpc.aio.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=(certs / "other" / "client-key.pem").read_bytes(),
        certificate_chain=(certs / "other" / "client.pem").read_bytes()))
    plaintext = grpc.aio.insecure_channel(f"localhost:{port}")
    tls.configure(_tls_for(certs, "client"))
    member = mesh_channel(f"localhost:{port}")
    try:
        got = await worker_pb2_grpc.WorkerServiceStub(member).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        assert got.engine == "admin"  # a verified mesh certificate is a mesh caller
        for ch in (no_cert, foreign, plaintext):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake itself fails
    finally:
        for ch in (no_cert, foreign, plaintext, member):
            await ch.close()
        await server.drain()


async def test_public_port_serves_tls_without_client_certificates(certs: Path, keys: None,
                                                                  plain_security: None) -> None:
    tls.configure(_tls_for(certs, "worker"))
    server = await _serve(Access.PUBLIC, public=True)
    ca = (certs / "ca.pem").read_bytes()
    ch = grpc.aio.secure_channel(f"localhost:{server.port}", grpc.ssl_channel_credentials(root_certificates=ca))
    try:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        assert (await stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=_md("kb-12345678"), timeout=10)).model \
            == "beta"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await ch.close()
        await server.drain()


@pytest.fixture
async def open_server(plain_security: None) -> AsyncIterator[Server]:
    server = await _serve(Access.MESH)
    yield server
    await server.drain()


@pytest.mark.parametrize("raw", [b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"not a protobuf at all \x80"])
async def test_bytes_that_are_not_a_protobuf_are_invalid_argument(open_server: Server, raw: bytes) -> None:
    async with grpc.aio.insecure_channel(open_server.address) as ch:
        call = ch.unary_unary(f"/{WORKER}/GetInfo", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(raw)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert from_rpc_error(info.value).field == "request"
        # ... and the server keeps serving.
        ok = ch.unary_unary(f"/{WORKER}/GetInfo", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        assert await ok(b"") is not None
