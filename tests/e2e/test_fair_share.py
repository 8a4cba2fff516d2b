"""Weighted fair share under saturation, through a real mesh (mocker worker, the preprocessor's
``--fair-share-slots``): a tenant of weight 4 that floods the mesh first and a tenant of weight 1 that arrives
later share the generation slots 4:1 while both have work waiting — first come, first served would run the whole
flood before the later tenant's first request. Counted in completion order, no wall-clock threshold."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.support.mesh import start_mesh

pytestmark = pytest.mark.e2e

HEAVY, LIGHT = "heavy-key-0001", "light-key-0001"


async def _run(base_url: str) -> tuple[list[str], float]:
    """40 requests of the heavy tenant, then (once they wait) 40 of the light one: the tenants in the order their
    requests completed, and when the light ones were sent."""
    done: list[tuple[float, str]] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=100)) as c:
        async def one(key: str, tenant: str) -> None:
            r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "mocker", "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 6})
            assert r.status_code == 200, r.text
            done.append((time.monotonic(), tenant))

        heavy = [asyncio.create_task(one(HEAVY, "heavy")) for _ in range(40)]
        await asyncio.sleep(0.5)  # the flood is queued
        light_at = time.monotonic()
        light = [asyncio.create_task(one(LIGHT, "light")) for _ in range(40)]
        await asyncio.gather(*heavy, *light)
    return [tenant for at, tenant in sorted(done) if at > light_at], light_at


def test_a_flooding_tenant_of_weight_4_gets_4_slots_for_each_of_a_weight_1_tenant(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": HEAVY, "tenant": "heavy", "weight": 4},
                                         {"key": LIGHT, "tenant": "light", "weight": 1}]}))
    mesh = start_mesh(engine="mocker", workers=1, env={
        "EMBEDMESH_API_KEYS_FILE": str(keys), "EMBEDMESH_PREPROCESSOR_FAIR_SHARE_SLOTS": "2",
        "EMBEDMESH_WORKER_MOCKER_DECODE_MS": "20"})
    try:
        after, _ = asyncio.run(_run(mesh.base_url))
    finally:
        mesh.stop()
    window = after[:25]  # while both tenants still have work waiting (the heavy tenant had > 20 left)
    heavy = window.count("heavy")
    print(f"\nfirst 25 completions after the light tenant arrived: heavy {heavy}, light {25 - heavy}")
    assert 17 <= heavy <= 23, window  # 4:1 is 20:5; first come, first served would be 25:0
    assert after.count("light") == 40
