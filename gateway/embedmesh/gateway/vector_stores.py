"""``/v1/vector_stores…`` (OpenAI Vector Stores) translated 1:1 to ``embedmesh.vectorstore.v1.VectorStoreService``.

Only translation lives here: JSON shapes are checked by the request models below (``requests.parse``; a wrong
shape is a 400 naming the field, e.g. ``filters.filters[1].value``); every rule (ranges, filter semantics, unknown
ids) is the service's, and its errors come back as OpenAI error JSON through ``errors.from_grpc``. Register with
``create_app(config, extra_routes=[*files.routes(gw), *vector_stores.routes(gw)])`` — see ``routes``.

Responses are OpenAI's objects; a vector store file also carries ``progress: {chunks_done, chunks_total}`` and a
vector store ``embedding_model`` and ``dimensions`` (extra fields the SDK keeps).
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import UNSET, Meta, UnsetType
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.core.errors import InvalidArgument
from embedmesh.gateway.context import Gateway
from embedmesh.gateway.errors import bad_request
from embedmesh.gateway.paging import list_json, page_request
from embedmesh.gateway.requests import Model, Refusal, Say, parse, parse_item
from embedmesh.gateway.vector_store_client import VectorStoreClient, json_response
from embedmesh.services.vector_store.filters import MAX_ATTRIBUTES, check_json_limits
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb

__all__ = ["routes", "VectorStoreClient", "page_request", "list_json", "json_response"]
"""``VectorStoreClient`` and ``json_response`` are ``vector_store_client.py``'s, ``page_request`` and ``list_json``
``paging.py``'s: imported here for the routes below and for app.py."""

_STATUS = {pb.FILE_STATUS_IN_PROGRESS: "in_progress", pb.FILE_STATUS_COMPLETED: "completed",
           pb.FILE_STATUS_FAILED: "failed", pb.FILE_STATUS_CANCELLED: "cancelled"}
_STATUS_IN = {v: k for k, v in _STATUS.items()}
_STORE_STATUS = {pb.VECTOR_STORE_STATUS_IN_PROGRESS: "in_progress", pb.VECTOR_STORE_STATUS_COMPLETED: "completed",
                 pb.VECTOR_STORE_STATUS_EXPIRED: "expired"}
_CMP = {"eq": pb.COMPARISON_OPERATOR_EQ, "ne": pb.COMPARISON_OPERATOR_NE, "gt": pb.COMPARISON_OPERATOR_GT,
        "gte": pb.COMPARISON_OPERATOR_GTE, "lt": pb.COMPARISON_OPERATOR_LT, "lte": pb.COMPARISON_OPERATOR_LTE,
        "in": pb.COMPARISON_OPERATOR_IN, "nin": pb.COMPARISON_OPERATOR_NIN}
_COMPOUND = {"and": pb.COMPOUND_OPERATOR_AND, "or": pb.COMPOUND_OPERATOR_OR}


