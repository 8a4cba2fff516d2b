"""An ingestion that finds its PostgreSQL connection gone (the server restarted) tries its file again on a new
connection instead of leaving it ``in_progress`` until the next process start: every file ends ``completed`` with
each chunk stored once (found by tests/hosts, PostgreSQL restarted while files were being ingested)."""

from __future__ import annotations

import asyncio

import grpc
import psycopg
import pytest

from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from tests.unit.services.vector_store.conftest import Running, upload, wait_files
from tests.unit.services.vector_store.fake_embedder import FakeEmbedder


@pytest.mark.parametrize("backend", ["pgvector"])
async def test_files_survive_the_connection_dropped_mid_ingestion(svc: Running, fake_embedder: FakeEmbedder,
                                                                  backend: str) -> None:
    dsn = svc.config.postgres_dsn
    fake_embedder.delay_seconds = 0.3  # every file is still embedding when its connection goes
    vs = (await svc.stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="lost"))).vector_store
    ids = []
    for i in range(3):
        f = await upload(svc.stub, f"d{i}.txt", " ".join(f"w{i}_{j}" for j in range(200)).encode())
        await svc.stub.CreateVectorStoreFile(pb.CreateVectorStoreFileRequest(vector_store_id=vs.id, file_id=f.id))
        ids.append(f.id)
    await asyncio.sleep(0.1)
    with psycopg.connect(dsn, autocommit=True) as admin:  # what a restart does to the service's connections
        dropped = admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                "WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchone()
    assert dropped is not None and dropped[0] >= 1
    await asyncio.sleep(1.0)  # an ingestion's next statement (its progress, after a batch) meets the dead connection
    try:  # the one statement that finds the connection gone fails (here or in an ingestion); the next reconnects
        await svc.stub.GetVectorStore(pb.GetVectorStoreRequest(vector_store_id=vs.id))
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.INTERNAL, e
    got = await wait_files(svc.stub, vs.id, timeout=60)
    assert got.file_counts.completed == 3 and got.file_counts.failed == 0, got.file_counts
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT file_id, count(*), count(DISTINCT seq) FROM vs_chunks WHERE store_id = %s "
                            "GROUP BY file_id", (vs.id,)).fetchall()
    assert sorted(r[0] for r in rows) == sorted(ids)
    assert all(r[1] == r[2] > 0 for r in rows), rows  # each chunk once
