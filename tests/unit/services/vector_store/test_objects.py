"""vector_store.objects: the domain types' few derived values — a store's file total, a page's first and last ids
(the cursors a client pages with) — and the defaults every module relies on."""

from __future__ import annotations

import dataclasses

import pytest

from embedmesh.services.vector_store.objects import (
    AUTO_CHUNKING,
    FILE_STATUSES,
    ChunkingSpec,
    FileCounts,
    FileObject,
    Page,
    PageRequest,
)


def test_file_counts_total_every_status() -> None:
    assert FileCounts().total == 0
    assert FileCounts(in_progress=1, completed=2, failed=3, cancelled=4).total == 10
    assert {f.name for f in dataclasses.fields(FileCounts)} == set(FILE_STATUSES)


def _file(i: str) -> FileObject:
    return FileObject(i, 1, 0, f"{i}.txt", "assistants", "text/plain")


def test_page_cursors_are_the_first_and_last_ids() -> None:
    page = Page([_file("file-a"), _file("file-b"), _file("file-c")], has_more=True)
    assert (page.first_id, page.last_id, page.has_more) == ("file-a", "file-c", True)
    one = Page([_file("file-x")], has_more=False)
    assert one.first_id == one.last_id == "file-x"
    assert (Page([], has_more=False).first_id, Page([], has_more=False).last_id) == ("", "")


def test_page_of_objects_without_ids_has_empty_cursors() -> None:
    page: Page[int] = Page([1, 2], has_more=False)
    assert (page.first_id, page.last_id) == ("", "")


def test_defaults() -> None:
    assert AUTO_CHUNKING == ChunkingSpec(800, 400)
    assert PageRequest() == PageRequest(limit=20, order="desc", after="", before="")
    with pytest.raises(dataclasses.FrozenInstanceError):
        AUTO_CHUNKING.max_chunk_size_tokens = 10  # type: ignore[misc]
