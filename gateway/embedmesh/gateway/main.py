"""Gateway bootstrap: config, JSON logs, tracing, uvicorn.

    python -m embedmesh.gateway.main [--host H] [--port P] [--preprocessor HOST:PORT] [--drain-seconds S]
                                     [--https-cert PEM --https-key PEM] ...

Prints ``gateway listening on http://HOST:PORT`` once the socket is bound (the real port when ``--port 0``).
SIGTERM/SIGINT drain it: uvicorn stops accepting connections at once, closes idle keep-alive ones, and lets open
responses (SSE streams included) finish for up to ``--drain-seconds`` (EMBEDMESH_DRAIN_GRACE_SECONDS, default 30);
only then is what is left cancelled (which cancels its gRPC calls) and the app's shutdown closes the channel.
A second signal stops waiting. With ``--https-cert``/``--https-key`` (EMBEDMESH_GATEWAY_HTTPS_CERT/KEY) the REST
API is served over HTTPS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator, Sequence

import uvicorn

from embedmesh.core.logs import get_logger, setup_logging
from embedmesh.core.security import configure_from_argv
from embedmesh.core.server import run_service
from embedmesh.core.telemetry import setup_tracing
from embedmesh.gateway.app import create_app
from embedmesh.gateway.config import GatewayConfig
from embedmesh.gateway.protocol import GatewayHttpProtocol

log = get_logger("embedmesh.gateway")

DEFAULT_DRAIN_SECONDS = 30.0


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


async def serve(config: GatewayConfig, drain_seconds: float = DEFAULT_DRAIN_SECONDS, https_cert: str = "",
                https_key: str = "") -> None:
    """Run until SIGTERM/SIGINT, then drain for up to ``drain_seconds``."""
    app = create_app(config)
    # uvicorn's graceful shutdown takes whole seconds; round up so a fractional drain is never cut short.
    grace = max(0, int(-(-drain_seconds // 1)))
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                                    http=GatewayHttpProtocol,
                                    access_log=False, timeout_graceful_shutdown=grace, lifespan="on",
                                    ssl_certfile=https_cert or None, ssl_keyfile=https_key or None))
    scheme = "https" if https_cert else "http"

    async def announce() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.02)
        if server.started:
            port = _bound_port(server, config.port)
            log.info("listening", extra={"host": config.host, "port": port, "preprocessor": config.preprocessor})
            print(f"gateway listening on {scheme}://{config.host}:{port}", flush=True)

    await asyncio.gather(server.serve(), announce())


def _process_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``--drain-seconds`` (over EMBEDMESH_DRAIN_GRACE_SECONDS, over 30 s), ``--https-cert``/``--https-key``, and
    the other arguments (for ``GatewayConfig``)."""
    env = os.environ
    p = argparse.ArgumentParser(prog="python -m embedmesh.gateway.main", add_help=False)
    p.add_argument("--drain-seconds", type=float,
                   default=float(env.get("EMBEDMESH_DRAIN_GRACE_SECONDS", DEFAULT_DRAIN_SECONDS)))
    p.add_argument("--https-cert", default=env.get("EMBEDMESH_GATEWAY_HTTPS_CERT", ""))
    p.add_argument("--https-key", default=env.get("EMBEDMESH_GATEWAY_HTTPS_KEY", ""))
    known, rest = p.parse_known_args(list(argv))
    if not known.drain_seconds >= 0:
        p.error("--drain-seconds must be >= 0")
    if bool(known.https_cert) != bool(known.https_key):
        p.error("--https-cert and --https-key go together")
    return known, rest


def main(argv: list[str] | None = None) -> None:
    rest = configure_from_argv(argv, prog="python -m embedmesh.gateway.main")
    known, rest = _process_args(rest)
    config = GatewayConfig.from_args(rest)
    setup_logging("gateway")
    setup_tracing("gateway")
    log.info("config", extra={"config": config.describe(), "drain_seconds": known.drain_seconds,
                              "https": bool(known.https_cert)})
    run_service(serve(config, known.drain_seconds, known.https_cert, known.https_key))
    log.info("stopped")


if __name__ == "__main__":
    main()
