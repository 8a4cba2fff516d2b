"""The Responses API's JSON, from a chat completion: the request as chat messages (``to_chat``), the chat path's
refusals named in the Responses body's words (``renamed``), the ``response`` object and its output items
(``Turn``), and the streamed events (``stream_events``), in the order OpenAI documents them::

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added, response.output_text.delta ...,
    response.output_text.done, response.content_part.done, response.output_item.done,
    per function call: response.output_item.added, response.function_call_arguments.delta / .done,
                       response.output_item.done,
    response.completed (or response.incomplete when max_output_tokens ended it)

A failure after the first event is an ``error`` event followed by ``response.failed``.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import orjson

from embedmesh.gateway.errors import ApiError, from_grpc
from embedmesh.gateway.requests.responses import PASSTHROUGH, ResponsesRequest
from embedmesh.gateway.translate import FINISH

__all__ = ["to_chat", "renamed", "Turn", "stream_events", "new_id", "item_ids"]

Origin = tuple[str, Any]
"""Where a chat message came from: ("instructions", None), ("history", None), ("input", "input") for a string
input, ("message", "input[k]"), ("output", "input[k]") or ("call", ["input[k]", ...]) (one per tool call)."""


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(24)


def _chat_part(part: dict[str, Any]) -> dict[str, Any]:
    if part["type"] == "input_prompt_embeds":
        return {"type": "prompt_embeds", **{k: v for k, v in part.items() if k in ("id", "data")}}
    if part["type"] == "input_image":
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    return {"type": "text", "text": part["text"]}


def _messages(items: list[dict[str, Any]], string_input: bool) -> tuple[list[dict[str, Any]], list[Origin]]:
    """Normalized input items -> chat messages (consecutive function calls: one assistant message)."""
    messages: list[dict[str, Any]] = []
    origins: list[Origin] = []
    for k, item in enumerate(items):
        where = f"input[{k}]"
        kind = item["type"]
        if kind == "message":
            content = item["content"]
            if not isinstance(content, str):
                content = [_chat_part(p) for p in content]
            messages.append({"role": item["role"], "content": content})
            origins.append(("input", "input") if string_input else ("message", where))
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if origins and origins[-1][0] == "call":
                messages[-1]["tool_calls"].append(call)
                origins[-1][1].append(where)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(("call", [where]))
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            origins.append(("output", where))
    return messages, origins


def to_chat(r: ResponsesRequest, raw_input: Any, history: list[dict[str, Any]]) -> tuple[dict[str, Any],
                                                                                         list[dict[str, Any]],
                                                                                         list[Origin]]:
    """The chat body carrying the request (``history``: the stored conversation it continues), this turn's own
    chat messages (stored for the next turn) and each message's origin."""
    new, new_origins = _messages(r.input, isinstance(raw_input, str))
    messages: list[dict[str, Any]] = []
    origins: list[Origin] = []
    if r.instructions is not None:
        messages.append({"role": "system", "content": r.instructions})
        origins.append(("instructions", None))
    messages += history
    origins += [("history", None)] * len(history)
    messages += new
    origins += new_origins
    body: dict[str, Any] = {"model": r.model, "messages": messages}
    for name in PASSTHROUGH:
        value = getattr(r, name)
        if value is not None:
            body[name] = value
    if r.max_output_tokens is not None:
        body["max_completion_tokens"] = r.max_output_tokens
    if r.text is not None:
        body["response_format"] = r.text
    if r.tools is not None:
        body["tools"] = r.tools
    if r.tool_choice is not None:
        body["tool_choice"] = r.tool_choice
    return body, new, origins


_MESSAGE = re.compile(r"^messages\[(\d+)\](.*)$")
_CALL = re.compile(r"^\.tool_calls\[(\d+)\](?:\.function)?(.*)$")
_TOOL = re.compile(r"^tools\[(\d+)\]\.function(.*)$")
_FIELDS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}


