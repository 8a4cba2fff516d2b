"""Big prompts go to the worker as a GenerateMany call of their own, a start frame then rows frames
(``preprocessor/worker_chunks.py``), on a real gRPC server: the pipeline sends prompts with at least
``thresholds.WORKER_PIECES_MIN`` bytes of rows that way and smaller ones on the shared stream, the rows arrive as
sent, and a worker that refuses a generation before reading all its rows still gets its own answer through."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np

from embedmesh.core.errors import from_rpc_error
from embedmesh.core.sampling import SamplingParams
from embedmesh.core.server import Server, ServerOptions
from embedmesh.core.transport.thresholds import WORKER_PIECES_MIN as CHUNKED_MIN
from embedmesh.services.preprocessor.pipeline import Job, Usage, run_job
from embedmesh.services.preprocessor.prompts import Prompt
from embedmesh.services.preprocessor.worker_stream import OwnGeneration
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.services.worker.servicer import WorkerServicer
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.engines import SlowEcho

SERVICE = "embedmesh.worker.v1.WorkerService"
HIDDEN = 4


class _Counting(WorkerServicer):
    """A worker servicer that counts the calls of each method and keeps the rows its engine got."""

    def __init__(self, max_message_bytes: int = 512 << 20) -> None:
        super().__init__(SlowEcho(), "w-1", max_message_bytes=max_message_bytes)
        self.calls = {"generation": 0, "with rows frames": 0, "GenerateMany": 0}
        self.rows: list[np.ndarray] = []
        real = self.engine.generate

        async def generate(request: Any) -> AsyncIterator[Any]:
            self.rows.extend(s.rows for s in request.segments if hasattr(s, "rows"))
            async for d in real(request):
                yield d

        self.engine.generate = generate  # type: ignore[method-assign]

    async def generate(self, request: Any, arrival: Any = None) -> AsyncIterator[Any]:
        self.calls["generation"] += 1
        self.calls["with rows frames"] += arrival is not None
        async for r in super().generate(request, arrival):
            yield r

    async def GenerateMany(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        self.calls["GenerateMany"] += 1
        async for r in super().GenerateMany(request_iterator, context):
            yield r


async def _serve(servicer: WorkerServicer) -> tuple[Server, WorkerPool]:
    await servicer.engine.start()
    # the server's message limit and the servicer's, as the worker's main sets them
    server = Server("w", ServerOptions(port=0, grace_seconds=0, max_message_bytes=servicer.max_message_bytes))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer, SERVICE)
    await server.start()
    await server.set_serving(True)
    pool = WorkerPool((server.address,), 512 << 20)
    pool.start()
    async with asyncio.timeout(10):
        while not pool.workers[0].healthy:
            await asyncio.sleep(0.02)
    return server, pool


def _job(*rows: np.ndarray, n: int = 1) -> Job:
    return Job(request_id="job", model="m", prompts=[Prompt([r]) for r in rows],
               sampling=SamplingParams(max_tokens=2), n=n, model_dtype=tensor_pb2.DATA_TYPE_FP32)


async def _run(job: Job, pool: WorkerPool) -> tuple[dict[int, str], Usage]:
    text: dict[int, str] = {}
    usage = None
    async for item in run_job(job, pool):
        if isinstance(item, Usage):
            usage = item
        else:
            text[item.index] = text.get(item.index, "") + item.text
    assert usage is not None
    return text, usage


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, HIDDEN)).astype(np.float32)


BIG = CHUNKED_MIN // (4 * HIDDEN) + 1  # rows just past the threshold
SMALL = CHUNKED_MIN // (4 * HIDDEN) - 1


def test_prompts_with_many_rows_go_as_chunks_and_others_as_before() -> None:
    async def run() -> None:
        worker = _Counting()
        server, pool = await _serve(worker)
        try:
            big, big2, small = _rows(BIG, 1), _rows(BIG + 7, 2), _rows(SMALL, 3)
            text, usage = await _run(_job(big, big2, small, n=2), pool)
            assert text == {i: "xx" for i in range(6)}
            assert usage.prompt_tokens == BIG + BIG + 7 + SMALL
            assert worker.calls["with rows frames"] == 4  # two big prompts x n=2
            assert worker.calls["generation"] - 4 == 2  # the small prompt: one message each
            # one call per generation: the small prompt (rows in its request) is past the shared stream's
            # thresholds.SHARED_STREAM_MAX too
            assert worker.calls["GenerateMany"] == 4 + 2
            sent = sorted((r for r in worker.rows), key=len)
            assert len(sent) == 6
            for got, want in zip(sent, [small, small, big, big, big2, big2], strict=True):
                np.testing.assert_array_equal(got, want)
        finally:
            await pool.close()
            await server._server.stop(0)

    asyncio.run(run())


def test_a_stream_the_worker_refused_early_still_ends_with_the_workers_answer() -> None:
    async def run() -> None:
        # The worker takes at most 1 MiB of rows: it refuses the generation at its start frame, while the
        # preprocessor is still writing its rows; the answer that comes back is the worker's.
        worker = _Counting(max_message_bytes=CHUNKED_MIN)
        server, pool = await _serve(worker)
        try:
            handle = pool.workers[0]
            from embedmesh.core.transport import wire
            from embedmesh.services.preprocessor.worker_chunks import ChunkedBody

            req = worker_pb2.GenerateRequest(request_id="r")
            req.sampling.max_tokens = 2
            head, rows = wire.chunked_segments([_rows(BIG * 3, 5)], tensor_pb2.DATA_TYPE_FP32)
            call = handle.generate_raw(ChunkedBody(req.SerializeToString() + head, tuple(rows)))
            assert isinstance(call, OwnGeneration)
            try:
                _ = [r async for r in call]
                raise AssertionError("the worker took more than its limit")
            except grpc.aio.AioRpcError as e:
                assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), e
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    assert from_rpc_error(e).reason == "TOO_LARGE"
            assert worker.rows == []
        finally:
            await pool.close()
            await server._server.stop(0)

    asyncio.run(run())
