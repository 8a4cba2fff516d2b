"""One routing question as the tests ask it: ``RouterService.RouteMany`` with a single question on a stream of its
own. Returns the ``RouteResponse``; an error answer raises the ``grpc.aio.AioRpcError`` its status makes
(``core.errors.rpc_error_from_status``: code, message and details, so ``from_rpc_error`` reads field and reason). A
sync stub gets a plain value back (``route``), an aio stub an awaitable (``route_async``)."""

from __future__ import annotations

from typing import Any

from embedmesh.core.errors import rpc_error_from_status
from embedmesh.router.v1 import router_pb2

__all__ = ["route", "route_async"]


def _message(request: router_pb2.RouteRequest) -> router_pb2.RouteManyRequest:
    return router_pb2.RouteManyRequest(questions=[router_pb2.RouteQuestion(id=1, request=request)])


def _result(answers: list[router_pb2.RouteAnswer]) -> router_pb2.RouteResponse:
    assert len(answers) == 1 and answers[0].id == 1, answers
    if answers[0].WhichOneof("result") == "error":
        raise rpc_error_from_status(answers[0].error)
    return answers[0].response


def route(stub: Any, request: router_pb2.RouteRequest, **kw: Any) -> router_pb2.RouteResponse:
    """``request`` asked on a sync ``RouterServiceStub``."""
    call = stub.RouteMany(iter([_message(request)]), **kw)
    try:
        return _result([a for m in call for a in m.answers])
    finally:
        call.cancel()


async def route_async(stub: Any, request: router_pb2.RouteRequest, **kw: Any) -> router_pb2.RouteResponse:
    """``request`` asked on a ``grpc.aio`` ``RouterServiceStub``."""
    call = stub.RouteMany(iter([_message(request)]), **kw)
    try:
        return _result([a async for m in call for a in m.answers])
    finally:
        call.cancel()
