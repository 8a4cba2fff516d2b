"""The preprocessor's view of its workers: health watched continuously, model info fetched once serving,
round-robin choice among the healthy ones for a model (the KV router replaces the choice when configured).

A worker leaves the choice at once when it reports NOT_SERVING (it is draining: its in-flight streams finish, no
new one starts) or when a call to it fails at the transport (``mark_lost``: it died); it comes back when it reports
SERVING again. Once a worker that served reports NOT_SERVING, its health stream is closed and re-opened with backoff,
so the pool holds no call open on a draining worker (its drain ends when its own streams do)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.core.server import insecure_channel
from embedmesh.core.tensors import DTYPE_NAMES
from embedmesh.core.transport import wire
from embedmesh.core.transport.thresholds import SHARED_STREAM_MAX
from embedmesh.services.preprocessor.config import WORKER_STREAMS
from embedmesh.services.preprocessor.migration import MigrationLimits
from embedmesh.services.preprocessor.worker_chunks import OWN_ID, ChunkedBody
from embedmesh.services.preprocessor.worker_stream import GENERATE_MANY, OwnGeneration, WorkerStream
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
    name: str = ""
    """The worker's id once known (GetInfo), for logs and /health; never its address in client-facing text."""
    adapters: set[str] = field(default_factory=set)
    """LoRA adapters loaded on it (ListLoraAdapters, refreshed whenever it turns SERVING and after admin calls)."""
    _task: asyncio.Task[None] | None = field(default=None, repr=False)
    _recheck: asyncio.Task[None] | None = field(default=None, repr=False)
    stream: WorkerStream | None = field(default=None, repr=False)
    """The GenerateMany stream small requests share (``worker_stream.py``); None = a GenerateMany call each."""
    _many_raw: Any = field(default=None, repr=False)

    def generate_raw(self, body: bytes | ChunkedBody) -> Any:
        """One generation of a request already serialized (``transport.wire``), iterated like a ``Generation``: bytes on
        the worker's shared GenerateMany stream when small; a ``ChunkedBody`` (big rows: a start frame, then rows
        frames), big bytes, or any request to a worker without a shared stream on a GenerateMany call of its own."""
        if isinstance(body, bytes) and self.stream is not None and len(body) <= SHARED_STREAM_MAX:
            return self.stream.generate(body)
        if self._many_raw is None:
            self._many_raw = self.channel.stream_stream(
                GENERATE_MANY, request_serializer=None,
                response_deserializer=worker_pb2.GenerateManyResponse.FromString)
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        messages = body.messages(carrier) if isinstance(body, ChunkedBody) else \
            iter([wire.frame_start(OWN_ID, body, carrier)])
        return OwnGeneration(self._many_raw(messages), OWN_ID)