def _message_param(rest: str, origin: Origin) -> str:
    kind, where = origin
    if kind in ("instructions", "history", "input"):
        return {"instructions": "instructions", "history": "previous_response_id", "input": "input"}[kind]
    if kind == "message":
        return where + rest
    if kind == "output":
        rest = rest.replace(".content", ".output", 1).replace(".tool_call_id", ".call_id", 1)
        return where + rest
    m = _CALL.match(rest)
    if m is None or int(m.group(1)) >= len(where):
        return where[0]
    sub = m.group(2)
    return where[int(m.group(1))] + (".call_id" if sub == ".id" else sub)


def _param(param: str, origins: list[Origin]) -> str:
    m = _MESSAGE.match(param)
    if m is not None and int(m.group(1)) < len(origins):
        return _message_param(m.group(2), origins[int(m.group(1))])
    if param.startswith("response_format"):
        return "text.format" + param[len("response_format"):].replace(".json_schema", "", 1)
    m = _TOOL.match(param)
    if m is not None:
        return f"tools[{m.group(1)}]" + m.group(2)
    return _FIELDS.get(param, param)


def renamed(err: ApiError, origins: list[Origin]) -> ApiError:
    """A refusal of the chat path (or the preprocessor) naming the Responses body's field instead of the chat's."""
    if not err.param:
        return err
    param = _param(err.param, origins)
    if param == err.param:
        return err
    message = err.message
    if message.startswith(err.param):
        message = param + message[len(err.param):]
    return ApiError(err.status, message, param=param, code=err.code, type_=err.type, retry_after=err.retry_after)


def item_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as ``input_items`` lists them: each with an id and a status."""
    out = []
    for item in items:
        prefix = {"message": "msg_", "function_call": "fc_"}.get(item["type"], "fco_")
        entry = {"id": new_id(prefix), **item}
        if item["type"] == "message" and isinstance(item["content"], str):
            entry["content"] = [{"type": "input_text" if item["role"] != "assistant" else "output_text",
                                 "text": item["content"]}]
        entry["status"] = "completed"
        out.append(entry)
    return out


def _usage(u: Any) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def _text_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
        else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call: Any, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status != "in_progress" else "", "status": status}


class Turn:
    """One response being made: its id, what it echoes from the request, and what it says once done."""

    def __init__(self, r: ResponsesRequest, body: dict[str, Any], rid: str, created: int, store: bool) -> None:
        self.id = rid
        self.created = created
        self.fields = {
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": r.model,
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": r.previous_response_id,
            "store": store, "background": bool(r.background), "temperature": r.temperature, "top_p": r.top_p,
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "truncation": r.truncation or "disabled",
            "metadata": r.metadata or {}, "user": r.user}
        self.text = ""
        self.calls: list[Any] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.model = r.model
        self.message_id = new_id("msg_")

    def json(self, status: str, output: list[dict[str, Any]] | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
                "incomplete_details": incomplete, **self.fields, "model": self.model, "output": output or [],
                "usage": self.usage}

    def take(self, choice: Any, usage: Any, model: str) -> None:
        """A whole chat completion's first choice."""
        self.text = choice.text
        self.calls = list(choice.tool_calls)
        self.finish = FINISH[choice.finish_reason]
        self.usage = _usage(usage)
        self.model = model or self.model

    def output(self) -> list[dict[str, Any]]:
        out = []
        if self.text or not self.calls:
            out.append(_text_item(self.message_id, self.text, "completed"))
        out += [_call_item("fc_" + c.id.removeprefix("call_"), c, "completed") for c in self.calls]
        return out

    def status(self) -> str:
        return "incomplete" if self.finish == "length" and not self.calls else "completed"

    def done(self) -> dict[str, Any]:
        return self.json(self.status(), self.output())

    def assistant_message(self) -> dict[str, Any]:
        """The output as the chat message a later turn's history carries."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                 "arguments": c.arguments}}
                                 for c in self.calls]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg


class Events:
    """The Responses stream's events, numbered by ``sequence_number`` in the order they are written."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def cut_events(turn: Turn, ev: Events) -> Callable[[ApiError], bytes]:
    """The last events of a stream the gateway's shutdown cuts (``sse.EventStream``'s ``cut``): an ``error`` event
    and ``response.failed`` with what was generated so far, numbered after the events already written."""

    def cut(err: ApiError) -> bytes:
        failure = {"code": err.code or "server_error", "message": err.message}
        response = turn.json("failed", turn.output() if turn.text else [], failure)
        return (ev("error", code=err.code, message=err.message, param=err.param)
                + ev("response.failed", response=response))

    return cut


