"""The metadata store on both databases: cursor paging against a reference built from OpenAI's rules, the atomic
completion that a cancelled, deleted or re-added file can never pass, tenant ownership of every object (another
tenant's id is an unknown id), random ids, and the migration that gives rows made before tenancy the tenant
``default``."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedmesh.core.errors import InvalidArgument, NotFound
from embedmesh.services.vector_store.chunking import Chunk
from embedmesh.services.vector_store.db import Database
from embedmesh.services.vector_store.objects import AUTO_CHUNKING, PageRequest
from embedmesh.services.vector_store.store import MetadataStore

A, B = "tenant-a", "tenant-b"


@pytest.fixture
def store(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    if backend == "pgvector":
        db = Database.postgres(request.getfixturevalue("pg").database())
    else:
        db = Database.sqlite(str(tmp_path / "m.sqlite3"))
    s = MetadataStore(db, 4, "m")
    s.init_schema()
    yield s
    db.close()


def reference(ids: list[str], p: PageRequest) -> tuple[list[str], bool]:
    """``ids`` oldest first. Ordered view; `after` -> the ones following it; `before` -> the `limit` nearest
    preceding it; has_more = more items beyond the page in the direction of travel."""
    view = ids if p.order == "asc" else ids[::-1]
    lo, hi = 0, len(view)
    if p.after:
        lo = view.index(p.after) + 1
    if p.before:
        hi = view.index(p.before)
    window = view[lo:hi]
    if p.before and not p.after:
        page = window[-p.limit:]
        return page, len(window) > p.limit
    return window[:p.limit], len(window) > p.limit


def test_paging_matches_reference(store: MetadataStore) -> None:
    ids = [store.create_file(A, f"f{i}.txt", "assistants", "text/plain", b"x").id for i in range(7)]
    cursors = ["", ids[0], ids[3], ids[6]]
    for order, limit, after, before in itertools.product(("asc", "desc"), (1, 2, 3, 20), cursors, cursors):
        p = PageRequest(limit, order, after, before)  # type: ignore[arg-type]
        page = store.list_files(A, "", p)
        want, more = reference(ids, p)
        assert ([f.id for f in page.data], page.has_more) == (want, more), p


@pytest.mark.parametrize(("page", "field"), [(PageRequest(limit=0), "limit"), (PageRequest(limit=101), "limit"),
                                             (PageRequest(order="up"), "order"),  # type: ignore[arg-type]
                                             (PageRequest(after="file-x"), "after"),
                                             (PageRequest(before="file-x"), "before")])
def test_paging_rules(store: MetadataStore, page: PageRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        store.list_files(A, "", page)
    assert e.value.field == field


def test_completion_is_atomic_and_guarded(store: MetadataStore) -> None:
    f = store.create_file(A, "a.txt", "assistants", "text/plain", b"hello")
    sid = store.create_store(A, "s", None, {"k": "v"})
    _, old, _ = store.add_store_file(A, sid, f.id, AUTO_CHUNKING, {"a": 1.0})
    _, new, _ = store.add_store_file(A, sid, f.id, AUTO_CHUNKING, {"a": 2.0})  # re-added: a new token
    chunks = [Chunk(0, "hello", 1)]
    vec = np.ones((1, 4), np.float32) / 2
    assert store.complete(old, chunks, vec) is None                   # the stale ingestion writes nothing
    assert store.chunk_ids(sid) == []
    ids = store.complete(new, chunks, vec)
    assert ids is not None and len(ids) == 1
    sf = store.get_store_file(sid, f.id)
    assert sf.status == "completed" and sf.chunks_done == sf.chunks_total == 1 and sf.attributes == {"a": 2.0}
    vs = store.get_store(A, sid)
    assert vs.file_counts.completed == 1 and vs.usage_bytes == len(b"hello") + 16 and vs.metadata == {"k": "v"}
    assert store.complete(new, chunks, vec) is None                    # completes once
    assert store.fail(new, "server_error", "late") is False            # and a completed file cannot fail


def test_cancel_then_complete_writes_nothing(store: MetadataStore) -> None:
    f = store.create_file(A, "a.txt", "assistants", "text/plain", b"hello")
    sid = store.create_store(A, "s", None, {})
    bid = store.create_batch(A, sid)
    _, p, _ = store.add_store_file(A, sid, f.id, AUTO_CHUNKING, {}, bid)
    assert store.cancel_batch(A, sid, bid) == [f.id]
    assert store.complete(p, [Chunk(0, "hello", 1)], np.ones((1, 4), np.float32)) is None
    assert store.get_batch(A, sid, bid).status == "cancelled" and store.chunk_ids(sid) == []


def test_another_tenants_ids_are_unknown_ids(store: MetadataStore) -> None:
    f = store.create_file(A, "a.txt", "assistants", "text/plain", b"secret of a")
    sid = store.create_store(A, "s", None, {})
    bid = store.create_batch(A, sid)
    store.add_store_file(A, sid, f.id, AUTO_CHUNKING, {}, bid)
    b_file = store.create_file(B, "b.txt", "assistants", "text/plain", b"of b")
    b_store = store.create_store(B, "sb", None, {})

    def unknown(call: Any, field: str) -> str:
        """The NotFound's message with every id replaced by ID."""
        with pytest.raises(NotFound) as e:
            call()
        assert e.value.field == field
        return re.sub(r"(file-|vs_|vsfb_)\w+", "ID", e.value.message)

    # B's view of A's objects is word for word the view of ids that do not exist.
    for call, twin, field in [
        (lambda: store.get_file(B, f.id), lambda: store.get_file(B, "file-nope"), "file_id"),
        (lambda: store.file_content(B, f.id), lambda: store.file_content(B, "file-nope"), "file_id"),
        (lambda: store.delete_file(B, f.id), lambda: store.delete_file(B, "file-nope"), "file_id"),
        (lambda: store.get_store(B, sid), lambda: store.get_store(B, "vs_nope"), "vector_store_id"),
        (lambda: store.update_store(B, sid, "x", None, False, None),
         lambda: store.update_store(B, "vs_nope", "x", None, False, None), "vector_store_id"),
        (lambda: store.delete_store(B, sid), lambda: store.delete_store(B, "vs_nope"), "vector_store_id"),
        (lambda: store.get_batch(B, sid, bid), lambda: store.get_batch(B, sid, "vsfb_nope"), "batch_id"),
        (lambda: store.cancel_batch(B, sid, bid), lambda: store.cancel_batch(B, sid, "vsfb_nope"), "batch_id"),
        (lambda: store.add_store_file(B, sid, b_file.id, AUTO_CHUNKING, {}),
         lambda: store.add_store_file(B, "vs_nope", b_file.id, AUTO_CHUNKING, {}), "vector_store_id"),
        (lambda: store.add_store_file(B, b_store, f.id, AUTO_CHUNKING, {}),
         lambda: store.add_store_file(B, b_store, "file-nope", AUTO_CHUNKING, {}), "file_id"),
    ]:
        assert unknown(call, field) == unknown(twin, field)
    assert [x.id for x in store.list_files(B, "", PageRequest()).data] == [b_file.id]
    assert [x.id for x in store.list_stores(B, PageRequest()).data] == [b_store]
    with pytest.raises(InvalidArgument):  # A's id is no cursor in B's list either
        store.list_files(B, "", PageRequest(after=f.id))
    # A still has everything, untouched.
    assert store.file_content(A, f.id) == b"secret of a"
    assert [x.id for x in store.list_files(A, "", PageRequest()).data] == [f.id]
    assert [x.id for x in store.list_stores(A, PageRequest()).data] == [sid]
    assert store.get_batch(A, sid, bid).file_counts.in_progress == 1
    assert store.get_store(A, sid).name == "s" and store.get_store_file(sid, f.id).status == "in_progress"


