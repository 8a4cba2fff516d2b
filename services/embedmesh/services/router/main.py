"""Router bootstrap: ``python -m embedmesh.services.router.main --port N`` (prints "router listening on HOST:PORT")."""

from __future__ import annotations

import asyncio
import random

from embedmesh.core.logs import get_logger, setup_logging
from embedmesh.core.security import configure_from_argv
from embedmesh.core.server import Server, ServerOptions, run_service
from embedmesh.core.telemetry import setup_tracing
from embedmesh.router.v1 import router_pb2_grpc
from embedmesh.services.router.config import RouterConfig
from embedmesh.services.router.metrics import DROPS
from embedmesh.services.router.policy import KvRouter
from embedmesh.services.router.registry import Registry
from embedmesh.services.router.servicer import SERVICE_NAME, RouterServicer, update_gauges

__all__ = ["build", "sweep_forever", "serve", "main"]

log = get_logger("embedmesh.router")


def build(config: RouterConfig) -> RouterServicer:
    """The servicer and the domain objects behind it, from one config."""
    registry = Registry(stale_seconds=config.stale_seconds, approx_ttl_seconds=config.approx_ttl_seconds,
                        approx_max_blocks=config.approx_max_blocks)
    return RouterServicer(KvRouter(registry, config.weights, random.Random(config.seed), config.mode))


async def sweep_forever(registry: Registry, every_seconds: float) -> None:
    """Drop silent workers, age out approximate blocks and refresh the gauges, every ``every_seconds``."""
    while True:
        await asyncio.sleep(every_seconds)
        for wid in registry.sweep():
            DROPS.labels("silent").inc()
            log.warning("worker silent; dropped from routing", extra={"worker_id": wid})
        update_gauges(registry)


async def serve(config: RouterConfig) -> None:
    servicer = build(config)
    server = Server("router", ServerOptions(host=config.host, port=config.port, metrics_port=config.metrics_port))
    server.add(router_pb2_grpc.add_RouterServiceServicer_to_server, servicer, SERVICE_NAME)
    server.on_drain_start(servicer.start_drain)
    await server.start()
    server.install_signal_handlers()
    await server.set_serving(True)
    print(f"router listening on {server.address}", flush=True)
    sweeper = asyncio.create_task(sweep_forever(servicer.registry, config.sweep_seconds))
    try:
        await server.wait_for_termination()
    finally:
        sweeper.cancel()


def main(argv: list[str] | None = None) -> None:
    config = RouterConfig.from_args(configure_from_argv(argv, prog="embedmesh-router"))
    setup_logging("router")
    setup_tracing("router")
    log.info("config", extra={"config": config.describe()})
    run_service(serve(config))


if __name__ == "__main__":
    main()
