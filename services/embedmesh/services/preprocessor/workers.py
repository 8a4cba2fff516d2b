"""The preprocessor's view of its workers: health watched continuously, model info fetched once serving,
round-robin choice among the healthy ones for a model (the KV router replaces the choice when configured)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.core.server import insecure_channel
from embedmesh.core.tensors import DTYPE_NAMES
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["WorkerHandle", "WorkerPool"]

log = get_logger(__name__)

WORKER_SERVICE = "embedmesh.worker.v1.WorkerService"


@dataclass(eq=False)
class WorkerHandle:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerServiceStub
    info: worker_pb2.GetInfoResponse | None = None
    healthy: bool = False
    seen_serving: bool = False
    inflight: int = 0
    _task: asyncio.Task[None] | None = field(default=None, repr=False)


class WorkerPool:
    """Watches each worker's grpc.health.v1 status and keeps its GetInfo."""

    def __init__(self, addresses: tuple[str, ...], max_message_bytes: int) -> None:
        self.workers: list[WorkerHandle] = []
        self._max_message_bytes = max_message_bytes
        for address in addresses:
            self._add(address)
        self._rr = itertools.count()
        self.changed = asyncio.Event()
        self.created: dict[str, int] = {}
        self._started = False

    def _add(self, address: str) -> WorkerHandle:
        channel = insecure_channel(address, self._max_message_bytes)
        handle = WorkerHandle(address, channel, worker_pb2_grpc.WorkerServiceStub(channel))
        self.workers.append(handle)
        return handle

    def start(self) -> None:
        self._started = True
        for w in self.workers:
            w._task = asyncio.create_task(self._watch(w), name=f"watch-{w.address}")

    def handle_for(self, address: str) -> WorkerHandle:
        """The handle of a worker the router named; workers not configured here are added and watched."""
        for w in self.workers:
            if w.address == address:
                return w
        handle = self._add(address)
        handle.seen_serving = True  # routed to by the router: it registered, so it served
        handle.healthy = True
        if self._started:
            handle._task = asyncio.create_task(self._watch(handle), name=f"watch-{address}")
        return handle

    async def close(self) -> None:
        for w in self.workers:
            if w._task:
                w._task.cancel()
        for w in self.workers:
            await w.channel.close()

    def _set(self, w: WorkerHandle, healthy: bool) -> None:
        if w.healthy != healthy:
            log.info("worker health", extra={"worker": w.address, "healthy": healthy})
        w.healthy = healthy
        self.changed.set()

    async def _watch(self, w: WorkerHandle) -> None:
        health = health_pb2_grpc.HealthStub(w.channel)
        backoff = 0.2
        while True:
            try:
                async for resp in health.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE)):
                    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
                    if serving and w.info is None:
                        w.info = await w.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
                        import time

                        self.created.setdefault(w.info.model, int(time.time()))
                    if serving:
                        w.seen_serving = True
                    self._set(w, serving)
                    backoff = 0.2
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError:
                self._set(w, False)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def all_started(self) -> bool:
        """Every configured worker has reported SERVING at least once and one is serving now."""
        return all(w.seen_serving for w in self.workers) and any(w.healthy for w in self.workers)

    def models(self) -> dict[str, list[WorkerHandle]]:
        out: dict[str, list[WorkerHandle]] = {}
        for w in self.workers:
            if w.info is not None:
                out.setdefault(w.info.model, []).append(w)
        return out

    def spec(self, model: str) -> worker_pb2.GetInfoResponse:
        """The served model's description, or an InvalidArgument naming ``model`` with what is served."""
        group = self.models().get(model)
        if not group:
            served = sorted(self.models())
            raise InvalidArgument(f"model {model!r} is not served here; served models: {served}", field="model",
                           reason="MODEL_NOT_FOUND")
        info = group[0].info
        assert info is not None
        return info

    def pick(self, model: str) -> WorkerHandle:
        """Round robin over healthy workers of ``model``, least in-flight first among equals."""
        group = [w for w in self.models().get(model, []) if w.healthy]
        if not group:
            raise Unavailable(f"no healthy worker serves model {model!r}; retry shortly", field="model",
                              reason="NO_HEALTHY_WORKER")
        start = next(self._rr)
        return group[start % len(group)]

    @staticmethod
    def dtype_name(info: worker_pb2.GetInfoResponse) -> str:
        return DTYPE_NAMES.get(info.dtype, "float32")
