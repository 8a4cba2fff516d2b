"""``/v1/vector_stores…`` (OpenAI Vector Stores) translated 1:1 to ``embedmesh.vectorstore.v1.VectorStoreService``.

Only translation lives here: JSON shapes are checked as they are turned into protobuf (a wrong shape is a 400 naming
the field, e.g. ``filters.filters[1].value``); every rule (ranges, filter semantics, unknown ids) is the service's,
and its errors come back as OpenAI error JSON through ``errors.from_grpc``. Register with
``create_app(config, extra_routes=[*files.routes(gw), *vector_stores.routes(gw)])`` — see ``routes``.

Responses are OpenAI's objects; a vector store file also carries ``progress: {chunks_done, chunks_total}`` and a
vector store ``embedding_model`` and ``dimensions`` (extra fields the SDK keeps).
"""

from __future__ import annotations

from typing import Any

import grpc
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.core.errors import InvalidArgument
from embedmesh.gateway.auth import forwarding_channel
from embedmesh.gateway.context import Gateway
from embedmesh.gateway.errors import ApiError, bad_request, from_grpc
from embedmesh.services.vector_store.filters import check_json_limits
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from embedmesh.vectorstore.v1 import vectorstore_pb2_grpc

__all__ = ["routes", "VectorStoreClient", "page_request", "list_json", "json_response"]

_STATUS = {pb.FILE_STATUS_IN_PROGRESS: "in_progress", pb.FILE_STATUS_COMPLETED: "completed",
           pb.FILE_STATUS_FAILED: "failed", pb.FILE_STATUS_CANCELLED: "cancelled"}
_STATUS_IN = {v: k for k, v in _STATUS.items()}
_STORE_STATUS = {pb.VECTOR_STORE_STATUS_IN_PROGRESS: "in_progress", pb.VECTOR_STORE_STATUS_COMPLETED: "completed",
                 pb.VECTOR_STORE_STATUS_EXPIRED: "expired"}
_CMP = {"eq": pb.COMPARISON_OPERATOR_EQ, "ne": pb.COMPARISON_OPERATOR_NE, "gt": pb.COMPARISON_OPERATOR_GT,
        "gte": pb.COMPARISON_OPERATOR_GTE, "lt": pb.COMPARISON_OPERATOR_LT, "lte": pb.COMPARISON_OPERATOR_LTE,
        "in": pb.COMPARISON_OPERATOR_IN, "nin": pb.COMPARISON_OPERATOR_NIN}
_COMPOUND = {"and": pb.COMPOUND_OPERATOR_AND, "or": pb.COMPOUND_OPERATOR_OR}


