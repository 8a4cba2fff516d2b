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
