"""Tenants own their data, over gRPC with API keys, on both backends: tenant A's file, vector store and file batch
are NOT_FOUND for tenant B on every RPC that takes their id — with the very message an unknown id gets — and absent
from B's lists, while A keeps seeing and using all of it. Ids handed out are random 128-bit ids."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
import pytest

from embedmesh.core import auth
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from tests.unit.services.vector_store.conftest import Running, error_field, upload, wait_files

KA = (("authorization", "Bearer ka-12345678"),)
KB = (("authorization", "Bearer kb-12345678"),)
TEXT_A = b"Orchards of tenant A: apples, pears and plums ripen in late summer."
TEXT_B = b"Tenant B writes about rockets and satellites."


@pytest.fixture(autouse=True)
def keys() -> Iterator[None]:
    before = auth.keyring()
    auth.configure_keys(auth.keyring_from_values(api_keys="ka-12345678=a,kb-12345678=b"))
    yield
    auth.configure_keys(before)


class World:
    """What tenant A made (a file in a store, a second file in a batch) and tenant B's own file and store."""

    def __init__(self, fa: str, fa2: str, sa: str, batch: str, fb: str, sb: str) -> None:
        self.fa, self.fa2, self.sa, self.batch, self.fb, self.sb = fa, fa2, sa, batch, fb, sb


async def _world(svc: Running) -> World:
    s = svc.stub
    fa = (await upload(s, "a.txt", TEXT_A, metadata=KA)).id
    fa2 = (await upload(s, "a2.md", b"# more of A\nplums", metadata=KA)).id
    sa = (await s.CreateVectorStore(pb.CreateVectorStoreRequest(name="a-store", file_ids=[fa]),
                                    metadata=KA)).vector_store.id
    batch = (await s.CreateVectorStoreFileBatch(pb.CreateVectorStoreFileBatchRequest(
        vector_store_id=sa, file_ids=[fa2]), metadata=KA)).batch.id
    assert (await wait_files(s, sa, metadata=KA)).file_counts.completed == 2
    fb = (await upload(s, "b.txt", TEXT_B, metadata=KB)).id
    sb = (await s.CreateVectorStore(pb.CreateVectorStoreRequest(name="b-store"), metadata=KB)).vector_store.id
    return World(fa, fa2, sa, batch, fb, sb)


async def _collect(stream: Any) -> bytes:
    return b"".join([m.chunk async for m in stream])