class VectorStoreClient:
    """The gateway's channel to the vector store (opened on first use, from ``config.vector_store``)."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway
        self._stub: vectorstore_pb2_grpc.VectorStoreServiceStub | None = None

    @property
    def timeout(self) -> float:
        return float(self.gateway.config.request_timeout_seconds)

    def stub(self) -> vectorstore_pb2_grpc.VectorStoreServiceStub:
        if self._stub is None:
            address = getattr(self.gateway.config, "vector_store", "")
            if not address:
                raise ApiError(501, "the vector store is not configured on this gateway (--vector-store)",
                               code="not_implemented", type_="not_implemented_error")
            self._stub = vectorstore_pb2_grpc.VectorStoreServiceStub(forwarding_channel(address))
        return self._stub

    async def call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self.stub(), method)(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None


# --- JSON -> protobuf ---------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _object(v: Any, field: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise bad_request(field, "must be an object", "invalid_type")
    return v


def _uint(v: Any, field: str) -> int:
    if not _is_int(v) or v < 0 or v >= 2**32:
        raise bad_request(field, f"must be a non-negative integer, got {v!r}", "invalid_type")
    return int(v)


def _scalar(v: Any, field: str) -> pb.AttributeValue:
    if isinstance(v, bool):
        return pb.AttributeValue(bool_value=v)
    if _is_number(v):
        return pb.AttributeValue(number_value=float(v))
    if isinstance(v, str):
        return pb.AttributeValue(string_value=v)
    raise bad_request(field, f"must be a string, number or boolean, got {type(v).__name__}", "invalid_type")


def attributes(v: Any, field: str = "attributes") -> dict[str, pb.AttributeValue]:
    if v is None:
        return {}
    return {str(k): _scalar(x, f"{field}.{k}") for k, x in _object(v, field).items()}


def chunking(v: Any, field: str = "chunking_strategy") -> pb.ChunkingStrategy | None:
    if v is None:
        return None
    obj = _object(v, field)
    kind = obj.get("type")
    if kind == "auto":
        return pb.ChunkingStrategy(auto_chunking=pb.AutoChunking())
    if kind == "static":
        st = _object(obj.get("static"), f"{field}.static")
        return pb.ChunkingStrategy(static_chunking=pb.StaticChunking(
            max_chunk_size_tokens=_uint(st.get("max_chunk_size_tokens"), f"{field}.static.max_chunk_size_tokens"),
            chunk_overlap_tokens=_uint(st.get("chunk_overlap_tokens", 0), f"{field}.static.chunk_overlap_tokens")))
    raise bad_request(f"{field}.type", f"must be 'auto' or 'static', got {kind!r}", "invalid_value")


def _expires(v: Any) -> pb.ExpiresAfter:
    obj = _object(v, "expires_after")
    anchor = obj.get("anchor", "last_active_at")
    if not isinstance(anchor, str):
        raise bad_request("expires_after.anchor", "must be a string", "invalid_type")
    return pb.ExpiresAfter(anchor=anchor, days=_uint(obj.get("days"), "expires_after.days"))


def _metadata(v: Any) -> dict[str, str]:
    obj = _object(v, "metadata")
    for k, x in obj.items():
        if not isinstance(x, str):
            raise bad_request(f"metadata.{k}", "values must be strings", "invalid_type")
    return {str(k): x for k, x in obj.items()}


def _file_ids(v: Any, field: str = "file_ids") -> list[str]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise bad_request(field, "must be a list of file ids", "invalid_type")
    return v


def filter_proto(v: Any, field: str = "filters") -> pb.Filter:
    obj = _object(v, field)
    kind = obj.get("type")
    if not isinstance(kind, str):  # an unhashable type (a list) would make the lookups below raise TypeError
        raise bad_request(f"{field}.type", f"must be one of {', '.join([*_CMP, *_COMPOUND])}", "invalid_type")
    if kind in _COMPOUND:
        subs = obj.get("filters")
        if not isinstance(subs, list):
            raise bad_request(f"{field}.filters", "must be a list of filters", "invalid_type")
        return pb.Filter(compound=pb.CompoundFilter(
            type=_COMPOUND[kind], filters=[filter_proto(s, f"{field}.filters[{i}]") for i, s in enumerate(subs)]))
    if kind in _CMP:
        key = obj.get("key")
        if not isinstance(key, str):
            raise bad_request(f"{field}.key", "must be a string", "invalid_type")
        raw = obj.get("value")
        if isinstance(raw, list):
            value = pb.FilterValue(list=pb.AttributeValueList(
                values=[_scalar(x, f"{field}.value[{i}]") for i, x in enumerate(raw)]))
        elif raw is None:
            raise bad_request(f"{field}.value", "is required", "missing")
        else:
            value = pb.FilterValue(scalar=_scalar(raw, f"{field}.value"))
        return pb.Filter(comparison=pb.ComparisonFilter(key=key, type=_CMP[kind], value=value))
    raise bad_request(f"{field}.type", f"must be one of {', '.join([*_CMP, *_COMPOUND])}, got {kind!r}",
                      "invalid_value")


def page_request(request: Request, *, before: bool = True) -> pb.PageRequest:
    q = request.query_params
    page = pb.PageRequest(after=q.get("after", ""), before=q.get("before", "") if before else "")
    if "limit" in q:
        try:
            page.limit = int(q["limit"])
        except ValueError:
            raise bad_request("limit", f"must be an integer, got {q['limit']!r}", "invalid_type") from None
        if page.limit < 0:
            raise bad_request("limit", "must be in [1, 100]", "invalid_value")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order", f"must be 'asc' or 'desc', got {order!r}", "invalid_value")
    page.order = pb.SORT_ORDER_ASC if order == "asc" else pb.SORT_ORDER_DESC
    return page


def _status_filter(request: Request) -> int:
    f = request.query_params.get("filter")
    if f is None:
        return pb.FILE_STATUS_UNSPECIFIED
    if f not in _STATUS_IN:
        raise bad_request("filter", f"must be one of {', '.join(_STATUS_IN)}, got {f!r}", "invalid_value")
    return _STATUS_IN[f]


# --- protobuf -> JSON ---------------------------------------------------------------------------------------------
def _value(v: pb.AttributeValue) -> Any:
    kind = v.WhichOneof("kind")
    x = getattr(v, kind) if kind else None
    if kind == "number_value" and float(x).is_integer() and abs(x) < 2**53:
        return int(x)
    return x


def _counts(c: pb.FileCounts) -> dict[str, int]:
    return {"in_progress": c.in_progress, "completed": c.completed, "failed": c.failed, "cancelled": c.cancelled,
            "total": c.total}


def store_json(s: pb.VectorStore) -> dict[str, Any]:
    return {"id": s.id, "object": "vector_store", "created_at": s.created_at, "name": s.name,
            "usage_bytes": s.usage_bytes, "file_counts": _counts(s.file_counts), "status": _STORE_STATUS[s.status],
            "expires_after": ({"anchor": s.expires_after.anchor, "days": s.expires_after.days}
                              if s.HasField("expires_after") else None),
            "expires_at": s.expires_at if s.HasField("expires_at") else None, "last_active_at": s.last_active_at,
            "metadata": dict(s.metadata), "embedding_model": s.embedding_model, "dimensions": s.dimensions}


def store_file_json(f: pb.VectorStoreFile) -> dict[str, Any]:
    return {"id": f.id, "object": "vector_store.file", "created_at": f.created_at,
            "vector_store_id": f.vector_store_id, "usage_bytes": f.usage_bytes, "status": _STATUS[f.status],
            "last_error": ({"code": f.last_error.code, "message": f.last_error.message}
                           if f.HasField("last_error") else None),
            "chunking_strategy": {"type": "static", "static": {
                "max_chunk_size_tokens": f.chunking_strategy.max_chunk_size_tokens,
                "chunk_overlap_tokens": f.chunking_strategy.chunk_overlap_tokens}},
            "attributes": {k: _value(v) for k, v in f.attributes.items()},
            "progress": {"chunks_done": f.chunks_done, "chunks_total": f.chunks_total}}


def batch_json(b: pb.VectorStoreFileBatch) -> dict[str, Any]:
    return {"id": b.id, "object": "vector_store.files_batch", "created_at": b.created_at,
            "vector_store_id": b.vector_store_id, "status": _STATUS[b.status], "file_counts": _counts(b.file_counts)}


def list_json(data: list[dict[str, Any]], page: pb.PageInfo) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": page.first_id or None, "last_id": page.last_id or None,
            "has_more": page.has_more}


def json_response(obj: Any) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


# --- routes -------------------------------------------------------------------------------------------------------
def routes(gateway: Gateway, client: VectorStoreClient | None = None) -> list[Route]:
    """The ``/v1/vector_stores…`` routes. ``gateway`` is app.py's ``Gateway`` (its ``config.vector_store`` address
    and ``read_json``)."""
    vs = client or VectorStoreClient(gateway)

    async def create(request: Request) -> Response:
        body = await gateway.read_json(request)
        req = pb.CreateVectorStoreRequest(file_ids=_file_ids(body.get("file_ids")))
        if body.get("name") is not None:
            if not isinstance(body["name"], str):
                raise bad_request("name", "must be a string", "invalid_type")
            req.name = body["name"]
        if (c := chunking(body.get("chunking_strategy"))) is not None:
            req.chunking_strategy.CopyFrom(c)
        if body.get("expires_after") is not None:
            req.expires_after.CopyFrom(_expires(body["expires_after"]))
        if body.get("metadata") is not None:
            req.metadata.update(_metadata(body["metadata"]))
        return json_response(store_json((await vs.call("CreateVectorStore", req)).vector_store))

    async def list_stores(request: Request) -> Response:
        r = await vs.call("ListVectorStores", pb.ListVectorStoresRequest(page=page_request(request)))
        return json_response(list_json([store_json(s) for s in r.data], r.page))

    async def retrieve(request: Request) -> Response:
        r = await vs.call("GetVectorStore", pb.GetVectorStoreRequest(vector_store_id=request.path_params["id"]))
        return json_response(store_json(r.vector_store))

    async def modify(request: Request) -> Response:
        body = await gateway.read_json(request)
        req = pb.UpdateVectorStoreRequest(vector_store_id=request.path_params["id"])
        if body.get("name") is not None:
            if not isinstance(body["name"], str):
                raise bad_request("name", "must be a string", "invalid_type")
            req.name = body["name"]
        if "expires_after" in body:
            if body["expires_after"] is None:
                req.clear_expires_after = True
            else:
                req.expires_after.CopyFrom(_expires(body["expires_after"]))
        if "metadata" in body:
            req.update_metadata = True
            req.metadata.update(_metadata(body["metadata"] or {}))
        return json_response(store_json((await vs.call("UpdateVectorStore", req)).vector_store))

    async def delete(request: Request) -> Response:
        r = await vs.call("DeleteVectorStore", pb.DeleteVectorStoreRequest(vector_store_id=request.path_params["id"]))
        return json_response({"id": r.id, "object": "vector_store.deleted", "deleted": r.deleted})

    async def add_file(request: Request) -> Response:
        body = await gateway.read_json(request)
        fid = body.get("file_id")
        if not isinstance(fid, str) or not fid:
            raise bad_request("file_id", "is required", "missing")
        req = pb.CreateVectorStoreFileRequest(vector_store_id=request.path_params["id"], file_id=fid,
                                              attributes=attributes(body.get("attributes")))
        if (c := chunking(body.get("chunking_strategy"))) is not None:
            req.chunking_strategy.CopyFrom(c)
        return json_response(store_file_json((await vs.call("CreateVectorStoreFile", req)).file))

    async def list_files(request: Request) -> Response:
        r = await vs.call("ListVectorStoreFiles", pb.ListVectorStoreFilesRequest(
            vector_store_id=request.path_params["id"], filter=_status_filter(request), page=page_request(request)))
        return json_response(list_json([store_file_json(f) for f in r.data], r.page))

    async def get_file(request: Request) -> Response:
        r = await vs.call("GetVectorStoreFile", pb.GetVectorStoreFileRequest(
            vector_store_id=request.path_params["id"], file_id=request.path_params["file_id"]))
        return json_response(store_file_json(r.file))

    async def update_file(request: Request) -> Response:
        body = await gateway.read_json(request)
        if "attributes" not in body:
            raise bad_request("attributes", "is required", "missing")
        r = await vs.call("UpdateVectorStoreFile", pb.UpdateVectorStoreFileRequest(
            vector_store_id=request.path_params["id"], file_id=request.path_params["file_id"],
            attributes=attributes(body.get("attributes"))))
        return json_response(store_file_json(r.file))

    async def delete_file(request: Request) -> Response:
        r = await vs.call("DeleteVectorStoreFile", pb.DeleteVectorStoreFileRequest(
            vector_store_id=request.path_params["id"], file_id=request.path_params["file_id"]))
        return json_response({"id": r.id, "object": "vector_store.file.deleted", "deleted": r.deleted})

    async def create_batch(request: Request) -> Response:
        body = await gateway.read_json(request)
        req = pb.CreateVectorStoreFileBatchRequest(vector_store_id=request.path_params["id"],
                                                   file_ids=_file_ids(body.get("file_ids")),
                                                   attributes=attributes(body.get("attributes")))
        if (c := chunking(body.get("chunking_strategy"))) is not None:
            req.chunking_strategy.CopyFrom(c)
        files = body.get("files") or []
        if not isinstance(files, list):
            raise bad_request("files", "must be a list", "invalid_type")
        for i, f in enumerate(files):
            obj = _object(f, f"files[{i}]")
            if not isinstance(obj.get("file_id"), str):
                raise bad_request(f"files[{i}].file_id", "is required", "missing")
            item = pb.BatchFile(file_id=obj["file_id"], attributes=attributes(obj.get("attributes"),
                                                                              f"files[{i}].attributes"))
            if (c := chunking(obj.get("chunking_strategy"), f"files[{i}].chunking_strategy")) is not None:
                item.chunking_strategy.CopyFrom(c)
            req.files.append(item)
        return json_response(batch_json((await vs.call("CreateVectorStoreFileBatch", req)).batch))

    async def get_batch(request: Request) -> Response:
        r = await vs.call("GetVectorStoreFileBatch", pb.GetVectorStoreFileBatchRequest(
            vector_store_id=request.path_params["id"], batch_id=request.path_params["batch_id"]))
        return json_response(batch_json(r.batch))

    async def cancel_batch(request: Request) -> Response:
        r = await vs.call("CancelVectorStoreFileBatch", pb.CancelVectorStoreFileBatchRequest(
            vector_store_id=request.path_params["id"], batch_id=request.path_params["batch_id"]))
        return json_response(batch_json(r.batch))

    async def batch_files(request: Request) -> Response:
        r = await vs.call("ListVectorStoreFileBatchFiles", pb.ListVectorStoreFileBatchFilesRequest(
            vector_store_id=request.path_params["id"], batch_id=request.path_params["batch_id"],
            filter=_status_filter(request), page=page_request(request)))
        return json_response(list_json([store_file_json(f) for f in r.data], r.page))

    async def search(request: Request) -> Response:
        body = await gateway.read_json(request)
        query = body.get("query")
        if isinstance(query, str):
            queries = [query]
        elif isinstance(query, list) and all(isinstance(q, str) for q in query):
            queries = query
        else:
            raise bad_request("query", "must be a string or a list of strings", "invalid_type")
        req = pb.SearchVectorStoreRequest(vector_store_id=request.path_params["id"], queries=queries)
        if body.get("filters") is not None:
            try:  # depth and size first: filter_proto recurses, and protobuf refuses nesting past 100 levels
                check_json_limits(body["filters"])
            except InvalidArgument as e:
                raise bad_request(e.field or "filters", e.message, e.reason.lower()) from None
            req.filters.CopyFrom(filter_proto(body["filters"]))
        if body.get("max_num_results") is not None:
            n = body["max_num_results"]
            if not _is_int(n) or not 0 <= n < 2**32:
                raise bad_request("max_num_results", f"must be an integer in [1, 50], got {n!r}", "invalid_value")
            req.max_num_results = n
        if body.get("ranking_options") is not None:
            ro = _object(body["ranking_options"], "ranking_options")
            ranker = ro.get("ranker", "auto")
            if not isinstance(ranker, str):
                raise bad_request("ranking_options.ranker", "must be a string", "invalid_type")
            req.ranking_options.ranker = ranker
            if ro.get("score_threshold") is not None:
                if not _is_number(ro["score_threshold"]):
                    raise bad_request("ranking_options.score_threshold", "must be a number", "invalid_type")
                req.ranking_options.score_threshold = float(ro["score_threshold"])
        rq = body.get("rewrite_query", False)
        if not isinstance(rq, bool):
            raise bad_request("rewrite_query", "must be a boolean", "invalid_type")
        req.rewrite_query = rq
        r = await vs.call("SearchVectorStore", req)
        searched: Any = r.search_queries[0] if isinstance(query, str) else list(r.search_queries)
        return json_response({
            "object": "vector_store.search_results.page", "search_query": searched,
            "data": [{"file_id": d.file_id, "filename": d.filename, "score": d.score,
                      "attributes": {k: _value(v) for k, v in d.attributes.items()},
                      "content": [{"type": c.type, "text": c.text} for c in d.content]} for d in r.data],
            "has_more": r.has_more, "next_page": None})

    base = "/v1/vector_stores"
    return [
        Route(base, create, methods=["POST"]),
        Route(base, list_stores, methods=["GET"]),
        Route(base + "/{id}", retrieve, methods=["GET"]),
        Route(base + "/{id}", modify, methods=["POST"]),
        Route(base + "/{id}", delete, methods=["DELETE"]),
        Route(base + "/{id}/files", add_file, methods=["POST"]),
        Route(base + "/{id}/files", list_files, methods=["GET"]),
        Route(base + "/{id}/files/{file_id}", get_file, methods=["GET"]),
        Route(base + "/{id}/files/{file_id}", update_file, methods=["POST"]),
        Route(base + "/{id}/files/{file_id}", delete_file, methods=["DELETE"]),
        Route(base + "/{id}/file_batches", create_batch, methods=["POST"]),
        Route(base + "/{id}/file_batches/{batch_id}", get_batch, methods=["GET"]),
        Route(base + "/{id}/file_batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
        Route(base + "/{id}/file_batches/{batch_id}/files", batch_files, methods=["GET"]),
        Route(base + "/{id}/search", search, methods=["POST"]),
    ]

