"""``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI JSON in, one gRPC call, OpenAI JSON or SSE out.

Non-streamed: ``Complete``/``Chat`` → one ``text_completion``/``chat.completion`` object.
Streamed: ``StreamComplete``/``StreamChat`` → SSE chunks in OpenAI's shape; ``finish_reason`` appears exactly once
per choice; with ``stream_options.include_usage`` every chunk carries ``"usage": null`` and a last chunk with
``"choices": []`` carries the usage; then ``data: [DONE]``. The first gRPC message is awaited before the HTTP
response starts, so a request the preprocessor rejects is a plain OpenAI error with its HTTP status; a failure
after that is an SSE ``{"error": {...}}`` event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.gateway.errors import ApiError, from_grpc
from embedmesh.gateway.metrics import DISCONNECTS
from embedmesh.gateway.sse import DONE, DisconnectWatcher, EventStream, event
from embedmesh.gateway.translate import FINISH, chat_params, completion_params, usage_json
from embedmesh.inference.v1 import inference_pb2

if TYPE_CHECKING:
    from embedmesh.gateway.app import Gateway

__all__ = ["completion_routes"]


def _gone() -> Response:
    """The answer to a client that already left: nobody reads it, the access log and metrics do."""
    return Response(status_code=499)


def _id(rid: str, prefix: str) -> str:
    return rid if rid.startswith(prefix) else prefix + rid


def _whole(resp: Any, created: int, chat: bool) -> dict[str, Any]:
    if chat:
        choices: list[dict[str, Any]] = [
            {"index": c.index, "message": {"role": "assistant", "content": c.text},
             "finish_reason": FINISH[c.finish_reason], "logprobs": None}
            for c in resp.choices
        ]
        return {"id": _id(resp.id, "chatcmpl-"), "object": "chat.completion", "created": created,
                "model": resp.model, "choices": choices, "usage": usage_json(resp.usage)}
    choices = [{"index": c.index, "text": c.text, "finish_reason": FINISH[c.finish_reason], "logprobs": None}
               for c in resp.choices]
    return {"id": _id(resp.id, "cmpl-"), "object": "text_completion", "created": created, "model": resp.model,
            "choices": choices, "usage": usage_json(resp.usage)}


async def _events(call: Any, first: Any, created: int, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    """gRPC deltas → OpenAI chunks. Invariant: ``finished`` holds every choice whose finish_reason was sent."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    rid = _id(first.id, "chatcmpl-" if chat else "cmpl-")
    # OpenAI puts "usage": null on every chunk but the last when usage was asked for, and no key otherwise.
    tail: dict[str, Any] = {"usage": None} if include_usage else {}
    started: set[int] = set()
    finished: set[int] = set()
    ev = first
    try:
        while ev is not grpc.aio.EOF:
            if ev.HasField("usage"):
                if include_usage:
                    yield event({"id": rid, "object": obj, "created": created, "model": ev.model, "choices": [],
                                 "usage": usage_json(ev.usage)})
            else:
                index = ev.index
                finish = FINISH[ev.finish_reason]
                if finish is not None:
                    if index in finished:
                        finish = None
                    else:
                        finished.add(index)
                if chat and index not in started:
                    started.add(index)
                    yield event({"id": rid, "object": obj, "created": created, "model": ev.model,
                                 "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None, "logprobs": None}], **tail})
                if ev.text or finish is not None:
                    if chat:
                        choice = {"index": index, "delta": {"content": ev.text} if ev.text else {},
                                  "finish_reason": finish, "logprobs": None}
                    else:
                        choice = {"index": index, "text": ev.text, "finish_reason": finish, "logprobs": None}
                    yield event({"id": rid, "object": obj, "created": created, "model": ev.model,
                                 "choices": [choice], **tail})
            ev = await call.read()
    except grpc.aio.AioRpcError as e:
        yield event(from_grpc(e).body())
    yield DONE


def completion_routes(gw: Gateway) -> list[Route]:
    """The completion routes, bound to the gateway's channel."""

    async def generate(request: Request, chat: bool) -> Response:
        body = await gw.read_json(request)
        params = chat_params(body) if chat else completion_params(body)
        stub = gw.stub
        timeout = gw.config.request_timeout_seconds
        created = int(time.time())
        if not body.get("stream"):
            if chat:
                unary = stub.Chat(inference_pb2.ChatRequest(params=params), timeout=timeout)
            else:
                unary = stub.Complete(inference_pb2.CompleteRequest(params=params), timeout=timeout)
            # A client that leaves before the whole completion is ready cancels the generation too.
            watcher = DisconnectWatcher(request.receive, unary)
            try:
                resp = await unary
            except grpc.aio.AioRpcError as e:
                raise from_grpc(e) from None
            except asyncio.CancelledError:
                unary.cancel()
                if not watcher.gone:
                    raise
                return _gone()
            finally:
                watcher.stop()
            return Response(orjson.dumps(_whole(resp, created, chat)), media_type="application/json")
        if chat:
            call = stub.StreamChat(inference_pb2.StreamChatRequest(params=params), timeout=timeout)
        else:
            call = stub.StreamComplete(inference_pb2.StreamCompleteRequest(params=params), timeout=timeout)
        # Watch from the start: a client that leaves during a long prefill cancels the call too.
        watcher = DisconnectWatcher(request.receive, call)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            watcher.stop()
            raise from_grpc(e) from None
        except asyncio.CancelledError:
            watcher.stop()
            call.cancel()
            if not watcher.gone:
                raise
            DISCONNECTS.inc()
            return _gone()
        if first is grpc.aio.EOF:
            watcher.stop()
            raise ApiError(502, "the inference service ended the stream without a result", code="empty_stream",
                           type_="server_error")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return EventStream(_events(call, first, created, chat, include_usage), call, watcher)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
