"""``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI JSON in, one gRPC call, OpenAI JSON or SSE out.

Both go through ``pieces_body.generate``: big payloads as an ``InferenceService.Generate`` pieces stream, the rest as
one ``InferenceService.GenerateInline`` message. Non-streamed: its one ``completion``/``chat`` event → one
``text_completion``/``chat.completion`` object. Streamed: its ``completion_chunk``/``chat_chunk`` events → SSE chunks in
OpenAI's shape; ``finish_reason`` appears exactly once per choice; with ``stream_options.include_usage`` every chunk
carries ``"usage": null`` and a last chunk with ``"choices": []`` carries the usage; then ``data: [DONE]``. The first
gRPC message is awaited before the HTTP response starts, so a request the preprocessor rejects is a plain OpenAI error
with its HTTP status; a failure after that is an SSE ``{"error": {...}}`` event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.gateway.context import Gateway
from embedmesh.gateway.embeds_json import chat_slots, completion_slots
from embedmesh.gateway.errors import ApiError, from_grpc
from embedmesh.gateway.metrics import DISCONNECTS
from embedmesh.gateway.pieces_body import generate as generate_call
from embedmesh.gateway.sse import DONE, DisconnectWatcher, EventStream, event
from embedmesh.gateway.translate import FINISH, chat_params, completion_params, usage_json

__all__ = ["routes"]


def _gone() -> Response:
    """The answer to a client that already left: nobody reads it, the access log and metrics do."""
    return Response(status_code=499)


def _id(rid: str, prefix: str) -> str:
    return rid if rid.startswith(prefix) else prefix + rid


class _Shape:
    """What the request asked for that changes the response's shape (log-probabilities, echo)."""

    def __init__(self, body: dict[str, Any], chat: bool) -> None:
        self.chat = chat
        self.echo = body.get("echo") is True
        self.logprobs = body.get("logprobs") is True if chat else body.get("logprobs") is not None
        self.top = int(body.get("top_logprobs") or 0) if chat else int(body.get("logprobs") or 0)
        self.prompt_logprobs = not chat and body.get("prompt_logprobs") is not None
        self.offsets: dict[int, int] = {}
        """Completions' text_offset: characters returned so far per choice (streaming)."""


def _lp_value(lp: Any) -> float | None:
    return lp.logprob if lp.HasField("logprob") else None


