"""The preprocessor's view of its workers (``preprocessor/workers.py``): round robin over the healthy workers of a
model (``exclude`` and adapters honoured, refusals naming the model), the model and adapter tables, LoRA adapters
loaded on demand once for concurrent requests, and health followed from the workers themselves (a real worker on
loopback: GetInfo once serving, out of the choice while NOT_SERVING, back when serving again)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.core.server import Server, ServerOptions
from embedmesh.services.preprocessor.workers import WorkerHandle, WorkerPool
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc


def _pool(*models: str, healthy: tuple[bool, ...] = (), on_demand: bool = False) -> WorkerPool:
    pool = WorkerPool(tuple(f"127.0.0.1:{10 + i}" for i in range(len(models))), 1 << 20,
                      lora_load_on_demand=on_demand)
    for i, (w, m) in enumerate(zip(pool.workers, models, strict=True)):
        w.info = worker_pb2.GetInfoResponse(model=m, worker_id=f"w{i}")
        w.healthy = healthy[i] if i < len(healthy) else True
        w.seen_serving = w.healthy
    return pool


def _run(body: Callable[[], Any]) -> None:
    async def run() -> None:
        await body()

    asyncio.run(run())


def test_round_robin_over_the_healthy_workers_of_the_model() -> None:
    async def body() -> None:
        pool = _pool("m", "m", "other", "m", healthy=(True, True, True, False))
        a, b = pool.workers[0], pool.workers[1]
        assert [pool.pick("m") for _ in range(4)] == [a, b, a, b]
        assert {pool.pick("m", exclude=a) for _ in range(3)} == {b}
        assert pool.pick("other") is pool.workers[2]
        await pool.close()

    _run(body)


def test_no_healthy_worker_is_unavailable_naming_the_model() -> None:
    async def body() -> None:
        pool = _pool("m", healthy=(False,))
        with pytest.raises(Unavailable) as e:
            pool.pick("m")
        assert (e.value.field, e.value.reason, e.value.retry_after_seconds) == ("model", "NO_HEALTHY_WORKER", 1.0)
        assert e.value.message == "no healthy worker serves model 'm'; retry shortly"
        pool.workers[0].healthy = True
        with pytest.raises(Unavailable) as e:
            pool.pick("m", exclude=pool.workers[0])
        with pytest.raises(Unavailable, match="no healthy worker holds the LoRA adapter 'a'; retry shortly"):
            pool.pick("m", adapter="a")
        pool.workers[0].adapters = {"a"}
        assert pool.pick("m", adapter="a") is pool.workers[0]
        await pool.close()

    _run(body)


def test_spec_models_and_dtype() -> None:
    async def body() -> None:
        pool = _pool("m", "e", "m")
        pool.workers[0].info.dtype = tensor_pb2.DATA_TYPE_BF16  # type: ignore[union-attr]
        pool.workers.append(pool._add("127.0.0.1:99"))  # not serving yet: no info, in no model
        assert {k: [w.name or w.info.worker_id for w in v] for k, v in pool.models().items()} == {  # type: ignore[union-attr]
            "m": ["w0", "w2"], "e": ["w1"]}
        assert pool.spec("m") is pool.workers[0].info
        with pytest.raises(InvalidArgument) as e:
            pool.spec("x")
        assert (e.value.field, e.value.reason) == ("model", "MODEL_NOT_FOUND")
        assert e.value.message == "model 'x' is not served here; served models: ['e', 'm']"
        assert WorkerPool.dtype_name(pool.spec("m")) == "bfloat16"
        assert WorkerPool.dtype_name(worker_pb2.GetInfoResponse()) == "float32"
        await pool.close()

    _run(body)


def test_all_started_needs_every_worker_seen_and_one_serving() -> None:
    async def body() -> None:
        pool = _pool("m", "m", healthy=(True, False))
        assert not pool.all_started()
        pool.workers[1].seen_serving = True
        assert pool.all_started()
        pool.workers[0].healthy = False
        assert not pool.all_started()
        await pool.close()

    _run(body)


def test_a_worker_the_router_names_is_added_once_as_serving() -> None:
    async def body() -> None:
        pool = _pool("m")
        assert pool.handle_for(pool.workers[0].address) is pool.workers[0]
        new = pool.handle_for("127.0.0.1:5")
        assert new.healthy and new.seen_serving and pool.handle_for("127.0.0.1:5") is new and len(pool.workers) == 2
        await pool.close()

    _run(body)


class _Stub:
    def __init__(self, adapters: dict[str, str] | None = None, fail_load: bool = False,
                 gate: asyncio.Event | None = None) -> None:
        self.adapters = dict(adapters or {})
        self.loads: list[tuple[str, str]] = []
        self.fail_load = fail_load
        self.gate = gate

    async def ListLoraAdapters(self, request: Any, timeout: float) -> Any:  # noqa: N802
        return worker_pb2.ListLoraAdaptersResponse(
            adapters=[worker_pb2.LoraAdapter(name=n, path=p) for n, p in self.adapters.items()])

    async def LoadLoraAdapter(self, request: Any, timeout: float) -> Any:  # noqa: N802
        self.loads.append((request.name, request.path))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_load:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="bad adapter")
        self.adapters[request.name] = request.path
        return worker_pb2.LoadLoraAdapterResponse(loaded=True)


def _with_stubs(pool: WorkerPool, *stubs: _Stub) -> None:
    for w, s in zip(pool.workers, stubs, strict=True):
        w.stub = s  # type: ignore[assignment]


def test_adapters_are_read_into_the_catalog_and_tables() -> None:
    async def body() -> None:
        pool = _pool("m", "m", "e")
        pool.workers[2].info.task = worker_pb2.MODEL_TASK_EMBED  # type: ignore[union-attr]
        _with_stubs(pool, _Stub({"a": "/r/a"}), _Stub({"a": "/r/a", "b": "/r/b"}), _Stub({"never": "/x"}))
        for w in pool.workers:
            await pool.refresh_adapters(w)
        assert pool.workers[2].adapters == set()  # embedding workers are not asked
        table = pool.adapters()
        assert table["a"][0] == "m" and table["a"][1] == pool.workers[:2] and table["b"][1] == [pool.workers[1]]
        assert pool.catalog == {"a": ("m", "/r/a"), "b": ("m", "/r/b")}
        assert pool.known_adapter("a") == "m" and pool.known_adapter("never") is None
        # Unloaded everywhere: known again only with load on demand.
        for w in pool.workers:
            w.adapters = set()
        assert pool.known_adapter("a") is None
        pool.lora_load_on_demand = True
        assert pool.known_adapter("a") == "m" and pool.known_adapter("zzz") is None
        await pool.close()

    _run(body)


def test_an_unreachable_worker_holds_no_adapters() -> None:
    async def body() -> None:
        pool = _pool("m")

        class _Down:
            async def ListLoraAdapters(self, request: Any, timeout: float) -> Any:  # noqa: N802
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())

        pool.workers[0].adapters = {"a"}
        pool.workers[0].stub = _Down()  # type: ignore[assignment]
        await pool.refresh_adapters(pool.workers[0])
        assert pool.workers[0].adapters == set()
        await pool.close()

    _run(body)


def test_on_demand_loads_once_on_the_preferred_or_least_busy_worker() -> None:
    async def body() -> None:
        pool = _pool("m", "m", on_demand=True)
        gate = asyncio.Event()
        stubs = (_Stub(gate=gate), _Stub(gate=gate))
        _with_stubs(pool, *stubs)
        pool.catalog["a"] = ("m", "/r/a")
        pool.workers[0].inflight = 5
        tasks = [asyncio.create_task(pool.ensure_adapter("m", "a")) for _ in range(3)]
        await asyncio.sleep(0.01)
        gate.set()
        got = await asyncio.gather(*tasks)
        assert got == [pool.workers[1]] * 3 and stubs[1].loads == [("a", "/r/a")] and stubs[0].loads == []
        assert pool.workers[1].adapters == {"a"}
        # Held now: no second load; the preferred worker is used when a load is needed.
        assert await pool.ensure_adapter("m", "a") is pool.workers[1]
        pool.catalog["b"] = ("m", "/r/b")
        assert await pool.ensure_adapter("m", "b", preferred=pool.workers[0]) is pool.workers[0]
        assert stubs[0].loads == [("b", "/r/b")]
        await pool.close()

    _run(body)


def test_a_failed_on_demand_load_is_unavailable_for_every_waiter() -> None:
    async def body() -> None:
        pool = _pool("m", on_demand=True)
        gate = asyncio.Event()
        _with_stubs(pool, _Stub(fail_load=True, gate=gate))
        pool.catalog["a"] = ("m", "/r/a")
        tasks = [asyncio.create_task(pool.ensure_adapter("m", "a")) for _ in range(2)]
        await asyncio.sleep(0.01)
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            assert isinstance(r, Unavailable) and (r.field, r.reason) == ("model", "ADAPTER_LOAD_FAILED")
            assert "loading the LoRA adapter 'a' on demand failed (bad adapter)" in r.message
        await pool.close()

    _run(body)


def test_without_on_demand_an_adapter_nobody_holds_is_unavailable() -> None:
    async def body() -> None:
        pool = _pool("m")
        pool.catalog["a"] = ("m", "/r/a")
        with pytest.raises(Unavailable, match="no healthy worker holds the LoRA adapter 'a'"):
            await pool.ensure_adapter("m", "a")
        await pool.close()

    _run(body)


class _Worker(worker_pb2_grpc.WorkerServiceServicer):
    async def GetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        return worker_pb2.GetInfoResponse(model="m", worker_id="real-1", task=worker_pb2.MODEL_TASK_EMBED)


async def _until(cond: Callable[[], bool]) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_health_is_followed_from_a_real_worker() -> None:
    async def body() -> None:
        server = Server("w", ServerOptions(port=0, grace_seconds=0))
        server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, _Worker(), "embedmesh.worker.v1.WorkerService")
        await server.start()
        pool = WorkerPool((server.address,), 1 << 20)
        w: WorkerHandle = pool.workers[0]
        pool.start()
        await asyncio.sleep(0.1)
        assert not w.healthy and w.info is None and not pool.all_started()
        await server.set_serving(True)
        await _until(lambda: w.healthy)
        assert w.info is not None and w.name == "real-1" and pool.all_started() and "m" in pool.created
        await server.set_serving(False)
        await _until(lambda: not w.healthy)
        with pytest.raises(Unavailable):
            pool.pick("m")
        await server.set_serving(True)
        await _until(lambda: w.healthy)
        assert pool.pick("m") is w
        await pool.close()
        await server._server.stop(0)

    _run(body)


def test_a_lost_worker_leaves_the_choice_until_a_probe_finds_it_serving() -> None:
    async def body() -> None:
        server = Server("w", ServerOptions(port=0, grace_seconds=0))
        server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, _Worker(), "embedmesh.worker.v1.WorkerService")
        await server.start()
        await server.set_serving(True)
        pool = _pool("m")
        await pool.workers[0].channel.close()
        pool.workers = []
        w = pool._add(server.address)
        w.info = worker_pb2.GetInfoResponse(model="m")
        w.healthy = True
        pool.mark_lost(w)
        assert not w.healthy
        with pytest.raises(Unavailable):
            pool.pick("m")
        await _until(lambda: w.healthy)  # the probe's health check answered SERVING
        await pool.close()
        await server._server.stop(0)

    _run(body)
