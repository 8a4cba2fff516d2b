"""EncoderCacheService over a real gRPC server: chunked Put/Get of a 20 MiB tensor, Contains/Delete/Stats, a table
of bad uploads (each INVALID_ARGUMENT naming the field and rule, after which the service still serves), tenant
isolation (over gRPC with real API keys, and as a table under principal scopes), key spaces and TTL bounds."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
from embedmesh.core import auth, inbound
from embedmesh.core.auth import Access, Principal, principal_scope
from embedmesh.core.errors import EmbedmeshError, from_rpc_error
from embedmesh.core.server import Server, ServerOptions, insecure_channel
from embedmesh.core.tensors import f32_to_bf16
from embedmesh.services.encoder_cache.keys import payload_key, tenant_key
from embedmesh.services.encoder_cache.service import SERVICE_NAME, EncoderCacheServicer, lookup_upload
from embedmesh.services.encoder_cache.tiered import CacheConfig, CachedTensor, TieredCache
from embedmesh.tensor.v1 import tensor_pb2 as tpb

CHUNK = 1 << 20
FP32 = tpb.DATA_TYPE_FP32
MAX_TTL = 30 * 24 * 3600


@pytest.fixture(scope="module")
def cache() -> TieredCache:
    return TieredCache(CacheConfig(capacity_bytes=64 << 20, max_ttl_seconds=MAX_TTL))


@pytest.fixture(scope="module")
async def server(cache: TieredCache) -> AsyncIterator[Server]:
    server = Server("cache-test", ServerOptions(port=0, public=True))
    server.add(cache_pb2_grpc.add_EncoderCacheServiceServicer_to_server, EncoderCacheServicer(cache, 32 << 20),
               SERVICE_NAME, access=Access.PUBLIC, methods={"Stats": Access.ADMIN})
    await server.start()
    yield server
    await server.drain()


@pytest.fixture(scope="module")
async def stub(server: Server) -> AsyncIterator[cache_pb2_grpc.EncoderCacheServiceStub]:
    channel = insecure_channel(server.address)
    yield cache_pb2_grpc.EncoderCacheServiceStub(channel)
    await channel.close()


def put_messages(header: cache_pb2.PutHeader | None, data: bytes) -> list[cache_pb2.PutRequest]:
    msgs = [cache_pb2.PutRequest(header=header)] if header is not None else []
    msgs += [cache_pb2.PutRequest(chunk=data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)]
    return msgs


def raw(arr: np.ndarray, dtype: int = FP32, **kw: Any) -> list[cache_pb2.PutRequest]:
    return put_messages(cache_pb2.PutHeader(dtype=dtype, shape=list(arr.shape), **kw), arr.tobytes())


def torch_save(t: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def encoded(payload: bytes, **kw: Any) -> list[cache_pb2.PutRequest]:
    return put_messages(cache_pb2.PutHeader(encoding=tpb.TENSOR_ENCODING_TORCH_SAVE, **kw), payload)


async def get_all(stub: Any, key: str, **kw: Any) -> tuple[cache_pb2.TensorHeader, bytes]:
    header, data = None, bytearray()
    async for msg in stub.Get(cache_pb2.GetRequest(key=key), **kw):
        if msg.WhichOneof("part") == "header":
            header = msg.header
        else:
            data += msg.chunk
    assert header is not None
    return header, bytes(data)


ROWS = np.random.default_rng(7).standard_normal((3, 8), dtype=np.float32)


async def test_large_tensor_round_trips_in_chunks(stub: Any) -> None:
    arr = np.random.default_rng(1).standard_normal((9100, 576), dtype=np.float32)  # ~20 MiB
    r = await stub.Put(iter(raw(arr)))
    assert r.stored and r.size_bytes == arr.nbytes
    got_header, data = await get_all(stub, r.key)
    assert list(got_header.shape) == list(arr.shape)
    assert np.array_equal(np.frombuffer(data, np.float32).reshape(arr.shape), arr)
    present = await stub.Contains(cache_pb2.ContainsRequest(keys=[r.key, "emb-absent"]))
    assert list(present.present) == [True, False]
    stats = await stub.Stats(cache_pb2.StatsRequest())
    assert stats.tiers[0].tier == "l1" and stats.tiers[0].entries >= 1 and stats.tiers[0].hits >= 1
    assert (await stub.Delete(cache_pb2.DeleteRequest(key=r.key))).deleted
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await get_all(stub, r.key)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and from_rpc_error(info.value).field == "key"


async def test_ids_are_random_128_bit_and_never_content_hashes(stub: Any) -> None:
    a = await stub.Put(iter(raw(ROWS)))
    b = await stub.Put(iter(raw(ROWS)))
    for r in (a, b):
        assert r.key.startswith("emb-") and len(r.key) == 4 + 32 and int(r.key[4:], 16) >= 0
    assert a.key != b.key, "the same tensor uploaded twice gets two unrelated ids"
    # Deleting one leaves the other.
    assert (await stub.Delete(cache_pb2.DeleteRequest(key=a.key))).deleted
    _, data = await get_all(stub, b.key)
    assert np.array_equal(np.frombuffer(data, np.float32).reshape(ROWS.shape), ROWS)


async def test_torch_save_upload_is_decoded(stub: Any) -> None:
    import torch

    t = torch.randn(5, 576)
    r = await stub.Put(iter(encoded(torch_save(t))))
    _, data = await get_all(stub, r.key)
    assert np.array_equal(np.frombuffer(data, np.float32).reshape(5, 576), t.numpy())


async def test_every_float_dtype_and_3d_with_leading_one_are_accepted(stub: Any) -> None:
    import torch

    for t in (torch.randn(2, 4), torch.randn(2, 4).half(), torch.randn(2, 4).bfloat16(), torch.randn(2, 4).double(),
              torch.randn(1, 2, 4)):
        r = await stub.Put(iter(encoded(torch_save(t))))
        assert r.stored and list(r.shape) == list(t.shape)
    bits = f32_to_bf16(ROWS)
    r = await stub.Put(iter(raw(bits, tpb.DATA_TYPE_BF16)))
    assert r.stored and r.dtype == tpb.DATA_TYPE_BF16


async def test_client_chosen_plain_name_lands_in_the_tenant(stub: Any, cache: TieredCache) -> None:
    r = await stub.Put(iter(raw(ROWS, key="my-prompt.v2")))
    assert r.key == "my-prompt.v2"
    assert tenant_key("default", "my-prompt.v2") in cache.l1
    _, data = await get_all(stub, "my-prompt.v2")
    assert data == ROWS.tobytes()


def _nan(shape: tuple[int, ...] = (3, 8), value: float = np.nan) -> np.ndarray:
    a = np.ones(shape, np.float32)
    a[1, 2] = value
    return a


def _sparse_payload() -> bytes:
    import torch

    return torch_save(torch.eye(4).to_sparse())


def _int_payload() -> bytes:
    import torch

    return torch_save(torch.ones(3, 8, dtype=torch.int64))


def _nan_payload() -> bytes:
    import torch

    t = torch.ones(3, 8)
    t[2, 2] = float("nan")
    return torch_save(t)


def _rank4_payload() -> bytes:
    import torch

    return torch_save(torch.ones(1, 1, 3, 8))


BAD = [
    # name, messages (a callable so payloads are built lazily), field, reason
    ("empty stream", lambda: [], "header", "REQUIRED"),
    ("no header", lambda: put_messages(None, b"\0" * 16), "header", "HEADER_FIRST"),
    ("chunk before header", lambda: [cache_pb2.PutRequest(chunk=b"\0" * 16),
                                     cache_pb2.PutRequest(header=cache_pb2.PutHeader(dtype=FP32))],
     "header", "HEADER_FIRST"),
    ("bytes do not match shape", lambda: put_messages(cache_pb2.PutHeader(dtype=FP32, shape=[4, 4]), b"\0" * 60),
     "chunk", "DATA_SIZE_MISMATCH"),
    ("unknown dtype", lambda: put_messages(cache_pb2.PutHeader(dtype=0, shape=[4, 4]), b"\0" * 64), "header.dtype",
     "UNSUPPORTED_DTYPE"),
    ("integer dtype, raw", lambda: raw(np.ones((3, 8), np.int32), tpb.DATA_TYPE_INT32), "header.dtype",
     "UNSUPPORTED_DTYPE"),
    ("integer dtype, torch.save", lambda: encoded(_int_payload()), "chunk", "UNSUPPORTED_DTYPE"),
    ("sparse torch tensor", lambda: encoded(_sparse_payload()), "chunk", "SPARSE_TENSOR"),
    ("negative shape", lambda: put_messages(cache_pb2.PutHeader(dtype=FP32, shape=[-1, 4]), b""), "header.shape",
     "INVALID_SHAPE"),
    ("rank 1", lambda: raw(np.ones(8, np.float32)), "header.shape", "BAD_RANK"),
    ("rank 4, raw", lambda: raw(np.ones((1, 1, 3, 8), np.float32)), "header.shape", "BAD_RANK"),
    ("rank 4, torch.save", lambda: encoded(_rank4_payload()), "chunk", "BAD_RANK"),
    ("rank 71", lambda: put_messages(cache_pb2.PutHeader(dtype=FP32, shape=[1] * 71), b"\0" * 4), "header.shape",
     "BAD_RANK"),
    ("3-D batch of 2", lambda: raw(np.ones((2, 3, 8), np.float32)), "header.shape", "BATCH_NOT_ONE"),
    ("zero rows", lambda: raw(np.ones((0, 8), np.float32)), "header.shape", "EMPTY_EMBEDS"),
    ("zero hidden", lambda: raw(np.ones((3, 0), np.float32)), "header.shape", "EMPTY_EMBEDS"),
    ("NaN, raw", lambda: raw(_nan()), "chunk", "NON_FINITE"),
    ("Inf, raw", lambda: raw(_nan(value=np.inf)), "chunk", "NON_FINITE"),
    ("NaN, bf16", lambda: raw(f32_to_bf16(_nan()), tpb.DATA_TYPE_BF16), "chunk", "NON_FINITE"),
    ("NaN, torch.save", lambda: encoded(_nan_payload()), "chunk", "NON_FINITE"),
    ("declared shape over the cap", lambda: put_messages(cache_pb2.PutHeader(dtype=FP32, shape=[9 << 20, 1]), b""),
     "header.shape", "TOO_LARGE"),
    ("bytes over the cap", lambda: put_messages(cache_pb2.PutHeader(dtype=FP32, shape=[1, 8]), b"\0" * (33 << 20)),
     "chunk", "TOO_LARGE"),
    ("bad torch payload", lambda: encoded(b"nonsense"), "chunk", None),
    ("key in the validated space", lambda: raw(ROWS, key=payload_key("payload:1:8", b"x")), "header.key",
     "INVALID_KEY"),
    ("key shaped like the old payload keys", lambda: raw(ROWS, key="payload:1:576:0123456789abcdef"),
     "header.key", "INVALID_KEY"),
    ("key naming another tenant", lambda: raw(ROWS, key="u:other:emb-1"), "header.key", "INVALID_KEY"),
    ("key with a slash", lambda: raw(ROWS, key="a/b"), "header.key", "INVALID_KEY"),
    ("key too long", lambda: raw(ROWS, key="k" * 129), "header.key", "INVALID_KEY"),
    ("ttl 0", lambda: raw(ROWS, ttl_seconds=0), "ttl_seconds", "OUT_OF_RANGE"),
    ("ttl above the maximum", lambda: raw(ROWS, ttl_seconds=MAX_TTL + 1), "ttl_seconds", "OUT_OF_RANGE"),
    ("ttl at the wire maximum", lambda: raw(ROWS, ttl_seconds=(1 << 32) - 1), "ttl_seconds", "OUT_OF_RANGE"),
]


@pytest.mark.parametrize("name,messages,field,reason", BAD, ids=[b[0] for b in BAD])
async def test_bad_uploads(stub: Any, cache: TieredCache, name: str, messages: Any, field: str,
                           reason: str | None) -> None:
    entries = len(cache.l1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Put(iter(messages()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    err = from_rpc_error(info.value)
    assert err.field == field and info.value.details().startswith(field), info.value.details()
    if reason is not None:
        assert err.reason == reason
    assert len(cache.l1) == entries, "nothing was stored"
    ok = await stub.Put(iter(raw(ROWS)))
    assert ok.stored


async def test_a_put_that_goes_silent_is_refused_naming_chunk(stub: Any, cache: TieredCache,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The servicer declares Put an idle-bound upload (``idle_bound_streams``; the server applies it): a Put that
    sends its header and a chunk and then nothing, never ending, is refused after the bound (0.3 s here), not held
    until the client's own deadline."""
    monkeypatch.setattr(inbound, "UPLOAD_IDLE_SECONDS", 0.3)
    entries = len(cache.l1)

    async def silent() -> AsyncIterator[cache_pb2.PutRequest]:
        yield raw(ROWS)[0]
        yield cache_pb2.PutRequest(chunk=ROWS.tobytes()[:8])
        await asyncio.Event().wait()
        yield cache_pb2.PutRequest()

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Put(silent(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert (from_rpc_error(info.value).field, from_rpc_error(info.value).reason) == ("chunk", "IDLE_TIMEOUT")
    assert len(cache.l1) == entries


async def test_ttl_bounds_are_inclusive(stub: Any, cache: TieredCache) -> None:
    for ttl in (1, MAX_TTL):
        r = await stub.Put(iter(raw(ROWS, ttl_seconds=ttl)))
        assert r.stored
        assert 0 <= r.expires_at - ttl - int(__import__("time").time()) <= 1


async def test_contains_refuses_an_unbounded_key_list(stub: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Contains(cache_pb2.ContainsRequest(keys=["emb-x"] * 1025))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and from_rpc_error(info.value).field == "keys"


async def test_no_rpc_reaches_a_validated_entry(stub: Any, cache: TieredCache) -> None:
    """An entry the server validated (v1:…) cannot be read, probed, deleted or overwritten through the API."""
    key = payload_key("payload:1:8", b"some payload")
    await cache.put(key, CachedTensor(ROWS, FP32))
    for name in (key, key.split(":", 1)[1], f"u:default:{key}"):
        assert list((await stub.Contains(cache_pb2.ContainsRequest(keys=[name]))).present) == [False]
        assert not (await stub.Delete(cache_pb2.DeleteRequest(key=name))).deleted
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await get_all(stub, name)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Put(iter(raw(np.zeros((3, 8), np.float32), key=name)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    got = await cache.get(key)
    assert got is not None and np.array_equal(got.array, ROWS)


# --- tenants ------------------------------------------------------------------------------------------------


class _Ctx:
    """Stands in for the grpc context: the servicer never uses it."""


async def _put(svc: EncoderCacheServicer, arr: np.ndarray, **kw: Any) -> cache_pb2.PutResponse:
    async def it() -> AsyncIterator[cache_pb2.PutRequest]:
        for m in raw(arr, **kw):
            yield m

    return await svc.Put(it(), _Ctx())  # type: ignore[arg-type]


async def _get(svc: EncoderCacheServicer, key: str) -> bytes:
    out = b""
    async for m in svc.Get(cache_pb2.GetRequest(key=key), _Ctx()):  # type: ignore[arg-type]
        out += m.chunk
    return out


A, B = Principal("tenant-a"), Principal("tenant-b")


@pytest.mark.parametrize("named", [False, True], ids=["server id", "client name"])
async def test_tenant_isolation_table(named: bool) -> None:
    svc = EncoderCacheServicer(TieredCache(CacheConfig(capacity_bytes=8 << 20)), 1 << 20)
    with principal_scope(A):
        r = await _put(svc, ROWS, **({"key": "shared-name"} if named else {}))
    name = r.key
    with principal_scope(B):
        # Every read, probe and delete of A's id by B is NOT_FOUND / absent, exactly as for an unknown id.
        for key in (name, "emb-" + "0" * 32):
            with pytest.raises(EmbedmeshError) as info:
                await _get(svc, key)
            assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.field == "key"
            assert list((await svc.Contains(cache_pb2.ContainsRequest(keys=[key]), _Ctx())).present) == [False]
            assert not (await svc.Delete(cache_pb2.DeleteRequest(key=key), _Ctx())).deleted
            with pytest.raises(EmbedmeshError) as info:
                await lookup_upload(svc.cache, key, "prompt_embeds")
            assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.field == "prompt_embeds"
        if named:
            # B may use the same name: it gets its own entry, A's is untouched.
            mine = np.zeros((2, 8), np.float32)
            assert (await _put(svc, mine, key="shared-name")).key == "shared-name"
            assert await _get(svc, "shared-name") == mine.tobytes()
    with principal_scope(A):
        assert await _get(svc, name) == ROWS.tobytes()
        assert np.array_equal((await lookup_upload(svc.cache, name, "prompt_embeds")).array, ROWS)
        assert (await svc.Delete(cache_pb2.DeleteRequest(key=name), _Ctx())).deleted
    if named:
        with principal_scope(B):
            assert await _get(svc, "shared-name") == np.zeros((2, 8), np.float32).tobytes()


@pytest.fixture
def two_keys() -> Iterator[None]:
    auth.configure_keys(auth.keyring_from_values(api_keys="key-a-12345678=alpha,key-b-12345678=beta"))
    yield
    auth.configure_keys(auth.KeyRing())


async def test_tenant_isolation_over_grpc_with_api_keys(stub: Any, two_keys: None) -> None:
    ka = [("authorization", "Bearer key-a-12345678")]
    kb = [("authorization", "Bearer key-b-12345678")]
    r = await stub.Put(iter(raw(ROWS)), metadata=ka)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await get_all(stub, r.key, metadata=kb)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert list((await stub.Contains(cache_pb2.ContainsRequest(keys=[r.key]), metadata=kb)).present) == [False]
    assert not (await stub.Delete(cache_pb2.DeleteRequest(key=r.key), metadata=kb)).deleted
    _, data = await get_all(stub, r.key, metadata=ka)
    assert data == ROWS.tobytes()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Put(iter(raw(ROWS)))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Stats(cache_pb2.StatsRequest(), metadata=ka)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
