"""Worker bootstrap: parse config, build the configured engine through the registry (``engines/registry.py``),
serve it (NOT_SERVING until the model is loaded). No engine is named here: what an engine offers beyond the
``Engine`` interface (KV events, KV usage, its own metrics, LoRA) is asked of the engine through its optional hooks."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from embedmesh.core.logs import get_logger, setup_logging
from embedmesh.core.security import configure_from_argv
from embedmesh.core.server import Server, ServerOptions, run_service
from embedmesh.core.telemetry import setup_tracing
from embedmesh.models.convert import ModelNotFound
from embedmesh.router.v1 import router_pb2
from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines.base import Engine
from embedmesh.services.worker.engines.registry import build_engine
from embedmesh.services.worker.metrics import register_engine_metrics
from embedmesh.services.worker.router_link import LoadReport, RouterLink
from embedmesh.services.worker.servicer import WorkerServicer
from embedmesh.services.worker.watchdog import Watchdog
from embedmesh.worker.v1 import worker_pb2_grpc

log = get_logger("embedmesh.worker")

SERVICE_NAME = "embedmesh.worker.v1.WorkerService"


async def serve(config: WorkerConfig) -> None:
    worker_id = f"{config.engine}-{uuid.uuid4().hex[:8]}"
    engine = build_engine(config)
    options = ServerOptions(host=config.host, port=config.port, metrics_port=config.metrics_port)
    server = Server("worker", options)
    lora_root = Path(config.lora_root) if config.lora_root else None
    servicer = WorkerServicer(engine, worker_id, lora_root, max_queue=config.max_queue,
                              max_message_bytes=options.max_message_bytes)
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer, SERVICE_NAME)
    # New generations on open GenerateMany streams are refused once the drain starts; running ones finish.
    server.on_drain_start(servicer.many.start_drain)
    server.on_drain(engine.shutdown)
    register_engine_metrics(engine, worker_id)
    await server.start()
    server.install_signal_handlers()
    print(f"worker {worker_id} listening on {server.address} (loading {config.engine} engine)", flush=True)
    await engine.start()
    await _load_lora_modules(engine, config, lora_root)
    watchdog = Watchdog(engine, config.watchdog_seconds, set_not_serving=lambda: server.set_serving(False),
                        exit=os._exit)
    watchdog.start()
    # A drain shuts the engine on purpose: stop watching before that.
    server.on_drain_start(watchdog.stop)
    await server.set_serving(True)
    info = engine.info()
    log.info("serving", extra={"model": info.model, "engine": info.engine, "worker_id": worker_id})
    print(f"worker {worker_id} serving model {info.model!r} on {server.address}", flush=True)
    if config.routers and info.task == "generate":
        from embedmesh.core.kv_events import to_proto

        source = engine.kv_event_source()
        link = RouterLink(
            config.routers,
            router_pb2.Registration(worker_id=worker_id, address=config.advertise or server.address, model=info.model,
                                    block_size=config.block_size, engine=info.engine,
                                    publishes_kv_events=source is not None),
            load=lambda: LoadReport(engine.stats().active_requests, engine.kv_usage(), tuple(engine.lora_names())),
            snapshot=(lambda: to_proto(source.kv_snapshot())) if source is not None else None,
        )
        if source is not None:
            source.on_kv_events(lambda events: link.publish(to_proto(events)))
        link.start()
        watchdog.add_on_trip(link.close)
        # Leave the routers as soon as a drain starts: no new work arrives while in-flight streams finish.
        server.on_drain_start(link.close)
    await server.wait_for_termination()


async def _load_lora_modules(engine: Engine, config: WorkerConfig, lora_root: Path | None) -> None:
    """``--lora-modules``: load each adapter before serving; a bad one stops the worker with the reason."""
    from embedmesh.core.errors import EmbedmeshError
    from embedmesh.services.worker.lora_paths import default_lora_root, resolve_adapter_path

    for name, path in config.lora_modules:
        try:
            folder = resolve_adapter_path(path, lora_root or default_lora_root(), field="--lora-modules")
            await engine.load_lora(name, str(folder))
        except NotImplementedError:
            raise SystemExit(f"--lora-modules: the {config.engine} engine does not load LoRA adapters") from None
        except EmbedmeshError as e:
            raise SystemExit(f"--lora-modules {name}={path}: {e}") from None
        log.info("LoRA adapter loaded", extra={"adapter": name, "path": str(folder)})


def main(argv: list[str] | None = None) -> None:
    config = WorkerConfig.from_args(configure_from_argv(argv, prog="embedmesh-worker"))
    setup_logging("worker")
    setup_tracing("worker")
    log.info("config", extra={"config": config.describe()})
    try:
        run_service(serve(config))
    except ModelNotFound as e:
        # The operator's to fix (a volume not mounted, a wrong --model): one line saying what to pass, exit status
        # 2 as for a bad flag, no traceback, so a restarting container's log keeps showing the reason.
        print(f"embedmesh-worker: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
