"""The REST routes (gateway/files.py, gateway/vector_stores.py) with the official openai SDK, against the service
in process (fake embedder) and the gateway app in a thread: OpenAI shapes, and OpenAI error JSON naming the param."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from embedmesh.gateway import files, vector_stores
from embedmesh.gateway.app import create_app
from embedmesh.gateway.config import GatewayConfig
from tests.support.mesh import free_port
from tests.unit.services.vector_store.conftest import HAVE_HNSWLIB, Running


class _Gateway:
    def __init__(self, vector_store: str) -> None:
        import uvicorn

        self.port = free_port()
        config = GatewayConfig(port=self.port, vector_store=vector_store, preprocessor="127.0.0.1:1")
        holder: dict[str, Any] = {}

        def extra() -> list[Any]:
            gw = holder["app"].state.gateway
            client = vector_stores.VectorStoreClient(gw)
            return [*files.routes(gw, client), *vector_stores.routes(gw, client)]

        # create_app builds the Gateway; routes need it, so build once to get it, then again with the routes.
        probe = create_app(config)
        holder["app"] = probe
        app = create_app(config, extra_routes=extra())
        app.state.gateway = probe.state.gateway
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None,
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Gateway:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(params=["embedded"])
def backend(request: pytest.FixtureRequest) -> str:
    if not HAVE_HNSWLIB:
        pytest.skip("hnswlib not installed")
    return str(request.param)


@pytest.fixture
async def client(svc: Running) -> AsyncIterator[openai.AsyncOpenAI]:
    with _Gateway(svc.server.address) as gw:
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="unused", max_retries=0)
        yield c
        await c.close()


async def _completed(client: openai.AsyncOpenAI, store_id: str) -> Any:
    for _ in range(400):
        vs = await client.vector_stores.retrieve(store_id)
        if vs.file_counts.in_progress == 0:
            return vs
        await asyncio.sleep(0.05)
    raise AssertionError("still in progress")


async def test_sdk_flow(client: openai.AsyncOpenAI) -> None:
    a = await client.files.create(file=("space.md", b"# Space\nRockets, orbits and astronauts."),
                                  purpose="assistants")
    b = await client.files.create(file=("food.txt", b"Apples, pears and bananas in the orchard."),
                                  purpose="assistants")
    assert a.object == "file" and a.bytes > 0 and a.filename == "space.md"
    assert (await client.files.content(a.id)).content == b"# Space\nRockets, orbits and astronauts."
    vs = await client.vector_stores.create(name="kb", file_ids=[a.id], metadata={"team": "x"},
                                           expires_after={"anchor": "last_active_at", "days": 3})
    await client.vector_stores.files.create(vector_store_id=vs.id, file_id=b.id, attributes={"kind": "food",
                                                                                             "year": 2024})
    vs = await _completed(client, vs.id)
    assert vs.status == "completed" and vs.file_counts.completed == 2 and vs.metadata == {"team": "x"}
    page = await client.vector_stores.search(vs.id, query="astronauts and rockets")
    assert page.data[0].file_id == a.id and 0 <= page.data[0].score <= 1
    assert page.data[0].content[0].type == "text" and "Rockets" in page.data[0].content[0].text
    page = await client.vector_stores.search(vs.id, query="astronauts",
                                             filters={"type": "and", "filters": [
                                                 {"type": "eq", "key": "kind", "value": "food"},
                                                 {"type": "gte", "key": "year", "value": 2020}]},
                                             max_num_results=5, ranking_options={"ranker": "auto"})
    assert [d.file_id for d in page.data] == [b.id] and page.data[0].attributes == {"kind": "food", "year": 2024}
    f = await client.vector_stores.files.retrieve(file_id=b.id, vector_store_id=vs.id)
    assert f.status == "completed" and f.chunking_strategy.type == "static"
    listed = [x.id async for x in client.vector_stores.files.list(vs.id, filter="completed")]
    assert sorted(listed) == sorted([a.id, b.id])
    batch = await client.vector_stores.file_batches.create(vector_store_id=vs.id, file_ids=[a.id])
    assert batch.object == "vector_store.files_batch"
    stores = await client.vector_stores.list(limit=1)
    assert stores.data[0].id == vs.id
    assert (await client.vector_stores.update(vs.id, name="renamed")).name == "renamed"
    assert (await client.vector_stores.files.delete(file_id=b.id, vector_store_id=vs.id)).deleted
    assert (await client.files.delete(a.id)).deleted
    assert (await client.vector_stores.delete(vs.id)).deleted


@pytest.mark.parametrize(("action", "status", "param"), [
    ("unknown_store", 404, "vector_store_id"),
    ("pdf", 400, "file"),
    ("filter_shape", 400, "filters.filters[0].value"),
    ("filter_type", 400, "filters.type"),
    ("max_results", 400, "max_num_results"),
    ("chunk_size", 400, "chunking_strategy.static.max_chunk_size_tokens"),
])
async def test_errors(client: openai.AsyncOpenAI, action: str, status: int, param: str) -> None:
    vs = await client.vector_stores.create(name="e")
    with pytest.raises(openai.APIStatusError) as e:
        if action == "unknown_store":
            await client.vector_stores.retrieve("vs_missing")
        elif action == "pdf":
            await client.files.create(file=("doc.pdf", b"%PDF-1.4 ...", "application/pdf"), purpose="assistants")
        elif action == "filter_shape":
            await client.vector_stores.search(vs.id, query="x", filters={"type": "or", "filters": [
                {"type": "eq", "key": "k", "value": {"nested": 1}}]})
        elif action == "filter_type":
            await client.vector_stores.search(vs.id, query="x", filters={"type": "like", "key": "k", "value": "v"})
        elif action == "max_results":
            await client.vector_stores.search(vs.id, query="x", max_num_results=51)
        elif action == "chunk_size":
            f = await client.files.create(file=("a.txt", b"hello"), purpose="assistants")
            await client.vector_stores.files.create(vector_store_id=vs.id, file_id=f.id, chunking_strategy={
                "type": "static", "static": {"max_chunk_size_tokens": 50, "chunk_overlap_tokens": 0}})
    assert e.value.status_code == status
    body: Any = e.value.body
    assert body["param"] == param, body
    if action == "pdf":
        assert "application/pdf" in body["message"] and ".pdf" in body["message"]


def test_not_configured() -> None:
    import httpx

    with _Gateway("") as gw:
        r = httpx.get(f"http://127.0.0.1:{gw.port}/v1/vector_stores")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_implemented_error"



async def test_tenants_over_rest(svc: Running) -> None:
    """Through the gateway with two keys: B gets OpenAI's 404 for A's file, store and batch; lists are per tenant."""
    from embedmesh.core import auth

    before = auth.keyring()
    auth.configure_keys(auth.keyring_from_values(api_keys="ka-12345678=a,kb-12345678=b"))
    try:
        with _Gateway(svc.server.address) as gw:
            url = f"http://127.0.0.1:{gw.port}/v1"
            a = openai.AsyncOpenAI(base_url=url, api_key="ka-12345678", max_retries=0)
            b = openai.AsyncOpenAI(base_url=url, api_key="kb-12345678", max_retries=0)
            fa = await a.files.create(file=("a.txt", b"apples of tenant a"), purpose="assistants")
            vs = await a.vector_stores.create(name="a", file_ids=[fa.id])
            batch = await a.vector_stores.file_batches.create(vector_store_id=vs.id, file_ids=[fa.id])
            fb = await b.files.create(file=("b.txt", b"rockets of tenant b"), purpose="assistants")
            vb = await b.vector_stores.create(name="b")
            attempts = [
                ("file_id", b.files.retrieve(fa.id)), ("file_id", b.files.content(fa.id)),
                ("file_id", b.files.delete(fa.id)),
                ("vector_store_id", b.vector_stores.retrieve(vs.id)),
                ("vector_store_id", b.vector_stores.search(vs.id, query="apples")),
                ("vector_store_id", b.vector_stores.update(vs.id, name="taken")),
                ("vector_store_id", b.vector_stores.delete(vs.id)),
                ("vector_store_id", b.vector_stores.files.create(vector_store_id=vs.id, file_id=fb.id)),
                ("file_id", b.vector_stores.files.create(vector_store_id=vb.id, file_id=fa.id)),
                ("vector_store_id", b.vector_stores.file_batches.retrieve(batch.id, vector_store_id=vs.id)),
                ("batch_id", b.vector_stores.file_batches.retrieve(batch.id, vector_store_id=vb.id)),
            ]
            for param, call in attempts:
                with pytest.raises(openai.NotFoundError) as e:
                    await call
                body: Any = e.value.body
                assert body["param"] == param, body
            assert [f.id async for f in b.files.list()] == [fb.id]
            assert [v.id async for v in b.vector_stores.list()] == [vb.id]
            assert [f.id async for f in a.files.list()] == [fa.id]
            assert (await a.files.content(fa.id)).content == b"apples of tenant a"
            assert (await _completed(a, vs.id)).name == "a"
            await a.close()
            await b.close()
    finally:
        auth.configure_keys(before)
