"""End-to-end vector search through a real mesh (gateway, preprocessor, hf-embed worker with all-MiniLM-L6-v2,
vector store with the embedded hnswlib index): where the time of ``POST /v1/vector_stores/{id}/search`` goes.

A store is made through the REST API (files uploaded, a vector store created from them, ingestion awaited: every
chunk embedded by the mesh's embedding worker). Then, at 1 and at 8 concurrent clients, p50/p99 and requests/s of:

  * ``POST /v1/vector_stores/{id}/search`` with a new query text: the whole path (gateway, the vector store, its
    Embed call through the preprocessor to the embedding worker, the index, the chunk rows);
  * ``POST /v1/embeddings`` of a new query of the same shape: the embedding alone (gateway -> preprocessor ->
    embedding worker);
  * the search again with the queries already searched: their vectors come from the preprocessor's encoder cache;
  * ``SearchVectorStore`` with ``query_embedding`` (a query's vector) straight to the vector store's gRPC port: the
    search alone (no gateway, no embedding: the index and the chunk rows);
  * the embedding's limit: the same hf-embed engine (one thread, as the worker runs it) called in this process.

The paths take turns (``--rounds``, each row's requests split over them), so a change in the shared machine's
load falls on every path alike. Every query is new unless the row says repeated: the encoder cache answers a
repeated input without the model, so "the same query" twice would measure the cache, not the embedding.

The index at 1M vectors is measured on its own (with its limits) by ``bench_vector_store.py``; here the store is
small (``--files`` files of a few chunks) because every chunk is embedded by the model on 2 cores.

    python bench/bench_vector_search_e2e.py [--quick] [--files 40] [--requests 200] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.mesh import start_mesh  # noqa: E402

MODEL = "all-MiniLM-L6-v2"
TOPICS = ["bananas", "rockets", "databases", "violins", "glaciers", "bicycles", "volcanoes", "compilers", "tea",
          "bridges", "honeybees", "telescopes", "sourdough", "submarines", "chess", "orchids", "railways", "coral",
          "typewriters", "lighthouses"]
VERBS = ["grow", "fail", "change", "work", "move", "break", "last", "begin", "matter", "improve"]
PLACES = ["in winter", "near the coast", "under pressure", "at night", "in the mountains", "after rain",
          "in old cities", "for beginners", "in the desert", "on long trips"]


def document(i: int, words: int, rng: random.Random) -> str:
    """A synthetic article about one topic, ``words`` words long."""
    topic = TOPICS[i % len(TOPICS)]
    out: list[str] = [f"# Notes on {topic} ({i})"]
    n = 0
    while n < words:
        s = (f"{topic.capitalize()} {rng.choice(VERBS)} {rng.choice(PLACES)} because of "
             f"{rng.choice(TOPICS)} and {rng.choice(TOPICS)}, as record {rng.randrange(10**6)} shows.")
        out.append(s)
        n += len(s.split())
    return " ".join(out)


WARM = 10
"""Warm-up calls before each measured row."""


class Fresh:
    """Query strings never used before in this run, handed out in slices: the preprocessor's encoder cache answers a
    repeated /v1/embeddings input (and the vector store's Embed call of a repeated query) without the model."""

    def __init__(self, seed: int = 2) -> None:
        self._rng = random.Random(seed)
        self._seen: set[str] = set()

    def take(self, n: int) -> list[str]:
        out: list[str] = []
        while len(out) < n:
            q = (f"why do {self._rng.choice(TOPICS)} {self._rng.choice(VERBS)} {self._rng.choice(PLACES)}? "
                 f"({self._rng.randrange(10**9)})")
            if q not in self._seen:
                self._seen.add(q)
                out.append(q)
        return out


def pct(xs: list[float], q: float) -> float:
    return 1000 * float(np.percentile(xs, q))


async def drive(call: Callable[[int], Awaitable[None]], clients: int, total: int) -> tuple[list[float], float]:
    """``total`` measured calls call(0) .. call(total - 1), ``clients`` at a time, after WARM warm-up calls
    call(total) .. call(total + WARM - 1): (latencies, wall seconds)."""
    lat: list[float] = []
    nxt = iter(range(total))

    async def client() -> None:
        for i in nxt:
            t = time.perf_counter()
            await call(i)
            lat.append(time.perf_counter() - t)

    for i in range(total, total + WARM):
        await call(i)
    t0 = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(clients)])
    return lat, time.perf_counter() - t0