async def stream_events(turn: Turn, call: Any, first: Any, origins: list[Origin],
                        finished: Callable[[str, dict[str, Any]], Awaitable[None]],
                        ev: Events | None = None) -> AsyncIterator[bytes]:
    """gRPC chat deltas -> the Responses stream; ``finished(status, response)`` runs before the last event (the
    route stores the response there). ``ev`` numbers the events (pass the one ``cut_events`` numbers with)."""
    ev = ev or Events()
    yield ev("response.created", response=turn.json("in_progress"))
    yield ev("response.in_progress", response=turn.json("in_progress"))
    mid = turn.message_id
    started = False
    delta = first
    try:
        while delta is not grpc.aio.EOF:
            if delta.HasField("usage"):
                turn.usage = _usage(delta.usage)
            else:
                turn.model = delta.model or turn.model
                if delta.text:
                    if not started:
                        started = True
                        yield ev("response.output_item.added", output_index=0, item=_text_item(mid, "", "in_progress"))
                        yield ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                                 part={"type": "output_text", "text": "", "annotations": []})
                    turn.text += delta.text
                    yield ev("response.output_text.delta", item_id=mid, output_index=0, content_index=0,
                             delta=delta.text, logprobs=[])
                turn.calls.extend(delta.tool_calls)
                turn.finish = FINISH[delta.finish_reason] or turn.finish
            delta = await call.read()
    except grpc.aio.AioRpcError as e:
        err = renamed(from_grpc(e), origins)
        failure = {"code": err.code or "server_error", "message": err.message}
        response = turn.json("failed", turn.output() if turn.text else [], failure)
        await finished("failed", response)
        yield ev("error", code=err.code, message=err.message, param=err.param)
        yield ev("response.failed", response=response)
        return
    async for chunk in _close_items(ev, turn, started):
        yield chunk
    response = turn.done()
    await finished(response["status"], response)
    yield ev("response.completed" if response["status"] == "completed" else "response.incomplete", response=response)


async def _close_items(ev: Events, turn: Turn, started: bool) -> AsyncIterator[bytes]:
    """The ``.done`` events of the message, and each function call's events (calls arrive whole)."""
    mid = turn.message_id
    index = 0
    if started or not turn.calls:
        if not started:
            yield ev("response.output_item.added", output_index=0, item=_text_item(mid, "", "in_progress"))
            yield ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                     part={"type": "output_text", "text": "", "annotations": []})
        part = {"type": "output_text", "text": turn.text, "annotations": [], "logprobs": []}
        yield ev("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=turn.text,
                 logprobs=[])
        yield ev("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part)
        yield ev("response.output_item.done", output_index=0, item=_text_item(mid, turn.text, "completed"))
        index = 1
    for c in turn.calls:
        fid = "fc_" + c.id.removeprefix("call_")
        yield ev("response.output_item.added", output_index=index, item=_call_item(fid, c, "in_progress"))
        yield ev("response.function_call_arguments.delta", item_id=fid, output_index=index, delta=c.arguments)
        yield ev("response.function_call_arguments.done", item_id=fid, output_index=index, name=c.name,
                 arguments=c.arguments)
        yield ev("response.output_item.done", output_index=index, item=_call_item(fid, c, "completed"))
        index += 1
