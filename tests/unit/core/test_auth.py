"""core.auth: API keys name tenants, admin and mesh-only RPCs refuse plain clients, the mesh token is compared
exactly (over the wire, through the server's interceptor), per-tenant limits refuse with a retry hint; the key file,
the ``key=tenant`` list and the flags are parsed and refused naming the bad entry."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from embedmesh.core import auth, tls
from embedmesh.core.auth import Access, Principal, TenantLimiter
from embedmesh.core.errors import PermissionDenied, ResourceExhausted, Unauthenticated, from_rpc_error
from embedmesh.core.server import mesh_channel
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.worker_generate import worker_generate

from .conftest import ServeEcho


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
    ({"keys": [{"key": "long-enough-key", "weight": 0}]}, "weight must be"),
    ({"keys": [{"key": "long-enough-key", "weight": "4"}]}, "weight must be"),
    ({"keys": [{"key": "long-enough-key", "priority": "urgent"}]}, "priority must be one of interactive, batch"),
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
    assert (k1.weight, k1.priority) == (1.0, "interactive")  # the defaults


def test_key_file_takes_weights_and_priorities(tmp_path: Path) -> None:
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"keys": [{"key": "heavy-key-1", "tenant": "h", "weight": 4},
                                      {"key": "bulk-key-12", "tenant": "b", "weight": 0.5, "priority": "batch"}]}))
    ring = auth.keyring_from_values(keys_file=str(f))
    h, b = ring.lookup("heavy-key-1"), ring.lookup("bulk-key-12")
    assert h is not None and (h.weight, h.priority) == (4.0, "interactive")
    assert b is not None and (b.weight, b.priority) == (0.5, "batch")


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


async def test_grpc_keys_tenants_and_admin_methods(keys: None, plain_security: None, serve_echo: ServeEcho) -> None:
    server = await serve_echo(Access.PUBLIC, methods={"ClearKvBlocks": Access.ADMIN}, public=True)
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


async def test_mesh_token_opens_internal_rpcs_only_when_exact(plain_security: None, serve_echo: ServeEcho) -> None:
    tls.configure(tls.Security(mesh_token="s3cret-token-value"))
    server = await serve_echo(Access.MESH)
    good = mesh_channel(server.address)  # carries the configured token
    bare = grpc.aio.insecure_channel(server.address)
    try:
        assert (await worker_pb2_grpc.WorkerServiceStub(good).GetInfo(worker_pb2.GetInfoRequest())).engine == "admin"
        # Streaming calls carry the token too (each call kind has its own interceptor).
        assert [r.text async for r in worker_generate(worker_pb2_grpc.WorkerServiceStub(good),
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


# --- parsing and the request's principal -----------------------------------------------------------------------


@pytest.mark.parametrize("value,token", [
    ("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("BEARER abc", "abc"), ("Basic abc", ""), ("abc", ""),
    ("", ""), (None, ""),
])
def test_bearer_token_takes_only_the_bearer_scheme(value: str | None, token: str) -> None:
    assert auth.bearer_token(value) == token


@pytest.mark.parametrize("api_keys,message", [
    ("no-equals-sign", "EMBEDMESH_API_KEYS entry 0: expected key=tenant"),
    ("good-key-1=a,=b", "EMBEDMESH_API_KEYS entry 1: expected key=tenant"),
    ("good-key-1=bad tenant", "EMBEDMESH_API_KEYS entry 0: tenant must be"),
    ("good-key-1=mesh", "reserved for the mesh"),
    ("good-key-1=" + "t" * 65, "tenant must be 1-64 characters"),
])
def test_key_tenant_lists_are_refused_naming_the_entry(api_keys: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        auth.keyring_from_values(api_keys=api_keys)


def test_keyring_from_values_joins_every_source(tmp_path: Path) -> None:
    f = tmp_path / "keys.json"
    f.write_text(json.dumps([{"key": "file-key-123", "tenant": "filed"}]))  # a bare list is accepted too
    ring = auth.keyring_from_values(keys_file=str(f), api_key="single-key-1", api_keys=" k=v=x-1 , other-k=o ",
                                    admin_keys="adm-aaaaaaaa, adm-bbbbbbbb")
    assert ring.enabled and ring.tenants() == ["admin", "default", "filed", "o", "x-1"]
    assert ring.lookup("single-key-1").tenant == auth.DEFAULT_TENANT  # type: ignore[union-attr]
    assert ring.lookup("k=v").tenant == "x-1"  # type: ignore[union-attr]  # the last '=' splits key from tenant
    assert all(ring.lookup(k).admin for k in ("adm-aaaaaaaa", "adm-bbbbbbbb"))  # type: ignore[union-attr]
    assert not auth.keyring_from_values().enabled


def test_unreadable_key_file_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "keys.json"
    f.write_text("{not json")
    with pytest.raises(ValueError, match=f"api keys file {f}: cannot read it as JSON"):
        auth.keyring_from_values(keys_file=str(f))
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        auth.keyring_from_values(keys_file=str(tmp_path / "missing.json"))


def test_key_flags_default_from_the_environment() -> None:
    p = argparse.ArgumentParser()
    auth.add_key_args(p, {"EMBEDMESH_API_KEYS_FILE": "/k.json", "EMBEDMESH_API_KEY": "env-key-1",
                          "EMBEDMESH_ADMIN_KEYS": "a1"})
    a = p.parse_args([])
    assert (a.api_keys_file, a.api_key, a.admin_key) == ("/k.json", "env-key-1", "a1")
    a = p.parse_args(["--api-key", "flag-key-1"])
    assert a.api_key == "flag-key-1"


def test_principal_scope_sets_and_restores_the_caller() -> None:
    assert auth.current_tenant() == auth.DEFAULT_TENANT
    with auth.principal_scope(Principal("alpha")):
        assert auth.current_tenant() == "alpha"
        with auth.principal_scope(Principal("beta")):
            assert auth.current_principal().tenant == "beta"
        assert auth.current_tenant() == "alpha"
    assert auth.current_tenant() == auth.DEFAULT_TENANT


def test_a_bad_tenant_header_from_a_mesh_peer_is_refused(keys: None) -> None:
    with pytest.raises(PermissionDenied) as info:
        _decide(Access.PUBLIC, mesh_cert=True, tenant_header="no spaces allowed")
    assert info.value.reason == "BAD_TENANT"


def test_open_calls_need_nothing(keys: None) -> None:
    assert _decide(Access.OPEN).tenant == auth.DEFAULT_TENANT
    assert _decide(Access.OPEN, "Bearer wrong-key-123").tenant == auth.DEFAULT_TENANT
