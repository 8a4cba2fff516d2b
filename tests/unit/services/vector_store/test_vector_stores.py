"""vector_store.vector_stores: the operations called directly (no gRPC), on both backends with the fake embedder —
``build`` wires the configured backend; uploads, stores and searches refuse what they must naming the field;
several queries merge by best score per chunk; a threshold drops weak hits; every operation acts for the caller's
tenant, and another tenant's ids are unknown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np
import pytest

from embedmesh.core.auth import Principal, principal_scope
from embedmesh.core.errors import EmbedmeshError, FailedPrecondition, InvalidArgument, NotFound
from embedmesh.services.vector_store.config import VectorStoreConfig
from embedmesh.services.vector_store.objects import ExpiresAfter, PageRequest
from embedmesh.services.vector_store.vector_stores import VectorStores, build, rewrite
from tests.unit.services.vector_store.fake_embedder import bag_of_words

DOCS = {
    "fruit.md": b"Apples and pears grow in orchards. Bananas are yellow fruit.",
    "space.txt": b"Rockets launch satellites into orbit around the earth.",
}


@pytest.fixture
async def api(config: VectorStoreConfig) -> AsyncIterator[VectorStores]:
    vs = await asyncio.to_thread(build, replace(config))
    await vs.start()
    yield vs
    await vs.close()


async def _ready_store(api: VectorStores) -> tuple[str, dict[str, str]]:
    ids = {name: (await api.upload_file(name, "assistants", "", content)).id for name, content in DOCS.items()}
    store = await api.create_store("docs", list(ids.values()), None, None, {"team": "a"})
    deadline = time.monotonic() + 20
    while (await api.get_store(store.id)).file_counts.in_progress:
        assert time.monotonic() < deadline, "ingestion did not finish"
        await asyncio.sleep(0.05)
    assert (await api.get_store(store.id)).file_counts.completed == 2
    return store.id, ids


def _refused(exc: pytest.ExceptionInfo[EmbedmeshError], field: str, reason: str) -> str:
    assert (exc.value.field, exc.value.reason) == (field, reason), (exc.value.field, exc.value.reason)
    return exc.value.message


def test_rewrite_collapses_whitespace_only() -> None:
    assert rewrite("  What   is\tthe \n moon?  ") == "What is the moon?"
    assert rewrite("Case Stays, punctuation!") == "Case Stays, punctuation!"


async def test_build_wires_the_configured_backend(api: VectorStores, backend: str) -> None:
    from embedmesh.services.vector_store.index.embedded import EmbeddedIndex
    from embedmesh.services.vector_store.index.pgvector import PgVectorIndex

    assert api.db.dialect == ("sqlite" if backend == "embedded" else "postgres")
    assert isinstance(api.index, EmbeddedIndex if backend == "embedded" else PgVectorIndex)
    assert (api.embedder.model, api.embedder.dimensions) == (api.config.embedding_model, api.config.dimensions)


async def test_uploads_keep_the_base_name_and_refuse_what_they_must(api: VectorStores) -> None:
    f = await api.upload_file("../../etc/notes.txt", "assistants", "", b"hello")
    assert (f.filename, f.media_type, f.size_bytes) == ("notes.txt", "text/plain", 5)
    assert await api.file_content(f.id) == b"hello"
    with pytest.raises(InvalidArgument) as info:
        await api.upload_file("", "assistants", "", b"x")
    _refused(info, "filename", "MISSING_FILENAME")
    with pytest.raises(InvalidArgument) as info:
        await api.upload_file("big.txt", "assistants", "", b"x" * (api.config.max_file_bytes + 1))
    assert _refused(info, "file", "FILE_TOO_LARGE") == (f"file: {api.config.max_file_bytes + 1} bytes is over the "
                                                        f"{api.config.max_file_bytes} byte limit")
    with pytest.raises(InvalidArgument) as info:
        await api.upload_file("a.pdf", "assistants", "", b"x")
    _refused(info, "file", "UNSUPPORTED_FILE_TYPE")


@pytest.mark.parametrize("metadata,expires,field,reason", [
    ({f"k{i}": "v" for i in range(17)}, None, "metadata", "TOO_MANY_METADATA"),
    ({"k" * 65: "v"}, None, "metadata." + "k" * 65, "INVALID_METADATA"),
    ({"k": "v" * 513}, None, "metadata.k", "INVALID_METADATA"),
    ({}, ExpiresAfter(days=0), "expires_after.days", "DAYS_OUT_OF_RANGE"),
    ({}, ExpiresAfter(days=366), "expires_after.days", "DAYS_OUT_OF_RANGE"),
    ({}, ExpiresAfter(days=3, anchor="created_at"), "expires_after.anchor", "INVALID_ANCHOR"),
])
async def test_store_settings_are_checked(api: VectorStores, metadata: dict, expires: ExpiresAfter | None,
                                          field: str, reason: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        await api.create_store("s", [], None, expires, metadata)
    _refused(info, field, reason)
    store = await api.create_store("s", [], None, ExpiresAfter(days=365), {f"k{i}": "v" for i in range(16)})
    with pytest.raises(InvalidArgument) as info:
        await api.update_store(store.id, None, expires, False, metadata)
    _refused(info, field, reason)


async def test_a_store_with_an_unknown_file_names_its_position(api: VectorStores) -> None:
    f = await api.upload_file("a.txt", "assistants", "", b"words")
    with pytest.raises(NotFound) as info:
        await api.create_store("s", [f.id, "file-nope"], None, None, {})
    assert info.value.field == "file_ids[1]"
    assert (await api.list_stores(PageRequest())).data == [], "nothing was created"


async def test_search_ranks_merges_queries_and_applies_the_threshold(api: VectorStores) -> None:
    store_id, ids = await _ready_store(api)
    searched, hits = await api.search(store_id, ["  rockets   orbit "], None, None, 10, "auto", None, True)
    assert searched == ["rockets orbit"]
    assert hits[0].file_id == ids["space.txt"] and hits[0].filename == "space.txt"
    assert all(0.0 <= h.score <= 1.0 for h in hits)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    # Two queries: each file's chunk is found by the query that matches it; one hit per chunk, best score kept.
    _, both = await api.search(store_id, ["rockets orbit", "apples pears"], None, None, 10, "none", None, False)
    assert {h.file_id for h in both} == set(ids.values()) and len({h.chunk_id for h in both}) == len(both)
    best = {h.file_id: h.score for h in both}
    _, alone = await api.search(store_id, ["apples pears"], None, None, 10, "", None, False)
    assert best[ids["fruit.md"]] == pytest.approx(alone[0].score)
    # The threshold keeps only what scores at least that much.
    cut = (both[0].score + both[-1].score) / 2
    _, kept = await api.search(store_id, ["rockets orbit", "apples pears"], None, None, 10, "auto", cut, False)
    assert kept and all(h.score >= cut for h in kept) and len(kept) < len(both)
    _, one = await api.search(store_id, ["rockets orbit", "apples pears"], None, None, 1, "auto", None, False)
    assert len(one) == 1 and one[0].chunk_id == both[0].chunk_id


async def test_search_by_vector(api: VectorStores) -> None:
    store_id, ids = await _ready_store(api)
    v = bag_of_words("bananas yellow fruit") * 3.0  # any length: normalised
    searched, hits = await api.search(store_id, [], v, None, 5, "auto", None, False)
    assert searched == [] and hits[0].file_id == ids["fruit.md"]


@pytest.mark.parametrize("kw,field,reason", [
    ({"max_num_results": 0}, "max_num_results", "MAX_NUM_RESULTS_OUT_OF_RANGE"),
    ({"max_num_results": 51}, "max_num_results", "MAX_NUM_RESULTS_OUT_OF_RANGE"),
    ({"ranker": "bm25"}, "ranking_options.ranker", "INVALID_RANKER"),
    ({"score_threshold": 1.5}, "ranking_options.score_threshold", "THRESHOLD_OUT_OF_RANGE"),
    ({"queries": []}, "query", "MISSING_QUERY"),
    ({"queries": ["q"] * 17}, "query", "TOO_MANY_QUERIES"),
    ({"queries": ["   "]}, "query", "EMPTY_QUERY"),
    ({"queries": ["ok", " \n "]}, "query[1]", "EMPTY_QUERY"),
    ({"vector": np.ones(384, np.float32)}, "query", "QUERY_AND_EMBEDDING"),
    ({"queries": [], "vector": np.ones(3, np.float32)}, "query_embedding", "DIMENSION_MISMATCH"),
    ({"queries": [], "vector": np.zeros(384, np.float32)}, "query_embedding", "INVALID_EMBEDDING"),
])
async def test_bad_searches_name_the_field(api: VectorStores, kw: dict, field: str, reason: str) -> None:
    store = await api.create_store("s", [], None, None, {})
    args = {"queries": ["q"], "vector": None, "max_num_results": 5, "ranker": "auto", "score_threshold": None,
            **kw}
    with pytest.raises(InvalidArgument) as info:
        await api.search(store.id, args["queries"], args["vector"], None, args["max_num_results"], args["ranker"],
                         args["score_threshold"], True)
    _refused(info, field, reason)


async def test_a_store_of_another_embedding_model_cannot_be_searched_by_text(api: VectorStores) -> None:
    store = await api.create_store("s", [], None, None, {})
    api.embedder.model = "another-model"
    with pytest.raises(FailedPrecondition) as info:
        await api.search(store.id, ["q"], None, None, 5, "auto", None, True)
    _refused(info, "vector_store_id", "DIMENSION_MISMATCH")


async def test_another_tenants_ids_are_unknown(api: VectorStores) -> None:
    with principal_scope(Principal("alpha")):
        f = await api.upload_file("a.txt", "assistants", "", b"alpha's words")
        store = await api.create_store("mine", [], None, None, {})
    with principal_scope(Principal("beta")):
        for call in (api.get_file(f.id), api.get_store(store.id), api.file_content(f.id),
                     api.search(store.id, ["words"], None, None, 5, "auto", None, True),
                     api.add_file(store.id, f.id, {}, None)):
            with pytest.raises(NotFound):
                await call
        assert (await api.list_stores(PageRequest())).data == []
        own = await api.create_store("theirs", [], None, None, {})
        with pytest.raises(NotFound) as info:
            await api.add_file(own.id, f.id, {}, None)  # alpha's file into beta's store
        assert info.value.field
    with principal_scope(Principal("alpha")):
        assert [s.id for s in (await api.list_stores(PageRequest())).data] == [store.id]


async def test_unfiltered_searches_in_one_thread_hop_answer_as_hop_by_hop(api: VectorStores) -> None:
    """SQLite + the embedded graph: an unfiltered search reads its rows in the thread that searched the index (and a
    search by vector looks its store up there too); the answers and the refusals are those of the hop-by-hop path."""
    store_id, _ = await _ready_store(api)
    assert api._one_hop == (api.config.backend == "embedded")
    runs = 0
    real_run = api.db.run

    async def counting_run(fn, *args):  # type: ignore[no-untyped-def]
        nonlocal runs
        runs += 1
        return await real_run(fn, *args)

    api.db.run = counting_run  # type: ignore[method-assign]
    v = bag_of_words("bananas yellow fruit")
    searches = [(["rockets orbit", "apples pears"], None, 10, None), (["apples"], None, 1, None),
                ([], v, 5, None), ([], v, 5, 0.99)]
    fast = []
    for queries, vector, k, cut in searches:
        before = runs
        fast.append(await api.search(store_id, queries, vector, None, k, "auto", cut, False))
        hops = runs - before
        if api._one_hop:  # a text search looks its store up on the database thread; a vector search does not
            assert hops == (1 if queries else 0), (queries, hops)
    refusals = []
    with principal_scope(Principal("someone-else")):
        with pytest.raises(NotFound) as nf:
            await api.search(store_id, [], v, None, 5, "auto", None, False)
        refusals.append((nf.value.field, nf.value.reason))
    with pytest.raises(InvalidArgument) as bad:
        await api.search(store_id, [], np.ones(7, np.float32), None, 5, "auto", None, False)
    refusals.append((bad.value.field, bad.value.reason))
    api._one_hop = False
    slow = [await api.search(store_id, q, vec, None, k, "auto", cut, False) for q, vec, k, cut in searches]
    assert fast == slow and all(hits for _, hits in fast[:3])
    with principal_scope(Principal("someone-else")):
        with pytest.raises(NotFound) as nf:
            await api.search(store_id, [], v, None, 5, "auto", None, False)
    with pytest.raises(InvalidArgument) as bad:
        await api.search(store_id, [], np.ones(7, np.float32), None, 5, "auto", None, False)
    assert refusals == [(nf.value.field, nf.value.reason), (bad.value.field, bad.value.reason)]
    assert refusals == [("vector_store_id", "VECTOR_STORE_NOT_FOUND"), ("query_embedding", "DIMENSION_MISMATCH")]
