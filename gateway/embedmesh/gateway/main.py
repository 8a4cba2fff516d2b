"""Gateway bootstrap: config, logging, tracing, uvicorn. SIGINT/SIGTERM stop it cleanly (uvicorn drains)."""

from __future__ import annotations

import asyncio

import uvicorn

from embedmesh.core.logs import get_logger, setup_logging
from embedmesh.core.telemetry import setup_tracing
from embedmesh.gateway.app import create_app
from embedmesh.gateway.config import GatewayConfig

log = get_logger("embedmesh.gateway")


async def serve(config: GatewayConfig) -> None:
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                                           access_log=False, timeout_graceful_shutdown=5, lifespan="on"))

    async def announce() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.05)
        print(f"gateway listening on http://{config.host}:{config.port} (preprocessor {config.preprocessor})",
              flush=True)

    await asyncio.gather(server.serve(), announce())


def main(argv: list[str] | None = None) -> None:
    config = GatewayConfig.from_args(argv)
    setup_logging("gateway")
    setup_tracing("gateway")
    log.info("config", extra={"config": config.describe()})
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
