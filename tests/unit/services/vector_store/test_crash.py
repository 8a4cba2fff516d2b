"""Kill the service process (SIGKILL) in the middle of an ingestion and start it again: the file is never reported
completed with part of its chunks; on restart it is ingested again from the start (or, with --no-requeue, marked
failed with a reason)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from embedmesh.vectorstore.v1 import vectorstore_pb2_grpc
from tests.support.mesh import free_port
from tests.unit.services.vector_store.conftest import upload
from tests.unit.services.vector_store.fake_embedder import FakeEmbedder

TEXT = " ".join(f"token{i}" for i in range(4000)).encode()   # 40 chunks of 100 tokens with no overlap
CHUNKS = 40
LAST = " ".join(f"token{i}" for i in range(3900, 4000))


class Proc:
    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.log = open(log, "ab")
        self.p = subprocess.Popen([sys.executable, "-m", "embedmesh.services.vector_store.main", "--port",
                                   str(self.port), "--tokenizer", "approx", "--embed-batch-size", "2", *args],
                                  stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    async def stub(self) -> vectorstore_pb2_grpc.VectorStoreServiceStub:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        await asyncio.wait_for(channel.channel_ready(), 30)
        self.channel = channel
        return vectorstore_pb2_grpc.VectorStoreServiceStub(channel)

    async def kill(self) -> None:
        await self.channel.close()
        os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(10)

    async def stop(self) -> None:
        await self.channel.close()
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            self.p.wait(20)
        self.log.close()


@pytest.fixture
def slow_embedder() -> Iterator[FakeEmbedder]:
    e = FakeEmbedder(delay_seconds=0.25).start()
    yield e
    e.stop()


async def _file(stub: Any, sid: str, fid: str) -> pb.VectorStoreFile:
    return (await stub.GetVectorStoreFile(pb.GetVectorStoreFileRequest(vector_store_id=sid, file_id=fid))).file


async def _until(stub: Any, sid: str, fid: str, pred: Any, timeout: float = 25) -> pb.VectorStoreFile:
    deadline = time.monotonic() + timeout
    while True:
        f = await _file(stub, sid, fid)
        assert not (f.status == pb.FILE_STATUS_COMPLETED and f.chunks_done != CHUNKS)
        if pred(f):
            return f
        assert time.monotonic() < deadline, f"timed out; last state {f}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("requeue", [True, False], ids=["requeue", "no-requeue"])
async def test_kill_mid_ingestion(backend: str, tmp_path: Path, slow_embedder: FakeEmbedder, requeue: bool,
                                  request: pytest.FixtureRequest) -> None:
    if backend == "pgvector" and not requeue:
        pytest.skip("the no-requeue path is backend independent; run once")
    args = ["--backend", backend, "--data-dir", str(tmp_path / "data"), "--inference-addr", slow_embedder.address]
    if backend == "pgvector":
        args += ["--postgres-dsn", request.getfixturevalue("pg").database()]
    proc = Proc(args, tmp_path / "service.log")
    stub = await proc.stub()
    vs = (await stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="crash"))).vector_store
    f = await upload(stub, "long.txt", TEXT)
    await stub.CreateVectorStoreFile(pb.CreateVectorStoreFileRequest(
        vector_store_id=vs.id, file_id=f.id,
        chunking_strategy=pb.ChunkingStrategy(static_chunking=pb.StaticChunking(max_chunk_size_tokens=100,
                                                                                 chunk_overlap_tokens=0))))
    # Progress is visible while it runs; kill it part-way.
    mid = await _until(stub, vs.id, f.id, lambda x: x.chunks_done >= 6)
    assert mid.status == pb.FILE_STATUS_IN_PROGRESS and mid.chunks_total == CHUNKS
    await proc.kill()
    if backend == "embedded":
        with sqlite3.connect(tmp_path / "data" / "vectorstore.sqlite3") as db:
            assert db.execute("SELECT COUNT(*) FROM vs_chunks").fetchone()[0] == 0
            assert db.execute("SELECT status FROM vs_store_files").fetchone()[0] == "in_progress"

    slow_embedder.delay_seconds = 0.0
    proc = Proc(args + ([] if requeue else ["--no-requeue"]), tmp_path / "service.log")
    stub = await proc.stub()
    try:
        if not requeue:
            done = await _until(stub, vs.id, f.id, lambda x: x.status != pb.FILE_STATUS_IN_PROGRESS)
            assert done.status == pb.FILE_STATUS_FAILED and "stopped while ingesting" in done.last_error.message
            return
        done = await _until(stub, vs.id, f.id, lambda x: x.status == pb.FILE_STATUS_COMPLETED)
        assert done.chunks_done == done.chunks_total == CHUNKS
        r = await stub.SearchVectorStore(pb.SearchVectorStoreRequest(vector_store_id=vs.id, queries=[LAST],
                                                                     max_num_results=50))
        texts = [d.content[0].text for d in r.data]
        assert texts[0] == LAST and len(texts) == len(set(texts)) == CHUNKS   # each chunk exactly once
    finally:
        await proc.stop()
