"""The gateway's /health is open to anyone (probes carry no key): requests that arrive while the mesh is being
asked share that round of calls, so a crowd of callers costs the mesh one round in flight, not one per request.
Through the real gateway over HTTP; the round is held open until every request of the crowd waits on it."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from embedmesh.gateway import app
from tests.unit.gateway.conftest import Harness, wait_for

CROWD = 20


class _Asyncio:
    """asyncio as the app module sees it, with ``shield`` replaced."""

    def __init__(self, shield: Any) -> None:
        self.shield = shield

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)


def test_concurrent_health_requests_share_one_round(gw: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    rounds = {"asked": 0, "waiting": 0}
    release = threading.Event()
    real_health, real_shield = app._preprocessor_health, asyncio.shield

    async def held(gateway: Any) -> dict[str, str]:
        rounds["asked"] += 1
        while not release.is_set():
            await asyncio.sleep(0.01)
        return await real_health(gateway)

    def shield(task: Any) -> Any:  # each /health request waits on the round through this
        rounds["waiting"] += 1
        return real_shield(task)

    monkeypatch.setattr(app, "_preprocessor_health", held)
    monkeypatch.setattr(app, "asyncio", _Asyncio(shield))
    with ThreadPoolExecutor(CROWD) as pool:
        crowd = [pool.submit(httpx.get, f"{gw.url}/health", timeout=30) for _ in range(CROWD)]
        assert wait_for(lambda: rounds["waiting"] == CROWD, timeout=30), rounds
        assert rounds["asked"] == 1
        release.set()
        answers = [f.result() for f in crowd]
    assert all(r.status_code == 200 and r.json()["status"] == "ok" for r in answers)
    assert rounds["asked"] == 1
    # the next request asks the mesh again: nothing is remembered
    assert httpx.get(f"{gw.url}/health", timeout=30).status_code == 200
    assert rounds["asked"] == 2


def test_a_caller_that_leaves_does_not_cancel_the_others(gw: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real_health = app._preprocessor_health

    async def held(gateway: Any) -> dict[str, str]:
        while not release.is_set():
            await asyncio.sleep(0.01)
        return await real_health(gateway)

    monkeypatch.setattr(app, "_preprocessor_health", held)
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(f"{gw.url}/health", timeout=0.5)  # leaves while the round is held
        other = pool.submit(httpx.get, f"{gw.url}/health", timeout=30)
        release.set()
        r = other.result()
    assert r.status_code == 200 and r.json()["status"] == "ok"
