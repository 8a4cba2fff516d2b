"""A `vllm` worker with KV events on, run inside the vLLM venv by test_vllm_worker_kv.py.

It wires what the worker's main wires (server, servicer, KV events forwarded to the routers, re-syncs answered from
the engine's snapshot) plus a tap: every translated event is also appended to ``--events-file`` as a JSON line, so
the test can compare the hashes with the ones it computes itself. The real main is covered by test_vllm_mesh.py and
test_vllm_startup.py. vLLM spawns its engine core with multiprocessing, which may re-import this file: everything
runs under the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path


async def _serve(a: argparse.Namespace) -> None:
    from embedmesh.core.server import Server, ServerOptions
    from embedmesh.router.v1 import router_pb2
    from embedmesh.services.router.worker_client import LoadReport, RouterLink
    from embedmesh.services.worker.engines.vllm_engine import VLLMConfig, VLLMEngine
    from embedmesh.services.worker.engines.vllm_kv_events import MeshKvEvent, Stored, to_router_events
    from embedmesh.services.worker.engines.vllm_metrics import register_vllm_metrics
    from embedmesh.services.worker.metrics import register_engine_metrics
    from embedmesh.services.worker.servicer import WorkerServicer
    from embedmesh.worker.v1 import worker_pb2_grpc

    worker_id = "vllm-kv-test"
    engine = VLLMEngine(VLLMConfig(Path(a.model), a.served_name, max_model_len=2048, max_num_seqs=8,
                                   kv_events=True, kv_event_block_size=a.block_size))
    server = Server("worker", ServerOptions(host="127.0.0.1", port=a.port, metrics_port=a.metrics_port))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, WorkerServicer(engine, worker_id),
               "embedmesh.worker.v1.WorkerService")
    server.on_drain(engine.shutdown)
    register_engine_metrics(engine, worker_id)
    register_vllm_metrics(engine.engine_metrics, engine.kv_event_counters, worker_id)
    await server.start()
    server.install_signal_handlers()
    await engine.start()
    await server.set_serving(True)

    events = open(a.events_file, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def dump(batch: list[MeshKvEvent]) -> None:
        for e in batch:
            kind = type(e).__name__.lower()
            row: dict[str, object] = {"kind": kind}
            if isinstance(e, Stored):
                row["parent"] = e.parent_hash
            if hasattr(e, "block_hashes"):
                row["hashes"] = list(e.block_hashes)
            events.write(json.dumps(row) + "\n")

    engine.on_kv_events(dump)
    link = RouterLink(
        [a.router],
        router_pb2.Registration(worker_id=worker_id, address=server.address, model=a.served_name,
                                block_size=a.block_size, engine="vllm", publishes_kv_events=True),
        load=lambda: LoadReport(engine.stats().active_requests, engine.engine_metrics().kv_usage),
        snapshot=lambda: to_router_events(engine.kv_snapshot()),
    )
    engine.on_kv_events(lambda batch: link.publish(to_router_events(batch)))
    link.start()
    server.on_drain(link.close)
    print(f"worker {worker_id} serving on {server.address}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--served-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--router", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--events-file", required=True)
    asyncio.run(_serve(p.parse_args()))
