"""gRPC adapter of ``VectorStoreService``: protobuf in -> domain call -> protobuf out. No logic of its own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np

from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument
from embedmesh.services.vector_store.filters import Comparison, Compound, Filter
from embedmesh.services.vector_store.objects import (
    AUTO_CHUNKING,
    Attributes,
    ChunkingSpec,
    ExpiresAfter,
    FileBatch,
    FileCounts,
    FileObject,
    FileStatus,
    Page,
    PageRequest,
    VectorStore,
    VectorStoreFile,
)
from embedmesh.services.vector_store.vector_stores import VectorStores
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from embedmesh.vectorstore.v1 import vectorstore_pb2_grpc

__all__ = ["VectorStoreServicer", "SERVICE_NAME"]

SERVICE_NAME = "embedmesh.vectorstore.v1.VectorStoreService"
_CHUNK = 1 << 20

_STATUS_TO_PB = {"in_progress": pb.FILE_STATUS_IN_PROGRESS, "completed": pb.FILE_STATUS_COMPLETED,
                 "failed": pb.FILE_STATUS_FAILED, "cancelled": pb.FILE_STATUS_CANCELLED}
_STATUS_FROM_PB: dict[int, FileStatus | None] = {v: k for k, v in _STATUS_TO_PB.items()}  # type: ignore[misc]
_STATUS_FROM_PB[pb.FILE_STATUS_UNSPECIFIED] = None
_STORE_STATUS = {"in_progress": pb.VECTOR_STORE_STATUS_IN_PROGRESS, "completed": pb.VECTOR_STORE_STATUS_COMPLETED,
                 "expired": pb.VECTOR_STORE_STATUS_EXPIRED}
_CMP = {pb.COMPARISON_OPERATOR_EQ: "eq", pb.COMPARISON_OPERATOR_NE: "ne", pb.COMPARISON_OPERATOR_GT: "gt",
        pb.COMPARISON_OPERATOR_GTE: "gte", pb.COMPARISON_OPERATOR_LT: "lt", pb.COMPARISON_OPERATOR_LTE: "lte",
        pb.COMPARISON_OPERATOR_IN: "in", pb.COMPARISON_OPERATOR_NIN: "nin"}
_COMPOUND = {pb.COMPOUND_OPERATOR_AND: "and", pb.COMPOUND_OPERATOR_OR: "or"}


# --- protobuf -> domain -----------------------------------------------------------------------------------------
def _page(p: pb.PageRequest) -> PageRequest:
    order = "asc" if p.order == pb.SORT_ORDER_ASC else "desc"
    return PageRequest(p.limit if p.HasField("limit") else 20, order, p.after, p.before)  # type: ignore[arg-type]


def _value(v: pb.AttributeValue, field: str) -> str | float | bool:
    kind = v.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(f"{field}: a value is required", field=field, reason="MISSING_VALUE")
    return getattr(v, kind)  # type: ignore[no-any-return]


def _attributes(m: Any, field: str = "attributes") -> Attributes:
    return {k: _value(v, f"{field}.{k}") for k, v in m.items()}


def _status(s: int) -> FileStatus | None:
    if s not in _STATUS_FROM_PB:
        raise InvalidArgument(f"filter: unknown file status {s}", field="filter", reason="INVALID_STATUS")
    return _STATUS_FROM_PB[s]


def _chunking(c: pb.ChunkingStrategy, given: bool = True) -> ChunkingSpec | None:
    kind = c.WhichOneof("kind") if given else None
    if kind == "static_chunking":
        return ChunkingSpec(c.static_chunking.max_chunk_size_tokens, c.static_chunking.chunk_overlap_tokens)
    return AUTO_CHUNKING if kind == "auto_chunking" else None


def _expires(e: pb.ExpiresAfter) -> ExpiresAfter:
    return ExpiresAfter(e.days, e.anchor or "last_active_at")


def _filter(f: pb.Filter) -> Filter:
    """Structure only; ``filters.validate`` checks the rules and names the path."""
    kind = f.WhichOneof("kind")
    if kind == "compound":
        return Compound(_COMPOUND.get(f.compound.type, ""), tuple(_filter(s) for s in f.compound.filters))
    if kind == "comparison":
        c = f.comparison
        vk = c.value.WhichOneof("kind")
        value: Any = None
        if vk == "scalar":
            sk = c.value.scalar.WhichOneof("kind")
            value = getattr(c.value.scalar, sk) if sk else None
        elif vk == "list":
            value = tuple(getattr(x, x.WhichOneof("kind")) if x.WhichOneof("kind") else None
                          for x in c.value.list.values)
        return Comparison(c.key, _CMP.get(c.type, ""), value)
    return Compound("", ())


def _query_vector(t: tensor_pb2.Tensor) -> np.ndarray:
    if t.dtype not in (tensor_pb2.DATA_TYPE_FP32, tensor_pb2.DATA_TYPE_FP16):
        raise InvalidArgument("query_embedding: dtype must be FP32 or FP16", field="query_embedding",
                              reason="UNSUPPORTED_DTYPE")
    arr, _ = tensors.to_numpy(t, field="query_embedding")
    if arr.ndim not in (1, 2) or (arr.ndim == 2 and arr.shape[0] != 1):
        raise InvalidArgument(f"query_embedding: shape must be (dim) or (1, dim), got {list(arr.shape)}",
                              field="query_embedding", reason="INVALID_SHAPE")
    return np.asarray(arr, dtype=np.float32)


# --- domain -> protobuf -----------------------------------------------------------------------------------------
def _pb_value(v: Any) -> pb.AttributeValue:
    if isinstance(v, bool):
        return pb.AttributeValue(bool_value=v)
    if isinstance(v, int | float):
        return pb.AttributeValue(number_value=float(v))
    return pb.AttributeValue(string_value=str(v))


def _pb_counts(c: FileCounts) -> pb.FileCounts:
    return pb.FileCounts(in_progress=c.in_progress, completed=c.completed, failed=c.failed, cancelled=c.cancelled,
                         total=c.total)


def _pb_file(f: FileObject) -> pb.File:
    return pb.File(id=f.id, size_bytes=f.size_bytes, created_at=f.created_at, filename=f.filename,
                   purpose=f.purpose, media_type=f.media_type)


def _pb_store(s: VectorStore) -> pb.VectorStore:
    out = pb.VectorStore(id=s.id, created_at=s.created_at, name=s.name, usage_bytes=s.usage_bytes,
                         file_counts=_pb_counts(s.file_counts), status=_STORE_STATUS[s.status],
                         last_active_at=s.last_active_at, metadata=s.metadata, embedding_model=s.embedding_model,
                         dimensions=s.dimensions)
    if s.expires_after is not None:
        out.expires_after.CopyFrom(pb.ExpiresAfter(anchor=s.expires_after.anchor, days=s.expires_after.days))
    if s.expires_at is not None:
        out.expires_at = s.expires_at
    return out


def _pb_sf(f: VectorStoreFile) -> pb.VectorStoreFile:
    out = pb.VectorStoreFile(
        id=f.id, created_at=f.created_at, vector_store_id=f.vector_store_id, usage_bytes=f.usage_bytes,
        status=_STATUS_TO_PB[f.status],
        chunking_strategy=pb.StaticChunking(max_chunk_size_tokens=f.chunking.max_chunk_size_tokens,
                                            chunk_overlap_tokens=f.chunking.chunk_overlap_tokens),
        attributes={k: _pb_value(v) for k, v in f.attributes.items()}, chunks_done=f.chunks_done,
        chunks_total=f.chunks_total)
    if f.last_error is not None:
        out.last_error.CopyFrom(pb.FileError(code=f.last_error[0], message=f.last_error[1]))
    return out


def _pb_batch(b: FileBatch) -> pb.VectorStoreFileBatch:
    return pb.VectorStoreFileBatch(id=b.id, created_at=b.created_at, vector_store_id=b.vector_store_id,
                                   status=_STATUS_TO_PB[b.status], file_counts=_pb_counts(b.file_counts))


def _pb_page(p: Page[Any]) -> pb.PageInfo:
    return pb.PageInfo(first_id=p.first_id, last_id=p.last_id, has_more=p.has_more)


class VectorStoreServicer(vectorstore_pb2_grpc.VectorStoreServiceServicer):
    def __init__(self, api: VectorStores, max_file_bytes: int) -> None:
        self.api = api
        self.max_file_bytes = max_file_bytes

    # --- files --------------------------------------------------------------------------------------------------
    async def UploadFile(self, request_iterator: AsyncIterator[pb.UploadFileRequest],  # noqa: N802 - gRPC method name
                         context: grpc.aio.ServicerContext) -> pb.UploadFileResponse:
        header: pb.UploadFileHeader | None = None
        parts: list[bytes] = []
        size = 0
        async for msg in request_iterator:
            if msg.HasField("header"):
                if header is not None:
                    raise InvalidArgument("header: sent twice", field="header", reason="DUPLICATE_HEADER")
                header = msg.header
                continue
            if header is None:
                raise InvalidArgument("header: must come before the chunks", field="header", reason="MISSING_HEADER")
            size += len(msg.chunk)
            if size > self.max_file_bytes:
                raise InvalidArgument(f"file: over the {self.max_file_bytes} byte limit", field="file",
                                      reason="FILE_TOO_LARGE")
            parts.append(msg.chunk)
        if header is None:
            raise InvalidArgument("header: missing", field="header", reason="MISSING_HEADER")
        f = await self.api.upload_file(header.filename, header.purpose, header.content_type, b"".join(parts))
        return pb.UploadFileResponse(file=_pb_file(f))

    async def ListFiles(self, request: pb.ListFilesRequest, context: Any) -> pb.ListFilesResponse:  # noqa: N802
        page = await self.api.list_files(request.purpose, _page(request.page))
        return pb.ListFilesResponse(data=[_pb_file(f) for f in page.data], page=_pb_page(page))

    async def GetFile(self, request: pb.GetFileRequest, context: Any) -> pb.GetFileResponse:  # noqa: N802
        return pb.GetFileResponse(file=_pb_file(await self.api.get_file(request.file_id)))

    async def DeleteFile(self, request: pb.DeleteFileRequest, context: Any) -> pb.DeleteFileResponse:  # noqa: N802
        await self.api.delete_file(request.file_id)
        return pb.DeleteFileResponse(id=request.file_id, deleted=True)

    async def GetFileContent(self, request: pb.GetFileContentRequest,  # noqa: N802
                             context: Any) -> AsyncIterator[pb.GetFileContentResponse]:
        data = await self.api.file_content(request.file_id)
        for i in range(0, max(len(data), 1), _CHUNK):
            yield pb.GetFileContentResponse(chunk=data[i:i + _CHUNK])

    # --- stores -------------------------------------------------------------------------------------------------
    async def CreateVectorStore(self, request: pb.CreateVectorStoreRequest,  # noqa: N802
                                context: Any) -> pb.CreateVectorStoreResponse:
        s = await self.api.create_store(
            request.name, list(request.file_ids), _chunking(request.chunking_strategy),
            _expires(request.expires_after) if request.HasField("expires_after") else None, dict(request.metadata))
        return pb.CreateVectorStoreResponse(vector_store=_pb_store(s))

    async def ListVectorStores(self, request: pb.ListVectorStoresRequest, context: Any) -> pb.ListVectorStoresResponse:  # noqa: N802
        page = await self.api.list_stores(_page(request.page))
        return pb.ListVectorStoresResponse(data=[_pb_store(s) for s in page.data], page=_pb_page(page))

    async def GetVectorStore(self, request: pb.GetVectorStoreRequest, context: Any) -> pb.GetVectorStoreResponse:  # noqa: N802
        return pb.GetVectorStoreResponse(vector_store=_pb_store(await self.api.get_store(request.vector_store_id)))

    async def UpdateVectorStore(self, request: pb.UpdateVectorStoreRequest,  # noqa: N802
                                context: Any) -> pb.UpdateVectorStoreResponse:
        s = await self.api.update_store(
            request.vector_store_id, request.name if request.HasField("name") else None,
            _expires(request.expires_after) if request.HasField("expires_after") else None,
            request.clear_expires_after, dict(request.metadata) if request.update_metadata else None)
        return pb.UpdateVectorStoreResponse(vector_store=_pb_store(s))

    async def DeleteVectorStore(self, request: pb.DeleteVectorStoreRequest,  # noqa: N802
                                context: Any) -> pb.DeleteVectorStoreResponse:
        await self.api.delete_store(request.vector_store_id)
        return pb.DeleteVectorStoreResponse(id=request.vector_store_id, deleted=True)

    # --- files in a store ---------------------------------------------------------------------------------------
    async def CreateVectorStoreFile(self, request: pb.CreateVectorStoreFileRequest,  # noqa: N802
                                    context: Any) -> pb.CreateVectorStoreFileResponse:
        f = await self.api.add_file(request.vector_store_id, request.file_id, _attributes(request.attributes),
                                    _chunking(request.chunking_strategy))
        return pb.CreateVectorStoreFileResponse(file=_pb_sf(f))

    async def ListVectorStoreFiles(self, request: pb.ListVectorStoreFilesRequest,  # noqa: N802
                                   context: Any) -> pb.ListVectorStoreFilesResponse:
        page = await self.api.list_store_files(request.vector_store_id, _status(request.filter), _page(request.page))
        return pb.ListVectorStoreFilesResponse(data=[_pb_sf(f) for f in page.data], page=_pb_page(page))

    async def GetVectorStoreFile(self, request: pb.GetVectorStoreFileRequest,  # noqa: N802
                                 context: Any) -> pb.GetVectorStoreFileResponse:
        return pb.GetVectorStoreFileResponse(
            file=_pb_sf(await self.api.get_store_file(request.vector_store_id, request.file_id)))

    async def UpdateVectorStoreFile(self, request: pb.UpdateVectorStoreFileRequest,  # noqa: N802
                                    context: Any) -> pb.UpdateVectorStoreFileResponse:
        f = await self.api.update_store_file(request.vector_store_id, request.file_id,
                                             _attributes(request.attributes))
        return pb.UpdateVectorStoreFileResponse(file=_pb_sf(f))

    async def DeleteVectorStoreFile(self, request: pb.DeleteVectorStoreFileRequest,  # noqa: N802
                                    context: Any) -> pb.DeleteVectorStoreFileResponse:
        await self.api.delete_store_file(request.vector_store_id, request.file_id)
        return pb.DeleteVectorStoreFileResponse(id=request.file_id, deleted=True)

    # --- batches ------------------------------------------------------------------------------------------------
    async def CreateVectorStoreFileBatch(self, request: pb.CreateVectorStoreFileBatchRequest,  # noqa: N802
                                         context: Any) -> pb.CreateVectorStoreFileBatchResponse:
        shared_attrs = _attributes(request.attributes)
        shared_chunking = _chunking(request.chunking_strategy)
        items = [(fid, dict(shared_attrs), shared_chunking) for fid in request.file_ids]
        for i, f in enumerate(request.files):
            items.append((f.file_id, _attributes(f.attributes, f"files[{i}].attributes"),
                          _chunking(f.chunking_strategy) or shared_chunking))
        b = await self.api.create_batch(request.vector_store_id, items)
        return pb.CreateVectorStoreFileBatchResponse(batch=_pb_batch(b))

    async def GetVectorStoreFileBatch(self, request: pb.GetVectorStoreFileBatchRequest,  # noqa: N802
                                      context: Any) -> pb.GetVectorStoreFileBatchResponse:
        return pb.GetVectorStoreFileBatchResponse(
            batch=_pb_batch(await self.api.get_batch(request.vector_store_id, request.batch_id)))

    async def CancelVectorStoreFileBatch(self, request: pb.CancelVectorStoreFileBatchRequest,  # noqa: N802
                                         context: Any) -> pb.CancelVectorStoreFileBatchResponse:
        return pb.CancelVectorStoreFileBatchResponse(
            batch=_pb_batch(await self.api.cancel_batch(request.vector_store_id, request.batch_id)))

    async def ListVectorStoreFileBatchFiles(self, request: pb.ListVectorStoreFileBatchFilesRequest,  # noqa: N802
                                            context: Any) -> pb.ListVectorStoreFileBatchFilesResponse:
        page = await self.api.list_batch_files(request.vector_store_id, request.batch_id, _status(request.filter),
                                               _page(request.page))
        return pb.ListVectorStoreFileBatchFilesResponse(data=[_pb_sf(f) for f in page.data], page=_pb_page(page))

    # --- search -------------------------------------------------------------------------------------------------
    async def SearchVectorStore(self, request: pb.SearchVectorStoreRequest,  # noqa: N802
                                context: Any) -> pb.SearchVectorStoreResponse:
        ro = request.ranking_options
        searched, hits = await self.api.search(
            request.vector_store_id, list(request.queries),
            _query_vector(request.query_embedding) if request.HasField("query_embedding") else None,
            _filter(request.filters) if request.HasField("filters") else None,
            request.max_num_results if request.HasField("max_num_results") else 10,
            ro.ranker, ro.score_threshold if ro.HasField("score_threshold") else None, request.rewrite_query)
        return pb.SearchVectorStoreResponse(
            search_queries=searched, has_more=False,
            data=[pb.SearchResult(file_id=h.file_id, filename=h.filename, score=h.score,
                                  attributes={k: _pb_value(v) for k, v in h.attributes.items()},
                                  content=[pb.SearchContent(type="text", text=h.text)]) for h in hits])
