"""Vector store bootstrap: ``python -m embedmesh.services.vector_store.main --port N --data-dir DIR
--backend embedded|pgvector [--postgres-dsn DSN] --inference-addr HOST:PORT --embedding-model all-MiniLM-L6-v2``.

SERVING once the schema and index are open and files a previous process left in progress are re-queued.
"""

from __future__ import annotations

import asyncio

from embedmesh.core.logs import get_logger, setup_logging
from embedmesh.core.security import configure_from_argv
from embedmesh.core.server import Access, Server, ServerOptions, run_service
from embedmesh.core.telemetry import setup_tracing
from embedmesh.services.vector_store.config import VectorStoreConfig
from embedmesh.services.vector_store.servicer import SERVICE_NAME, VectorStoreServicer
from embedmesh.services.vector_store.vector_stores import VectorStores, build
from embedmesh.vectorstore.v1 import vectorstore_pb2_grpc

__all__ = ["serve", "start", "main"]

log = get_logger("embedmesh.vector_store")


async def start(config: VectorStoreConfig) -> tuple[Server, VectorStores]:
    """Build, bind and start serving (used by ``serve`` and by in-process tests)."""
    api = await asyncio.to_thread(build, config)
    server = Server("vector-store", ServerOptions(host=config.host, port=config.port,
                                                  max_message_bytes=config.max_message_bytes,
                                                  metrics_port=config.metrics_port))
    server.add(vectorstore_pb2_grpc.add_VectorStoreServiceServicer_to_server,
               VectorStoreServicer(api, config.max_file_bytes), SERVICE_NAME, access=Access.PUBLIC)
    server.on_drain(api.close)
    await server.start()
    requeued = await api.start()
    if requeued:
        log.info("files left in progress by the previous process",
                 extra={"count": requeued, "action": "re-queued" if config.requeue_on_start else "failed"})
    await server.set_serving(True)
    return server, api


async def serve(config: VectorStoreConfig) -> None:
    server, _ = await start(config)
    server.install_signal_handlers()
    print(f"vector-store listening on {server.address} (backend {config.backend}, embeddings "
          f"{config.embedding_model} via {config.inference_addr})", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    config = VectorStoreConfig.from_args(configure_from_argv(argv, prog="embedmesh-vector-store"))
    setup_logging("vector-store")
    setup_tracing("vector-store")
    log.info("config", extra={"config": config.describe()})
    run_service(serve(config))


if __name__ == "__main__":
    main()
