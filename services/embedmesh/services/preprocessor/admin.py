"""The preprocessor's operations over the whole worker pool, with no gRPC server in sight: the served models (base
models and the LoRA adapters loaded on them), sleep mode, LoRA adapters loaded and unloaded on every generative
worker at once (nothing half-loaded), and the mesh's health as one answer. The servicer converts the results.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.core.errors import InvalidArgument, NotFound, Unavailable, from_rpc_error
from embedmesh.core.server import mesh_channel
from embedmesh.services.preprocessor.workers import WorkerHandle, WorkerPool
from embedmesh.worker.v1 import worker_pb2

__all__ = ["ServedModelEntry", "ServiceHealth", "MeshAdmin"]

_ROUTER_HEALTH_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class ServedModelEntry:
    """One row of the model list (``/v1/models``): a base model, or an adapter with its ``parent``."""

    id: str
    hidden_size: int
    max_context_tokens: int
    dtype: int
    engines: list[str]
    ready_workers: int
    task: str
    created: int
    embedding_size: int = 0
    parent: str = ""


@dataclass(frozen=True)
class ServiceHealth:
    service: str
    name: str
    status: str
    """"serving", "degraded" or "down"."""
    model: str = ""
    detail: str = ""


class MeshAdmin:
    def __init__(self, pool: WorkerPool, routers: Sequence[str] = ()) -> None:
        self.pool = pool
        self.routers = tuple(routers)
        self._router_health: list[health_pb2_grpc.HealthStub] = []
        self._round: asyncio.Task[list[ServiceHealth]] | None = None
        """The routers' health round in flight, shared by every caller that asks meanwhile."""

    # --- models -------------------------------------------------------------------------------------------------
    async def list_models(self) -> list[ServedModelEntry]:
        await asyncio.gather(*(self.pool.refresh_adapters(w) for w in self.pool.workers if w.healthy))
        out = []
        for name, group in sorted(self.pool.models().items()):
            info = group[0].info
            assert info is not None
            out.append(ServedModelEntry(
                id=name, hidden_size=info.hidden_size, max_context_tokens=info.max_context_tokens, dtype=info.dtype,
                engines=sorted({w.info.engine for w in group if w.info}),
                ready_workers=sum(1 for w in group if w.healthy),
                task="embed" if info.task == worker_pb2.MODEL_TASK_EMBED else "generate",
                embedding_size=info.embedding_size, created=self.pool.created.get(name, int(time.time()))))
        base = {m.id: m for m in out}
        for name, (parent, holders) in sorted(self.pool.adapters().items()):
            if name in base or parent not in base:
                continue
            p = base[parent]
            out.append(ServedModelEntry(
                id=name, parent=parent, hidden_size=p.hidden_size, max_context_tokens=p.max_context_tokens,
                dtype=p.dtype, engines=sorted({w.info.engine for w in holders if w.info}), task="generate",
                ready_workers=sum(1 for w in holders if w.healthy), created=p.created))
        return out

    # --- sleep mode ---------------------------------------------------------------------------------------------
    async def sleep(self, level: int, workers: Sequence[str]) -> list[str]:
        """Put the generative workers (or those named) to sleep; their names."""
        if level not in (1, 2):
            raise InvalidArgument("level must be 1 or 2", field="level", reason="OUT_OF_RANGE")
        targets = _generative(self.pool, workers)
        await _all(targets, lambda w: w.stub.Sleep(worker_pb2.SleepRequest(level=level), timeout=300))
        return [w.name for w in targets]

    async def wake_up(self, workers: Sequence[str]) -> list[str]:
        targets = [w for w in self.pool.workers if w.info is not None and w.info.task != worker_pb2.MODEL_TASK_EMBED
                   and (not workers or w.name in set(workers))]
        _generative(self.pool, workers)  # unknown ids refused
        await _all(targets, lambda w: w.stub.WakeUp(worker_pb2.WakeUpRequest(), timeout=300))
        return [w.name for w in targets]

    async def sleeping(self) -> tuple[bool, list[str]]:
        """Whether every generative worker sleeps, and the names of those that do."""
        targets = [w for w in self.pool.workers if w.info is not None and w.info.task != worker_pb2.MODEL_TASK_EMBED]
        stats = await asyncio.gather(*(w.stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10) for w in targets),
                                     return_exceptions=True)
        asleep = [w.name for w, s in zip(targets, stats, strict=True)
                  if not isinstance(s, BaseException) and s.sleeping]
        return bool(targets) and len(asleep) == len(targets), asleep

    # --- LoRA adapters ------------------------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str, workers: Sequence[str]) -> tuple[list[str], bool]:
        """Load ``name`` from ``path`` on every generative worker (or those named): their names, and whether any
        loaded it now. A failure on one undoes the loads this call made, then is reported."""
        self._check_new_adapter(name, path)
        targets = self._adapter_targets(workers)
        held = self.pool.adapters().get(name)
        if held is not None and any(w.info is not None and w.info.model != held[0] for w in targets):
            raise InvalidArgument(f"lora_name {name!r} is already loaded for model {held[0]!r}",
                                  field="lora_name", reason="NAME_TAKEN")
        req = worker_pb2.LoadLoraAdapterRequest(name=name, path=path)
        results = await asyncio.gather(*(w.stub.LoadLoraAdapter(req, timeout=300) for w in targets),
                                       return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            await self._undo_loads(name, targets, results)
            raise _lora_error(failed)
        await asyncio.gather(*(self.pool.refresh_adapters(w) for w in targets))
        return [w.name for w in targets], any(r.loaded for r in results)  # type: ignore[union-attr]

    def _check_new_adapter(self, name: str, path: str) -> None:
        """A name an adapter may take (printable, no spaces, not a served model's) and a path."""
        if not name or len(name) > 256 or any(c.isspace() or not c.isprintable() for c in name):
            raise InvalidArgument("lora_name is required: a name without spaces (at most 256 characters)",
                                  field="lora_name", reason="INVALID_NAME")
        if not path:
            raise InvalidArgument("lora_path is required", field="lora_path", reason="REQUIRED")
        if name in self.pool.models():
            raise InvalidArgument(f"lora_name {name!r} is the name of a served model", field="lora_name",
                                  reason="NAME_TAKEN")

    def _adapter_targets(self, workers: Sequence[str]) -> list[WorkerHandle]:
        """The serving generative workers, or those of ``workers`` (each must be one); at least one."""
        targets = [w for w in self.pool.workers
                   if w.healthy and w.info is not None and w.info.task != worker_pb2.MODEL_TASK_EMBED]
        if workers:
            ids = {w.name for w in targets}
            unknown = [x for x in workers if x not in ids]
            if unknown:
                raise InvalidArgument(f"workers: {unknown} are not serving generative workers (see /health)",
                                      field="workers", reason="UNKNOWN_WORKER")
            targets = [w for w in targets if w.name in set(workers)]
        if not targets:
            raise Unavailable("no generative worker is serving; retry shortly", reason="NO_HEALTHY_WORKER",
                              retry_after_seconds=1.0)
        return targets

    async def _undo_loads(self, name: str, targets: list[WorkerHandle], results: Sequence[Any]) -> None:
        """Nothing half-loaded: unload ``name`` where this call loaded it, then read every target's adapters."""
        undo = [w for w, r in zip(targets, results, strict=True) if not isinstance(r, BaseException) and r.loaded]
        await asyncio.gather(*(w.stub.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(name=name),
                                                        timeout=60) for w in undo), return_exceptions=True)
        await asyncio.gather(*(self.pool.refresh_adapters(w) for w in targets))

    async def unload_adapter(self, name: str) -> list[str]:
        """Unload ``name`` wherever it is held: the names of the workers that unloaded it now."""
        if not name:
            raise InvalidArgument("lora_name is required", field="lora_name", reason="REQUIRED")
        holders = [w for w in self.pool.workers if name in w.adapters]
        if not holders and self.pool.lora_load_on_demand and self.pool.catalog.pop(name, None) is not None:
            return []  # loaded nowhere now; forgotten for load on demand
        if not holders:
            raise NotFound(f"lora_name: no worker holds an adapter named {name!r}", field="lora_name",
                           reason="ADAPTER_NOT_FOUND")
        results = await asyncio.gather(*(w.stub.UnloadLoraAdapter(
            worker_pb2.UnloadLoraAdapterRequest(name=name), timeout=300) for w in holders), return_exceptions=True)
        await asyncio.gather(*(self.pool.refresh_adapters(w) for w in holders))
        if not any(name in w.adapters for w in self.pool.workers):
            self.pool.catalog.pop(name, None)  # unloaded on purpose: load on demand must not bring it back
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise _lora_error(failed)
        return [w.name for w, r in zip(holders, results, strict=True) if r.unloaded]  # type: ignore[union-attr]

    # --- health -------------------------------------------------------------------------------------------------
    async def mesh_health(self) -> list[ServiceHealth]:
        """The preprocessor's own state first, then every worker and router."""
        workers: list[ServiceHealth] = []
        generating = 0
        for i, w in enumerate(self.pool.workers):
            embed = w.info is not None and w.info.task == worker_pb2.MODEL_TASK_EMBED
            if w.healthy and not embed:
                generating += 1
            detail = "" if w.healthy else ("not serving (draining, stopped or failed)" if w.seen_serving
                                           else "not serving yet (starting) or unreachable")
            workers.append(ServiceHealth(
                service="embedding-worker" if embed else "worker", name=w.name or f"worker-{i}",
                status="serving" if w.healthy else "down", model=w.info.model if w.info else "", detail=detail))
        routers = await self._routers_health()
        if not any(w.healthy for w in self.pool.workers):
            own, detail = "down", "no worker is serving"
        elif generating == 0:
            own, detail = "degraded", "no generation worker is serving (embeddings only)"
        elif any(s.status != "serving" for s in [*workers, *routers]):
            own, detail = "degraded", "some workers or routers are not serving"
        else:
            own, detail = "serving", ""
        me = ServiceHealth(service="preprocessor", name="preprocessor", status=own, detail=detail)
        return [me, *workers, *routers]

    async def _routers_health(self) -> list[ServiceHealth]:
        """Every router's health. ``GetMeshHealth`` is open to any caller (probes carry no key): callers that ask
        while a round of Checks is in flight share it, so any number of them cost the routers one round at a time;
        one that leaves does not cancel the others' answer, and nothing is kept after the round."""
        if self._round is None:
            self._round = asyncio.ensure_future(self._ask_routers())
            self._round.add_done_callback(lambda _: setattr(self, "_round", None))
        return await asyncio.shield(self._round)

    async def _ask_routers(self) -> list[ServiceHealth]:
        if not self._router_health:
            self._router_health = [health_pb2_grpc.HealthStub(mesh_channel(a)) for a in self.routers]

        async def one(i: int, stub: health_pb2_grpc.HealthStub) -> ServiceHealth:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=_ROUTER_HEALTH_TIMEOUT_S)
                ok, detail = r.status == health_pb2.HealthCheckResponse.SERVING, "not serving"
            except grpc.aio.AioRpcError as e:
                ok, detail = False, f"unreachable ({e.code().name}); requests are routed round robin"
            return ServiceHealth(service="router", name=f"router-{i}", status="serving" if ok else "down",
                                 detail="" if ok else detail)

        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(self._router_health))))


