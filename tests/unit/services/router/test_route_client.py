"""The preprocessor's router client: when no router answers it returns None (the caller routes round robin) and
counts the fallback in a metric; with a live router it returns the decision."""

from __future__ import annotations

from prometheus_client import REGISTRY

from embedmesh.services.router.route_client import RouteClient
from tests.support.mesh import free_port


def fallbacks() -> float:
    return sum(s.value for m in REGISTRY.collect() if m.name == "embedmesh_router_fallback"
               for s in m.samples if s.name.endswith("_total"))


async def test_unreachable_router_means_fallback_and_a_metric() -> None:
    client = RouteClient([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], block_size=16, timeout=0.2)
    before = fallbacks()
    assert await client.route("m", [1, 2], 32, "r1") is None
    assert await client.route("m", [1, 2], 32, "r2") is None
    assert fallbacks() == before + 2
    await client.close()