# --- JSON -> protobuf: the bodies as request models (requests/) -------------------------------------------------------
# Every body here ignores fields it does not know (as it always has). Checks leave protobuf messages in their fields.
def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _object(v: Any, field: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise Refusal(field, "must be an object", "invalid_type")
    return v


def _got(v: Any, obj: Any) -> str:
    return f"must be a non-negative integer, got {v!r}"


_Uint = Annotated[int, Meta(ge=0, le=2**32 - 1), Say(_got, "invalid_type")]
_String = Annotated[str, Say("must be a string", "invalid_type")]


def _scalar(v: Any, field: str) -> pb.AttributeValue:
    if isinstance(v, bool):
        return pb.AttributeValue(bool_value=v)
    if _is_number(v):
        return pb.AttributeValue(number_value=float(v))
    if isinstance(v, str):
        return pb.AttributeValue(string_value=v)
    raise Refusal(field, f"must be a string, number or boolean, got {type(v).__name__}", "invalid_type")


def _attributes(v: Any, field: str = "attributes") -> dict[str, pb.AttributeValue]:
    if v is None:
        return {}
    values = _object(v, field)
    if len(values) > MAX_ATTRIBUTES:  # counted before any is converted
        raise Refusal(field, f"may hold at most {MAX_ATTRIBUTES} keys (got {len(values)})", "too_many")
    return {str(k): _scalar(x, f"{field}.{k}") for k, x in values.items()}


def _check_attributes(obj: Any) -> None:
    """-> {key: AttributeValue}."""
    obj.attributes = _attributes(obj.attributes)


class _Static(Model, kw_only=True):
    max_chunk_size_tokens: _Uint
    chunk_overlap_tokens: _Uint = 0


class AutoChunking(Model, kw_only=True, tag_field="type", tag="auto"):
    def proto(self) -> pb.ChunkingStrategy:
        return pb.ChunkingStrategy(auto_chunking=pb.AutoChunking())


class StaticChunking(Model, kw_only=True, tag_field="type", tag="static"):
    static: Annotated[_Static, Say("must be an object", "invalid_type")]

    def proto(self) -> pb.ChunkingStrategy:
        return pb.ChunkingStrategy(static_chunking=pb.StaticChunking(
            max_chunk_size_tokens=self.static.max_chunk_size_tokens,
            chunk_overlap_tokens=self.static.chunk_overlap_tokens))


def _chunking_message(v: Any, obj: Any) -> str:
    return f"must be 'auto' or 'static', got {v.get('type')!r}" if isinstance(v, dict) else "must be an object"


Chunking = Annotated[AutoChunking | StaticChunking, Say(
    _chunking_message, lambda v, o: "invalid_value" if isinstance(v, dict) else "invalid_type",
    lambda v: ".type" if isinstance(v, dict) else "")]


class ExpiresAfter(Model, kw_only=True):
    anchor: _String = "last_active_at"
    days: _Uint

    def proto(self) -> pb.ExpiresAfter:
        return pb.ExpiresAfter(anchor=self.anchor, days=self.days)


Expires = Annotated[ExpiresAfter, Say("must be an object", "invalid_type")]


def _metadata(v: Any) -> dict[str, str]:
    values = _object(v, "metadata")
    if len(values) > MAX_ATTRIBUTES:  # the same bound as the vector store's, counted before any is read
        raise Refusal("metadata", f"may hold at most {MAX_ATTRIBUTES} keys (got {len(values)})", "too_many")
    for k, x in values.items():
        if not isinstance(x, str):
            raise Refusal(f"metadata.{k}", "values must be strings", "invalid_type")
    return {str(k): x for k, x in values.items()}


def _check_metadata(obj: Any) -> None:
    """-> {key: value}."""
    obj.metadata = _metadata(obj.metadata)


def _check_new_metadata(obj: Any) -> None:
    """``modify``: absent stays UNSET (kept as it is), any falsy value is {} (cleared)."""
    if obj.metadata is not UNSET:
        obj.metadata = _metadata(obj.metadata or {})


_FileIds = Annotated[list[str], Say("must be a list of file ids", "invalid_type")]


class CreateStore(Model, kw_only=True):
    """``POST /v1/vector_stores``."""

    file_ids: _FileIds | None = None
    name: _String | None = None
    chunking_strategy: Chunking | None = None
    expires_after: Expires | None = None
    metadata: Any = None

    checks = {"metadata": _check_metadata}


class ModifyStore(Model, kw_only=True):
    """``POST /v1/vector_stores/{id}``: ``expires_after`` null clears it, ``metadata`` replaces it (null: {})."""

    name: _String | None = None
    expires_after: Expires | None | UnsetType = UNSET
    metadata: Any = UNSET

    checks = {"metadata": _check_new_metadata}
    always = frozenset({"metadata"})


class AddFile(Model, kw_only=True):
    """``POST /v1/vector_stores/{id}/files``."""

    file_id: Annotated[str, Meta(min_length=1), Say("is required", "missing")]
    attributes: Any = None
    chunking_strategy: Chunking | None = None

    checks = {"attributes": _check_attributes}
    always = frozenset({"attributes"})


def _check_required_attributes(obj: Any) -> None:
    if obj.attributes is UNSET:
        raise Refusal("attributes", "is required", "missing")
    obj.attributes = _attributes(obj.attributes)


class UpdateFile(Model, kw_only=True):
    """``POST /v1/vector_stores/{id}/files/{file_id}``: ``attributes`` required (null: none)."""

    attributes: Any = UNSET

    checks = {"attributes": _check_required_attributes}
    always = frozenset({"attributes"})


class BatchFile(Model, kw_only=True):
    file_id: Annotated[str, Say("is required", "missing")]
    attributes: Any = None
    chunking_strategy: Chunking | None = None

    checks = {"attributes": _check_attributes}
    always = frozenset({"attributes"})


def _check_files(obj: Any) -> None:
    """-> a list of BatchFile (any falsy value is none)."""
    files = obj.files or []
    if not isinstance(files, list):
        raise Refusal("files", "must be a list", "invalid_type")
    obj.files = [parse_item(BatchFile, f, f"files[{i}]", Say("must be an object", "invalid_type"))
                 for i, f in enumerate(files)]


class CreateBatch(Model, kw_only=True):
    """``POST /v1/vector_stores/{id}/file_batches``."""

    file_ids: _FileIds | None = None
    attributes: Any = None
    chunking_strategy: Chunking | None = None
    files: Any = None

    checks = {"attributes": _check_attributes, "files": _check_files}
    always = frozenset({"attributes", "files"})


def filter_proto(v: Any, field: str = "filters") -> pb.Filter:
    obj = _object(v, field)
    kind = obj.get("type")
    if not isinstance(kind, str):  # an unhashable type (a list) would make the lookups below raise TypeError
        raise Refusal(f"{field}.type", f"must be one of {', '.join([*_CMP, *_COMPOUND])}", "invalid_type")
    if kind in _COMPOUND:
        subs = obj.get("filters")
        if not isinstance(subs, list):
            raise Refusal(f"{field}.filters", "must be a list of filters", "invalid_type")
        return pb.Filter(compound=pb.CompoundFilter(
            type=_COMPOUND[kind], filters=[filter_proto(s, f"{field}.filters[{i}]") for i, s in enumerate(subs)]))
    if kind in _CMP:
        key = obj.get("key")
        if not isinstance(key, str):
            raise Refusal(f"{field}.key", "must be a string", "invalid_type")
        raw = obj.get("value")
        if isinstance(raw, list):
            value = pb.FilterValue(list=pb.AttributeValueList(
                values=[_scalar(x, f"{field}.value[{i}]") for i, x in enumerate(raw)]))
        elif raw is None:
            raise Refusal(f"{field}.value", "is required", "missing")
        else:
            value = pb.FilterValue(scalar=_scalar(raw, f"{field}.value"))
        return pb.Filter(comparison=pb.ComparisonFilter(key=key, type=_CMP[kind], value=value))
    raise Refusal(f"{field}.type", f"must be one of {', '.join([*_CMP, *_COMPOUND])}, got {kind!r}", "invalid_value")


def _check_filters(obj: Any) -> None:
    """-> a Filter message. Depth and size first: filter_proto recurses, and protobuf refuses nesting past 100."""
    try:
        check_json_limits(obj.filters)
    except InvalidArgument as e:
        raise Refusal(e.field or "filters", e.message, e.reason.lower()) from None
    obj.filters = filter_proto(obj.filters)


class RankingOptions(Model, kw_only=True):
    ranker: _String = "auto"
    score_threshold: Annotated[float, Say("must be a number", "invalid_type")] | None = None


class Search(Model, kw_only=True):
    """``POST /v1/vector_stores/{id}/search``."""

    query: Annotated[str | list[str], Say("must be a string or a list of strings", "invalid_type")]
    filters: Any = None
    max_num_results: Annotated[int, Meta(ge=0, le=2**32 - 1),
                               Say(lambda v, o: f"must be an integer in [1, 50], got {v!r}")] | None = None
    ranking_options: Annotated[RankingOptions, Say("must be an object", "invalid_type")] | None = None
    rewrite_query: Annotated[bool, Say("must be a boolean", "invalid_type")] = False

    checks = {"filters": _check_filters}


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


# --- routes -------------------------------------------------------------------------------------------------------
def routes(gateway: Gateway, client: VectorStoreClient | None = None) -> list[Route]:
    """The ``/v1/vector_stores…`` routes. ``gateway`` is app.py's ``Gateway`` (its ``config.vector_store`` address
    and ``read_json``)."""
    vs = client or VectorStoreClient(gateway)

    async def create(request: Request) -> Response:
        b = parse(CreateStore, await gateway.read_json(request, bounded=gateway.bounds.vector_store))
        req = pb.CreateVectorStoreRequest(file_ids=b.file_ids or [], metadata=b.metadata or {})
        if b.name is not None:
            req.name = b.name
        if b.chunking_strategy is not None:
            req.chunking_strategy.CopyFrom(b.chunking_strategy.proto())
        if b.expires_after is not None:
            req.expires_after.CopyFrom(b.expires_after.proto())
        return json_response(store_json((await vs.call("CreateVectorStore", req)).vector_store))

    async def list_stores(request: Request) -> Response:
        r = await vs.call("ListVectorStores", pb.ListVectorStoresRequest(page=page_request(request)))
        return json_response(list_json([store_json(s) for s in r.data], r.page))

    async def retrieve(request: Request) -> Response:
        r = await vs.call("GetVectorStore", pb.GetVectorStoreRequest(vector_store_id=request.path_params["id"]))
        return json_response(store_json(r.vector_store))

    async def modify(request: Request) -> Response:
        b = parse(ModifyStore, await gateway.read_json(request, bounded=gateway.bounds.vector_store))
        req = pb.UpdateVectorStoreRequest(vector_store_id=request.path_params["id"])
        if b.name is not None:
            req.name = b.name
        if b.expires_after is None:
            req.clear_expires_after = True
        elif b.expires_after is not UNSET:
            req.expires_after.CopyFrom(b.expires_after.proto())
        if b.metadata is not UNSET:
            req.update_metadata = True
            req.metadata.update(b.metadata)
        return json_response(store_json((await vs.call("UpdateVectorStore", req)).vector_store))

    async def delete(request: Request) -> Response:
        r = await vs.call("DeleteVectorStore", pb.DeleteVectorStoreRequest(vector_store_id=request.path_params["id"]))
        return json_response({"id": r.id, "object": "vector_store.deleted", "deleted": r.deleted})

    async def add_file(request: Request) -> Response:
        b = parse(AddFile, await gateway.read_json(request, bounded=gateway.bounds.vector_store))
        req = pb.CreateVectorStoreFileRequest(vector_store_id=request.path_params["id"], file_id=b.file_id,
                                              attributes=b.attributes)
        if b.chunking_strategy is not None:
            req.chunking_strategy.CopyFrom(b.chunking_strategy.proto())
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
        b = parse(UpdateFile, await gateway.read_json(request, bounded=gateway.bounds.vector_store))
        r = await vs.call("UpdateVectorStoreFile", pb.UpdateVectorStoreFileRequest(
            vector_store_id=request.path_params["id"], file_id=request.path_params["file_id"],
            attributes=b.attributes))
        return json_response(store_file_json(r.file))

    async def delete_file(request: Request) -> Response:
        r = await vs.call("DeleteVectorStoreFile", pb.DeleteVectorStoreFileRequest(
            vector_store_id=request.path_params["id"], file_id=request.path_params["file_id"]))
        return json_response({"id": r.id, "object": "vector_store.file.deleted", "deleted": r.deleted})

    async def create_batch(request: Request) -> Response:
        b = parse(CreateBatch, await gateway.read_json(request, bounded=gateway.bounds.vector_store))
        req = pb.CreateVectorStoreFileBatchRequest(vector_store_id=request.path_params["id"],
                                                   file_ids=b.file_ids or [], attributes=b.attributes)
        if b.chunking_strategy is not None:
            req.chunking_strategy.CopyFrom(b.chunking_strategy.proto())
        for f in b.files:
            item = pb.BatchFile(file_id=f.file_id, attributes=f.attributes)
            if f.chunking_strategy is not None:
                item.chunking_strategy.CopyFrom(f.chunking_strategy.proto())
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
        b = parse(Search, await gateway.read_json(request, bounded=gateway.bounds.vector_store))
        query = b.query
        req = pb.SearchVectorStoreRequest(vector_store_id=request.path_params["id"],
                                          queries=[query] if isinstance(query, str) else query,
                                          rewrite_query=b.rewrite_query)
        if b.filters is not None:
            req.filters.CopyFrom(b.filters)
        if b.max_num_results is not None:
            req.max_num_results = b.max_num_results
        if b.ranking_options is not None:
            req.ranking_options.ranker = b.ranking_options.ranker
            if b.ranking_options.score_threshold is not None:
                req.ranking_options.score_threshold = b.ranking_options.score_threshold
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

