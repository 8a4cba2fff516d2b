"""Per-tenant limits shared by every replica through a real Redis (core/shared_limits.py): two limiters standing for
two replicas count one tenant together — requests in flight, requests per second, tokens per minute — other
tenants are apart, a served RPC takes its slot there, and with Redis gone each process falls back to its own
limits instead of failing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from embedmesh.core import auth
from embedmesh.core.auth import Access, ApiKey, Principal
from embedmesh.core.errors import ResourceExhausted, from_rpc_error
from embedmesh.core.shared_limits import SharedLimits
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.redis_server import RedisServer

from .conftest import ServeEcho


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
async def replicas(redis: RedisServer) -> AsyncIterator[tuple[SharedLimits, SharedLimits]]:
    a, b = SharedLimits(redis.url), SharedLimits(redis.url)
    await a._redis.flushdb()
    yield a, b
    auth.configure_shared(None)
    await a.close()
    await b.close()


async def test_requests_in_flight_are_counted_across_replicas(replicas: tuple[SharedLimits, SharedLimits]) -> None:
    a, b = replicas
    held = [await a.acquire("alpha", 2, 0, 0), await b.acquire("alpha", 2, 0, 0)]
    for replica in (a, b):
        with pytest.raises(ResourceExhausted) as info:
            await replica.acquire("alpha", 2, 0, 0)
        assert info.value.reason == "RATE_LIMIT_EXCEEDED" and "2 requests in flight" in info.value.message
    assert await a.acquire("beta", 2, 0, 0) is not None  # another tenant is counted apart
    await a.release(held[0])  # what one replica releases, the other may take
    assert await b.acquire("alpha", 2, 0, 0) is not None


async def test_requests_per_second_are_one_bucket_for_every_replica(
        replicas: tuple[SharedLimits, SharedLimits]) -> None:
    a, b = replicas
    granted = 0
    for i in range(6):
        try:
            await (a if i % 2 else b).acquire("gamma", 0, 2.0, 0)
            granted += 1
        except ResourceExhausted as e:
            assert 0 < (e.retry_after_seconds or 0) <= 1.0
    assert granted == 2  # the burst of a 2/s bucket, not 2 per replica
    await asyncio.sleep(0.6)
    assert await a.acquire("gamma", 0, 2.0, 0) is None  # refilled (no lease: no concurrency limit)


async def test_tokens_charged_on_one_replica_count_on_the_other(replicas: tuple[SharedLimits, SharedLimits]) -> None:
    a, b = replicas
    await b.acquire("delta", 0, 0, 100)
    await a.charge("delta", 60)
    await b.acquire("delta", 0, 0, 100)
    await a.charge("delta", 40)
    with pytest.raises(ResourceExhausted) as info:
        await b.acquire("delta", 0, 0, 100)
    assert "100 tokens per minute" in info.value.message and 0 < (info.value.retry_after_seconds or 0) <= 60


async def test_a_served_rpc_takes_its_slot_in_redis(replicas: tuple[SharedLimits, SharedLimits], keys: None,
                                                    serve_echo: ServeEcho) -> None:
    """The preprocessor's and vector store's path (core/server.py): with limits shared, a tenant whose one slot
    another replica holds is refused here; once released, served."""
    a, other_replica = replicas
    auth.configure_keys(auth.KeyRing([ApiKey(auth._digest("ka-12345678"), "alpha", max_concurrent_requests=1)]))
    auth.configure_shared(a)
    server = await serve_echo(Access.PUBLIC, public=True)
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            md = [("authorization", "Bearer ka-12345678")]
            assert (await stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=md, timeout=10)).model == "alpha"
            lease = await other_replica.acquire("alpha", 1, 0, 0)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=md, timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert from_rpc_error(info.value).reason == "RATE_LIMIT_EXCEEDED"
            await other_replica.release(lease)
            assert (await stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=md, timeout=10)).model == "alpha"
    finally:
        await server.drain()


async def test_without_redis_each_process_keeps_its_own_limits(redis: RedisServer) -> None:
    gone = SharedLimits("redis://127.0.0.1:1/0", timeout=0.5)  # nothing listens there
    auth.configure_shared(gone)
    p = Principal("epsilon", key=ApiKey(b"x" * 32, "epsilon", max_concurrent_requests=1))
    try:
        held = await auth.take_slot(p)
        assert held == p  # a local slot
        with pytest.raises(ResourceExhausted):
            await auth.take_slot(p)  # the local limit still holds
        auth.release_slot(held)
        auth.release_slot(await auth.take_slot(p))
    finally:
        auth.configure_shared(None)
        await gone.close()