# (name, field named by the error, call as B given (file, store, batch) ids). Each runs twice: with A's ids and with
# ids that exist nowhere; both must fail alike.
Call = Callable[[Any, str, str, str, World], Awaitable[Any]]
CASES: list[tuple[str, str, Call]] = [
    ("GetFile", "file_id", lambda s, f, v, b, w: s.GetFile(pb.GetFileRequest(file_id=f), metadata=KB)),
    ("GetFileContent", "file_id",
     lambda s, f, v, b, w: _collect(s.GetFileContent(pb.GetFileContentRequest(file_id=f), metadata=KB))),
    ("DeleteFile", "file_id", lambda s, f, v, b, w: s.DeleteFile(pb.DeleteFileRequest(file_id=f), metadata=KB)),
    ("GetVectorStore", "vector_store_id",
     lambda s, f, v, b, w: s.GetVectorStore(pb.GetVectorStoreRequest(vector_store_id=v), metadata=KB)),
    ("UpdateVectorStore", "vector_store_id",
     lambda s, f, v, b, w: s.UpdateVectorStore(pb.UpdateVectorStoreRequest(vector_store_id=v, name="mine now"),
                                               metadata=KB)),
    ("DeleteVectorStore", "vector_store_id",
     lambda s, f, v, b, w: s.DeleteVectorStore(pb.DeleteVectorStoreRequest(vector_store_id=v), metadata=KB)),
    ("SearchVectorStore", "vector_store_id",
     lambda s, f, v, b, w: s.SearchVectorStore(pb.SearchVectorStoreRequest(vector_store_id=v, queries=["apples"]),
                                               metadata=KB)),
    ("ListVectorStoreFiles", "vector_store_id",
     lambda s, f, v, b, w: s.ListVectorStoreFiles(pb.ListVectorStoreFilesRequest(vector_store_id=v), metadata=KB)),
    ("GetVectorStoreFile", "vector_store_id",
     lambda s, f, v, b, w: s.GetVectorStoreFile(pb.GetVectorStoreFileRequest(vector_store_id=v, file_id=f),
                                                metadata=KB)),
    ("UpdateVectorStoreFile", "vector_store_id",
     lambda s, f, v, b, w: s.UpdateVectorStoreFile(pb.UpdateVectorStoreFileRequest(vector_store_id=v, file_id=f),
                                                   metadata=KB)),
    ("DeleteVectorStoreFile", "vector_store_id",
     lambda s, f, v, b, w: s.DeleteVectorStoreFile(pb.DeleteVectorStoreFileRequest(vector_store_id=v, file_id=f),
                                                   metadata=KB)),
    ("CreateVectorStoreFile into A's store", "vector_store_id",
     lambda s, f, v, b, w: s.CreateVectorStoreFile(pb.CreateVectorStoreFileRequest(vector_store_id=v, file_id=w.fb),
                                                   metadata=KB)),
    ("CreateVectorStoreFile of A's file", "file_id",
     lambda s, f, v, b, w: s.CreateVectorStoreFile(pb.CreateVectorStoreFileRequest(vector_store_id=w.sb, file_id=f),
                                                   metadata=KB)),
    ("CreateVectorStore with A's file", "file_ids[0]",
     lambda s, f, v, b, w: s.CreateVectorStore(pb.CreateVectorStoreRequest(name="x", file_ids=[f]), metadata=KB)),
    ("CreateVectorStoreFileBatch of A's file", "file_ids[0]",
     lambda s, f, v, b, w: s.CreateVectorStoreFileBatch(pb.CreateVectorStoreFileBatchRequest(
         vector_store_id=w.sb, file_ids=[f]), metadata=KB)),
    ("CreateVectorStoreFileBatch into A's store", "vector_store_id",
     lambda s, f, v, b, w: s.CreateVectorStoreFileBatch(pb.CreateVectorStoreFileBatchRequest(
         vector_store_id=v, file_ids=[w.fb]), metadata=KB)),
    ("GetVectorStoreFileBatch", "vector_store_id",
     lambda s, f, v, b, w: s.GetVectorStoreFileBatch(pb.GetVectorStoreFileBatchRequest(
         vector_store_id=v, batch_id=b), metadata=KB)),
    ("CancelVectorStoreFileBatch", "vector_store_id",
     lambda s, f, v, b, w: s.CancelVectorStoreFileBatch(pb.CancelVectorStoreFileBatchRequest(
         vector_store_id=v, batch_id=b), metadata=KB)),
    ("ListVectorStoreFileBatchFiles", "vector_store_id",
     lambda s, f, v, b, w: s.ListVectorStoreFileBatchFiles(pb.ListVectorStoreFileBatchFilesRequest(
         vector_store_id=v, batch_id=b), metadata=KB)),
    ("GetVectorStoreFileBatch in B's store", "batch_id",
     lambda s, f, v, b, w: s.GetVectorStoreFileBatch(pb.GetVectorStoreFileBatchRequest(
         vector_store_id=w.sb, batch_id=b), metadata=KB)),
]

_ID = re.compile(r"(file-|vs_|vsfb_)\w+")


