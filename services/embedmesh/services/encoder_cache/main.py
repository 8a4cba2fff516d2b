"""Standalone encoder cache: ``python -m embedmesh.services.encoder_cache.main --port N [--redis-url URL]``.
(The preprocessor also serves the same API on its own port, over its in-process cache.)"""

from __future__ import annotations

from dataclasses import dataclass

from embedmesh.cache.v1 import cache_pb2_grpc
from embedmesh.core.config import Settings, option
from embedmesh.core.logs import get_logger, setup_logging
from embedmesh.core.security import configure_from_argv
from embedmesh.core.server import Server, ServerOptions, run_service
from embedmesh.core.telemetry import setup_tracing
from embedmesh.services.encoder_cache.service import SERVICE_NAME, EncoderCacheServicer
from embedmesh.services.encoder_cache.tiered import DEFAULT_MAX_TTL_SECONDS, CacheConfig, TieredCache

log = get_logger("embedmesh.encoder_cache")


@dataclass(frozen=True)
class EncoderCacheConfig(Settings, service="cache", prog="embedmesh-encoder-cache",
                         description="Run the encoder cache API standalone (L1, over Redis when --redis-url)."):
    """The standalone encoder cache's settings (``core/config.py``: ``--field-name``, ``EMBEDMESH_CACHE_<FIELD>``)."""

    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 50071
    """gRPC port (0 = any free port)."""
    metrics_port: int = 0
    """Prometheus /metrics port (0 = none)."""
    redis_url: str = option("", aliases=("REDIS_URL",))
    """L2 Redis URL; empty = L1 only."""
    capacity_bytes: int = 1 << 30
    """L1 capacity in bytes."""
    default_ttl: int = option(3600, aliases=("EMBEDMESH_CACHE_TTL_SECONDS",))
    """TTL in seconds of entries stored without their own."""
    max_ttl: int = option(DEFAULT_MAX_TTL_SECONDS, aliases=("EMBEDMESH_CACHE_MAX_TTL_SECONDS",))
    """Longest ttl_seconds a client may ask for (longer: INVALID_ARGUMENT)."""
    max_tensor_bytes: int = option(256 << 20, aliases=("EMBEDMESH_MAX_EMBEDS_BYTES",))
    """Largest tensor a client may store, in bytes."""

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0 or not 1 <= self.default_ttl <= self.max_ttl or self.max_tensor_bytes < 1024:
            raise ValueError("capacity must be >= 0, 1 <= default ttl <= max ttl and max tensor bytes >= 1024")


def parse(argv: list[str] | None = None) -> tuple[ServerOptions, CacheConfig, int]:
    c = EncoderCacheConfig.from_args(argv)
    return (ServerOptions(host=c.host, port=c.port, metrics_port=c.metrics_port),
            CacheConfig(capacity_bytes=c.capacity_bytes, redis_url=c.redis_url, default_ttl_seconds=c.default_ttl,
                        max_ttl_seconds=c.max_ttl),
            c.max_tensor_bytes)


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
    run_service(serve(options, config, max_bytes))


if __name__ == "__main__":
    main()
