"""The preprocessor's router client: a live router's decision; when no router answers, round robin over the
workers it knows (counted in a metric), or None when it knows none; a failed router is skipped for a while."""

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


async def test_fallback_round_robins_over_the_callers_healthy_workers() -> None:
    client = RouteClient([f"127.0.0.1:{free_port()}"], block_size=4, timeout=0.2,
                         healthy_workers=lambda model: ["w1:1", "w2:1"] if model == "m" else [])
    picks = [await client.route("m", [1], 4) for _ in range(4)]
    assert [d.address for d in picks if d] == ["w1:1", "w2:1", "w1:1", "w2:1"]
    assert all(d is not None and d.fallback for d in picks)
    assert await client.route("other", [1], 4) is None
    await client.close()


async def test_live_router_decides_and_its_workers_are_remembered_for_an_outage() -> None:
    r = await start_router()
    client = RouteClient([r.address], block_size=4, timeout=0.5, retry_after=30)
    async with FakeWorker([r.address], "a") as a, FakeWorker([r.address], "b") as b:
        a.store(0, [1, 2])
        await until(lambda: r.index.blocks_of("a") == 2)
        d = await client.route("m", [1, 2], 9, "req-1")
        assert d is not None and not d.fallback
        assert (d.worker_id, d.address, d.overlap_blocks) == ("a", a.link.registration.address, 2)
        assert [c.worker_id for c in d.candidates] == ["a", "b"] and d.candidates[0].cost < d.candidates[1].cost
        await r.close()
    before = fallbacks()
    outage = [await client.route("m", [1, 2], 9) for _ in range(2)]
    assert all(d is not None and d.fallback for d in outage)
    assert {d.address for d in outage if d} == {a.link.registration.address, b.link.registration.address}
    assert fallbacks() == before + 2
    await client.close()
