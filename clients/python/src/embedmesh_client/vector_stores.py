"""Request builders for ``VectorStoreService`` shared by the sync and async clients (pure functions, no I/O).

Arguments take the shapes of OpenAI's Files / Vector Stores API (filters as ``{"type": "eq", "key": ..., "value":
...}``, chunking as ``{"type": "static", "static": {...}}``, statuses as ``"completed"``); the protobuf messages
themselves are accepted too. Only shapes are checked here (a ``TypeError``/``ValueError`` before any call); every
rule (ranges, limits, unknown ids) is the service's and comes back as an ``EmbedmeshClientError``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from embedmesh_client.requests import CHUNK_BYTES
from embedmesh_client.tensors import to_tensor

__all__ = ["upload_file_messages", "page_request", "file_status", "attribute_value", "attributes", "filter_proto",
           "chunking_strategy", "expires_after", "search_request", "Attribute"]

Attribute = str | int | float | bool

_ORDER = {None: pb.SORT_ORDER_UNSPECIFIED, "asc": pb.SORT_ORDER_ASC, "desc": pb.SORT_ORDER_DESC}
_STATUS = {None: pb.FILE_STATUS_UNSPECIFIED, "in_progress": pb.FILE_STATUS_IN_PROGRESS,
           "completed": pb.FILE_STATUS_COMPLETED, "failed": pb.FILE_STATUS_FAILED,
           "cancelled": pb.FILE_STATUS_CANCELLED}
_COMPARISON = {"eq": pb.COMPARISON_OPERATOR_EQ, "ne": pb.COMPARISON_OPERATOR_NE, "gt": pb.COMPARISON_OPERATOR_GT,
               "gte": pb.COMPARISON_OPERATOR_GTE, "lt": pb.COMPARISON_OPERATOR_LT,
               "lte": pb.COMPARISON_OPERATOR_LTE, "in": pb.COMPARISON_OPERATOR_IN,
               "nin": pb.COMPARISON_OPERATOR_NIN}
_COMPOUND = {"and": pb.COMPOUND_OPERATOR_AND, "or": pb.COMPOUND_OPERATOR_OR}


def upload_file_messages(data: bytes, filename: str, purpose: str = "assistants",
                         content_type: str = "") -> Iterator[pb.UploadFileRequest]:
    """An UploadFile stream: the header, then the bytes in 1 MiB chunks (none for an empty file)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    yield pb.UploadFileRequest(header=pb.UploadFileHeader(filename=filename, purpose=purpose,
                                                          content_type=content_type))
    view = memoryview(data).cast("B")
    for i in range(0, len(view), CHUNK_BYTES):
        yield pb.UploadFileRequest(chunk=bytes(view[i:i + CHUNK_BYTES]))


def page_request(limit: int | None = None, order: str | None = None, after: str | None = None,
                 before: str | None = None) -> pb.PageRequest:
    """Cursor paging: ``limit`` 1-100 (server default 20), ``order`` "asc" or "desc" (default newest first)."""
    if order not in _ORDER:
        raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
    page = pb.PageRequest(order=_ORDER[order], after=after or "", before=before or "")
    if limit is not None:
        page.limit = limit
    return page


def file_status(status: str | None) -> pb.FileStatus.ValueType:
    """``None`` (any), "in_progress", "completed", "failed" or "cancelled"."""
    if status not in _STATUS:
        raise ValueError(f"status must be one of {', '.join(s for s in _STATUS if s)}, got {status!r}")
    return _STATUS[status]


def attribute_value(value: Attribute) -> pb.AttributeValue:
    if isinstance(value, bool):  # before int: bool is an int
        return pb.AttributeValue(bool_value=value)
    if isinstance(value, int | float):
        return pb.AttributeValue(number_value=float(value))
    if isinstance(value, str):
        return pb.AttributeValue(string_value=value)
    raise TypeError(f"an attribute value must be a string, number or boolean, got {type(value).__name__}")


def attributes(values: Mapping[str, Attribute] | None) -> dict[str, pb.AttributeValue]:
    return {str(k): attribute_value(v) for k, v in (values or {}).items()}


