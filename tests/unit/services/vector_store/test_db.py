"""vector_store.db: one connection driven from one thread, on SQLite and on a real PostgreSQL — ``?`` placeholders
work on both, transactions are all or nothing and nest, ``run`` keeps statements off the event loop's thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from embedmesh.services.vector_store.db import Database


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        d = Database.sqlite(str(tmp_path / "t.db"))
    else:
        d = Database.postgres(request.getfixturevalue("pg").database())
    d.execute("DROP TABLE IF EXISTS t")
    d.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT NOT NULL)")
    yield d
    d.close()


def test_statements_with_placeholders(db: Database) -> None:
    assert db.execute("INSERT INTO t (id, name) VALUES (?, ?)", (1, "a")) == 1
    db.executemany("INSERT INTO t (id, name) VALUES (?, ?)", [(2, "b"), (3, "c")])
    assert db.query("SELECT id, name FROM t WHERE id >= ? ORDER BY id", (2,)) == [(2, "b"), (3, "c")]
    assert db.one("SELECT name FROM t WHERE id = ?", (3,)) == ("c",)
    assert db.one("SELECT name FROM t WHERE id = ?", (99,)) is None
    assert db.execute("UPDATE t SET name = ? WHERE id <= ?", ("z", 2)) == 2


def test_a_failed_transaction_leaves_nothing(db: Database) -> None:
    with pytest.raises(RuntimeError):
        with db.transaction():
            db.execute("INSERT INTO t (id, name) VALUES (?, ?)", (1, "a"))
            raise RuntimeError("abort")
    assert db.query("SELECT * FROM t") == []
    with db.transaction():
        db.execute("INSERT INTO t (id, name) VALUES (?, ?)", (1, "a"))
    assert db.query("SELECT * FROM t") == [(1, "a")]


def test_nested_transactions_join_the_outer_one(db: Database) -> None:
    with pytest.raises(RuntimeError):
        with db.transaction():
            db.execute("INSERT INTO t (id, name) VALUES (?, ?)", (1, "outer"))
            with db.transaction():
                db.execute("INSERT INTO t (id, name) VALUES (?, ?)", (2, "inner"))
            raise RuntimeError("the outer block fails after the inner one finished")
    assert db.query("SELECT * FROM t") == [], "the inner block was not committed on its own"
    with db.transaction():
        with db.transaction():
            db.execute("INSERT INTO t (id, name) VALUES (?, ?)", (3, "x"))
        db.execute("INSERT INTO t (id, name) VALUES (?, ?)", (4, "y"))
    assert sorted(db.query("SELECT id FROM t")) == [(3,), (4,)]


def test_constraint_violations_raise_and_roll_back(db: Database) -> None:
    db.execute("INSERT INTO t (id, name) VALUES (?, ?)", (1, "a"))
    with pytest.raises(Exception):  # noqa: B017 - sqlite3.IntegrityError or psycopg's UniqueViolation
        with db.transaction():
            db.execute("INSERT INTO t (id, name) VALUES (?, ?)", (2, "b"))
            db.execute("INSERT INTO t (id, name) VALUES (?, ?)", (1, "duplicate"))
    assert db.query("SELECT id FROM t") == [(1,)]


async def test_run_calls_on_one_database_thread(db: Database) -> None:
    seen: list[Any] = []

    def work(i: int) -> int:
        seen.append(threading.current_thread())
        db.execute("INSERT INTO t (id, name) VALUES (?, ?)", (i, f"n{i}"))
        return i * 2

    assert [await db.run(work, i) for i in range(1, 4)] == [2, 4, 6]
    assert len(set(seen)) == 1 and seen[0] is not threading.current_thread()
    assert seen[0].name.startswith(f"vs-db-{db.dialect}")
    assert await db.run(db.query, "SELECT count(*) FROM t") == [(3,)]  # run(fn, *args) calls fn(*args)


def test_sqlite_runs_in_wal_mode_with_foreign_keys(tmp_path: Path) -> None:
    d = Database.sqlite(str(tmp_path / "w.db"))
    try:
        assert d.one("PRAGMA journal_mode") == ("wal",)
        assert d.one("PRAGMA foreign_keys") == (1,)
        d.execute("CREATE TABLE p (id INTEGER PRIMARY KEY)")
        d.execute("CREATE TABLE c (id INTEGER PRIMARY KEY, p INTEGER REFERENCES p(id))")
        with pytest.raises(Exception):  # noqa: B017 - sqlite3.IntegrityError
            d.execute("INSERT INTO c (id, p) VALUES (1, 42)")
    finally:
        d.close()


def test_a_reader_of_its_own_per_thread_sees_committed_writes_and_cannot_write(tmp_path: Path) -> None:
    d = Database.sqlite(str(tmp_path / "r.db"))
    d.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT NOT NULL)")
    assert d.has_readers
    seen: dict[str, Any] = {}

    def reader_thread() -> None:
        r = d.reading()
        assert r is not None and r is d.reading()  # one per thread, kept
        seen["before"] = r.query("SELECT name FROM t")
        seen["conn"] = r.connection
        go.set()
        written.wait(5)
        seen["after"] = r.query("SELECT name FROM t ORDER BY id")  # the writer's commit is visible at once
        try:
            r.execute("INSERT INTO t (id, name) VALUES (9, 'no')")
        except Exception as e:  # noqa: BLE001
            seen["write"] = e

    go, written = threading.Event(), threading.Event()
    t = threading.Thread(target=reader_thread)
    t.start()
    go.wait(5)
    with d.transaction():
        d.execute("INSERT INTO t (id, name) VALUES (1, 'a')")
        d.execute("INSERT INTO t (id, name) VALUES (2, 'b')")
    written.set()
    t.join(5)
    assert seen["before"] == [] and seen["after"] == [("a",), ("b",)]
    assert "readonly" in str(seen["write"]) or "read-only" in str(seen["write"])
    assert d.query("SELECT COUNT(*) FROM t") == [(2,)]
    other = d.reading()  # this thread's own, not the other thread's
    assert other is not None and other.connection is not seen["conn"]
    d.close()
    import sqlite3

    with pytest.raises(sqlite3.ProgrammingError):  # closed with the database
        seen["conn"].execute("SELECT 1")


def test_no_readers_without_a_file_to_share(tmp_path: Path) -> None:
    mem = Database.sqlite(":memory:")
    assert not mem.has_readers and mem.reading() is None
    mem.close()


def test_postgres_reads_stay_on_the_database_thread(db: Database) -> None:
    assert db.has_readers == (db.dialect == "sqlite")
    assert (db.reading() is None) == (db.dialect == "postgres")
