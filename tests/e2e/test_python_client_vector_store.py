"""The Python client's vector-store methods (clients/python, VectorStoreService) against the real mesh: upload two
text files, build a store from them (one at creation, one added with attributes), wait for ingestion (real
all-MiniLM-L6-v2 embeddings from the embedding worker), search, filter, then delete and see NOT_FOUND — with the
sync and the async client."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from embedmesh_client import AsyncClient, Client, EmbedmeshClientError

from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

FRUIT = (b"Bananas are long yellow fruit that grow in tropical climates. Apples are crisp and grow on trees in "
         b"orchards; people pick them in autumn.")
SPACE = (b"Astronauts travel to the International Space Station on rockets. The Moon orbits the Earth and has no "
         b"atmosphere.")
INGEST_TIMEOUT = 120.0


def _check_uploaded(f: pb.File, name: str, data: bytes) -> None:
    assert f.id.startswith("file-") and f.filename == name and f.size_bytes == len(data), f
    assert f.purpose == "assistants" and f.media_type == "text/plain", f


def _check_ready(store: pb.VectorStore, files: pb.ListVectorStoreFilesResponse, fruit: str, space: str) -> None:
    assert store.status == pb.VECTOR_STORE_STATUS_COMPLETED, store
    assert (store.file_counts.completed, store.file_counts.total, store.file_counts.failed) == (2, 2, 0), store
    assert store.embedding_model and store.dimensions > 0, store
    by_id = {f.id: f for f in files.data}
    assert set(by_id) == {fruit, space}, files
    assert all(f.status == pb.FILE_STATUS_COMPLETED and f.chunks_total > 0 for f in files.data), files
    assert by_id[space].attributes["topic"].string_value == "science", by_id[space]
    assert by_id[space].attributes["year"].number_value == 2024, by_id[space]


def _check_search(resp: pb.SearchVectorStoreResponse, top: str, other: str) -> None:
    got = [(r.file_id, round(r.score, 4)) for r in resp.data]
    assert resp.data and resp.data[0].file_id == top, got
    assert {r.file_id for r in resp.data} <= {top, other}, got
    scores = [r.score for r in resp.data]
    assert scores == sorted(scores, reverse=True), got
    assert 0.0 <= scores[-1] <= scores[0] <= 1.0, got
    assert resp.data[0].content and resp.data[0].content[0].text, resp.data[0]


def _check_filtered(resp: pb.SearchVectorStoreResponse, space: str) -> None:
    # The query is about fruit, but only the space file carries topic=science.
    assert [r.file_id for r in resp.data] == [space], [(r.file_id, r.score) for r in resp.data]
    assert resp.data[0].filename == "space.txt" and resp.data[0].attributes["topic"].string_value == "science"


def _check_not_found(e: pytest.ExceptionInfo[EmbedmeshClientError]) -> None:
    assert e.value.code == grpc.StatusCode.NOT_FOUND, e.value
    assert e.value.field, e.value  # the server's ErrorInfo names the unknown id's field


def test_sync_client_vector_store_round_trip(mesh: Mesh) -> None:
    with Client(mesh.preprocessor, vector_store_address=str(mesh.extra["vector_store"]), timeout=120) as c:
        fruit_file = c.upload_file(FRUIT, "fruit.txt")
        space_file = c.upload_file(SPACE, "space.txt", purpose="assistants")
        _check_uploaded(fruit_file, "fruit.txt", FRUIT)
        _check_uploaded(space_file, "space.txt", SPACE)
        fruit, space = fruit_file.id, space_file.id
        assert fruit != space
        assert {fruit, space} <= {f.id for f in c.list_files(purpose="assistants", limit=100).data}
        assert c.get_file_content(space) == SPACE

        store = c.create_vector_store("py-client-sync", file_ids=[fruit], metadata={"suite": "e2e"})
        assert store.id.startswith("vs_") and store.name == "py-client-sync" and store.metadata["suite"] == "e2e"
        added = c.create_vector_store_file(store.id, space, attributes={"topic": "science", "year": 2024})
        assert added.id == space and added.vector_store_id == store.id, added
        assert store.id in {s.id for s in c.list_vector_stores(limit=100).data}

        deadline = time.monotonic() + INGEST_TIMEOUT
        while (store := c.get_vector_store(store.id)).file_counts.in_progress:
            assert time.monotonic() < deadline, f"ingestion did not finish: {store}"
            time.sleep(0.2)
        _check_ready(store, c.list_vector_store_files(store.id), fruit, space)
        assert [f.id for f in c.list_vector_store_files(store.id, status="failed").data] == []

        _check_search(c.search_vector_store(store.id, "which fruit is yellow?", max_num_results=5), fruit, space)
        _check_search(c.search_vector_store(store.id, "how do people get to space"), space, fruit)
        _check_filtered(c.search_vector_store(store.id, "which fruit is yellow?",
                                              filters={"type": "eq", "key": "topic", "value": "science"}), space)

        deleted = c.delete_vector_store(store.id)
        assert deleted.id == store.id and deleted.deleted
        with pytest.raises(EmbedmeshClientError) as e:
            c.get_vector_store(store.id)
        _check_not_found(e)
        assert store.id not in {s.id for s in c.list_vector_stores(limit=100).data}
        with pytest.raises(EmbedmeshClientError) as e:
            c.search_vector_store(store.id, "which fruit is yellow?")
        _check_not_found(e)

        for fid in (fruit, space):
            assert c.delete_file(fid).deleted
        with pytest.raises(EmbedmeshClientError) as e:
            c.get_file(fruit)
        _check_not_found(e)


def test_async_client_vector_store_round_trip(mesh: Mesh) -> None:
    async def go() -> None:
        async with AsyncClient(mesh.preprocessor, vector_store_address=str(mesh.extra["vector_store"]),
                               timeout=120) as c:
            fruit_file, space_file = await asyncio.gather(c.upload_file(FRUIT, "fruit.txt"),
                                                          c.upload_file(SPACE, "space.txt"))
            _check_uploaded(fruit_file, "fruit.txt", FRUIT)
            _check_uploaded(space_file, "space.txt", SPACE)
            fruit, space = fruit_file.id, space_file.id
            assert {fruit, space} <= {f.id for f in (await c.list_files(limit=100)).data}
            assert await c.get_file_content(fruit) == FRUIT

            store = await c.create_vector_store("py-client-async", file_ids=[fruit])
            await c.create_vector_store_file(store.id, space, attributes={"topic": "science", "year": 2024})
            assert store.id in {s.id for s in (await c.list_vector_stores(limit=100)).data}

            deadline = time.monotonic() + INGEST_TIMEOUT
            while (store := await c.get_vector_store(store.id)).file_counts.in_progress:
                assert time.monotonic() < deadline, f"ingestion did not finish: {store}"
                await asyncio.sleep(0.2)
            _check_ready(store, await c.list_vector_store_files(store.id), fruit, space)

            _check_search(await c.search_vector_store(store.id, "which fruit is yellow?", max_num_results=5),
                          fruit, space)
            _check_search(await c.search_vector_store(store.id, "how do people get to space"), space, fruit)
            _check_filtered(await c.search_vector_store(
                store.id, "which fruit is yellow?", filters={"type": "eq", "key": "topic", "value": "science"}),
                space)

            deleted = await c.delete_vector_store(store.id)
            assert deleted.id == store.id and deleted.deleted
            with pytest.raises(EmbedmeshClientError) as e:
                await c.get_vector_store(store.id)
            _check_not_found(e)
            assert store.id not in {s.id for s in (await c.list_vector_stores(limit=100)).data}

            for fid in (fruit, space):
                assert (await c.delete_file(fid)).deleted
            with pytest.raises(EmbedmeshClientError) as e:
                await c.get_file(space)
            _check_not_found(e)

    asyncio.run(go())


def test_vector_store_calls_go_to_vector_store_address(mesh: Mesh) -> None:
    """Without ``vector_store_address`` the calls go to the preprocessor, which does not serve VectorStoreService:
    the server's UNIMPLEMENTED comes back as the client's typed error."""
    with Client(mesh.preprocessor, timeout=30) as c, pytest.raises(EmbedmeshClientError) as e:
        c.list_vector_stores()
    assert e.value.code == grpc.StatusCode.UNIMPLEMENTED, e.value
