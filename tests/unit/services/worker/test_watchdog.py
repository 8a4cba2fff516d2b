"""The worker's watchdog around a stand-in engine whose progress the test controls, behind a real gRPC server
with health checking and the real WorkerServicer: a stall or a dead engine turns the worker NOT_SERVING, fails
its pending requests with a retryable UNAVAILABLE, refuses new ones, and calls the exit hook. Time is a fake
clock advanced by the test; the process exit is a recorder."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.core.errors import Unavailable, from_rpc_error
from embedmesh.core.server import Server, ServerOptions, insecure_channel
from embedmesh.services.worker.engines.base import (
    Engine,
    EngineProgress,
    EngineStats,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
)
from embedmesh.services.worker.main import SERVICE_NAME
from embedmesh.services.worker.servicer import WorkerServicer
from embedmesh.services.worker.watchdog import EXIT_CODE, Watchdog
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.worker_generate import worker_generate


class StandIn(Engine):
    """Requests wait until the test finishes them; ``steps``/``failed`` are whatever the test sets."""

    def __init__(self) -> None:
        self.steps = 0
        self.failed: str | None = None
        self.waiting: dict[str, asyncio.Queue[Any]] = {}
        self.refusal: Exception | None = None

    async def start(self) -> None:
        return None

    def info(self) -> ModelInfo:
        return ModelInfo("stand-in", "stand-in", 8, 1024, "float32", 100, 4)

    def stats(self) -> EngineStats:
        return EngineStats(active_requests=len(self.waiting))

    def progress(self) -> EngineProgress:
        return EngineProgress(self.steps, busy=bool(self.waiting), failed=self.failed)

    def fail_all(self, error: Exception) -> int:
        self.refusal = error
        for q in self.waiting.values():
            q.put_nowait(error)
        return len(self.waiting)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        if self.refusal is not None:
            raise self.refusal
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.waiting[request.request_id] = q
        try:
            item = await q.get()
            if isinstance(item, BaseException):
                raise item
            yield GenerationDelta("ok", (1,), 1, FinishReason.STOP)
        finally:
            del self.waiting[request.request_id]

    async def abort(self, request_id: str) -> bool:
        return False


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(self, engine: StandIn, server: Server, watchdog: Watchdog, clock: Clock,
                 exits: list[int], left: list[str]) -> None:
        self.engine, self.server, self.watchdog, self.clock = engine, server, watchdog, clock
        self.exits, self.left = exits, left
        self.channel = insecure_channel(server.address)
        self.worker = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, request_id: str) -> Any:
        req = worker_pb2.GenerateRequest(request_id=request_id,
                                         segments=[worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=[1]))])
        req.sampling.max_tokens = 1
        return worker_generate(self.worker, req, timeout=30)

    async def status(self) -> int:
        resp = await self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        return resp.status

    async def wait_pending(self, n: int) -> None:
        while len(self.engine.waiting) < n:
            await asyncio.sleep(0.01)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    engine, clock, exits, left = StandIn(), Clock(), [], []
    server = Server("worker-test", ServerOptions(port=0, grace_seconds=0.1))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, WorkerServicer(engine, "w"), SERVICE_NAME)
    await server.start()
    await server.set_serving(True)

    async def leave() -> None:
        left.append("routers")

    watchdog = Watchdog(engine, 120, set_not_serving=lambda: server.set_serving(False), on_trip=[leave],
                        exit=exits.append, exit_delay=0, clock=clock)
    h = Harness(engine, server, watchdog, clock, exits, left)
    yield h
    await h.channel.close()
    await server.drain()


async def _texts(call: Any) -> list[str]:
    return [r.text async for r in call]


async def _error_of(call: Any) -> Any:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    return info.value


async def test_a_stalled_engine_turns_the_worker_not_serving_fails_pending_requests_and_exits(
    harness: Harness,
) -> None:
    calls = [harness.generate(f"r{i}") for i in range(3)]
    readers = [asyncio.create_task(_error_of(c)) for c in calls]
    await harness.wait_pending(3)
    assert await harness.watchdog.poll() is None
    harness.clock.now += 119
    assert await harness.watchdog.poll() is None, "tripped before --watchdog-seconds"
    assert await harness.status() == health_pb2.HealthCheckResponse.SERVING
    harness.clock.now += 1
    tripped = await harness.watchdog.poll()
    assert tripped is not None and tripped.reason == "ENGINE_STALLED"
    assert harness.exits == [EXIT_CODE] and EXIT_CODE != 0
    assert harness.left == ["routers"]
    assert await harness.status() == health_pb2.HealthCheckResponse.NOT_SERVING
    for err in await asyncio.gather(*readers):
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        e = from_rpc_error(err)
        assert e.reason == "ENGINE_STALLED" and "retry" in str(e) and "another worker" in str(e)
        assert e.retry_after_seconds == 1.0
    # A request arriving afterwards fails at once instead of waiting.
    late = from_rpc_error(await _error_of(harness.generate("late")))
    assert isinstance(late, Unavailable) and late.reason == "ENGINE_STALLED"
    # Tripped once: later polls do nothing more.
    harness.clock.now += 1000
    assert await harness.watchdog.poll() is None
    assert harness.exits == [EXIT_CODE]


async def test_progress_or_idleness_keeps_the_watchdog_quiet(harness: Harness) -> None:
    reader = asyncio.create_task(_texts(harness.generate("slow")))
    await harness.wait_pending(1)
    for _ in range(10):  # 10 × 100 s busy, but a step every poll
        harness.engine.steps += 1
        harness.clock.now += 100
        assert await harness.watchdog.poll() is None
    harness.engine.waiting["slow"].put_nowait("finish")
    assert await reader == ["ok"]
    # Idle for an hour without a step: nothing is waiting, so nothing is stuck.
    harness.clock.now += 3600
    assert await harness.watchdog.poll() is None
    # Work arrives after the long idle spell: the stall clock starts from the last idle poll, not before.
    stuck = asyncio.create_task(_texts(harness.generate("after-idle")))
    await harness.wait_pending(1)
    harness.clock.now += 60
    assert await harness.watchdog.poll() is None
    assert harness.exits == []
    assert await harness.status() == health_pb2.HealthCheckResponse.SERVING
    harness.engine.waiting["after-idle"].put_nowait("finish")
    assert await stuck == ["ok"]


async def test_a_dead_engine_trips_at_once_even_with_the_stall_check_off(harness: Harness) -> None:
    harness.watchdog.stall_seconds = 0
    reader = asyncio.create_task(_error_of(harness.generate("doomed")))
    await harness.wait_pending(1)
    harness.clock.now += 10**6
    assert await harness.watchdog.poll() is None, "stall check is off"
    harness.engine.failed = "engine thread failed: RuntimeError()"
    tripped = await harness.watchdog.poll()
    assert tripped is not None and tripped.reason == "ENGINE_FAILED"
    err = from_rpc_error(await reader)
    assert err.reason == "ENGINE_FAILED"
    assert harness.exits == [EXIT_CODE]
    assert await harness.status() == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_engines_without_progress_are_not_watched() -> None:
    from embedmesh.services.worker.engines.echo.engine import EchoEngine

    exits: list[int] = []
    clock = Clock()

    async def not_serving() -> None:
        raise AssertionError("must not be called")

    watchdog = Watchdog(EchoEngine(), 1, set_not_serving=not_serving, exit=exits.append, exit_delay=0, clock=clock)
    clock.now += 10**6
    assert await watchdog.poll() is None and exits == []


async def test_the_watchdog_task_polls_until_stopped(harness: Harness) -> None:
    harness.watchdog._interval = 0.01
    harness.watchdog.start()
    reader = asyncio.create_task(_error_of(harness.generate("looped")))
    await harness.wait_pending(1)
    harness.engine.failed = "dead"
    err = from_rpc_error(await reader)
    assert err.reason == "ENGINE_FAILED" and harness.exits == [EXIT_CODE]
    await harness.watchdog.stop()


def test_the_watchdog_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from embedmesh.services.worker.config import WorkerConfig

    assert WorkerConfig.from_args([]).watchdog_seconds == 120
    assert WorkerConfig.from_args(["--watchdog-seconds", "0"]).watchdog_seconds == 0
    monkeypatch.setenv("EMBEDMESH_WORKER_WATCHDOG_SECONDS", "7.5")
    assert WorkerConfig.from_args([]).watchdog_seconds == 7.5
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit):  # argparse's usage error naming the setting, no traceback
            WorkerConfig.from_args(["--watchdog-seconds", bad])
        assert "watchdog_seconds must be >= 0" in capsys.readouterr().err
