"""OpenAI's list paging for the vector store's routes (``/v1/files``, ``/v1/vector_stores…``): the query's
``after``, ``before``, ``limit`` and ``order`` as a ``PageRequest`` (a bad one is a 400 naming it), and a page of
results as OpenAI's list object."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from embedmesh.gateway.errors import bad_request
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb

__all__ = ["page_request", "list_json"]


def page_request(request: Request, *, before: bool = True) -> pb.PageRequest:
    """The page a list route asks for (``before``: whether the route takes a ``before`` cursor)."""
    q = request.query_params
    page = pb.PageRequest(after=q.get("after", ""), before=q.get("before", "") if before else "")
    if "limit" in q:
        try:
            limit = int(q["limit"])
        except ValueError:
            raise bad_request("limit", f"must be an integer, got {q['limit']!r}", "invalid_type") from None
        if not 0 <= limit < 2**32:  # 0 = the service's default; above 100 the service refuses it by name
            raise bad_request("limit", "must be in [1, 100]", "invalid_value")
        page.limit = limit
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order", f"must be 'asc' or 'desc', got {order!r}", "invalid_value")
    page.order = pb.SORT_ORDER_ASC if order == "asc" else pb.SORT_ORDER_DESC
    return page


def list_json(data: list[dict[str, Any]], page: pb.PageInfo) -> dict[str, Any]:
    """OpenAI's list object for one page of data."""
    return {"object": "list", "data": data, "first_id": page.first_id or None, "last_id": page.last_id or None,
            "has_more": page.has_more}