async def _not_found(call: Awaitable[Any], field: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
    assert error_field(e.value) == field
    return _ID.sub("ID", e.value.details() or "")


async def test_tenant_b_cannot_reach_tenant_a(svc: Running) -> None:
    w = await _world(svc)
    s = svc.stub
    for name, field, call in CASES:
        theirs = await _not_found(call(s, w.fa, w.sa, w.batch, w), field)
        unknown = await _not_found(call(s, "file-" + "0" * 32, "vs_" + "0" * 32, "vsfb_" + "0" * 32, w), field)
        assert theirs == unknown, name
    # B's lists hold B's objects only; A's ids are not even cursors there.
    assert [f.id for f in (await s.ListFiles(pb.ListFilesRequest(), metadata=KB)).data] == [w.fb]
    assert [v.id for v in (await s.ListVectorStores(pb.ListVectorStoresRequest(), metadata=KB)).data] == [w.sb]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await s.ListFiles(pb.ListFilesRequest(page=pb.PageRequest(after=w.fa)), metadata=KB)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_field(e.value) == "after"
    assert (await s.ListVectorStoreFiles(pb.ListVectorStoreFilesRequest(vector_store_id=w.sb), metadata=KB)).data == []

    # A still has everything, unchanged by B's attempts (B's delete, update and cancel calls did nothing).
    assert await _collect(s.GetFileContent(pb.GetFileContentRequest(file_id=w.fa), metadata=KA)) == TEXT_A
    assert {f.id for f in (await s.ListFiles(pb.ListFilesRequest(), metadata=KA)).data} == {w.fa, w.fa2}
    stores = (await s.ListVectorStores(pb.ListVectorStoresRequest(), metadata=KA)).data
    assert [v.id for v in stores] == [w.sa] and stores[0].name == "a-store"
    assert stores[0].file_counts.completed == 2
    batch = (await s.GetVectorStoreFileBatch(pb.GetVectorStoreFileBatchRequest(
        vector_store_id=w.sa, batch_id=w.batch), metadata=KA)).batch
    assert batch.status == pb.FILE_STATUS_COMPLETED and batch.file_counts.completed == 1
    hits = (await s.SearchVectorStore(pb.SearchVectorStoreRequest(vector_store_id=w.sa, queries=["apples pears"]),
                                      metadata=KA)).data
    assert hits and hits[0].file_id == w.fa
    # A's own store does not take B's file either.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await s.CreateVectorStoreFile(pb.CreateVectorStoreFileRequest(vector_store_id=w.sa, file_id=w.fb),
                                      metadata=KA)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and error_field(e.value) == "file_id"
    # And A can delete what is A's.
    assert (await s.DeleteVectorStore(pb.DeleteVectorStoreRequest(vector_store_id=w.sa), metadata=KA)).deleted
    assert (await s.DeleteFile(pb.DeleteFileRequest(file_id=w.fa), metadata=KA)).deleted


async def test_same_bytes_give_each_tenant_its_own_random_id(svc: Running) -> None:
    ids = [(await upload(svc.stub, "same.txt", b"identical bytes", metadata=k)).id for k in (KA, KA, KB)]
    assert all(re.fullmatch(r"file-[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 3
    vs = (await svc.stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="x", file_ids=[ids[0]]),
                                           metadata=KA)).vector_store
    assert re.fullmatch(r"vs_[0-9a-f]{32}", vs.id)
    b = (await svc.stub.CreateVectorStoreFileBatch(pb.CreateVectorStoreFileBatchRequest(
        vector_store_id=vs.id, file_ids=[ids[1]]), metadata=KA)).batch
    assert re.fullmatch(r"vsfb_[0-9a-f]{32}", b.id)
    # B's copy of the same bytes is B's alone: B deleting it leaves A's copies.
    await svc.stub.DeleteFile(pb.DeleteFileRequest(file_id=ids[2]), metadata=KB)
    got = await _collect(svc.stub.GetFileContent(pb.GetFileContentRequest(file_id=ids[0]), metadata=KA))
    assert got == b"identical bytes"
    await wait_files(svc.stub, vs.id, metadata=KA)


async def test_keys_are_required_once_configured(svc: Running) -> None:
    for md in ((), (("authorization", "Bearer wrong-key-123"),)):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await svc.stub.ListFiles(pb.ListFilesRequest(), metadata=md)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
