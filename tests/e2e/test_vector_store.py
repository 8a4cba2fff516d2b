"""The vector store through the running mesh with the official openai SDK: upload files, create a store from them,
wait for ingestion (real all-MiniLM-L6-v2 embeddings from the embedding worker), search with and without filters.

Needs the launcher to start the vector-store service and the gateway to know its address (``--vector-store``);
until then the gateway answers 501 and these tests skip.
"""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.e2e

DOCS = {
    "fruit.md": ("# Fruit\nBananas are long yellow fruit that grow in tropical climates. Apples are crisp and "
                 "grow on trees in orchards.", {"topic": "food", "year": 2021, "public": True}),
    "space.txt": ("Astronauts travel to the International Space Station on rockets. The Moon orbits the Earth "
                  "and has no atmosphere.", {"topic": "science", "year": 2024, "public": True}),
    "db.json": ('{"title": "Databases", "body": "PostgreSQL stores rows in tables and answers SQL queries; '
                'indexes make lookups fast."}', {"topic": "tech", "year": 2023, "public": False}),
}


@pytest.fixture
def store(client: openai.OpenAI) -> Any:
    try:
        client.vector_stores.list(limit=1)
    except openai.APIStatusError as e:
        if e.status_code == 501:
            pytest.skip("the mesh runs no vector store (launcher/gateway not wired yet)")
        raise
    ids = {}
    for name, (text, _) in DOCS.items():
        ids[name] = client.files.create(file=(name, text.encode()), purpose="assistants").id
    vs = client.vector_stores.create(name="e2e", file_ids=[ids["fruit.md"]])
    for name in ("space.txt", "db.json"):
        client.vector_stores.files.create(vector_store_id=vs.id, file_id=ids[name], attributes=DOCS[name][1])
    client.vector_stores.files.update(file_id=ids["fruit.md"], vector_store_id=vs.id,
                                      attributes=DOCS["fruit.md"][1])
    deadline = time.monotonic() + 120
    while (vs := client.vector_stores.retrieve(vs.id)).file_counts.in_progress:
        assert time.monotonic() < deadline, "ingestion did not finish"
        time.sleep(0.2)
    assert vs.status == "completed" and vs.file_counts.completed == 3, vs
    yield vs, ids
    client.vector_stores.delete(vs.id)
    for fid in ids.values():
        client.files.delete(fid)


def test_search_finds_the_right_file(client: openai.OpenAI, store: Any) -> None:
    vs, ids = store
    for query, name in [("which fruit is yellow?", "fruit.md"), ("how do people get to space", "space.txt"),
                        ("SQL database index", "db.json")]:
        page = client.vector_stores.search(vs.id, query=query)
        assert page.data[0].file_id == ids[name], (query, [(d.filename, d.score) for d in page.data])
        assert 0.0 <= page.data[-1].score <= page.data[0].score <= 1.0


def test_search_with_filters(client: openai.OpenAI, store: Any) -> None:
    vs, ids = store
    page = client.vector_stores.search(vs.id, query="which fruit is yellow?",
                                       filters={"type": "eq", "key": "topic", "value": "science"})
    assert [d.file_id for d in page.data] == [ids["space.txt"]]
    page = client.vector_stores.search(vs.id, query="rockets", filters={"type": "and", "filters": [
        {"type": "eq", "key": "public", "value": True}, {"type": "lt", "key": "year", "value": 2024}]})
    assert [d.file_id for d in page.data] == [ids["fruit.md"]]
    assert page.data[0].attributes["topic"] == "food"


def test_bad_filter_is_a_400(client: openai.OpenAI, store: Any) -> None:
    vs, _ = store
    with pytest.raises(openai.BadRequestError) as e:
        client.vector_stores.search(vs.id, query="x", filters={"type": "gt", "key": "year", "value": True})
    assert e.value.body["param"] == "filters.value"  # type: ignore[index]


def test_a_long_file_with_auto_chunking_is_cut_to_what_the_embedding_model_takes(client: openai.OpenAI) -> None:
    """auto = 800/400 tokens (OpenAI's), but all-MiniLM-L6-v2 takes 256 tokens per input: the file is chunked to
    the model's length instead of failing, and its last paragraph is found."""
    try:
        client.vector_stores.list(limit=1)
    except openai.APIStatusError as e:
        if e.status_code == 501:
            pytest.skip("the mesh runs no vector store")
        raise
    filler = " ".join(f"Paragraph {i} describes the weather of an ordinary day in a quiet town." for i in range(150))
    text = filler + " Finally: the lighthouse keeper paints the lamp room bright orange every spring."
    fid = client.files.create(file=("long.txt", text.encode()), purpose="assistants").id
    vs = client.vector_stores.create(name="long", file_ids=[fid])  # no chunking_strategy: auto
    try:
        deadline = time.monotonic() + 180
        while (vs := client.vector_stores.retrieve(vs.id)).file_counts.in_progress:
            assert time.monotonic() < deadline, "ingestion did not finish"
            time.sleep(0.2)
        f = client.vector_stores.files.retrieve(file_id=fid, vector_store_id=vs.id)
        assert f.status == "completed", f.last_error
        page = client.vector_stores.search(vs.id, query="who paints the lamp room orange?")
        assert page.data and page.data[0].file_id == fid
        assert "lighthouse keeper" in page.data[0].content[0].text
    finally:
        client.vector_stores.delete(vs.id)
        client.files.delete(fid)
