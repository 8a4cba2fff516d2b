"""Gateway bootstrap: config, JSON logs, tracing, uvicorn.

    python -m embedmesh.gateway.main [--host H] [--port P] [--preprocessor HOST:PORT] ...

Prints ``gateway listening on http://HOST:PORT`` once the socket is bound (the real port when ``--port 0``).
SIGTERM/SIGINT stop it cleanly: uvicorn stops accepting, lets open responses finish for a few seconds (cancelling
what is left, which cancels the gRPC calls), then the app's shutdown closes the channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import uvicorn

from embedmesh.core.logs import get_logger, setup_logging
from embedmesh.core.security import configure_from_argv
from embedmesh.core.telemetry import setup_tracing
from embedmesh.gateway.app import create_app
from embedmesh.gateway.config import GatewayConfig

log = get_logger("embedmesh.gateway")

_GRACE_S = 5


class _Server(uvicorn.Server):
    """uvicorn, minus its re-raising of the signal after shutdown, so a SIGTERM/SIGINT stop exits 0 with a last log
    line instead of dying by the signal (or a KeyboardInterrupt traceback)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting for open responses
        else:
            log.info("stopping", extra={"signal": signal.Signals(sig).name})
            self.should_exit = True


def _bound_port(server: uvicorn.Server, default: int) -> int:
    for s in getattr(server, "servers", []) or []:
        for sock in getattr(s, "sockets", []) or []:
            return int(sock.getsockname()[1])
    return default


async def serve(config: GatewayConfig) -> None:
    """Run until SIGTERM/SIGINT (uvicorn installs the handlers)."""
    app = create_app(config)
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                                           access_log=False, timeout_graceful_shutdown=_GRACE_S, lifespan="on"))

    async def announce() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.02)
        if server.started:
            port = _bound_port(server, config.port)
            log.info("listening", extra={"host": config.host, "port": port, "preprocessor": config.preprocessor})
            print(f"gateway listening on http://{config.host}:{port}", flush=True)

    await asyncio.gather(server.serve(), announce())


def main(argv: list[str] | None = None) -> None:
    config = GatewayConfig.from_args(configure_from_argv(argv, prog="python -m embedmesh.gateway.main"))
    setup_logging("gateway")
    setup_tracing("gateway")
    log.info("config", extra={"config": config.describe()})
    asyncio.run(serve(config))
    log.info("stopped")


if __name__ == "__main__":
    main()
