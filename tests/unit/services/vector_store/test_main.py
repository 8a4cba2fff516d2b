"""vector_store.main: ``start`` builds the configured backend, serves ``VectorStoreService`` (health SERVING once the
index is open) as a public service, and drains into ``api.close``; the process prints its address and backend."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.core import auth
from embedmesh.services.vector_store.config import VectorStoreConfig
from embedmesh.services.vector_store.main import start
from embedmesh.services.vector_store.servicer import SERVICE_NAME
from embedmesh.services.vector_store.vector_stores import VectorStores
from embedmesh.vectorstore.v1 import vectorstore_pb2 as pb
from embedmesh.vectorstore.v1 import vectorstore_pb2_grpc


async def test_start_serves_the_api_and_reports_serving(config: VectorStoreConfig) -> None:
    server, api = await start(replace(config))
    try:
        assert isinstance(api, VectorStores) and api.config.backend == config.backend
        async with grpc.aio.insecure_channel(server.address) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = vectorstore_pb2_grpc.VectorStoreServiceStub(ch)
            created = await stub.CreateVectorStore(pb.CreateVectorStoreRequest(name="n"))
            assert (await stub.GetVectorStore(pb.GetVectorStoreRequest(
                vector_store_id=created.vector_store.id))).vector_store.name == "n"
    finally:
        await server.drain()
    with pytest.raises(Exception):  # noqa: B017 - drained: the database connection was closed by api.close
        api.db.query("SELECT 1")


async def test_it_is_a_public_service_that_wants_an_api_key(config: VectorStoreConfig) -> None:
    auth.configure_keys(auth.keyring_from_values(api_keys="key-12345678=alpha"))
    server, _ = await start(replace(config))
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = vectorstore_pb2_grpc.VectorStoreServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListVectorStores(pb.ListVectorStoresRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = await stub.ListVectorStores(pb.ListVectorStoresRequest(),
                                             metadata=[("authorization", "Bearer key-12345678")])
            assert list(ok.data) == []
    finally:
        auth.configure_keys(auth.KeyRing())
        await server.drain()


def test_the_process_prints_its_address_and_backend(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "embedmesh.services.vector_store.main", "--port", "0",
                             "--data-dir", str(tmp_path / "vs"), "--tokenizer", "approx",
                             "--inference-addr", "127.0.0.1:1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("vector-store listening on 127.0.0.1:"), line
        assert "(backend embedded, embeddings " in line and "via 127.0.0.1:1)" in line
        assert (tmp_path / "vs" / "vectorstore.sqlite3").exists()
    finally:
        proc.terminate()
        proc.wait(timeout=15)
