"""Standalone encoder cache: ``python -m embedmesh.services.encoder_cache.main --port N [--redis-url URL]``.
(The preprocessor also serves the same API on its own port, over its in-process cache.)"""

from __future__ import annotations

import argparse
import asyncio
import os

from embedmesh.cache.v1 import cache_pb2_grpc
from embedmesh.core.logs import get_logger, setup_logging
from embedmesh.core.security import configure_from_argv
from embedmesh.core.server import Server, ServerOptions
from embedmesh.core.telemetry import setup_tracing
from embedmesh.services.encoder_cache.service import SERVICE_NAME, EncoderCacheServicer
from embedmesh.services.encoder_cache.tiered import DEFAULT_MAX_TTL_SECONDS, CacheConfig, TieredCache

log = get_logger("embedmesh.encoder_cache")


def parse(argv: list[str] | None = None) -> tuple[ServerOptions, CacheConfig, int]:
    env = os.environ
    p = argparse.ArgumentParser(prog="embedmesh-encoder-cache")
    p.add_argument("--host", default=env.get("EMBEDMESH_CACHE_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env.get("EMBEDMESH_CACHE_PORT", "50071")))
    p.add_argument("--metrics-port", type=int, default=int(env.get("EMBEDMESH_CACHE_METRICS_PORT", "0")))
    p.add_argument("--redis-url", default=env.get("REDIS_URL", ""))
    p.add_argument("--capacity-bytes", type=int, default=int(env.get("EMBEDMESH_CACHE_CAPACITY_BYTES", 1 << 30)))
    p.add_argument("--default-ttl", type=int, default=int(env.get("EMBEDMESH_CACHE_TTL_SECONDS", 3600)))
    p.add_argument("--max-ttl", type=int,
                   default=int(env.get("EMBEDMESH_CACHE_MAX_TTL_SECONDS", DEFAULT_MAX_TTL_SECONDS)),
                   help="longest ttl_seconds a client may ask for (longer: INVALID_ARGUMENT)")
    p.add_argument("--max-tensor-bytes", type=int, default=int(env.get("EMBEDMESH_MAX_EMBEDS_BYTES", 256 << 20)))
    a = p.parse_args(argv)
    if a.capacity_bytes < 0 or not 1 <= a.default_ttl <= a.max_ttl or a.max_tensor_bytes < 1024:
        p.error("capacity must be >= 0, 1 <= default ttl <= max ttl and max tensor bytes >= 1024")
    return (ServerOptions(host=a.host, port=a.port, metrics_port=a.metrics_port),
            CacheConfig(capacity_bytes=a.capacity_bytes, redis_url=a.redis_url, default_ttl_seconds=a.default_ttl,
                        max_ttl_seconds=a.max_ttl),
            a.max_tensor_bytes)


async def serve(options: ServerOptions, config: CacheConfig, max_tensor_bytes: int) -> None:
    cache = TieredCache(config)
    server = Server("encoder-cache", options)
    server.add(cache_pb2_grpc.add_EncoderCacheServiceServicer_to_server,
               EncoderCacheServicer(cache, max_tensor_bytes), SERVICE_NAME)
    server.on_drain(cache.close)
    await server.start()
    server.install_signal_handlers()
    await server.set_serving(True)
    print(f"encoder-cache listening on {server.address} (L2: {config.redis_url or 'none'})", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    options, config, max_bytes = parse(configure_from_argv(argv, prog="embedmesh-encoder-cache"))
    setup_logging("encoder-cache")
    setup_tracing("encoder-cache")
    asyncio.run(serve(options, config, max_bytes))


if __name__ == "__main__":
    main()
