"""``/v1/batches`` (OpenAI's Batch API) and the ``purpose=batch`` side of ``/v1/files``.

    POST /v1/batches                    {input_file_id, endpoint, completion_window: "24h", metadata} -> batch
    GET  /v1/batches                    ?after&limit&order -> list (newest first)
    GET  /v1/batches/{batch_id}         -> batch
    POST /v1/batches/{batch_id}/cancel  -> batch (cancelling, then cancelled)

A batch belongs to the tenant of the key that created it (another tenant's id is a 404, as an unknown one). Its
input file is checked when it is uploaded (``batch_lines``); at creation each line's ``url`` must be the batch's
``endpoint`` (a 400 naming the line). A line whose body asks for ``stream`` fails alone at once; every other body
goes, when its turn comes, to the route's own handler (``BatchRunner``), whose answer — 200 or the 400 naming the
field — is the line's result in the output or the error file.

The runner forwards the creator's ``Authorization`` header with each line, as the gateway does for an interactive
request: the preprocessor authenticates it again and derives the tenant itself (a key revoked meanwhile fails the
remaining lines with 401). The header is kept sealed (Fernet) under ``--batch-secret-file``, or for SQLite under
a random key in a 0600 file beside the database.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from cryptography.fernet import Fernet, InvalidToken
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from embedmesh.core import auth
from embedmesh.core.logs import get_logger
from embedmesh.gateway import batch_lines
from embedmesh.gateway.auth import authenticate_request
from embedmesh.gateway.batch_runner import BatchRunner, output_line
from embedmesh.gateway.batch_store import BatchStore, Work
from embedmesh.gateway.config import GatewayConfig
from embedmesh.gateway.context import Gateway
from embedmesh.gateway.errors import ApiError, bad_request, error_response
from embedmesh.gateway.paging import page_request
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb

__all__ = ["Batches", "routes", "tenant_of"]

log = get_logger("embedmesh.gateway.batches")

Handler = Callable[[Request], Any]
_METADATA_KEYS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512


def tenant_of(request: Request) -> str:
    principal = authenticate_request(request)  # checked already by the app's wrapper: this only reads the tenant
    return principal.tenant if principal is not None else auth.DEFAULT_TENANT


def _json(obj: Any) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


def _sealer(config: GatewayConfig, store: BatchStore) -> Fernet:
    if config.batch_secret_file:
        secret = Path(config.batch_secret_file).read_bytes().strip()
        if not secret:
            raise ValueError(f"batch_secret_file {config.batch_secret_file} is empty")
        return Fernet(base64.urlsafe_b64encode(hashlib.sha256(secret).digest()))
    if store.postgres:
        raise ValueError("batch_secret_file is required with a PostgreSQL batch database (every gateway on it must "
                         "read the Authorization headers the others sealed)")
    path = Path(store.target + ".key") if store.target != ":memory:" else None
    if path is None:
        return Fernet(Fernet.generate_key())
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        # Written whole under another name, then linked into place: a gateway starting at the same moment reads
        # either no file or the whole key, and the first link wins.
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(Fernet.generate_key())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return Fernet(path.read_bytes().strip())


class Batches:
    """The store, the runner and the handlers lines go to; ``open``/``close`` run in the app's lifespan."""

    def __init__(self, gw: Gateway, inflight: Callable[[], int] = lambda: 0) -> None:
        """``inflight``: the interactive requests in flight at this gateway (batch lines wait while they are
        ``batch_pause_inflight`` or more)."""
        config = gw.config
        self.gw = gw
        self.store = BatchStore(config.batch_db)
        self.handlers: dict[str, Handler] = {}
        """url -> the route's own handler (filled by ``create_app`` from the routes it serves)."""
        self._fernet: Fernet | None = None
        owner = config.batch_runner_id or f"{socket.gethostname()}:{config.port or os.getpid()}"
        self.own_calls = 0
        """Requests to the batch routes in flight here (a client polling its batch is not interactive traffic)."""
        self.runner = BatchRunner(self.store, self.call, owner=owner, unseal=self.unseal,
                                  concurrency=config.batch_concurrency,
                                  busy_concurrency=min(config.batch_busy_concurrency, config.batch_concurrency),
                                  busy=lambda: 0 < config.batch_pause_inflight <= inflight() - self.own_calls)

    @property
    def fernet(self) -> Fernet:
        if self._fernet is None:
            self._fernet = _sealer(self.gw.config, self.store)
        return self._fernet

    def seal(self, header: str) -> str:
        return self.fernet.encrypt(header.encode()).decode()

    def unseal(self, sealed: str) -> str:
        try:
            return self.fernet.decrypt(sealed.encode()).decode()
        except InvalidToken:  # sealed under another secret: the lines run without a key (and fail if one is needed)
            log.warning("a batch's Authorization was sealed under another batch secret")
            return ""

    def urls(self) -> tuple[str, ...]:
        return tuple(u for u in batch_lines.BATCH_URLS if u in self.handlers)

    async def open(self) -> None:
        _ = self.fernet  # a bad secret or key file stops the start, not the first batch
        self.runner.start()

    async def close(self) -> None:
        await self.runner.stop()
        self.store.close()

    async def call(self, url: str, body: bytes, authorization: str) -> tuple[int, bytes]:
        """One line through the handler an interactive ``POST url`` reaches, as if its creator sent it."""
        handler = self.handlers.get(url)
        if handler is None:
            err = ApiError(400, f"url: {url} is not served by this gateway", param="url", code="invalid_value")
            return err.status, orjson.dumps(err.body())
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if authorization:
            headers.append((b"authorization", authorization.encode("latin-1")))
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.get_running_loop().create_future()  # no client to leave: wait until cancelled
            raise AssertionError("unreachable")

        scope = {"type": "http", "method": "POST", "path": url, "raw_path": url.encode(), "query_string": b"",
                 "headers": headers, "http_version": "1.1", "scheme": "http", "root_path": "",
                 "server": ("batch-runner", 0), "client": None}
        request = Request(scope, receive)
        try:
            authenticate_request(request)  # the key is checked, and forwarded, exactly as for the interactive route
            response = await handler(request)
        except ApiError as e:
            r = error_response(e)
            return r.status_code, bytes(r.body)
        except Exception:  # noqa: BLE001 - as the app's wrapper answers a handler's bug: a 500 with no internals
            log.exception("unhandled error in a batch line", extra={"route": url})
            err = ApiError(500, "internal server error", code="internal_error")
            return err.status, orjson.dumps(err.body())
        return response.status_code, bytes(response.body)

    # --- files (purpose=batch) ----------------------------------------------------------------------------------
    async def add_input_file(self, request: Request, filename: str, content: bytes) -> dict[str, Any]:
        cfg = self.gw.config
        if len(content) > cfg.batch_max_file_bytes:
            raise bad_request("file", f"is {len(content)} bytes, over the {cfg.batch_max_file_bytes} byte limit of "
                                      "a batch input file", "file_too_large")
        batch_lines.parse(content, max_lines=cfg.batch_max_lines, urls=self.urls())
        return await self.store.add_file(tenant_of(request), "batch", filename, content)


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > _METADATA_KEYS:
        raise bad_request("metadata", f"must be an object of at most {_METADATA_KEYS} string values")
    for k, v in value.items():
        if len(k) > _METADATA_KEY_CHARS or not isinstance(v, str) or len(v) > _METADATA_VALUE_CHARS:
            raise bad_request("metadata", f"keys are at most {_METADATA_KEY_CHARS} characters and values strings "
                                          f"of at most {_METADATA_VALUE_CHARS}")
    return value


