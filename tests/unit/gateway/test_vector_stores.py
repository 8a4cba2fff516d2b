"""gateway/vector_stores.py: ``/v1/vector_stores…`` through a bare app with a scripted VectorStoreService stub — the
request each route sends (bodies, path ids, paging and status filters), the OpenAI objects it answers, a bad
body's 400 before any call, the service's refusals mapped, and 501 without a vector store. (The body models'
refusals are listed in requests/test_model.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from embedmesh.core.errors import NotFound
from embedmesh.gateway import vector_stores
from embedmesh.gateway.vector_stores import VectorStoreClient, filter_proto
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from tests.unit.gateway.conftest import FakeStub, bare_gateway, route_client, rpc_error

STORE = pb.VectorStore(id="vs_1", created_at=10, name="docs", usage_bytes=99,
                       file_counts=pb.FileCounts(completed=2, total=3, in_progress=1),
                       status=pb.VECTOR_STORE_STATUS_COMPLETED, expires_after=pb.ExpiresAfter(anchor="last_active_at",
                                                                                              days=7),
                       expires_at=700, last_active_at=20, metadata={"team": "a"}, embedding_model="e5",
                       dimensions=384)
STORE_JSON = {"id": "vs_1", "object": "vector_store", "created_at": 10, "name": "docs", "usage_bytes": 99,
              "file_counts": {"in_progress": 1, "completed": 2, "failed": 0, "cancelled": 0, "total": 3},
              "status": "completed", "expires_after": {"anchor": "last_active_at", "days": 7}, "expires_at": 700,
              "last_active_at": 20, "metadata": {"team": "a"}, "embedding_model": "e5", "dimensions": 384}
VS_FILE = pb.VectorStoreFile(id="file-1", created_at=11, vector_store_id="vs_1", usage_bytes=5,
                             status=pb.FILE_STATUS_FAILED, last_error=pb.FileError(code="parse", message="bad"),
                             chunking_strategy=pb.StaticChunking(max_chunk_size_tokens=800, chunk_overlap_tokens=400),
                             attributes={"n": pb.AttributeValue(number_value=3.0),
                                         "x": pb.AttributeValue(number_value=0.5),
                                         "ok": pb.AttributeValue(bool_value=True)},
                             chunks_done=1, chunks_total=4)
VS_FILE_JSON = {"id": "file-1", "object": "vector_store.file", "created_at": 11, "vector_store_id": "vs_1",
                "usage_bytes": 5, "status": "failed", "last_error": {"code": "parse", "message": "bad"},
                "chunking_strategy": {"type": "static", "static": {"max_chunk_size_tokens": 800,
                                                                   "chunk_overlap_tokens": 400}},
                "attributes": {"n": 3, "x": 0.5, "ok": True}, "progress": {"chunks_done": 1, "chunks_total": 4}}


class ScriptedClient(VectorStoreClient):
    def __init__(self, gateway: Any, stub: FakeStub) -> None:
        super().__init__(gateway)
        self._stub = stub  # type: ignore[assignment]


def client(**answers: Any) -> tuple[Any, FakeStub]:
    gw = bare_gateway(vector_store="127.0.0.1:1", request_timeout_seconds=8)
    stub = FakeStub(**answers)
    return route_client(vector_stores.routes(gw, ScriptedClient(gw, stub))), stub


def test_create_sends_every_field_and_answers_the_store() -> None:
    http, stub = client(CreateVectorStore=pb.CreateVectorStoreResponse(vector_store=STORE))
    r = http.post("/v1/vector_stores", json={"name": "docs", "file_ids": ["f1", "f2"], "metadata": {"team": "a"},
                                             "expires_after": {"anchor": "last_active_at", "days": 7},
                                             "chunking_strategy": {"type": "static", "static": {
                                                 "max_chunk_size_tokens": 800, "chunk_overlap_tokens": 400}}})
    assert r.status_code == 200 and r.json() == STORE_JSON
    assert stub.calls == [("CreateVectorStore", pb.CreateVectorStoreRequest(
        name="docs", file_ids=["f1", "f2"], metadata={"team": "a"},
        expires_after=pb.ExpiresAfter(anchor="last_active_at", days=7),
        chunking_strategy=pb.ChunkingStrategy(static_chunking=pb.StaticChunking(max_chunk_size_tokens=800,
                                                                                chunk_overlap_tokens=400))), 8.0)]


def test_a_bad_body_is_a_400_before_any_call() -> None:
    http, stub = client(CreateVectorStore=pb.CreateVectorStoreResponse(vector_store=STORE))
    r = http.post("/v1/vector_stores", json={"name": 5})
    assert r.status_code == 400 and r.json()["error"] == {"message": "name: must be a string",
                                                         "type": "invalid_request_error", "param": "name",
                                                         "code": "invalid_type"}
    r = http.post("/v1/vector_stores", content=b"[]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert stub.calls == []


def test_modify_clears_or_keeps_expiry_and_metadata() -> None:
    http, stub = client(UpdateVectorStore=pb.UpdateVectorStoreResponse(vector_store=STORE))
    assert http.post("/v1/vector_stores/vs_1", json={"name": "n", "expires_after": None, "metadata": None}).json() \
        == STORE_JSON
    assert stub.last("UpdateVectorStore") == pb.UpdateVectorStoreRequest(
        vector_store_id="vs_1", name="n", clear_expires_after=True, update_metadata=True)
    http.post("/v1/vector_stores/vs_1", json={"expires_after": {"days": 2}})
    assert stub.last("UpdateVectorStore") == pb.UpdateVectorStoreRequest(
        vector_store_id="vs_1", expires_after=pb.ExpiresAfter(anchor="last_active_at", days=2))
    http.post("/v1/vector_stores/vs_1", json={"metadata": {"k": "v"}})
    assert stub.last("UpdateVectorStore") == pb.UpdateVectorStoreRequest(vector_store_id="vs_1",
                                                                          update_metadata=True, metadata={"k": "v"})


def test_list_retrieve_delete_stores() -> None:
    http, stub = client(ListVectorStores=pb.ListVectorStoresResponse(data=[STORE], page=pb.PageInfo()),
                        GetVectorStore=lambda req: pb.GetVectorStoreResponse(vector_store=STORE),
                        DeleteVectorStore=pb.DeleteVectorStoreResponse(id="vs_1", deleted=True))
    assert http.get("/v1/vector_stores?limit=5&before=vs_9").json() == {
        "object": "list", "data": [STORE_JSON], "first_id": None, "last_id": None, "has_more": False}
    assert stub.last("ListVectorStores").page == pb.PageRequest(limit=5, before="vs_9", order=pb.SORT_ORDER_DESC)
    assert http.get("/v1/vector_stores/vs_1").json() == STORE_JSON
    assert stub.last("GetVectorStore") == pb.GetVectorStoreRequest(vector_store_id="vs_1")
    assert http.delete("/v1/vector_stores/vs_1").json() == {"id": "vs_1", "object": "vector_store.deleted",
                                                            "deleted": True}


def test_store_files_add_list_get_update_delete() -> None:
    http, stub = client(CreateVectorStoreFile=pb.CreateVectorStoreFileResponse(file=VS_FILE),
                        ListVectorStoreFiles=pb.ListVectorStoreFilesResponse(data=[VS_FILE]),
                        GetVectorStoreFile=pb.GetVectorStoreFileResponse(file=VS_FILE),
                        UpdateVectorStoreFile=pb.UpdateVectorStoreFileResponse(file=VS_FILE),
                        DeleteVectorStoreFile=pb.DeleteVectorStoreFileResponse(id="file-1", deleted=True))
    r = http.post("/v1/vector_stores/vs_1/files", json={"file_id": "file-1", "attributes": {"a": "b", "n": 2},
                                                        "chunking_strategy": {"type": "auto"}})
    assert r.json() == VS_FILE_JSON
    assert stub.last("CreateVectorStoreFile") == pb.CreateVectorStoreFileRequest(
        vector_store_id="vs_1", file_id="file-1",
        attributes={"a": pb.AttributeValue(string_value="b"), "n": pb.AttributeValue(number_value=2)},
        chunking_strategy=pb.ChunkingStrategy(auto_chunking=pb.AutoChunking()))
    assert http.get("/v1/vector_stores/vs_1/files?filter=failed").json()["data"] == [VS_FILE_JSON]
    assert stub.last("ListVectorStoreFiles").filter == pb.FILE_STATUS_FAILED
    r = http.get("/v1/vector_stores/vs_1/files?filter=broken")
    assert r.status_code == 400 and r.json()["error"]["param"] == "filter"
    assert http.get("/v1/vector_stores/vs_1/files/file-1").json() == VS_FILE_JSON
    assert stub.last("GetVectorStoreFile") == pb.GetVectorStoreFileRequest(vector_store_id="vs_1", file_id="file-1")
    http.post("/v1/vector_stores/vs_1/files/file-1", json={"attributes": {"ok": False}})
    assert stub.last("UpdateVectorStoreFile") == pb.UpdateVectorStoreFileRequest(
        vector_store_id="vs_1", file_id="file-1", attributes={"ok": pb.AttributeValue(bool_value=False)})
    assert http.delete("/v1/vector_stores/vs_1/files/file-1").json() == {
        "id": "file-1", "object": "vector_store.file.deleted", "deleted": True}


def test_file_batches() -> None:
    batch = pb.VectorStoreFileBatch(id="vsfb_1", created_at=12, vector_store_id="vs_1",
                                    status=pb.FILE_STATUS_IN_PROGRESS, file_counts=pb.FileCounts(in_progress=2,
                                                                                                 total=2))
    batch_json = {"id": "vsfb_1", "object": "vector_store.files_batch", "created_at": 12, "vector_store_id": "vs_1",
                  "status": "in_progress", "file_counts": {"in_progress": 2, "completed": 0, "failed": 0,
                                                           "cancelled": 0, "total": 2}}
    http, stub = client(CreateVectorStoreFileBatch=pb.CreateVectorStoreFileBatchResponse(batch=batch),
                        GetVectorStoreFileBatch=pb.GetVectorStoreFileBatchResponse(batch=batch),
                        CancelVectorStoreFileBatch=pb.CancelVectorStoreFileBatchResponse(batch=batch),
                        ListVectorStoreFileBatchFiles=pb.ListVectorStoreFileBatchFilesResponse(data=[VS_FILE]))
    r = http.post("/v1/vector_stores/vs_1/file_batches", json={
        "file_ids": ["a"], "files": [{"file_id": "b", "attributes": {"k": "v"},
                                      "chunking_strategy": {"type": "static",
                                                            "static": {"max_chunk_size_tokens": 100}}}]})
    assert r.json() == batch_json
    assert stub.last("CreateVectorStoreFileBatch") == pb.CreateVectorStoreFileBatchRequest(
        vector_store_id="vs_1", file_ids=["a"], files=[pb.BatchFile(
            file_id="b", attributes={"k": pb.AttributeValue(string_value="v")},
            chunking_strategy=pb.ChunkingStrategy(static_chunking=pb.StaticChunking(max_chunk_size_tokens=100)))])
    assert http.get("/v1/vector_stores/vs_1/file_batches/vsfb_1").json() == batch_json
    assert http.post("/v1/vector_stores/vs_1/file_batches/vsfb_1/cancel").json() == batch_json
    assert stub.last("CancelVectorStoreFileBatch") == pb.CancelVectorStoreFileBatchRequest(vector_store_id="vs_1",
                                                                                            batch_id="vsfb_1")
    assert http.get("/v1/vector_stores/vs_1/file_batches/vsfb_1/files").json()["data"] == [VS_FILE_JSON]


def test_search_sends_queries_filters_and_ranking_and_answers_openais_page() -> None:
    http, stub = client(SearchVectorStore=pb.SearchVectorStoreResponse(
        search_queries=["capital"], has_more=False,
        data=[pb.SearchResult(file_id="file-1", filename="a.md", score=0.75,
                              attributes={"n": pb.AttributeValue(number_value=1.0)},
                              content=[pb.SearchContent(type="text", text="Paris")])]))
    r = http.post("/v1/vector_stores/vs_1/search", json={
        "query": "capital", "max_num_results": 3, "rewrite_query": True,
        "filters": {"type": "and", "filters": [{"type": "eq", "key": "lang", "value": "fr"},
                                               {"type": "in", "key": "n", "value": [1, 2]}]},
        "ranking_options": {"ranker": "auto", "score_threshold": 0.5}})
    assert r.json() == {"object": "vector_store.search_results.page", "search_query": "capital",
                        "data": [{"file_id": "file-1", "filename": "a.md", "score": 0.75, "attributes": {"n": 1},
                                  "content": [{"type": "text", "text": "Paris"}]}],
                        "has_more": False, "next_page": None}
    eq = pb.Filter(comparison=pb.ComparisonFilter(key="lang", type=pb.COMPARISON_OPERATOR_EQ, value=pb.FilterValue(
        scalar=pb.AttributeValue(string_value="fr"))))
    within = pb.Filter(comparison=pb.ComparisonFilter(key="n", type=pb.COMPARISON_OPERATOR_IN, value=pb.FilterValue(
        list=pb.AttributeValueList(values=[pb.AttributeValue(number_value=1), pb.AttributeValue(number_value=2)]))))
    assert stub.last("SearchVectorStore") == pb.SearchVectorStoreRequest(
        vector_store_id="vs_1", queries=["capital"], max_num_results=3, rewrite_query=True,
        filters=pb.Filter(compound=pb.CompoundFilter(type=pb.COMPOUND_OPERATOR_AND, filters=[eq, within])),
        ranking_options=pb.RankingOptions(ranker="auto", score_threshold=0.5))


def test_search_with_several_queries_answers_them_all() -> None:
    http, stub = client(SearchVectorStore=pb.SearchVectorStoreResponse(search_queries=["a", "b"]))
    assert http.post("/v1/vector_stores/vs_1/search", json={"query": ["a", "b"]}).json()["search_query"] == ["a", "b"]
    assert list(stub.last("SearchVectorStore").queries) == ["a", "b"]


def test_a_refusal_of_the_service_is_mapped() -> None:
    http, _ = client(GetVectorStore=rpc_error(NotFound("vector_store_id: no vector store 'vs_9'",
                                                       field="vector_store_id")))
    r = http.get("/v1/vector_stores/vs_9")
    assert r.status_code == 404 and r.json()["error"] == {"message": "vector_store_id: no vector store 'vs_9'",
                                                         "type": "not_found_error", "param": "vector_store_id",
                                                         "code": "not_found"}


def test_without_a_vector_store_the_routes_are_501() -> None:
    r = route_client(vector_stores.routes(bare_gateway())).get("/v1/vector_stores")
    assert r.status_code == 501 and r.json()["error"]["code"] == "not_implemented"


@pytest.mark.parametrize(("query", "param", "message"), [
    ("limit=ten", "limit", "limit: must be an integer, got 'ten'"),
    ("limit=-1", "limit", "limit: must be in [1, 100]"),
    ("limit=99999999999", "limit", "limit: must be in [1, 100]"),
    ("order=sideways", "order", "order: must be 'asc' or 'desc', got 'sideways'"),
])
def test_bad_paging_is_a_400(query: str, param: str, message: str) -> None:
    http, stub = client(ListVectorStores=pb.ListVectorStoresResponse())
    r = http.get(f"/v1/vector_stores?{query}")
    assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, message)
    assert stub.calls == []


def test_filter_proto_for_a_single_comparison() -> None:
    assert filter_proto({"type": "lte", "key": "n", "value": True}) == pb.Filter(comparison=pb.ComparisonFilter(
        key="n", type=pb.COMPARISON_OPERATOR_LTE, value=pb.FilterValue(scalar=pb.AttributeValue(bool_value=True))))