def _completion_logprobs(shape: _Shape, index: int, prompt_lps: Any, lps: Any) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object; with echo the prompt's tokens come first (the first one null)."""
    entries = [*prompt_lps, *lps] if shape.echo else list(lps)
    pos = shape.offsets.get(index, 0)
    tokens, values, tops, offsets = [], [], [], []
    for lp in entries:
        tokens.append(lp.token)
        value = _lp_value(lp)
        values.append(value)
        tops.append({t.token: t.logprob for t in lp.top} if value is not None else None)
        offsets.append(pos)
        pos += len(lp.token)
    shape.offsets[index] = pos
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _vllm_prompt_logprobs(prompt_lps: Any) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per position {token id: {logprob, rank, decoded_token}} (null first)."""
    out: list[dict[str, Any] | None] = []
    for lp in prompt_lps:
        if not lp.HasField("logprob"):
            out.append(None)
            continue
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": r + 1, "decoded_token": t.token}
                 for r, t in enumerate(lp.top)}
        entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "rank": None, "decoded_token": lp.token})
        out.append(entry)
    return out


def _chat_logprobs(shape: _Shape, lps: Any) -> dict[str, Any]:
    def one(t: Any) -> dict[str, Any]:
        return {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}

    return {"content": [{**one(lp), "top_logprobs": [one(t) for t in lp.top[: shape.top]]} for lp in lps]}


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def _finish(c: Any) -> str | None:
    finish = FINISH[c.finish_reason]
    return "tool_calls" if finish is not None and len(c.tool_calls) else finish


def _whole(resp: Any, created: int, shape: _Shape) -> dict[str, Any]:
    if shape.chat:
        choices: list[dict[str, Any]] = []
        for c in resp.choices:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if len(c.tool_calls):
                message = {"role": "assistant", "content": c.text or None, "tool_calls": _tool_calls(c.tool_calls)}
            choices.append({"index": c.index, "message": message, "finish_reason": _finish(c),
                            "logprobs": _chat_logprobs(shape, c.logprobs) if shape.logprobs else None})
        return {"id": _id(resp.id, "chatcmpl-"), "object": "chat.completion", "created": created,
                "model": resp.model, "choices": choices, "usage": usage_json(resp.usage)}
    out = []
    for c in resp.choices:
        choice: dict[str, Any] = {
            "index": c.index, "text": c.text, "finish_reason": FINISH[c.finish_reason],
            "logprobs": _completion_logprobs(shape, c.index, c.prompt_logprobs, c.logprobs) if shape.logprobs
            else None}
        if shape.prompt_logprobs:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(c.prompt_logprobs)
        out.append(choice)
    return {"id": _id(resp.id, "cmpl-"), "object": "text_completion", "created": created, "model": resp.model,
            "choices": out, "usage": usage_json(resp.usage)}


async def _events(call: Any, first: Any, created: int, shape: _Shape, include_usage: bool) -> AsyncIterator[bytes]:
    """gRPC deltas → OpenAI chunks. Invariant: ``finished`` holds every choice whose finish_reason was sent."""
    chat = shape.chat
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
                finish = _finish(ev)
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
                has_lps = shape.logprobs and (len(ev.logprobs) or (shape.echo and len(ev.prompt_logprobs)))
                if ev.text or finish is not None or has_lps or len(ev.tool_calls):
                    yield event({"id": rid, "object": obj, "created": created, "model": ev.model,
                                 "choices": [_chunk_choice(ev, finish, shape, bool(has_lps))], **tail})
            ev = await call.read()
    except grpc.aio.AioRpcError as e:
        yield event(from_grpc(e).body())
    yield DONE


def _chunk_choice(ev: Any, finish: str | None, shape: _Shape, has_lps: bool) -> dict[str, Any]:
    """One delta's choice in a chunk: a chat ``delta`` (content, tool calls) or a completion's ``text``."""
    if shape.chat:
        delta: dict[str, Any] = {"content": ev.text} if ev.text else {}
        if len(ev.tool_calls):
            delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(_tool_calls(ev.tool_calls))]
        return {"index": ev.index, "delta": delta, "finish_reason": finish,
                "logprobs": _chat_logprobs(shape, ev.logprobs) if has_lps else None}
    choice = {"index": ev.index, "text": ev.text, "finish_reason": finish,
              "logprobs": _completion_logprobs(shape, ev.index, ev.prompt_logprobs, ev.logprobs) if has_lps else None}
    if shape.prompt_logprobs and len(ev.prompt_logprobs):
        choice["prompt_logprobs"] = _vllm_prompt_logprobs(ev.prompt_logprobs)
    return choice


def routes(gw: Gateway) -> list[Route]:
    """The completion routes, bound to the gateway's channel."""

    async def generate(request: Request, chat: bool) -> Response:
        body = await gw.read_json(request, chat_slots if chat else completion_slots,
                                  gw.bounds.chat if chat else gw.bounds.completion)
        blobs: list[bytes] = []
        params = chat_params(body, blobs) if chat else completion_params(body, blobs)
        stream = bool(body.get("stream"))
        call = generate_call(gw.channel, params, blobs, chat=chat, stream=stream,
                             timeout=gw.config.request_timeout_seconds, min_bytes=gw.config.pieces_min_bytes)
        del blobs
        created = int(time.time())
        if not stream:
            # A client that leaves before the whole completion is ready cancels the generation too.
            watcher = DisconnectWatcher(request.receive, call)
            try:
                resp = await call
            except grpc.aio.AioRpcError as e:
                raise from_grpc(e) from None
            except asyncio.CancelledError:
                call.cancel()
                if not watcher.gone:
                    raise
                return _gone()
            finally:
                watcher.stop()
            return Response(orjson.dumps(_whole(resp, created, _Shape(body, chat))), media_type="application/json")
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
        return EventStream(_events(call, first, created, _Shape(body, chat), include_usage), call, watcher)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
