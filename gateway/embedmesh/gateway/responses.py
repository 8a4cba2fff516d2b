"""``/v1/responses``: OpenAI's Responses API, carried out as a chat completion.

    POST   /v1/responses                     create (JSON, SSE with ``stream``, or ``background``)
    GET    /v1/responses/{id}                retrieve a stored response
    DELETE /v1/responses/{id}                delete it
    GET    /v1/responses/{id}/input_items    its input items, paged like the other list routes
    POST   /v1/responses/{id}/cancel         cancel a background response

A create is rewritten as the chat body it means (``responses_shape.to_chat``: instructions as a system message, the
stored conversation of ``previous_response_id``, the new input items as messages, ``text.format`` as
``response_format``, function tools as chat tools) and goes through the chat path's own checks
(``translate.chat_params``) and gRPC call (``GenerateInline``, or ``Generate`` for big payloads); a refusal names the
Responses field. With ``store`` (the default) the response, the conversation up to its output and its input items go to
the response store (``response_store.py``) under the caller's tenant: another tenant's id is the same 404 as an unknown
one. A follow-up turn sends only its new input; the gateway puts the stored conversation before it.

A ``background`` response runs on a task of this gateway and is read back by its id; ``cancel`` marks it cancelled
in the store (so a run finishing meanwhile, here or on another replica, does not overwrite it) and cancels the
task when it runs here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import grpc
import orjson
import pybase64
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.core import auth
from embedmesh.gateway.auth import authenticate_request
from embedmesh.gateway.context import Gateway
from embedmesh.gateway.embeds_json import Base64Text
from embedmesh.gateway.errors import ApiError, bad_request, from_grpc
from embedmesh.gateway.paging import list_json, page_request
from embedmesh.gateway.pieces_body import generate
from embedmesh.gateway.requests import parse
from embedmesh.gateway.requests.responses import ResponsesRequest
from embedmesh.gateway.response_store import ResponseStore, Stored
from embedmesh.gateway.responses_shape import (
    Events,
    Turn,
    cut_events,
    item_ids,
    new_id,
    renamed,
    stream_events,
    to_chat,
)
from embedmesh.gateway.sse import DisconnectWatcher, EventStream
from embedmesh.gateway.translate import chat_params
from embedmesh.inference.v1 import inference_pb2
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb

__all__ = ["routes"]

_RUNNING = ("queued", "in_progress")
_CONTINUABLE = ("completed", "incomplete")
_MARGIN_S = 30.0


def _json(obj: Any) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


def _tenant(request: Request) -> str:
    principal = authenticate_request(request)  # checked already by the app's wrapper: this only reads the tenant
    return principal.tenant if principal is not None else auth.DEFAULT_TENANT


def _not_found(rid: str, param: str | None = None) -> ApiError:
    where = f"{param}: " if param else ""
    return ApiError(404, f"{where}no response with id {rid!r} (unknown, expired, deleted or not stored)",
                    param=param, code="response_not_found", type_="not_found_error")


def _call(gw: Gateway, params: inference_pb2.ChatParams, blobs: list[bytes], stream: bool) -> Any:
    """The chat call, as the chat route makes it (``pieces_body.generate``)."""
    return generate(gw.channel, params, blobs, chat=True, stream=stream, timeout=gw.config.request_timeout_seconds,
                    min_bytes=gw.config.pieces_min_bytes)


def _plain(value: Any) -> Any:
    """``value`` with each base64 string read already decoded (``embeds_json.Base64Text``) as base64 text again,
    for the store."""
    if type(value) is Base64Text:
        return pybase64.b64encode(value.decoded).decode()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def responses_slots(body: Any) -> Iterator[tuple[Any, Any]]:
    """Where /v1/responses reads base64 (``embeds_json``): ``input[k].content[j].data``."""
    items = body.get("input") if isinstance(body, dict) else None
    if not isinstance(items, list):
        return
    for item in items:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("data"), str):
                    yield part, "data"


def _page(request: Request, items: list[dict[str, Any]]) -> dict[str, Any]:
    """One page of ``items`` (in input order) as the query asks: ``after``, ``before``, ``limit`` (1-100, default
    20), ``order`` (default desc)."""
    page = page_request(request)
    if page.limit > 100:
        raise bad_request("limit", "must be in [1, 100]", "invalid_value")
    limit = page.limit or 20
    ordered = items if page.order == pb.SORT_ORDER_ASC else items[::-1]
    ids = [x["id"] for x in ordered]
    start, end = 0, len(ordered)
    if page.after:
        if page.after not in ids:
            raise bad_request("after", f"{page.after!r} is not an item of this response", "invalid_value")
        start = ids.index(page.after) + 1
    if page.before:
        if page.before not in ids:
            raise bad_request("before", f"{page.before!r} is not an item of this response", "invalid_value")
        end = ids.index(page.before)
        start = max(start, end - limit) if not page.after else start
    data = ordered[start:min(end, start + limit)]
    info = pb.PageInfo(first_id=data[0]["id"] if data else "", last_id=data[-1]["id"] if data else "",
                       has_more=start + len(data) < end)
    return list_json(data, info)


class _Responses:
    """The routes' state: the store (opened on first use) and the background runs of this gateway."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.store = ResponseStore(gw.config.responses_db, gw.config.responses_ttl_seconds)
        self._opened = False
        self._lock = asyncio.Lock()
        self.tasks: dict[tuple[str, str], asyncio.Task[None]] = {}

    async def db(self) -> ResponseStore:
        if not self._opened:
            async with self._lock:
                if not self._opened:
                    await self.store.open()
                    self._opened = True
        return self.store

    async def stored(self, tenant: str, rid: str, param: str | None = None) -> Stored:
        found = await (await self.db()).get(tenant, rid)
        if found is None:
            raise _not_found(rid, param)
        if found.status in _RUNNING and self._abandoned(found):
            failed = {**found.body, "status": "failed", "error": {
                "code": "gateway_stopped", "message": "the gateway running this background response stopped "
                                                      "before it finished; create it again"}}
            await (await self.db()).set_if(tenant, rid, _RUNNING, Stored(rid, "failed", failed, [], []))
            return await self.stored(tenant, rid, param)
        return found

    def _abandoned(self, found: Stored) -> bool:
        """A background run past its deadline (``request_timeout_seconds``, with a margin) that no gateway will
        finish: the one running it stopped (every gateway's calls end by that deadline)."""
        deadline = int(found.body.get("created_at") or 0) + self.gw.config.request_timeout_seconds + _MARGIN_S
        return time.time() > deadline

    # --- create --------------------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        tenant = _tenant(request)
        body = await self.gw.read_json(request, responses_slots, self.gw.bounds.responses)
        r = parse(ResponsesRequest, body)
        history: list[dict[str, Any]] = []
        if r.previous_response_id is not None:
            prev = await self.stored(tenant, r.previous_response_id, "previous_response_id")
            if prev.status not in _CONTINUABLE:
                raise bad_request("previous_response_id", f"response {prev.id!r} is {prev.status}: only a "
                                                          "completed or incomplete response can be continued")
            history = prev.history
        chat, new_messages, origins = to_chat(r, body["input"], history)
        self.gw.bounds.conversation(len(chat["messages"]), len(new_messages))
        blobs: list[bytes] = []
        try:
            params = chat_params(chat, blobs)
        except ApiError as e:
            raise renamed(e, origins) from None
        store = r.store is not False
        turn = Turn(r, body, new_id("resp_"), int(time.time()), store)
        items = item_ids(_plain(r.input)) if store else []
        conversation = history + _plain(new_messages) if store else []

        async def finished(status: str, response: dict[str, Any]) -> None:
            if store:
                await (await self.db()).put(tenant, Stored(turn.id, status, response,
                                                           conversation + [turn.assistant_message()], items))

        if r.background:
            queued = turn.json("queued")
            await (await self.db()).put(tenant, Stored(turn.id, "queued", queued, [], items))
            key = (tenant, turn.id)
            self.tasks[key] = asyncio.get_running_loop().create_task(
                self._background(tenant, turn, params, blobs, origins, conversation))
            self.tasks[key].add_done_callback(lambda _: self.tasks.pop(key, None))
            return _json(queued)
        if r.stream:
            return await self._stream(request, turn, params, blobs, origins, finished)
        unary = _call(self.gw, params, blobs, False)
        del blobs
        watcher = DisconnectWatcher(request.receive, unary)
        try:
            resp = await unary
        except grpc.aio.AioRpcError as e:
            raise renamed(from_grpc(e), origins) from None
        except asyncio.CancelledError:
            unary.cancel()
            if not watcher.gone:
                raise
            return Response(status_code=499)
        finally:
            watcher.stop()
        turn.take(resp.choices[0], resp.usage, resp.model)
        out = turn.done()
        await finished(out["status"], out)
        return _json(out)

    async def _stream(self, request: Request, turn: Turn, params: Any, blobs: list[bytes], origins: list[Any],
                      finished: Any) -> Response:
        call = _call(self.gw, params, blobs, True)
        del blobs
        watcher = DisconnectWatcher(request.receive, call)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            watcher.stop()
            raise renamed(from_grpc(e), origins) from None
        except asyncio.CancelledError:
            watcher.stop()
            call.cancel()
            if not watcher.gone:
                raise
            return Response(status_code=499)
        if first is grpc.aio.EOF:
            watcher.stop()
            raise ApiError(502, "the inference service ended the stream without a result", code="empty_stream",
                           type_="server_error")
        ev = Events()
        return EventStream(stream_events(turn, call, first, origins, finished, ev), call, watcher,
                           cut=cut_events(turn, ev))

    async def _background(self, tenant: str, turn: Turn, params: Any, blobs: list[bytes], origins: list[Any],
                          conversation: list[dict[str, Any]]) -> None:
        db = await self.db()
        running = Stored(turn.id, "in_progress", turn.json("in_progress"), [], [])
        if not await db.set_if(tenant, turn.id, ("queued",), running):
            return  # cancelled before it started
        try:
            resp = await _call(self.gw, params, blobs, False)
        except grpc.aio.AioRpcError as e:
            err = renamed(from_grpc(e), origins)
            failed = turn.json("failed", error={"code": err.code or "server_error", "message": err.message})
            await db.set_if(tenant, turn.id, _RUNNING, Stored(turn.id, "failed", failed, [], []))
            return
        turn.take(resp.choices[0], resp.usage, resp.model)
        out = turn.done()
        await db.set_if(tenant, turn.id, _RUNNING,
                        Stored(turn.id, out["status"], out, conversation + [turn.assistant_message()], []))

    # --- the stored ones -----------------------------------------------------------------------------------------
    async def retrieve(self, request: Request) -> Response:
        return _json((await self.stored(_tenant(request), request.path_params["id"])).body)

    async def delete(self, request: Request) -> Response:
        rid = request.path_params["id"]
        tenant = _tenant(request)
        self._cancel_task(tenant, rid)
        if not await (await self.db()).delete(tenant, rid):
            raise _not_found(rid)
        return _json({"id": rid, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        found = await self.stored(_tenant(request), request.path_params["id"])
        return _json(_page(request, found.items))

    async def cancel(self, request: Request) -> Response:
        tenant = _tenant(request)
        rid = request.path_params["id"]
        found = await self.stored(tenant, rid)
        if not found.body.get("background"):
            raise ApiError(400, f"response {rid!r} was not created with background: true; only a background "
                                "response can be cancelled", code="not_background")
        if found.status in _RUNNING:
            body = {**found.body, "status": "cancelled"}
            if await (await self.db()).set_if(tenant, rid, _RUNNING, Stored(rid, "cancelled", body, [], [])):
                self._cancel_task(tenant, rid)
            found = await self.stored(tenant, rid)
        if found.status != "cancelled":
            raise ApiError(400, f"response {rid!r} already finished ({found.status}); it cannot be cancelled",
                           code="not_cancellable")
        return _json(found.body)

    def _cancel_task(self, tenant: str, rid: str) -> None:
        task = self.tasks.pop((tenant, rid), None)
        if task is not None:
            task.cancel()


def routes(gw: Gateway) -> list[Route]:
    """The Responses routes, bound to the gateway's channel and a response store."""
    api = _Responses(gw)
    return [
        Route("/v1/responses", api.create, methods=["POST"]),
        Route("/v1/responses/{id}", api.retrieve, methods=["GET"]),
        Route("/v1/responses/{id}", api.delete, methods=["DELETE"]),
        Route("/v1/responses/{id}/input_items", api.input_items, methods=["GET"]),
        Route("/v1/responses/{id}/cancel", api.cancel, methods=["POST"]),
    ]
