"""Worker failures seen by the pipeline, with real gRPC workers on loopback: a worker that dies before producing
anything is marked unhealthy and the sequence is retried on another; a worker lost mid-stream ends the request with
UNAVAILABLE ``WORKER_LOST`` and no address in the message; the preprocessor's in-flight bound refuses at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.core.errors import Unavailable
from embedmesh.core.server import Server, ServerOptions
from embedmesh.services.preprocessor.pipeline import _one
from embedmesh.services.preprocessor.servicer import Admission
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc


class _Worker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, tokens: int, die_after: int | None = None) -> None:
        self.tokens = tokens
        self.die_after = die_after
        self.calls = 0
        self.server: Server | None = None

    async def GetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        return worker_pb2.GetInfoResponse(model="m", worker_id=f"w-{id(self)}", hidden_size=4)

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        self.calls += 1
        for i in range(self.tokens):
            if self.die_after is not None and i == self.die_after:
                assert self.server is not None
                await self.server._server.stop(0)  # the process is gone: connections reset
                await asyncio.sleep(3600)
            yield worker_pb2.GenerateResponse(text=f"{i}", token_ids=[i])
            await asyncio.sleep(0.01)
        yield worker_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH, completion_tokens=self.tokens)


async def _serve(w: _Worker) -> Server:
    server = Server("w", ServerOptions(port=0, grace_seconds=0))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, w, "embedmesh.worker.v1.WorkerService")
    await server.start()
    await server.set_serving(True)
    w.server = server
    return server


async def _pool(*workers: _Worker) -> tuple[WorkerPool, list[Server]]:
    servers = [await _serve(w) for w in workers]
    pool = WorkerPool(tuple(s.address for s in servers), 64 << 20)
    pool.start()
    for _ in range(200):
        if all(h.healthy for h in pool.workers):
            break
        await asyncio.sleep(0.02)
    return pool, servers


async def _run_one(pool: WorkerPool, first: int) -> list[Any]:
    out: asyncio.Queue[Any] = asyncio.Queue()

    async def pick() -> Any:
        return pool.workers[first]

    await _one(0, worker_pb2.GenerateRequest(request_id="r"), pick, out, pool, "m")
    items = []
    while not out.empty():
        items.append(out.get_nowait())
    return items


def test_a_worker_dead_before_any_output_is_marked_unhealthy_and_the_sequence_retried() -> None:
    async def run() -> None:
        dead, alive = _Worker(3), _Worker(3)
        pool, servers = await _pool(dead, alive)
        await servers[0]._server.stop(0)
        items = await _run_one(pool, first=0)
        assert [i[1].text for i in items[:-1]] == ["0", "1", "2"]
        assert items[-1][1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert not pool.workers[0].healthy and alive.calls == 1
        # No request picks it afterwards.
        assert all(pool.pick("m") is pool.workers[1] for _ in range(4))
        await pool.close()
        await servers[1].drain()

    asyncio.run(run())


def test_a_worker_lost_mid_stream_fails_the_request_retryably_without_an_address() -> None:
    async def run() -> None:
        w, other = _Worker(10, die_after=2), _Worker(3)
        pool, servers = await _pool(w, other)
        items = await _run_one(pool, first=0)
        assert [i[1].text for i in items[:-1]] == ["0", "1"]
        err = items[-1]
        assert isinstance(err, Unavailable) and err.reason == "WORKER_LOST" and err.retry_after_seconds == 1.0
        assert "127.0.0.1" not in err.message and servers[0].address not in err.message
        assert not pool.workers[0].healthy and other.calls == 0  # output was sent: not retried
        await pool.close()
        await servers[1].drain()

    asyncio.run(run())


def test_the_in_flight_bound_refuses_at_once_with_a_retry_delay() -> None:
    admission = Admission(2)
    with admission.slot("Complete"), admission.slot("Complete"):
        with pytest.raises(Unavailable) as e, admission.slot("Complete"):
            pass
        assert e.value.reason == "OVERLOADED" and e.value.retry_after_seconds == 1.0
    assert admission.inflight == 0
    with admission.slot("Complete"):
        assert admission.inflight == 1


def test_retry_after_on_retryable_gateway_errors() -> None:
    from embedmesh.gateway.errors import ApiError, error_response

    assert error_response(ApiError(503, "x")).headers["retry-after"] == "1"
    assert error_response(ApiError(429, "x", retry_after=2.2)).headers["retry-after"] == "3"
    assert error_response(ApiError(503, "x", retry_after=0.001)).headers["retry-after"] == "1"
    assert "retry-after" not in error_response(ApiError(400, "x")).headers