class WorkerPool:
    """Watches each worker's grpc.health.v1 status and keeps its GetInfo."""

    def __init__(self, addresses: tuple[str, ...], max_message_bytes: int, *,
                 lora_load_on_demand: bool = False, worker_streams: str = "all",
                 migration: MigrationLimits | None = None) -> None:
        self.workers: list[WorkerHandle] = []
        self.migration = migration or MigrationLimits()
        """How far a sequence cut mid-stream may be continued on another worker (``migration.py``)."""
        self._max_message_bytes = max_message_bytes
        if worker_streams not in WORKER_STREAMS:
            raise ValueError(f"worker_streams must be {', '.join(WORKER_STREAMS[:-1])} or {WORKER_STREAMS[-1]}, got "
                             f"{worker_streams!r}")
        self.worker_streams = worker_streams
        """Which workers' small generations share one GenerateMany stream: all, routed (only addresses the router
        named; configured addresses get a GenerateMany call per generation), off."""
        self.lora_load_on_demand = lora_load_on_demand
        """A request naming a known adapter that no healthy worker holds loads it on one (``ensure_adapter``)."""
        self.catalog: dict[str, tuple[str, str]] = {}
        """Adapters seen loaded on any worker since start: name -> (base model, folder). An explicit unload
        forgets one; a worker restarting without it does not."""
        self._on_demand: dict[tuple[str, str], asyncio.Future[None]] = {}
        for address in addresses:
            self._add(address)
        self._rr = itertools.count()
        self.changed = asyncio.Event()
        self.created: dict[str, int] = {}
        self._started = False

    def _add(self, address: str, routed: bool = False) -> WorkerHandle:
        channel = insecure_channel(address, self._max_message_bytes)
        handle = WorkerHandle(address, channel, worker_pb2_grpc.WorkerServiceStub(channel))
        if self.worker_streams == "all" or (self.worker_streams == "routed" and routed):
            handle.stream = WorkerStream(address, self._max_message_bytes)
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
        handle = self._add(address, routed=True)
        handle.seen_serving = True  # routed to by the router: it registered, so it served
        handle.healthy = True
        if self._started:
            handle._task = asyncio.create_task(self._watch(handle), name=f"watch-{address}")
        return handle

    async def close(self) -> None:
        for w in self.workers:
            for t in (w._task, w._recheck):
                if t is not None:
                    t.cancel()
        for w in self.workers:
            if w.stream is not None:
                await w.stream.close()
            await w.channel.close()

    def _set(self, w: WorkerHandle, healthy: bool) -> None:
        if w.healthy != healthy:
            log.info("worker health", extra={"worker": w.address, "healthy": healthy})
        w.healthy = healthy
        self.changed.set()

    def mark_lost(self, w: WorkerHandle) -> None:
        """A call to ``w`` failed at the transport: no request goes to it from now on. A probe brings it back as
        soon as it answers SERVING again (so one failed call cannot exclude a live worker for good)."""
        if w.healthy:
            log.warning("worker lost", extra={"worker": w.address, "worker_id": w.name})
        self._set(w, False)
        if w._recheck is None or w._recheck.done():
            w._recheck = asyncio.get_running_loop().create_task(self._probe(w), name=f"probe-{w.address}")

    async def _probe(self, w: WorkerHandle) -> None:
        health = health_pb2_grpc.HealthStub(w.channel)
        delay = 0.5
        while not w.healthy:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            try:
                r = await health.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=1)
            except grpc.aio.AioRpcError:
                continue
            if r.status == health_pb2.HealthCheckResponse.SERVING and w.info is not None:
                self._set(w, True)

    async def _watch(self, w: WorkerHandle) -> None:
        health = health_pb2_grpc.HealthStub(w.channel)
        backoff = 0.2
        while True:
            try:
                call = health.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE))
                async for resp in call:
                    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
                    if serving and w.info is None:
                        w.info = await w.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
                        w.name = w.info.worker_id
                        import time

                        self.created.setdefault(w.info.model, int(time.time()))
                    if serving:
                        w.seen_serving = True
                        await self.refresh_adapters(w)
                    self._set(w, serving)
                    backoff = 0.2
                    if not serving and w.seen_serving:
                        # Draining (or stopped by its watchdog): let go of the stream so it does not hold the
                        # worker's drain open; poll again with backoff until it serves or is gone.
                        call.cancel()
                        break
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError:
                self._set(w, False)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def refresh_adapters(self, w: WorkerHandle) -> None:
        """Re-read ``w``'s LoRA adapters; an engine without LoRA (or an unreachable worker) has none."""
        if w.info is None or w.info.task == worker_pb2.MODEL_TASK_EMBED:
            return
        try:
            resp = await w.stub.ListLoraAdapters(worker_pb2.ListLoraAdaptersRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            w.adapters = set()
            return
        w.adapters = {a.name for a in resp.adapters}
        for a in resp.adapters:
            self.catalog[a.name] = (w.info.model, a.path)

    def known_adapter(self, name: str) -> str | None:
        """The base model of ``name`` when it is an adapter a worker holds, or (with load on demand) one it can
        load; None otherwise."""
        held = self.adapters().get(name)
        if held is not None:
            return held[0]
        if self.lora_load_on_demand and name in self.catalog:
            return self.catalog[name][0]
        return None

    async def ensure_adapter(self, model: str, adapter: str, preferred: WorkerHandle | None = None,
                             exclude: WorkerHandle | None = None) -> WorkerHandle:
        """A healthy worker of ``model`` holding ``adapter``: one that holds it already (round robin), else, with
        load on demand, ``preferred`` (the router's least-loaded pick) or the least busy worker, after loading it
        there (concurrent requests share one load). Unavailable when neither is possible."""
        holders = [w for w in self.models().get(model, []) if w.healthy and w is not exclude and adapter in w.adapters]
        if holders or not self.lora_load_on_demand or adapter not in self.catalog:
            return self.pick(model, exclude=exclude, adapter=adapter)
        group = [w for w in self.models().get(model, []) if w.healthy and w is not exclude]
        if not group:
            return self.pick(model, exclude=exclude)  # raises Unavailable naming the model
        target = preferred if preferred in group else min(group, key=lambda w: w.inflight)
        key = (target.address, adapter)
        pending = self._on_demand.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._on_demand[key] = pending
            try:
                path = self.catalog[adapter][1]
                log.info("loading a LoRA adapter on demand", extra={"adapter": adapter, "worker": target.address})
                await target.stub.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(name=adapter, path=path),
                                                   timeout=300)
                await self.refresh_adapters(target)
                pending.set_result(None)
            except grpc.aio.AioRpcError as e:
                log.warning("on-demand LoRA load failed", extra={"adapter": adapter, "worker": target.address,
                                                                 "error": e.details()})
                pending.set_exception(Unavailable(
                    f"model: loading the LoRA adapter {adapter!r} on demand failed ({e.details()}); retry or "
                    "load it through the admin plane", field="model", reason="ADAPTER_LOAD_FAILED",
                    retry_after_seconds=1.0))
            finally:
                del self._on_demand[key]
        await asyncio.shield(pending)
        return target

    def adapters(self) -> dict[str, tuple[str, list[WorkerHandle]]]:
        """Adapter name -> (its base model, the workers holding it)."""
        out: dict[str, tuple[str, list[WorkerHandle]]] = {}
        for w in self.workers:
            if w.info is None:
                continue
            for name in w.adapters:
                out.setdefault(name, (w.info.model, []))[1].append(w)
        return out

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

    def resumable(self, model: str, adapter: str = "", exclude: WorkerHandle | None = None) -> list[WorkerHandle]:
        """Healthy workers of ``model`` (holding ``adapter``; other than ``exclude``) that continue a generation
        from its resumed tokens (GetInfo ``resumes_generation``): where a migrated stream may go."""
        return [w for w in self.models().get(model, []) if w.healthy and w is not exclude
                and (not adapter or adapter in w.adapters) and w.info is not None and w.info.resumes_generation]

    def pick(self, model: str, exclude: WorkerHandle | None = None, adapter: str = "",
             resuming: bool = False) -> WorkerHandle:
        """Round robin over healthy workers of ``model`` (other than ``exclude``; holding ``adapter`` if given;
        with ``resuming``, only those that continue a generation)."""
        group = [w for w in self.models().get(model, []) if w.healthy and w is not exclude
                 and (not adapter or adapter in w.adapters)]
        if resuming:
            group = self.resumable(model, adapter, exclude)
        if not group and adapter:
            raise Unavailable(f"no healthy worker holds the LoRA adapter {adapter!r}; retry shortly or load it "
                              "again", field="model", reason="NO_HEALTHY_WORKER", retry_after_seconds=1.0)
        if not group:
            raise Unavailable(f"no healthy worker serves model {model!r}; retry shortly", field="model",
                              reason="NO_HEALTHY_WORKER", retry_after_seconds=1.0)
        start = next(self._rr)
        return group[start % len(group)]

    @staticmethod
    def dtype_name(info: worker_pb2.GetInfoResponse) -> str:
        return DTYPE_NAMES.get(info.dtype, "float32")