def test_ids_are_random_128_bits(store: MetadataStore) -> None:
    files = [store.create_file(A, "same.txt", "assistants", "text/plain", b"same bytes") for _ in range(20)]
    files.append(store.create_file(B, "same.txt", "assistants", "text/plain", b"same bytes"))
    sid = store.create_store(A, "s", None, {})
    ids = [f.id for f in files]
    assert all(re.fullmatch(r"file-[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)  # same bytes, same tenant or not: a new id every time, nothing shared
    assert re.fullmatch(r"vs_[0-9a-f]{32}", sid)
    assert re.fullmatch(r"vsfb_[0-9a-f]{32}", store.create_batch(A, sid))
    # Every hex digit position varies across the ids (a counter or a content hash prefix would not).
    for pos in range(5, 37):
        assert len({i[pos] for i in ids}) > 1, pos


_OLD_SCHEMA = [  # the three tenant tables as they were before tenancy
    """CREATE TABLE vs_files (seq {pk}, id TEXT NOT NULL UNIQUE, size_bytes BIGINT NOT NULL,
       created_at BIGINT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL, media_type TEXT NOT NULL,
       content {blob} NOT NULL)""",
    """CREATE TABLE vs_stores (seq {pk}, id TEXT NOT NULL UNIQUE, created_at BIGINT NOT NULL, name TEXT NOT NULL,
       expires_days INTEGER, last_active_at BIGINT NOT NULL, metadata TEXT NOT NULL, embedding_model TEXT NOT NULL,
       dimensions INTEGER NOT NULL)""",
    """CREATE TABLE vs_batches (seq {pk}, id TEXT NOT NULL UNIQUE, store_id TEXT NOT NULL,
       created_at BIGINT NOT NULL, cancelled INTEGER NOT NULL DEFAULT 0)""",
]


@pytest.fixture
def old_db(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    if backend == "pgvector":
        db = Database.postgres(request.getfixturevalue("pg").database())
        pk, blob = "BIGSERIAL PRIMARY KEY", "BYTEA"
    else:
        db = Database.sqlite(str(tmp_path / "old.sqlite3"))
        pk, blob = "INTEGER PRIMARY KEY AUTOINCREMENT", "BLOB"
    for stmt in _OLD_SCHEMA:
        db.execute(stmt.format(pk=pk, blob=blob))
    db.execute("INSERT INTO vs_files (id, size_bytes, created_at, filename, purpose, media_type, content) "
               "VALUES ('file-old', 3, 1, 'o.txt', 'assistants', 'text/plain', ?)", [b"old"])
    db.execute("INSERT INTO vs_stores (id, created_at, name, last_active_at, metadata, embedding_model, dimensions) "
               "VALUES ('vs_old', 1, 'old', 1, '{}', 'm', 4)")
    db.execute("INSERT INTO vs_batches (id, store_id, created_at) VALUES ('vsfb_old', 'vs_old', 1)")
    yield db
    db.close()


def test_rows_from_before_tenancy_belong_to_default(old_db: Database) -> None:
    store = MetadataStore(old_db, 4, "m")
    store.init_schema()
    store.init_schema()  # a second start finds the column there
    assert store.file_content("default", "file-old") == b"old"
    assert store.get_store("default", "vs_old").name == "old"
    assert store.get_batch("default", "vs_old", "vsfb_old").id == "vsfb_old"
    for call in (lambda: store.get_file(A, "file-old"), lambda: store.get_store(A, "vs_old"),
                 lambda: store.get_batch(A, "vs_old", "vsfb_old")):
        with pytest.raises(NotFound):
            call()
    new = store.create_file(A, "n.txt", "assistants", "text/plain", b"new")
    assert [f.id for f in store.list_files("default", "", PageRequest()).data] == ["file-old"]
    assert [f.id for f in store.list_files(A, "", PageRequest()).data] == [new.id]