def filter_proto(f: Mapping[str, Any] | pb.Filter) -> pb.Filter:
    """An OpenAI filter (comparison ``{"type": "eq"|"ne"|"gt"|"gte"|"lt"|"lte"|"in"|"nin", "key", "value"}`` or
    compound ``{"type": "and"|"or", "filters": [...]}``) as a ``Filter`` message; a ``Filter`` is passed through."""
    if isinstance(f, pb.Filter):
        return f
    if not isinstance(f, Mapping):
        raise TypeError(f"a filter must be a dict or a Filter message, got {type(f).__name__}")
    kind = f.get("type")
    if kind in _COMPOUND:
        subs = f.get("filters")
        if not isinstance(subs, Sequence) or isinstance(subs, str):
            raise TypeError("a compound filter needs a list of filters")
        return pb.Filter(compound=pb.CompoundFilter(type=_COMPOUND[kind], filters=[filter_proto(s) for s in subs]))
    if kind in _COMPARISON:
        key, value = f.get("key"), f.get("value")
        if not isinstance(key, str):
            raise TypeError("a comparison filter needs a string key")
        if value is None:
            raise TypeError("a comparison filter needs a value")
        if isinstance(value, list | tuple):
            fv = pb.FilterValue(list=pb.AttributeValueList(values=[attribute_value(v) for v in value]))
        else:
            fv = pb.FilterValue(scalar=attribute_value(value))
        return pb.Filter(comparison=pb.ComparisonFilter(key=key, type=_COMPARISON[kind], value=fv))
    raise ValueError(f"filter type must be one of {', '.join([*_COMPARISON, *_COMPOUND])}, got {kind!r}")


def chunking_strategy(c: Mapping[str, Any] | pb.ChunkingStrategy | None) -> pb.ChunkingStrategy | None:
    """``{"type": "auto"}`` or ``{"type": "static", "static": {"max_chunk_size_tokens", "chunk_overlap_tokens"}}``."""
    if c is None or isinstance(c, pb.ChunkingStrategy):
        return c
    if c.get("type") == "auto":
        return pb.ChunkingStrategy(auto_chunking=pb.AutoChunking())
    if c.get("type") == "static":
        st = c.get("static") or {}
        return pb.ChunkingStrategy(static_chunking=pb.StaticChunking(
            max_chunk_size_tokens=int(st["max_chunk_size_tokens"]),
            chunk_overlap_tokens=int(st.get("chunk_overlap_tokens", 0))))
    raise ValueError(f"chunking strategy type must be 'auto' or 'static', got {c.get('type')!r}")


def expires_after(e: Mapping[str, Any] | pb.ExpiresAfter) -> pb.ExpiresAfter:
    """``{"anchor": "last_active_at", "days": N}`` (the anchor may be left out)."""
    if isinstance(e, pb.ExpiresAfter):
        return e
    return pb.ExpiresAfter(anchor=e.get("anchor", "last_active_at"), days=int(e["days"]))


def search_request(store_id: str, query: str | Sequence[str] | None = None, *, query_embedding: Any = None,
                   max_num_results: int | None = None, filters: Mapping[str, Any] | pb.Filter | None = None,
                   score_threshold: float | None = None, ranker: str | None = None,
                   rewrite_query: bool = False) -> pb.SearchVectorStoreRequest:
    """One or more query strings, or ``query_embedding`` (an array of the store's dimensions)."""
    req = pb.SearchVectorStoreRequest(vector_store_id=store_id, rewrite_query=rewrite_query)
    if query is not None:
        req.queries.extend([query] if isinstance(query, str) else query)
    if query_embedding is not None:
        req.query_embedding.CopyFrom(to_tensor(query_embedding))
    if max_num_results is not None:
        req.max_num_results = max_num_results
    if filters is not None:
        req.filters.CopyFrom(filter_proto(filters))
    if ranker is not None:
        req.ranking_options.ranker = ranker
    if score_threshold is not None:
        req.ranking_options.score_threshold = score_threshold
    return req