async def _all(targets: list[WorkerHandle], call: Callable[[WorkerHandle], Awaitable[Any]]) -> None:
    """Call every target; the first refusal (e.g. sleep mode unavailable) is the answer."""
    results = await asyncio.gather(*(call(w) for w in targets), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise from_rpc_error(failed) if isinstance(failed, grpc.aio.AioRpcError) else failed


def _generative(pool: WorkerPool, ids: Sequence[str]) -> list[WorkerHandle]:
    """Serving generative workers, or those of ``ids`` (worker ids; an unknown one is an INVALID_ARGUMENT)."""
    targets = [w for w in pool.workers
               if w.healthy and w.info is not None and w.info.task != worker_pb2.MODEL_TASK_EMBED]
    if ids:
        known = {w.name for w in pool.workers}
        unknown = [x for x in ids if x not in known]
        if unknown:
            raise InvalidArgument(f"workers: {unknown} are not workers of this mesh (see /health)", field="workers",
                                  reason="UNKNOWN_WORKER")
        targets = [w for w in pool.workers if w.name in set(ids)]
    return targets


def _lora_error(e: BaseException) -> Exception:
    """A worker's refusal of a LoRA call, re-named in the client's fields (path -> lora_path, name -> lora_name)."""
    if not isinstance(e, grpc.aio.AioRpcError):
        return e if isinstance(e, Exception) else Unavailable("the LoRA call was interrupted")
    err = from_rpc_error(e)
    field = {"path": "lora_path", "name": "lora_name"}.get(err.field or "", err.field)
    message = str(err).replace("path:", "lora_path:", 1) if err.field == "path" else str(err)
    return type(err)(message, field=field, reason=err.reason, retry_after_seconds=err.retry_after_seconds)
