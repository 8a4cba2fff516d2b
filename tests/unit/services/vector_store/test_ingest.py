"""Ingestion metrics, read from the process's Prometheus registry (what the service's /metrics serves) around real
ingestions through the gRPC service: completed, failed and cancelled files are counted once each, chunks and
durations are recorded, and the in-progress gauge returns to where it was."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

import embedmesh.services.vector_store.ingest  # noqa: F401 - registers the metrics
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from tests.unit.services.vector_store.conftest import Running, upload, wait_files

FAMILIES = {  # as the dashboard (deploy/grafana/embedmesh.json) queries them; counters lose "_total" here
    "embedmesh_vector_store_files_ingested": "counter",
    "embedmesh_vector_store_ingestion_duration_seconds": "histogram",
    "embedmesh_vector_store_chunks_indexed": "counter",
    "embedmesh_vector_store_ingestions_in_progress": "gauge",
}


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _snapshot() -> dict[str, float]:
    return {
        "completed": _sample("embedmesh_vector_store_files_ingested_total", status="completed"),
        "failed": _sample("embedmesh_vector_store_files_ingested_total", status="failed"),
        "cancelled": _sample("embedmesh_vector_store_files_ingested_total", status="cancelled"),
        "observed": _sample("embedmesh_vector_store_ingestion_duration_seconds_count"),
        "chunks": _sample("embedmesh_vector_store_chunks_indexed_total"),
        "in_progress": _sample("embedmesh_vector_store_ingestions_in_progress"),
    }


async def _settled(before: dict[str, float], ended: int) -> dict[str, float]:
    """The metrics once ``ended`` more ingestion tasks have finished (a task ends just after its row is final)."""
    deadline = time.monotonic() + 20
    while True:
        now = _snapshot()
        if sum(now[k] - before[k] for k in ("completed", "failed", "cancelled")) >= ended:
            return now
        assert time.monotonic() < deadline, (before, now)
        await asyncio.sleep(0.02)


def test_the_service_registers_every_ingestion_metric() -> None:
    families = {m.name: m.type for m in REGISTRY.collect()}
    for name, kind in FAMILIES.items():
        assert families.get(name) == kind, name


async def test_completed_files_count_their_chunks(svc: Running) -> None:
    before = _snapshot()
    vs = (await svc.stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="m"))).vector_store
    for i in range(2):
        f = await upload(svc.stub, f"d{i}.txt", " ".join(f"w{i}_{j}" for j in range(300)).encode())
        await svc.stub.CreateVectorStoreFile(pb.CreateVectorStoreFileRequest(
            vector_store_id=vs.id, file_id=f.id,
            chunking_strategy=pb.ChunkingStrategy(static_chunking=pb.StaticChunking(max_chunk_size_tokens=100,
                                                                                     chunk_overlap_tokens=0))))
    await wait_files(svc.stub, vs.id)
    files = (await svc.stub.ListVectorStoreFiles(pb.ListVectorStoreFilesRequest(vector_store_id=vs.id))).data
    after = await _settled(before, 2)
    assert after["completed"] - before["completed"] == 2
    assert after["failed"] == before["failed"] and after["cancelled"] == before["cancelled"]
    assert after["observed"] - before["observed"] == 2
    assert after["chunks"] - before["chunks"] == sum(f.chunks_total for f in files) >= 6
    assert after["in_progress"] == before["in_progress"]


async def test_failed_and_cancelled_files_are_counted(svc: Running, fake_embedder) -> None:
    before = _snapshot()
    fake_embedder.dim = 128  # vectors of the wrong size: the file fails
    vs = (await svc.stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="f"))).vector_store
    f = await upload(svc.stub, "a.txt", b"some text")
    await svc.stub.CreateVectorStoreFile(pb.CreateVectorStoreFileRequest(vector_store_id=vs.id, file_id=f.id))
    await wait_files(svc.stub, vs.id)
    fake_embedder.dim = 384
    after = await _settled(before, 1)
    assert after["failed"] - before["failed"] == 1 and after["observed"] - before["observed"] == 1
    assert after["chunks"] == before["chunks"]

    before = after
    fake_embedder.delay_seconds = 0.2
    text = " ".join(f"word{i}" for i in range(3000)).encode()
    fids = [(await upload(svc.stub, f"big{i}.txt", text)).id for i in range(3)]
    b = (await svc.stub.CreateVectorStoreFileBatch(pb.CreateVectorStoreFileBatchRequest(
        vector_store_id=vs.id, file_ids=fids))).batch
    assert _snapshot()["in_progress"] - before["in_progress"] == 3  # queued or running
    await svc.stub.CancelVectorStoreFileBatch(pb.CancelVectorStoreFileBatchRequest(vector_store_id=vs.id,
                                                                                   batch_id=b.id))
    fake_embedder.delay_seconds = 0.0
    after = await _settled(before, 3)
    assert after["cancelled"] - before["cancelled"] == 3
    assert after["completed"] == before["completed"] and after["chunks"] == before["chunks"]
    assert after["in_progress"] == before["in_progress"]


def test_auto_chunking_fits_the_embedding_models_input_length() -> None:
    from embedmesh.services.vector_store.ingest import fit_auto_chunking
    from embedmesh.services.vector_store.objects import AUTO_CHUNKING, ChunkingSpec

    assert fit_auto_chunking(AUTO_CHUNKING, 256) == ChunkingSpec(254, 127)  # MiniLM: 256 with [CLS] and [SEP]
    assert fit_auto_chunking(AUTO_CHUNKING, 8192) == AUTO_CHUNKING  # room for 800: OpenAI's auto as it is
    assert fit_auto_chunking(AUTO_CHUNKING, 0) == AUTO_CHUNKING  # the mesh did not say
    explicit = ChunkingSpec(300, 100)
    assert fit_auto_chunking(explicit, 256) == explicit  # a static strategy is the client's choice