def make_store(base_url: str, files: int, words: int) -> tuple[str, int, float]:
    """A vector store of ``files`` synthetic files through the REST API: (id, chunks, ingest seconds)."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(1)
    ids = [client.files.create(file=(f"doc{i}.md", document(i, words, rng).encode()), purpose="assistants").id
           for i in range(files)]
    t0 = time.perf_counter()
    # Static chunks that fit the model (all-MiniLM-L6-v2 takes at most 256 tokens and never truncates; the auto
    # strategy's 800-token chunks would be refused).
    vs = client.vector_stores.create(name="bench-e2e", file_ids=ids, chunking_strategy={
        "type": "static", "static": {"max_chunk_size_tokens": 200, "chunk_overlap_tokens": 50}})
    deadline = time.monotonic() + 1800
    while (vs := client.vector_stores.retrieve(vs.id)).file_counts.in_progress:
        if time.monotonic() > deadline:
            raise RuntimeError("ingestion did not finish in 30 minutes")
        time.sleep(0.2)
    ingest_s = time.perf_counter() - t0
    if vs.file_counts.completed != files:
        failed = client.vector_stores.files.list(vector_store_id=vs.id, filter="failed", limit=1).data
        raise RuntimeError(f"ingestion: {vs.file_counts}; {failed[0].last_error if failed else ''}")
    chunks = 0
    for fid in ids:  # the chunk count of each file: its `progress` (an embedmesh extra on the file object)
        f = client.vector_stores.files.retrieve(vector_store_id=vs.id, file_id=fid)
        chunks += int(((f.model_extra or {}).get("progress") or {}).get("chunks_total", 0))
    return vs.id, chunks, ingest_s


SEARCH = "REST search, new query (all of it)"
EMBED = "REST /v1/embeddings, new query"
SEARCH_CACHED = "REST search, repeated query"
GRPC_SEARCH = "gRPC search, query_embedding"
ENGINE = "limit: hf-embed engine in-process"


async def measure(base_url: str, vs_addr: str, store_id: str, fresh: Fresh, requests: int, rounds: int,
                  clients_list: list[int]) -> list[tuple[str, int, list[float], float]]:
    """Each path in ``rounds`` turns of ``requests / rounds`` calls, the paths taking turns, so a change in the
    machine's load (it is shared) falls on every path alike."""
    import grpc
    import httpx

    from embedmesh.core.tensors import from_numpy
    from embedmesh.models.minilm import minilm_dir
    from embedmesh.services.worker.engines.hf_embed.engine import HFEmbedConfig, HFEmbedEngine
    from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
    from embedmesh.vectorstore.v1 import vectorstore_pb2_grpc as pb_grpc

    per = max(1, requests // rounds)
    n = per + WARM
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    out: dict[tuple[str, int], tuple[list[float], float]] = {}
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as http, \
            grpc.aio.insecure_channel(vs_addr) as channel:
        stub = pb_grpc.VectorStoreServiceStub(channel)
        vectors: list[np.ndarray] = []
        texts = fresh.take(n)
        for i in range(0, n, 32):  # query vectors for the gRPC rows, made by the mesh's own embedding worker
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": texts[i:i + 32]})
            r.raise_for_status()
            vectors.extend(np.asarray(d["embedding"], dtype=np.float32) for d in r.json()["data"])

        def rest_search(texts: list[str]) -> Callable[[int], Awaitable[None]]:
            async def call(i: int) -> None:
                r = await http.post(f"/v1/vector_stores/{store_id}/search", json={"query": texts[i]})
                r.raise_for_status()
                assert r.json()["data"], "a search found nothing"
            return call

        def rest_embed(texts: list[str]) -> Callable[[int], Awaitable[None]]:
            async def call(i: int) -> None:
                r = await http.post("/v1/embeddings", json={"model": MODEL, "input": texts[i]})
                r.raise_for_status()
            return call

        async def grpc_search(i: int) -> None:
            r = await stub.SearchVectorStore(pb.SearchVectorStoreRequest(
                vector_store_id=store_id, query_embedding=from_numpy(vectors[i])))
            assert r.data, "a search found nothing"

        # The embedding's limit: the worker's engine (1 thread, as the mesh runs it) in this process.
        engine = HFEmbedEngine(HFEmbedConfig(minilm_dir(), MODEL, threads=1))
        await engine.start()

        def in_process(texts: list[str]) -> Callable[[int], Awaitable[None]]:
            async def call(i: int) -> None:
                await engine.embed([texts[i]])
            return call

        for clients in clients_list:
            for _ in range(rounds):
                searched = fresh.take(n)
                for name, call in [(SEARCH, rest_search(searched)), (EMBED, rest_embed(fresh.take(n))),
                                   (SEARCH_CACHED, rest_search(searched)), (GRPC_SEARCH, grpc_search),
                                   (ENGINE, in_process(fresh.take(n)))]:
                    lat, wall = await drive(call, clients, per)
                    before, spent = out.get((name, clients), ([], 0.0))
                    out[(name, clients)] = (before + lat, spent + wall)
            for name in (SEARCH, EMBED, SEARCH_CACHED, GRPC_SEARCH, ENGINE):
                print(f"... {name}, {clients} clients: p50 {pct(out[(name, clients)][0], 50):.1f} ms", flush=True)
        await engine.shutdown()
    return [(name, clients, lat, wall) for (name, clients), (lat, wall) in out.items()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer files and requests")
    p.add_argument("--files", type=int, default=40)
    p.add_argument("--words", type=int, default=600, help="words per file")
    p.add_argument("--requests", type=int, default=200, help="requests per row")
    p.add_argument("--rounds", type=int, default=4, help="turns the paths take (each row's requests split over them)")
    a, _ = p.parse_known_args()
    if a.quick:
        a.files, a.requests, a.rounds = 10, 60, 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    fresh = Fresh()
    mesh = start_mesh(workers=1, env={"EMBEDMESH_TRACE_CONSOLE": "0"})
    try:
        t0 = time.perf_counter()
        store_id, chunks, ingest_s = make_store(mesh.base_url, a.files, a.words)
        print(f"... store: {a.files} files, {chunks} chunks, ingested in {ingest_s:.1f} s "
              f"(setup {time.perf_counter() - t0:.1f} s)", flush=True)
        rows = asyncio.run(measure(mesh.base_url, str(mesh.extra["vector_store"]), store_id, fresh, a.requests,
                                   a.rounds, [1, 8]))
    finally:
        mesh.stop()
    print(f"\nPOST /v1/vector_stores/{{id}}/search end to end ({MODEL} embeds the query; embedded hnswlib index, "
          f"{chunks} chunks; {a.requests} requests per row, each query new unless 'repeated'; {os.cpu_count()} cores)")
    print(f"{'path':<40} {'clients':>7} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
    for name, clients, lat, wall in rows:
        print(f"{name:<40} {clients:>7} {pct(lat, 50):>8.2f} {pct(lat, 99):>8.2f} {len(lat) / wall:>8.1f}")
    by = {(n, c): pct(lat, 50) for n, c, lat, _ in rows}
    for clients in (1, 8):
        whole, emb, srch, model = (by[(name, clients)] for name in (SEARCH, EMBED, GRPC_SEARCH, ENGINE))
        print(f"  {clients} client(s), p50 of {whole:.1f} ms: the embedding call {emb:.1f} ms ({emb / whole:.0%}; "
              f"the model alone {model:.1f} ms) + the search alone {srch:.1f} ms ({srch / whole:.0%}); "
              f"remainder {whole - emb - srch:+.1f} ms (the vector store's own hop to the preprocessor, the hits' "
              f"JSON; negative = noise)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