def _not_found(bid: str) -> ApiError:
    return ApiError(404, f"no batch {bid!r}", param="batch_id", code="not_found", type_="not_found_error")


def routes(gw: Gateway, batches: Batches) -> list[Route]:
    """The ``/v1/batches`` routes."""

    async def create(request: Request) -> Response:
        body = await gw.read_json(request)
        extra = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
        if extra:
            raise bad_request(extra[0], "is not a parameter of a batch", "unknown_parameter")
        fid, endpoint = body.get("input_file_id"), body.get("endpoint")
        if not isinstance(fid, str) or not fid:
            raise bad_request("input_file_id", "is required (the id of a purpose=batch file)", "missing")
        urls = batches.urls()
        if endpoint not in urls:
            raise bad_request("endpoint", f"must be one of {', '.join(urls)}, got {endpoint!r}")
        if body.get("completion_window") != "24h":
            raise bad_request("completion_window", f"must be '24h', got {body.get('completion_window')!r}")
        metadata = _metadata(body.get("metadata"))
        tenant = tenant_of(request)
        meta = await batches.store.file(tenant, fid)
        if meta is None:
            raise ApiError(404, f"input_file_id: no file {fid!r}", param="input_file_id", code="not_found",
                           type_="not_found_error")
        if meta["purpose"] != "batch":
            raise bad_request("input_file_id", f"file {fid!r} has purpose {meta['purpose']!r}, not 'batch'")
        content = await batches.store.file_content(tenant, fid) or b""
        lines = batch_lines.parse(content, max_lines=gw.config.batch_max_lines, urls=urls)
        del content
        for line in lines:
            if line.url != endpoint:
                raise bad_request("input_file_id", f"line {line.number}: url {line.url!r} is not the batch's "
                                                   f"endpoint {endpoint!r}", "endpoint_mismatch")
        order = batch_lines.run_order(lines) if gw.config.batch_order == "prefix" else list(range(len(lines)))
        refused: dict[int, bytes] = {}
        for i, line in enumerate(lines):
            if line.stream:
                err = bad_request("stream", "a batch line cannot stream; leave stream unset or false",
                                  "unsupported_in_batch")
                refused[i] = output_line(Work(i, line.custom_id, line.url, b""), 400, orjson.dumps(err.body()))[1]
        made = await batches.store.create_batch(
            tenant, endpoint, fid, "24h", metadata, batches.seal(request.headers.get("authorization", "")),
            [(line.custom_id, line.url, line.body, order[i]) for i, line in enumerate(lines)], refused,
            owner=batches.runner.owner, lease_s=batches.runner.lease_s)
        batches.runner.wake()
        return _json(made)

    async def retrieve(request: Request) -> Response:
        bid = request.path_params["batch_id"]
        got = await batches.store.batch(tenant_of(request), bid)
        if got is None:
            raise _not_found(bid)
        return _json(got)

    async def list_batches(request: Request) -> Response:
        page = page_request(request, before=False)
        if page.limit > 100:
            raise bad_request("limit", "must be in [1, 100]")
        data, more = await batches.store.list_batches(tenant_of(request), page.after, page.limit or 20,
                                                      page.order == pb.SORT_ORDER_ASC)
        return _json(list_page(data, more))

    async def cancel(request: Request) -> Response:
        bid = request.path_params["batch_id"]
        got = await batches.store.cancel(tenant_of(request), bid)
        if got is None:
            raise _not_found(bid)
        batches.runner.wake(cancelled=bid)
        return _json(got)

    def own(handler: Handler) -> Handler:
        async def counted(request: Request) -> Response:
            batches.own_calls += 1
            try:
                return await handler(request)  # type: ignore[no-any-return]
            finally:
                batches.own_calls -= 1

        return counted

    return [
        Route("/v1/batches", own(create), methods=["POST"]),
        Route("/v1/batches", own(list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", own(retrieve), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", own(cancel), methods=["POST"]),
    ]


def list_page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """OpenAI's list object for one page."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
