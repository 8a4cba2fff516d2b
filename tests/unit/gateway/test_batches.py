"""gateway/batches.py: a line through a route's own handler (its answer, its ApiError, a bug's 500 without
internals, the creator's key checked as for an interactive request), the sealed Authorization, and the routes'
refusals (each naming its parameter) on a real SQLite store; purpose=batch uploads through ``files.routes``."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response

from embedmesh.core import auth
from embedmesh.gateway import batches, files
from embedmesh.gateway.errors import bad_request
from tests.unit.gateway.conftest import bare_gateway, route_client


def make(tmp_path: Path, **config: Any) -> batches.Batches:
    return batches.Batches(bare_gateway(batch_db=str(tmp_path / "b.sqlite3"), **config))


async def test_a_line_goes_to_the_handler_of_its_url_as_a_post_with_its_body(tmp_path: Path) -> None:
    b = make(tmp_path)
    seen: list[tuple[str, str, bytes, str]] = []

    async def handler(request: Request) -> Response:
        seen.append((request.method, request.url.path, await request.body(), request.headers["authorization"]))
        return Response(b'{"id": "cmpl-1"}', media_type="application/json")

    async def refusing(request: Request) -> Response:
        raise bad_request("temperature", "must be in [0, 2]")

    async def buggy(request: Request) -> Response:
        raise RuntimeError("secret internals")

    b.handlers = {"/v1/completions": handler, "/v1/embeddings": refusing, "/v1/chat/completions": buggy}
    assert await b.call("/v1/completions", b'{"prompt": "x"}', "Bearer k") == (200, b'{"id": "cmpl-1"}')
    assert seen == [("POST", "/v1/completions", b'{"prompt": "x"}', "Bearer k")]
    status, body = await b.call("/v1/embeddings", b"{}", "")
    assert status == 400 and orjson.loads(body)["error"]["param"] == "temperature"
    status, body = await b.call("/v1/chat/completions", b"{}", "")
    assert status == 500 and b"secret" not in body
    status, body = await b.call("/v1/responses", b"{}", "")
    assert status == 400 and orjson.loads(body)["error"]["param"] == "url"
    assert b.urls() == ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


async def test_a_line_whose_key_no_longer_works_fails_with_401_and_reaches_no_handler(tmp_path: Path) -> None:
    b = make(tmp_path)
    called: list[int] = []

    async def handler(request: Request) -> Response:
        called.append(1)
        return Response(b"{}")

    b.handlers = {"/v1/completions": handler}
    auth.configure_keys(auth.keyring_from_values(api_keys="good-key-123=t1"))
    try:
        status, body = await b.call("/v1/completions", b"{}", "Bearer revoked-key")
        assert status == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"
        assert (await b.call("/v1/completions", b"{}", "Bearer good-key-123"))[0] == 200
    finally:
        auth.configure_keys(auth.KeyRing())
    assert called == [1]


def test_the_authorization_is_sealed_under_a_0600_key_file_kept_across_restarts(tmp_path: Path) -> None:
    first = make(tmp_path)
    sealed = first.seal("Bearer sk-secret")
    assert "sk-secret" not in sealed
    key = tmp_path / "b.sqlite3.key"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert make(tmp_path).unseal(sealed) == "Bearer sk-secret"  # a restarted gateway reads it
    (tmp_path / "secret").write_text("shared secret\n")
    other = make(tmp_path, batch_secret_file=str(tmp_path / "secret"))
    assert other.unseal(sealed) == ""  # sealed under another key: no header, never an exception
    assert make(tmp_path, batch_secret_file=str(tmp_path / "secret")).unseal(other.seal("h")) == "h"


def test_postgres_without_a_secret_file_is_refused_at_start() -> None:
    b = batches.Batches(bare_gateway(batch_db="postgresql://127.0.0.1:1/x"))
    with pytest.raises(ValueError, match="batch_secret_file is required"):
        b.seal("x")


def _app(tmp_path: Path, tenant: str = "default") -> Any:
    b = make(tmp_path, batch_max_lines=5)
    b.handlers = {u: None for u in ("/v1/completions", "/v1/chat/completions")}  # type: ignore[misc]
    return route_client(batches.routes(b.gw, b) + files.routes(b.gw, None, b)), b


def _line(cid: str, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", "prompt": "x"}})


def test_uploads_are_checked_as_jsonl_and_batches_as_openai_says(tmp_path: Path) -> None:
    http, _ = _app(tmp_path)
    bad = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", b'{"a":\n')})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("line 1: ")
    up = http.post("/v1/files", data={"purpose": "batch"},
                   files={"file": ("in.jsonl", (_line("a") + "\n" + _line("b", "/v1/chat/completions")).encode())})
    assert up.status_code == 200 and up.json()["purpose"] == "batch"
    fid = up.json()["id"]
    assert http.get(f"/v1/files/{fid}").json()["bytes"] == up.json()["bytes"]
    assert http.get("/v1/files", params={"purpose": "batch"}).json()["data"][0]["id"] == fid
    assert [f["id"] for f in http.get("/v1/files").json()["data"]] == [fid]  # no vector store: every batch file
    refused = http.post("/v1/files", data={"purpose": "batch_output"}, files={"file": ("o.jsonl", _line("a"))})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "purpose"
    base = {"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h"}
    for change, param in [({"endpoint": "/v1/models"}, "endpoint"), ({"completion_window": "1h"},
                                                                     "completion_window"),
                          ({"input_file_id": 3}, "input_file_id"), ({"metadata": {"k": 1}}, "metadata"),
                          ({"extra": 1}, "extra")]:
        r = http.post("/v1/batches", json={**base, **change})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (change, r.text)
    r = http.post("/v1/batches", json={**base, "input_file_id": "file-nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id"
    mixed = http.post("/v1/batches", json=base)  # line 2 names another endpoint than the batch's
    assert mixed.status_code == 400 and "line 2:" in mixed.json()["error"]["message"]
    assert http.get("/v1/batches/batch_nope").status_code == 404
    assert http.post("/v1/batches/batch_nope/cancel").status_code == 404
    assert http.get("/v1/batches", params={"limit": 101}).json()["error"]["param"] == "limit"


def test_a_batch_is_created_listed_and_cancelled(tmp_path: Path) -> None:
    http, _ = _app(tmp_path)
    body = (_line("a") + "\n" + json.dumps({"custom_id": "s", "method": "POST", "url": "/v1/completions",
                                            "body": {"model": "m", "prompt": "x", "stream": True}})).encode()
    fid = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", body)}).json()["id"]
    made = http.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                          "completion_window": "24h", "metadata": {"k": "v"}}).json()
    assert made["object"] == "batch" and made["status"] == "validating" and made["metadata"] == {"k": "v"}
    assert made["request_counts"] == {"total": 2, "completed": 0, "failed": 1}  # the streaming line failed alone
    listed = http.get("/v1/batches").json()
    assert [x["id"] for x in listed["data"]] == [made["id"]] and not listed["has_more"]
    assert http.post(f"/v1/batches/{made['id']}/cancel").json()["status"] == "cancelling"


@pytest.mark.parametrize(("order", "expected"), [("prefix", ["a2", "b1", "c0"]), ("file", ["c0", "b1", "a2"])])
def test_lines_run_by_prefix_unless_file_order_is_configured(tmp_path: Path, order: str,
                                                             expected: list[str]) -> None:
    import asyncio

    b = make(tmp_path, batch_order=order)
    b.handlers = {"/v1/completions": None}  # type: ignore[dict-item]
    http = route_client(batches.routes(b.gw, b) + files.routes(b.gw, None, b))
    lines = [json.dumps({"custom_id": f"{p}{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "m", "prompt": p}}) for i, p in enumerate("cba")]
    fid = http.post("/v1/files", data={"purpose": "batch"},
                    files={"file": ("in.jsonl", "\n".join(lines).encode())}).json()["id"]
    bid = http.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                         "completion_window": "24h"}).json()["id"]
    todo = asyncio.run(b.store.todo(bid, 10))
    assert [w.custom_id for w in todo] == expected
