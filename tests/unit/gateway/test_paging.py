"""OpenAI list paging: the query as a PageRequest (limit and order refused by name), a page as the list object."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.paging import list_json, page_request
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb


def _request(query: str) -> Request:
    return Request({"type": "http", "method": "GET", "path": "/", "query_string": query.encode(), "headers": []})


def test_the_query_becomes_a_page_request() -> None:
    page = page_request(_request("after=a&before=b&limit=5&order=asc"))
    assert (page.after, page.before, page.limit, page.order) == ("a", "b", 5, pb.SORT_ORDER_ASC)
    assert page_request(_request("before=b"), before=False).before == ""
    assert page_request(_request("")).order == pb.SORT_ORDER_DESC


@pytest.mark.parametrize(("query", "param", "code"), [("limit=x", "limit", "invalid_type"),
                                                      ("limit=-1", "limit", "invalid_value"),
                                                      ("order=up", "order", "invalid_value")])
def test_a_bad_query_is_refused_by_name(query: str, param: str, code: str) -> None:
    with pytest.raises(ApiError) as e:
        page_request(_request(query))
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)


def test_a_page_as_openais_list() -> None:
    assert list_json([{"id": "a"}], pb.PageInfo(first_id="a", has_more=True)) == {
        "object": "list", "data": [{"id": "a"}], "first_id": "a", "last_id": None, "has_more": True}
