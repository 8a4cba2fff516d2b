"""Operations over the whole worker pool (admin.py) against scripted workers: the model list with adapters under
their base model, LoRA loads that leave nothing half-loaded, sleep-mode checks, and the mesh's health verdict."""

from __future__ import annotations

from typing import Any

import pytest

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.services.preprocessor.admin import MeshAdmin
from embedmesh.services.preprocessor.workers import WorkerHandle, WorkerPool
from embedmesh.worker.v1 import worker_pb2


class _Stub:
    """A worker's LoRA and sleep calls, scripted."""

    def __init__(self, fail_load: bool = False) -> None:
        self.fail_load = fail_load
        self.adapters: dict[str, str] = {}
        self.calls: list[str] = []

    async def ListLoraAdapters(self, request: Any, timeout: float) -> Any:  # noqa: N802
        return worker_pb2.ListLoraAdaptersResponse(
            adapters=[worker_pb2.LoraAdapter(name=n, path=p) for n, p in self.adapters.items()])

    async def LoadLoraAdapter(self, request: Any, timeout: float) -> Any:  # noqa: N802
        self.calls.append(f"load {request.name}")
        if self.fail_load:
            raise Unavailable("worker busy", reason="BUSY")
        self.adapters[request.name] = request.path
        return worker_pb2.LoadLoraAdapterResponse(loaded=True)

    async def UnloadLoraAdapter(self, request: Any, timeout: float) -> Any:  # noqa: N802
        self.calls.append(f"unload {request.name}")
        return worker_pb2.UnloadLoraAdapterResponse(unloaded=self.adapters.pop(request.name, None) is not None)


def _worker(name: str, model: str, *, task: int = worker_pb2.MODEL_TASK_GENERATE, healthy: bool = True,
            stub: _Stub | None = None) -> WorkerHandle:
    info = worker_pb2.GetInfoResponse(model=model, hidden_size=8, max_context_tokens=64, engine="echo", task=task)
    return WorkerHandle(address=f"{name}:1", channel=None, stub=stub or _Stub(), info=info,  # type: ignore[arg-type]
                        healthy=healthy, seen_serving=healthy, name=name)


def _pool(*workers: WorkerHandle) -> WorkerPool:
    pool = WorkerPool((), 1 << 20)
    pool.workers.extend(workers)
    return pool


async def test_models_list_bases_then_adapters_under_their_parent() -> None:
    gen = _worker("w0", "base")
    gen.stub.adapters["my-lora"] = "/a"  # type: ignore[attr-defined]
    pool = _pool(gen, _worker("e0", "embedder", task=worker_pb2.MODEL_TASK_EMBED))
    models = await MeshAdmin(pool).list_models()
    assert [(m.id, m.task, m.parent) for m in models] == [("base", "generate", ""), ("embedder", "embed", ""),
                                                          ("my-lora", "generate", "base")]
    assert models[2].max_context_tokens == 64 and models[2].ready_workers == 1


async def test_a_failed_load_undoes_the_loads_it_made() -> None:
    ok, bad = _Stub(), _Stub(fail_load=True)
    pool = _pool(_worker("w0", "base", stub=ok), _worker("w1", "base", stub=bad))
    with pytest.raises(Unavailable):
        await MeshAdmin(pool).load_adapter("my-lora", "/a", [])
    assert ok.calls == ["load my-lora", "unload my-lora"] and not ok.adapters


async def test_load_rules_name_the_client_fields() -> None:
    admin = MeshAdmin(_pool(_worker("w0", "base")))
    for name, path, workers, field, reason in [
        ("bad name", "/a", [], "lora_name", "INVALID_NAME"), ("x", "", [], "lora_path", "REQUIRED"),
        ("base", "/a", [], "lora_name", "NAME_TAKEN"), ("x", "/a", ["w9"], "workers", "UNKNOWN_WORKER"),
    ]:
        with pytest.raises(InvalidArgument) as e:
            await admin.load_adapter(name, path, workers)
        assert (e.value.field, e.value.reason) == (field, reason)
    workers, loaded = await admin.load_adapter("x", "/a", ["w0"])
    assert (workers, loaded) == (["w0"], True)
    assert await admin.unload_adapter("x") == ["w0"]


async def test_sleep_level_and_worker_ids_are_checked() -> None:
    admin = MeshAdmin(_pool(_worker("w0", "base")))
    with pytest.raises(InvalidArgument) as e:
        await admin.sleep(3, [])
    assert str(e.value) == "level must be 1 or 2"
    with pytest.raises(InvalidArgument) as e:
        await admin.wake_up(["nope"])
    assert e.value.reason == "UNKNOWN_WORKER"


@pytest.mark.parametrize(("workers", "status", "detail"), [
    ([], "down", "no worker is serving"),
    ([("e0", worker_pb2.MODEL_TASK_EMBED, True)], "degraded", "no generation worker is serving (embeddings only)"),
    ([("w0", worker_pb2.MODEL_TASK_GENERATE, True), ("w1", worker_pb2.MODEL_TASK_GENERATE, False)], "degraded",
     "some workers or routers are not serving"),
    ([("w0", worker_pb2.MODEL_TASK_GENERATE, True)], "serving", ""),
])
async def test_mesh_health_verdict(workers: list[tuple[str, int, bool]], status: str, detail: str) -> None:
    pool = _pool(*(_worker(n, "m", task=t, healthy=h) for n, t, h in workers))
    health = await MeshAdmin(pool).mesh_health()
    assert (health[0].service, health[0].status, health[0].detail) == ("preprocessor", status, detail)
    assert [h.name for h in health[1:]] == [n for n, _, _ in workers]


async def test_concurrent_mesh_health_calls_share_one_round_of_router_checks() -> None:
    """GetMeshHealth is open to any caller: 20 at once cost each router one Check, not 20; a caller that leaves does
    not cancel the others' answer; the next call after the round asks again."""
    import asyncio

    from grpc_health.v1 import health_pb2

    class _Router:
        def __init__(self) -> None:
            self.checks = 0
            self.release = asyncio.Event()

        async def Check(self, request: Any, timeout: float) -> Any:  # noqa: N802
            self.checks += 1
            await self.release.wait()
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    router = _Router()
    admin = MeshAdmin(_pool(_worker("w0", "m")), routers=["r0:1"])
    admin._router_health = [router]  # type: ignore[list-item]
    calls = [asyncio.ensure_future(admin.mesh_health()) for _ in range(20)]
    await asyncio.sleep(0.05)
    calls[0].cancel()  # one caller leaves while the round is in flight
    router.release.set()
    answers = await asyncio.gather(*calls[1:])
    assert router.checks == 1
    assert all([h.status for h in a] == ["serving", "serving", "serving"] for a in answers)
    await admin.mesh_health()
    assert router.checks == 2  # nothing kept after the round
