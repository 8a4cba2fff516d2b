"""The metadata store on both databases: cursor paging against a reference built from OpenAI's rules, and the
atomic completion that a cancelled, deleted or re-added file can never pass."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.services.vector_store.chunking import Chunk
from embedmesh.services.vector_store.db import Database
from embedmesh.services.vector_store.models import AUTO_CHUNKING, PageRequest
from embedmesh.services.vector_store.store import MetadataStore


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
    ids = [store.create_file(f"f{i}.txt", "assistants", "text/plain", b"x").id for i in range(7)]
    cursors = ["", ids[0], ids[3], ids[6]]
    for order, limit, after, before in itertools.product(("asc", "desc"), (1, 2, 3, 20), cursors, cursors):
        p = PageRequest(limit, order, after, before)  # type: ignore[arg-type]
        page = store.list_files("", p)
        want, more = reference(ids, p)
        assert ([f.id for f in page.data], page.has_more) == (want, more), p


@pytest.mark.parametrize(("page", "field"), [(PageRequest(limit=0), "limit"), (PageRequest(limit=101), "limit"),
                                             (PageRequest(order="up"), "order"),  # type: ignore[arg-type]
                                             (PageRequest(after="file-x"), "after"),
                                             (PageRequest(before="file-x"), "before")])
def test_paging_rules(store: MetadataStore, page: PageRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        store.list_files("", page)
    assert e.value.field == field


def test_completion_is_atomic_and_guarded(store: MetadataStore) -> None:
    f = store.create_file("a.txt", "assistants", "text/plain", b"hello")
    sid = store.create_store("s", None, {"k": "v"})
    _, old, _ = store.add_store_file(sid, f.id, AUTO_CHUNKING, {"a": 1.0})
    _, new, _ = store.add_store_file(sid, f.id, AUTO_CHUNKING, {"a": 2.0})  # re-added: a new token
    chunks = [Chunk(0, "hello", 1)]
    vec = np.ones((1, 4), np.float32) / 2
    assert store.complete(old, chunks, vec) is None                   # the stale ingestion writes nothing
    assert store.chunk_ids(sid) == []
    ids = store.complete(new, chunks, vec)
    assert ids is not None and len(ids) == 1
    sf = store.get_store_file(sid, f.id)
    assert sf.status == "completed" and sf.chunks_done == sf.chunks_total == 1 and sf.attributes == {"a": 2.0}
    vs = store.get_store(sid)
    assert vs.file_counts.completed == 1 and vs.usage_bytes == len(b"hello") + 16 and vs.metadata == {"k": "v"}
    assert store.complete(new, chunks, vec) is None                    # completes once
    assert store.fail(new, "server_error", "late") is False            # and a completed file cannot fail


def test_cancel_then_complete_writes_nothing(store: MetadataStore) -> None:
    f = store.create_file("a.txt", "assistants", "text/plain", b"hello")
    sid = store.create_store("s", None, {})
    bid = store.create_batch(sid)
    _, p, _ = store.add_store_file(sid, f.id, AUTO_CHUNKING, {}, bid)
    assert store.cancel_batch(sid, bid) == [f.id]
    assert store.complete(p, [Chunk(0, "hello", 1)], np.ones((1, 4), np.float32)) is None
    assert store.get_batch(sid, bid).status == "cancelled" and store.chunk_ids(sid) == []
