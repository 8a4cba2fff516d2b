"""Router bootstrap: ``python -m embedmesh.services.router.main --port N``."""

from __future__ import annotations

import argparse
import asyncio
import os

from embedmesh.core.logs import get_logger, setup_logging
from embedmesh.core.server import Server, ServerOptions
from embedmesh.core.telemetry import setup_tracing
from embedmesh.router.v1 import router_pb2_grpc
from embedmesh.services.router.registry import Registry
from embedmesh.services.router.scoring import Weights
from embedmesh.services.router.servicer import SERVICE_NAME, RouterServicer

log = get_logger("embedmesh.router")


def parse(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(prog="embedmesh-router", description="Run the KV-aware router.")
    p.add_argument("--host", default=env.get("EMBEDMESH_ROUTER_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env.get("EMBEDMESH_ROUTER_PORT", "50081")))
    p.add_argument("--metrics-port", type=int, default=int(env.get("EMBEDMESH_ROUTER_METRICS_PORT", "0")))
    p.add_argument("--prefill-weight", type=float, default=float(env.get("EMBEDMESH_ROUTER_PREFILL_WEIGHT", "1")))
    p.add_argument("--decode-weight", type=float, default=float(env.get("EMBEDMESH_ROUTER_DECODE_WEIGHT", "1")))
    p.add_argument("--temperature", type=float, default=float(env.get("EMBEDMESH_ROUTER_TEMPERATURE", "0")))
    p.add_argument("--stale-seconds", type=float, default=float(env.get("EMBEDMESH_ROUTER_STALE_SECONDS", "3")))
    p.add_argument("--approx-ttl", type=float, default=float(env.get("EMBEDMESH_ROUTER_APPROX_TTL", "120")))
    a = p.parse_args(argv)
    if a.prefill_weight < 0 or a.decode_weight < 0 or a.temperature < 0 or a.stale_seconds <= 0:
        p.error("weights and temperature must be >= 0 and stale-seconds > 0")
    return a


async def serve(a: argparse.Namespace) -> None:
    registry = Registry(stale_seconds=a.stale_seconds, approx_ttl_seconds=a.approx_ttl)
    servicer = RouterServicer(registry, Weights(a.prefill_weight, a.decode_weight, a.temperature))
    server = Server("router", ServerOptions(host=a.host, port=a.port, metrics_port=a.metrics_port))
    server.add(router_pb2_grpc.add_RouterServiceServicer_to_server, servicer, SERVICE_NAME)
    await server.start()
    server.install_signal_handlers()
    await server.set_serving(True)
    print(f"router listening on {server.address}", flush=True)

    async def sweep() -> None:
        while True:
            await asyncio.sleep(0.5)
            for wid in registry.sweep():
                log.warning("worker silent; dropped from routing", extra={"worker_id": wid})

    task = asyncio.create_task(sweep())
    await server.wait_for_termination()
    task.cancel()


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    setup_logging("router")
    setup_tracing("router")
    asyncio.run(serve(a))


if __name__ == "__main__":
    main()
