"""vector_store.servicer: the gRPC service end to end with the fake embedder, on both backends: files, stores,
ingestion, search with filters, batches, paging, and a table of bad inputs after which the service keeps serving."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from embedmesh.core import tensors
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from tests.unit.services.vector_store.conftest import Running, error_field, upload, wait_files

DOCS = {
    "fruit.md": "# Fruit\nApples and pears grow in orchards. Bananas are yellow fruit from the tropics.",
    "space.txt": "Rockets launch satellites into orbit. The moon circles the earth; astronauts walk in space.",
    "code.json": '{"topic": "python programming", "text": "functions classes modules and packages"}',
}
ATTRS = {
    "fruit.md": {"category": pb.AttributeValue(string_value="food"), "year": pb.AttributeValue(number_value=2021),
                 "public": pb.AttributeValue(bool_value=True)},
    "space.txt": {"category": pb.AttributeValue(string_value="science"),
                  "year": pb.AttributeValue(number_value=2024), "public": pb.AttributeValue(bool_value=False)},
    "code.json": {"category": pb.AttributeValue(string_value="tech"), "year": pb.AttributeValue(number_value=2023),
                  "public": pb.AttributeValue(bool_value=True)},
}


async def _store_with_docs(svc: Running) -> tuple[str, dict[str, str]]:
    ids = {}
    vs = (await svc.stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="docs"))).vector_store
    for name, text in DOCS.items():
        f = await upload(svc.stub, name, text.encode())
        ids[name] = f.id
        await svc.stub.CreateVectorStoreFile(pb.CreateVectorStoreFileRequest(
            vector_store_id=vs.id, file_id=f.id, attributes=ATTRS[name]))
    done = await wait_files(svc.stub, vs.id)
    assert done.file_counts.completed == 3 and done.status == pb.VECTOR_STORE_STATUS_COMPLETED
    return vs.id, ids


def _cmp(key: str, op: int, **value: object) -> pb.Filter:
    return pb.Filter(comparison=pb.ComparisonFilter(key=key, type=op,
                                                    value=pb.FilterValue(scalar=pb.AttributeValue(**value))))


async def test_files_roundtrip(svc: Running) -> None:
    f = await upload(svc.stub, "notes.md", b"# hello\nworld", purpose="user_data")
    assert f.id.startswith("file-") and f.size_bytes == 13 and f.media_type == "text/markdown"
    got = (await svc.stub.GetFile(pb.GetFileRequest(file_id=f.id))).file
    assert got == f
    content = b"".join([m.chunk async for m in svc.stub.GetFileContent(pb.GetFileContentRequest(file_id=f.id))])
    assert content == b"# hello\nworld"
    listed = await svc.stub.ListFiles(pb.ListFilesRequest(purpose="user_data"))
    assert [x.id for x in listed.data] == [f.id]
    assert (await svc.stub.DeleteFile(pb.DeleteFileRequest(file_id=f.id))).deleted
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await svc.stub.GetFile(pb.GetFileRequest(file_id=f.id))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and error_field(e.value) == "file_id"


async def test_ingest_and_search(svc: Running) -> None:
    store_id, ids = await _store_with_docs(svc)
    sf = (await svc.stub.GetVectorStoreFile(pb.GetVectorStoreFileRequest(vector_store_id=store_id,
                                                                         file_id=ids["space.txt"]))).file
    assert sf.status == pb.FILE_STATUS_COMPLETED and sf.chunks_done == sf.chunks_total >= 1 and sf.usage_bytes > 0
    assert sf.chunking_strategy.max_chunk_size_tokens == 800 and sf.chunking_strategy.chunk_overlap_tokens == 400
    r = await svc.stub.SearchVectorStore(pb.SearchVectorStoreRequest(vector_store_id=store_id,
                                                                     queries=["astronauts walk on the moon"]))
    assert r.data[0].file_id == ids["space.txt"] and r.data[0].filename == "space.txt"
    assert all(0.0 <= d.score <= 1.0 for d in r.data) and r.data[0].score > r.data[-1].score
    assert r.data[0].content[0].type == "text" and "astronauts" in r.data[0].content[0].text
    assert r.data[0].attributes["category"].string_value == "science"
    assert list(r.search_queries) == ["astronauts walk on the moon"] and not r.has_more
    vs = (await svc.stub.GetVectorStore(pb.GetVectorStoreRequest(vector_store_id=store_id))).vector_store
    assert vs.usage_bytes > 0 and vs.file_counts.total == 3 and vs.dimensions == 384


async def test_search_filters(svc: Running) -> None:
    store_id, ids = await _store_with_docs(svc)
    q = ["astronauts walk on the moon"]

    async def files(flt: pb.Filter, **kw: object) -> list[str]:
        r = await svc.stub.SearchVectorStore(pb.SearchVectorStoreRequest(vector_store_id=store_id, queries=q,
                                                                         filters=flt, **kw))
        names = {v: k for k, v in ids.items()}
        return [names[d.file_id] for d in r.data]

    assert await files(_cmp("category", pb.COMPARISON_OPERATOR_EQ, string_value="food")) == ["fruit.md"]
    assert "space.txt" not in await files(_cmp("public", pb.COMPARISON_OPERATOR_EQ, bool_value=True))
    assert set(await files(_cmp("year", pb.COMPARISON_OPERATOR_GTE, number_value=2023))) == {"space.txt",
                                                                                            "code.json"}
    in_list = pb.Filter(comparison=pb.ComparisonFilter(
        key="category", type=pb.COMPARISON_OPERATOR_NIN, value=pb.FilterValue(list=pb.AttributeValueList(
            values=[pb.AttributeValue(string_value="food"), pb.AttributeValue(string_value="tech")]))))
    assert await files(in_list) == ["space.txt"]
    nested = pb.Filter(compound=pb.CompoundFilter(type=pb.COMPOUND_OPERATOR_OR, filters=[
        _cmp("category", pb.COMPARISON_OPERATOR_EQ, string_value="tech"),
        pb.Filter(compound=pb.CompoundFilter(type=pb.COMPOUND_OPERATOR_AND, filters=[
            _cmp("year", pb.COMPARISON_OPERATOR_LT, number_value=2022),
            _cmp("public", pb.COMPARISON_OPERATOR_EQ, bool_value=True)]))]))
    assert set(await files(nested)) == {"code.json", "fruit.md"}
    assert await files(_cmp("missing", pb.COMPARISON_OPERATOR_NE, string_value="x")) == []
    # Attributes can change after ingestion, and filters see the change.
    await svc.stub.UpdateVectorStoreFile(pb.UpdateVectorStoreFileRequest(
        vector_store_id=store_id, file_id=ids["space.txt"],
        attributes={"category": pb.AttributeValue(string_value="food")}))
    assert set(await files(_cmp("category", pb.COMPARISON_OPERATOR_EQ, string_value="food"))) == {"fruit.md",
                                                                                                  "space.txt"}


async def test_search_options(svc: Running) -> None:
    store_id, ids = await _store_with_docs(svc)
    r = await svc.stub.SearchVectorStore(pb.SearchVectorStoreRequest(
        vector_store_id=store_id, queries=["  rockets   and\n bananas "], rewrite_query=True, max_num_results=1))
    assert list(r.search_queries) == ["rockets and bananas"] and len(r.data) == 1
    r = await svc.stub.SearchVectorStore(pb.SearchVectorStoreRequest(
        vector_store_id=store_id, queries=["rockets", "bananas"],
        ranking_options=pb.RankingOptions(ranker="auto", score_threshold=0.2)))
    assert {d.file_id for d in r.data} == {ids["space.txt"], ids["fruit.md"]}
    assert all(d.score >= 0.2 for d in r.data)
    # A query vector instead of text (gRPC only).
    from tests.unit.services.vector_store.fake_embedder import bag_of_words

    v = bag_of_words("python programming functions")
    r = await svc.stub.SearchVectorStore(pb.SearchVectorStoreRequest(vector_store_id=store_id,
                                                                     query_embedding=tensors.from_numpy(v)))
    assert r.data[0].file_id == ids["code.json"]


async def test_store_crud_and_paging(svc: Running) -> None:
    made = []
    for i in range(5):
        made.append((await svc.stub.CreateVectorStore(pb.CreateVectorStoreRequest(
            name=f"s{i}", metadata={"i": str(i)}))).vector_store.id)
    page = await svc.stub.ListVectorStores(pb.ListVectorStoresRequest(page=pb.PageRequest(limit=2)))
    assert [s.id for s in page.data] == made[::-1][:2] and page.page.has_more
    nxt = await svc.stub.ListVectorStores(pb.ListVectorStoresRequest(page=pb.PageRequest(limit=2,
                                                                                      after=page.page.last_id)))
    assert [s.id for s in nxt.data] == made[::-1][2:4]
    back = await svc.stub.ListVectorStores(pb.ListVectorStoresRequest(page=pb.PageRequest(limit=2,
                                                                                       before=nxt.page.first_id)))
    assert [s.id for s in back.data] == made[::-1][:2] and back.page.has_more is False
    up = (await svc.stub.UpdateVectorStore(pb.UpdateVectorStoreRequest(
        vector_store_id=made[0], name="renamed", expires_after=pb.ExpiresAfter(anchor="last_active_at", days=7),
        metadata={"k": "v"}, update_metadata=True))).vector_store
    assert up.name == "renamed" and dict(up.metadata) == {"k": "v"} and up.expires_after.days == 7
    assert up.expires_at == up.last_active_at + 7 * 86400
    assert (await svc.stub.DeleteVectorStore(pb.DeleteVectorStoreRequest(vector_store_id=made[0]))).deleted
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await svc.stub.GetVectorStore(pb.GetVectorStoreRequest(vector_store_id=made[0]))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and error_field(e.value) == "vector_store_id"


async def test_batches_and_store_files(svc: Running) -> None:
    vs = (await svc.stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="b"))).vector_store
    fids = [(await upload(svc.stub, f"d{i}.txt", f"document number {i} about topic {i}".encode())).id
            for i in range(4)]
    b = (await svc.stub.CreateVectorStoreFileBatch(pb.CreateVectorStoreFileBatchRequest(
        vector_store_id=vs.id, file_ids=fids[:3], attributes={"batch": pb.AttributeValue(bool_value=True)},
        chunking_strategy=pb.ChunkingStrategy(static_chunking=pb.StaticChunking(
            max_chunk_size_tokens=100, chunk_overlap_tokens=50))))).batch
    assert b.id.startswith("vsfb_") and b.file_counts.total == 3
    await wait_files(svc.stub, vs.id)
    b = (await svc.stub.GetVectorStoreFileBatch(pb.GetVectorStoreFileBatchRequest(vector_store_id=vs.id,
                                                                                  batch_id=b.id))).batch
    assert b.status == pb.FILE_STATUS_COMPLETED and b.file_counts.completed == 3
    listed = await svc.stub.ListVectorStoreFileBatchFiles(pb.ListVectorStoreFileBatchFilesRequest(
        vector_store_id=vs.id, batch_id=b.id, filter=pb.FILE_STATUS_COMPLETED))
    assert sorted(f.id for f in listed.data) == sorted(fids[:3])
    assert all(f.chunking_strategy.max_chunk_size_tokens == 100 and f.attributes["batch"].bool_value
               for f in listed.data)
    await svc.stub.CreateVectorStoreFile(pb.CreateVectorStoreFileRequest(vector_store_id=vs.id, file_id=fids[3]))
    await wait_files(svc.stub, vs.id)
    all_files = await svc.stub.ListVectorStoreFiles(pb.ListVectorStoreFilesRequest(
        vector_store_id=vs.id, page=pb.PageRequest(order=pb.SORT_ORDER_ASC)))
    assert [f.id for f in all_files.data] == fids
    none_failed = await svc.stub.ListVectorStoreFiles(pb.ListVectorStoreFilesRequest(vector_store_id=vs.id,
                                                                                     filter=pb.FILE_STATUS_FAILED))
    assert list(none_failed.data) == []
    await svc.stub.DeleteVectorStoreFile(pb.DeleteVectorStoreFileRequest(vector_store_id=vs.id, file_id=fids[0]))
    r = await svc.stub.SearchVectorStore(pb.SearchVectorStoreRequest(vector_store_id=vs.id,
                                                                     queries=["document number 0 topic 0"]))
    assert fids[0] not in {d.file_id for d in r.data} and r.data
    # Deleting the file itself removes it from the store too.
    await svc.stub.DeleteFile(pb.DeleteFileRequest(file_id=fids[1]))
    vs2 = (await svc.stub.GetVectorStore(pb.GetVectorStoreRequest(vector_store_id=vs.id))).vector_store
    assert vs2.file_counts.total == 2


async def test_cancel_batch(svc: Running, fake_embedder) -> None:
    fake_embedder.delay_seconds = 0.2
    vs = (await svc.stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="c"))).vector_store
    text = " ".join(f"word{i}" for i in range(3000)).encode()
    fids = [(await upload(svc.stub, f"big{i}.txt", text)).id for i in range(3)]
    b = (await svc.stub.CreateVectorStoreFileBatch(pb.CreateVectorStoreFileBatchRequest(
        vector_store_id=vs.id, file_ids=fids))).batch
    b = (await svc.stub.CancelVectorStoreFileBatch(pb.CancelVectorStoreFileBatchRequest(vector_store_id=vs.id,
                                                                                        batch_id=b.id))).batch
    assert b.status == pb.FILE_STATUS_CANCELLED and b.file_counts.cancelled == 3
    fake_embedder.delay_seconds = 0.0
    vs = await wait_files(svc.stub, vs.id)
    assert vs.file_counts.cancelled == 3 and vs.usage_bytes == 0


async def test_failed_ingestion_reports_the_reason(svc: Running, fake_embedder) -> None:
    fake_embedder.dim = 128  # the "model" now returns vectors of another size than the store's
    vs = (await svc.stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="dim"))).vector_store
    f = await upload(svc.stub, "a.txt", b"some text")
    await svc.stub.CreateVectorStoreFile(pb.CreateVectorStoreFileRequest(vector_store_id=vs.id, file_id=f.id))
    vs = await wait_files(svc.stub, vs.id)
    sf = (await svc.stub.GetVectorStoreFile(pb.GetVectorStoreFileRequest(vector_store_id=vs.id,
                                                                         file_id=f.id))).file
    assert sf.status == pb.FILE_STATUS_FAILED and sf.last_error.code == "server_error"
    assert "128-d" in sf.last_error.message and "384" in sf.last_error.message
    fake_embedder.dim = 384


def _bad_search(**kw: object) -> tuple[str, object]:
    return "search", kw


BAD = [
    # (call, request fields, expected code, expected field)
    ("get_store", {"vector_store_id": "vs_nope"}, grpc.StatusCode.NOT_FOUND, "vector_store_id"),
    ("add_file", {"file_id": "file-nope"}, grpc.StatusCode.NOT_FOUND, "file_id"),
    ("create_store", {"file_ids": ["file-nope"]}, grpc.StatusCode.NOT_FOUND, "file_ids[0]"),
    ("search", {"max_num_results": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_num_results"),
    ("search", {"max_num_results": 51}, grpc.StatusCode.INVALID_ARGUMENT, "max_num_results"),
    ("search", {"queries": []}, grpc.StatusCode.INVALID_ARGUMENT, "query"),
    ("search", {"queries": ["  "]}, grpc.StatusCode.INVALID_ARGUMENT, "query"),
    ("search", {"filters": _cmp("", pb.COMPARISON_OPERATOR_EQ, string_value="x")},
     grpc.StatusCode.INVALID_ARGUMENT, "filters.key"),
    ("search", {"filters": _cmp("k", pb.COMPARISON_OPERATOR_UNSPECIFIED, string_value="x")},
     grpc.StatusCode.INVALID_ARGUMENT, "filters.type"),
    ("search", {"filters": _cmp("k", pb.COMPARISON_OPERATOR_GT, bool_value=True)},
     grpc.StatusCode.INVALID_ARGUMENT, "filters.value"),
    ("search", {"filters": _cmp("k", pb.COMPARISON_OPERATOR_IN, string_value="x")},
     grpc.StatusCode.INVALID_ARGUMENT, "filters.value"),
    ("search", {"filters": pb.Filter(compound=pb.CompoundFilter(type=pb.COMPOUND_OPERATOR_AND))},
     grpc.StatusCode.INVALID_ARGUMENT, "filters.filters"),
    ("search", {"filters": pb.Filter(compound=pb.CompoundFilter(type=pb.COMPOUND_OPERATOR_OR, filters=[
        _cmp("k", pb.COMPARISON_OPERATOR_EQ, string_value="x"), pb.Filter()]))},
     grpc.StatusCode.INVALID_ARGUMENT, "filters.filters[1].type"),
    ("search", {"ranking_options": pb.RankingOptions(ranker="bm25")}, grpc.StatusCode.INVALID_ARGUMENT,
     "ranking_options.ranker"),
    ("search", {"ranking_options": pb.RankingOptions(score_threshold=1.5)}, grpc.StatusCode.INVALID_ARGUMENT,
     "ranking_options.score_threshold"),
    ("search", {"queries": [], "query_embedding": tensors.from_numpy(np.ones(17, np.float32))},
     grpc.StatusCode.INVALID_ARGUMENT, "query_embedding"),
    ("add_file", {"chunking_strategy": pb.ChunkingStrategy(static_chunking=pb.StaticChunking(
        max_chunk_size_tokens=99, chunk_overlap_tokens=0))}, grpc.StatusCode.INVALID_ARGUMENT,
     "chunking_strategy.static.max_chunk_size_tokens"),
    ("add_file", {"chunking_strategy": pb.ChunkingStrategy(static_chunking=pb.StaticChunking(
        max_chunk_size_tokens=4097, chunk_overlap_tokens=0))}, grpc.StatusCode.INVALID_ARGUMENT,
     "chunking_strategy.static.max_chunk_size_tokens"),
    ("add_file", {"chunking_strategy": pb.ChunkingStrategy(static_chunking=pb.StaticChunking(
        max_chunk_size_tokens=200, chunk_overlap_tokens=101))}, grpc.StatusCode.INVALID_ARGUMENT,
     "chunking_strategy.static.chunk_overlap_tokens"),
    ("add_file", {"attributes": {f"k{i}": pb.AttributeValue(bool_value=True) for i in range(17)}},
     grpc.StatusCode.INVALID_ARGUMENT, "attributes"),
    ("upload", {"name": "empty.txt", "content": b""}, grpc.StatusCode.INVALID_ARGUMENT, "file"),
    ("upload", {"name": "blob.txt", "content": b"\x89PNG\x00\x01"}, grpc.StatusCode.INVALID_ARGUMENT, "file"),
    ("upload", {"name": "bad.txt", "content": b"\xff\xfe\xfa"}, grpc.StatusCode.INVALID_ARGUMENT, "file"),
    ("upload", {"name": "doc.pdf", "content": b"%PDF-1.4"}, grpc.StatusCode.INVALID_ARGUMENT, "file"),
    ("upload", {"name": "x.json", "content": b"{not json"}, grpc.StatusCode.INVALID_ARGUMENT, "file"),
    ("upload", {"name": "big.txt", "content": b"a" * ((1 << 20) + 1)}, grpc.StatusCode.INVALID_ARGUMENT, "file"),
    ("upload", {"name": "a.txt", "content": b"x", "purpose": "fun"}, grpc.StatusCode.INVALID_ARGUMENT, "purpose"),
    ("list_stores", {"limit": 101}, grpc.StatusCode.INVALID_ARGUMENT, "limit"),
    ("list_stores", {"after": "vs_nope"}, grpc.StatusCode.INVALID_ARGUMENT, "after"),
    ("create_store", {"expires_after": pb.ExpiresAfter(anchor="created_at", days=1)},
     grpc.StatusCode.INVALID_ARGUMENT, "expires_after.anchor"),
    ("create_store", {"expires_after": pb.ExpiresAfter(anchor="last_active_at", days=0)},
     grpc.StatusCode.INVALID_ARGUMENT, "expires_after.days"),
    ("batch", {"batch_id": "vsfb_nope"}, grpc.StatusCode.NOT_FOUND, "batch_id"),
]


@pytest.mark.parametrize(("call", "fields", "code", "field"), BAD, ids=[f"{c}-{f}-{i}" for i, (c, _, _, f)
                                                                         in enumerate(BAD)])
async def test_bad_input(svc: Running, call: str, fields: dict, code: grpc.StatusCode, field: str) -> None:
    stub = svc.stub
    vs = (await stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="bad"))).vector_store
    ok = await upload(stub, "ok.txt", b"fine text here")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        if call == "get_store":
            await stub.GetVectorStore(pb.GetVectorStoreRequest(**fields))
        elif call == "add_file":
            await stub.CreateVectorStoreFile(pb.CreateVectorStoreFileRequest(
                vector_store_id=vs.id, **{"file_id": ok.id, **fields}))
        elif call == "create_store":
            await stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="x", **fields))
        elif call == "search":
            await stub.SearchVectorStore(pb.SearchVectorStoreRequest(vector_store_id=vs.id,
                                                                     **{"queries": ["hello"], **fields}))
        elif call == "upload":
            await upload(stub, fields["name"], fields["content"], purpose=fields.get("purpose", "assistants"))
        elif call == "list_stores":
            await stub.ListVectorStores(pb.ListVectorStoresRequest(page=pb.PageRequest(**fields)))
        elif call == "batch":
            await stub.GetVectorStoreFileBatch(pb.GetVectorStoreFileBatchRequest(vector_store_id=vs.id, **fields))
    assert e.value.code() == code, e.value.details()
    assert error_field(e.value) == field, e.value.details()
    assert field.split(".")[0].split("[")[0] in e.value.details()
    # ... and the service keeps serving.
    r = await stub.SearchVectorStore(pb.SearchVectorStoreRequest(vector_store_id=vs.id, queries=["hello"]))
    assert list(r.data) == []
