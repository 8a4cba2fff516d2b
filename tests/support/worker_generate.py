"""One generation on a worker as the tests drive it: ``WorkerService.GenerateMany`` (the worker's one generation RPC)
with a single generation on a stream of its own — its start frame, then optional ``rows`` frames (bytes of the
request's ``data``-less embeds tensors), then the end of the request stream.

``worker_generate(target, request, ...)`` takes a channel or a ``WorkerServiceStub``, sync or ``grpc.aio``, and gives
the generation's ``GenerateResponse`` deltas (an iterator, or an async iterator for ``grpc.aio``). The generation's
error result raises the ``grpc.aio.AioRpcError`` its status makes (``core.errors.rpc_error_from_status``: the same
code, message and details a call would end with, so ``from_rpc_error`` reads field and reason); an error of the call
itself (authentication, unparsable bytes) raises as the call's own ``grpc.RpcError``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import grpc

from embedmesh.core.errors import Unavailable, rpc_error_from_status, to_status_message
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["worker_generate", "frames"]

GID = 1
GENERATE_MANY = "/embedmesh.worker.v1.WorkerService/GenerateMany"


def frames(request: worker_pb2.GenerateRequest | None, rows: Iterable[bytes] = (), gid: int = GID
           ) -> list[worker_pb2.GenerateManyRequest]:
    """The request messages: a start frame of ``request`` (None: none), then one ``rows`` frame per piece."""
    out = [] if request is None else [
        worker_pb2.GenerateManyRequest(frames=[worker_pb2.GenerateFrame(id=gid, generate=request)])]
    out += [worker_pb2.GenerateManyRequest(frames=[worker_pb2.GenerateFrame(id=gid, rows=bytes(r))]) for r in rows]
    return out


def _stub(target: Any) -> Any:
    if isinstance(target, (grpc.Channel, grpc.aio.Channel)):
        return worker_pb2_grpc.WorkerServiceStub(target)
    return target


def _results(result: worker_pb2.GenerateResult, done: list[bool]) -> worker_pb2.GenerateResponse | None:
    kind = result.WhichOneof("result")
    if kind == "error":
        raise rpc_error_from_status(result.error)
    if kind == "end":
        done.append(True)
        return None
    return result.response


_ENDED = Unavailable("the stream ended before the generation did", reason="WORKER_DRAINING")


def worker_generate(target: Any, request: worker_pb2.GenerateRequest | None = None,
                    rows: Iterable[bytes] = (), *,
                    raw: Iterable[bytes] | AsyncIterator[bytes] | None = None,
                    **kw: Any) -> Any:
    """``request``'s generation (see the module docstring), its rows sent as one ``rows`` frame per piece; or, with
    ``raw`` (``target`` a channel), those request message bytes as they are (an async iterator too, for aio).
    ``kw`` (timeout, metadata) go to the call. An iterator of deltas, or an async iterator for ``grpc.aio``."""
    if raw is not None:
        call = target.stream_stream(GENERATE_MANY, request_serializer=None,
                                    response_deserializer=worker_pb2.GenerateManyResponse.FromString)(
            raw if hasattr(raw, "__aiter__") else iter(raw), **kw)
        return _async(call) if isinstance(target, grpc.aio.Channel) else _sync(call)
    stub = _stub(target)
    messages = frames(request, rows)
    if isinstance(stub.GenerateMany, grpc.aio.StreamStreamMultiCallable):
        return _async(stub.GenerateMany(iter(messages), **kw))
    return _sync(stub.GenerateMany(iter(messages), **kw))


def _sync(call: Any) -> Iterator[worker_pb2.GenerateResponse]:
    done: list[bool] = []
    try:
        for message in call:
            for result in message.results:
                if result.id == GID and (response := _results(result, done)) is not None:
                    yield response
            if done:
                return
        raise rpc_error_from_status(to_status_message(_ENDED))
    finally:
        call.cancel()


async def _async(call: Any) -> AsyncIterator[worker_pb2.GenerateResponse]:
    done: list[bool] = []
    try:
        async for message in call:
            for result in message.results:
                if result.id == GID and (response := _results(result, done)) is not None:
                    yield response
            if done:
                return
        raise rpc_error_from_status(to_status_message(_ENDED))
    finally:
        call.cancel()
