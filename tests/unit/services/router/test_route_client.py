"""The preprocessor's router client: a live router's decision; when no router answers, None (counted in a metric;
the caller's worker pool is the one fallback); a failed router is skipped for a while."""

from __future__ import annotations

from prometheus_client import REGISTRY

from embedmesh.services.router.route_client import RouteClient
from tests.support.mesh import free_port
from tests.unit.services.router.test_servicer import FakeWorker, start_router, until


def fallbacks() -> float:
    return sum(s.value for m in REGISTRY.collect() if m.name == "embedmesh_router_fallback"
               for s in m.samples if s.name.endswith("_total"))


async def test_unreachable_router_means_fallback_and_a_metric() -> None:
    client = RouteClient([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], block_size=16, timeout=0.2)
    before = fallbacks()
    assert await client.route("m", [1, 2], 32, "r1") is None, "no worker known: the caller uses its own pool"
    assert await client.route("m", [1, 2], 32) is None
    assert fallbacks() == before + 2
    await client.close()


async def test_a_failed_router_is_skipped_until_retry_after() -> None:
    import time

    client = RouteClient([f"127.0.0.1:{free_port()}"], block_size=4, timeout=0.2, retry_after=30)
    t0 = time.monotonic()
    assert await client.route("m", [1], 4) is None
    assert client._down_until[0] > t0 + 29, "an unreachable router is marked down for retry_after"
    before = fallbacks()
    assert await client.route("m", [1], 4) is None  # skipped, not dialled again: no timeout spent
    assert fallbacks() == before + 1
    await client.close()


async def test_live_router_decides_and_an_outage_leaves_the_choice_to_the_caller() -> None:
    r = await start_router()
    client = RouteClient([r.address], block_size=4, timeout=0.5, retry_after=30)
    async with FakeWorker([r.address], "a") as a, FakeWorker([r.address], "b"):
        a.store(0, [1, 2])
        await until(lambda: r.index.blocks_of("a") == 2)
        d = await client.route("m", [1, 2], 9, "req-1")
        assert d is not None
        assert (d.worker_id, d.address, d.overlap_blocks) == ("a", a.link.registration.address, 2)
        assert [c.worker_id for c in d.candidates] == ["a", "b"] and d.candidates[0].cost < d.candidates[1].cost
        await r.close()
    before = fallbacks()
    outage = [await client.route("m", [1, 2], 9) for _ in range(2)]
    assert outage == [None, None]
    assert fallbacks() == before + 2
    await client.close()
