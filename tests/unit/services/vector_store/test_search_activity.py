"""A search records activity on its store (expiry counts from ``last_active_at``) only when the last record is at
least ``SEARCH_TOUCH_SECONDS`` old, so a busy store is not written on every search; on both backends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np
import pytest

from embedmesh.core.errors import FailedPrecondition
from embedmesh.services.vector_store.config import VectorStoreConfig
from embedmesh.services.vector_store.vector_stores import SEARCH_TOUCH_SECONDS, VectorStores, build


@pytest.fixture
async def api(config: VectorStoreConfig) -> AsyncIterator[VectorStores]:
    vs = await asyncio.to_thread(build, replace(config))
    await vs.start()
    yield vs
    await vs.close()


async def _store(api: VectorStores) -> str:
    f = await api.upload_file("a.txt", "assistants", "", b"Rockets launch satellites into orbit.")
    store = await api.create_store("s", [f.id], None, None, {})
    deadline = time.monotonic() + 20
    while (await api.get_store(store.id)).file_counts.in_progress:
        assert time.monotonic() < deadline, "ingestion did not finish"
        await asyncio.sleep(0.05)
    return store.id


async def _set_last_active(api: VectorStores, store_id: str, t: int) -> None:
    await api.db.run(api.db.execute, "UPDATE vs_stores SET last_active_at = ? WHERE id = ?", [t, store_id])


async def test_a_search_records_activity_when_the_last_record_is_old(api: VectorStores) -> None:
    store_id = await _store(api)
    old = int(time.time()) - SEARCH_TOUCH_SECONDS - 3600
    await _set_last_active(api, store_id, old)
    _, hits = await api.search(store_id, ["rockets"], None, None, 5, "auto", None, False)
    assert hits
    assert (await api.get_store(store_id)).last_active_at >= int(time.time()) - 5


async def test_a_search_leaves_a_recent_record_alone(api: VectorStores) -> None:
    store_id = await _store(api)
    recent = int(time.time()) - SEARCH_TOUCH_SECONDS // 2
    await _set_last_active(api, store_id, recent)
    await api.search(store_id, ["rockets"], None, None, 5, "auto", None, False)
    assert (await api.get_store(store_id)).last_active_at == recent


@pytest.mark.parametrize("by", ["text", "vector"])
async def test_a_search_by_text_or_vector_records_old_activity_and_refuses_an_expired_store(
        api: VectorStores, by: str) -> None:
    store_id = await _store(api)
    queries, vector = (["rockets"], None) if by == "text" else ([], np.ones(api.embedder.dimensions, np.float32))
    old = int(time.time()) - SEARCH_TOUCH_SECONDS - 3600
    await _set_last_active(api, store_id, old)
    _, hits = await api.search(store_id, queries, vector, None, 5, "auto", None, False)
    assert hits
    assert (await api.get_store(store_id)).last_active_at >= int(time.time()) - 5
    # expired: a day's expiry counted from two days ago
    await api.db.run(api.db.execute, "UPDATE vs_stores SET expires_days = 1 WHERE id = ?", [store_id])
    await _set_last_active(api, store_id, int(time.time()) - 2 * 86400)
    with pytest.raises(FailedPrecondition) as info:
        await api.search(store_id, queries, vector, None, 5, "auto", None, False)
    assert (info.value.field, info.value.reason) == ("vector_store_id", "VECTOR_STORE_EXPIRED")
