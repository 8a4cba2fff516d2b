"""The gateway refuses past its in-flight limit at once (503 + Retry-After, no handler run), counts every route
together, frees the slot when a request ends, and never refuses /health."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.gateway import GatewayConfig, create_app


async def test_past_the_limit_requests_are_refused_at_once_and_slots_come_back() -> None:
    release = asyncio.Event()
    ran: list[str] = []

    async def slow(request: Request) -> Response:
        ran.append("slow")
        await release.wait()
        return Response(b"{}", media_type="application/json")

    async def fast(request: Request) -> Response:
        ran.append("fast")
        return Response(b"{}", media_type="application/json")

    def extra(gw: Any) -> list[Route]:
        return [Route("/v1/test_slow", slow, methods=["GET"]), Route("/v1/test_fast", fast, methods=["GET"])]

    app = create_app(GatewayConfig(preprocessor="127.0.0.1:1", max_inflight=2), extra_routes=[extra])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        held = [asyncio.create_task(c.get("/v1/test_slow")) for _ in range(2)]
        while ran.count("slow") < 2:
            await asyncio.sleep(0.01)
        r = await c.get("/v1/test_fast")  # another route: the limit is for the gateway as a whole
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert r.headers["retry-after"] == "1"
        assert "fast" not in ran  # refused before the handler ran
        assert "overloaded" not in (await c.get("/health")).text  # probes are never refused by admission
        release.set()
        assert [t.status_code for t in await asyncio.gather(*held)] == [200, 200]
        assert (await c.get("/v1/test_fast")).status_code == 200  # the slots came back


def _keyed_app(max_inflight: int, tenant_share: float, keys: list[Any], ran: list[str],
               release: asyncio.Event) -> Any:
    from embedmesh.core import auth

    auth.configure_keys(auth.KeyRing(keys))

    async def slow(request: Request) -> Response:
        ran.append(auth.bearer_token(request.headers["authorization"]))
        await release.wait()  # as a body still trickling in would: the slot is held
        return Response(b"{}", media_type="application/json")

    def extra(gw: Any) -> list[Route]:
        return [Route("/v1/test_slow", slow, methods=["POST"])]

    return create_app(GatewayConfig(preprocessor="127.0.0.1:1", max_inflight=max_inflight,
                                    tenant_share=tenant_share), extra_routes=[extra])


async def test_a_tenant_past_its_share_is_refused_with_429_and_others_still_get_slots() -> None:
    """The attack: one tenant (limited to 2 in flight, or unlimited) opens many requests whose bodies trickle. Only
    its share holds slots; the rest get 429 at once without a slot; another tenant is still admitted."""
    from embedmesh.core import auth

    def key(k: str, tenant: str, **limits: Any) -> auth.ApiKey:
        return auth.ApiKey(auth._digest(k), tenant, **limits)

    release = asyncio.Event()
    ran: list[str] = []
    app = _keyed_app(8, 0.5, [key("limited-key-1", "slowpoke", max_concurrent_requests=2),
                              key("greedy-key-12", "greedy"), key("polite-key-12", "polite")], ran, release)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            def post(k: str) -> Any:
                return c.post("/v1/test_slow", headers={"Authorization": f"Bearer {k}"}, content=b"{}")

            held = [asyncio.create_task(post("limited-key-1")) for _ in range(2)]
            held += [asyncio.create_task(post("greedy-key-12")) for _ in range(4)]  # 0.5 of 8
            while len(ran) < 6:
                await asyncio.sleep(0.01)
            for k, tenant in (("limited-key-1", "slowpoke"), ("greedy-key-12", "greedy")):
                for _ in range(5):
                    r = await post(k)
                    assert r.status_code == 429, r.text
                    err = r.json()["error"]
                    assert err["code"] == "rate_limit_exceeded" and tenant in err["message"]
                    assert r.headers["retry-after"] == "1"
            assert len(ran) == 6  # refused before the handler ran (before the body would be read)
            polite = [asyncio.create_task(post("polite-key-12")) for _ in range(2)]
            while len(ran) < 8:  # 6 held + 2: the gateway's other slots are still there for another tenant
                await asyncio.sleep(0.01)
            r = await post("polite-key-12")
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"  # now the gateway is full
            release.set()
            assert [t.status_code for t in await asyncio.gather(*held, *polite)] == [200] * 8
            assert (await post("limited-key-1")).status_code == 200  # the tenant's slots came back
    finally:
        auth.configure_keys(auth.KeyRing())
