"""Streams that survive their worker (``preprocessor/migration.py`` and the pipeline's cut handling), with real
worker servicers on loopback running the mocker engine (prompt-dependent token ids, a delay per step): a worker
stopped or draining mid-stream has the sequence continued on the other, and the client's stream is the undisturbed
one (the mocker run alone, in process, is the reference: no token duplicated or lost, usage counts the whole, the
continuation's finish); the continuation carries the ids sent, max_tokens reduced, no prompt log-probabilities and
the prompt's segments as they were. Limits: none left, the positions budget, no other worker that resumes, a
continuation that dies too: each ends with UNAVAILABLE ``WORKER_LOST``, never a hang."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.core.errors import Unavailable
from embedmesh.core.sampling import SamplingParams
from embedmesh.core.server import Server, ServerOptions
from embedmesh.services.preprocessor.migration import MIGRATIONS, MigrationLimits, Resume, continuation
from embedmesh.services.preprocessor.pipeline import Delta, Job, Usage, run_job
from embedmesh.services.preprocessor.prompts import Prompt
from embedmesh.services.preprocessor.worker_chunks import ChunkedBody
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.services.worker.engines.base import EmbedsSegment, GenerationRequest, TokenSegment
from embedmesh.services.worker.engines.mocker.config import MockerOptions
from embedmesh.services.worker.engines.mocker.engine import MockerEngine
from embedmesh.services.worker.servicer import WorkerServicer
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

OPTS = MockerOptions(mocker_decode_ms=20.0, mocker_decode_ms_per_seq=0.0, mocker_prefill_ms_per_token=0.0,
                     mocker_hidden_size=8)
N = 12
ROWS = np.linspace(-1, 1, 3 * 8, dtype=np.float32).reshape(3, 8)
PROMPTS = {"text": Prompt.of_ids(tuple(range(20))), "embeds": Prompt.of_embeds(ROWS),
           "parts": Prompt(((5, 6, 7), ROWS, (8, 9)))}


class _Stubborn(MockerEngine):
    resumes = False


async def _worker(engine_cls: type[MockerEngine] = MockerEngine) -> tuple[MockerEngine, Server]:
    engine = engine_cls("m", 16, OPTS)
    await engine.start()
    servicer = WorkerServicer(engine, f"w-{id(engine)}")
    server = Server("w", ServerOptions(port=0, grace_seconds=0))
    server.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer, "embedmesh.worker.v1.WorkerService")
    await server.start()
    await server.set_serving(True)
    return engine, server


async def _reference(prompt: Prompt) -> list[int]:
    engine = MockerEngine("m", 16, MockerOptions(mocker_decode_ms=0.0, mocker_decode_ms_per_seq=0.0,
                                                 mocker_prefill_ms_per_token=0.0, mocker_hidden_size=8))
    await engine.start()
    segments = [TokenSegment(p) if isinstance(p, tuple) else EmbedsSegment(p) for p in prompt.pieces]
    out = [d async for d in engine.generate(GenerationRequest("ref", segments, SamplingParams(max_tokens=N)))]
    await engine.shutdown()
    return [t for d in out for t in d.token_ids]


class _Mesh:
    def __init__(self, *workers: tuple[MockerEngine, Server], limits: MigrationLimits | None = None) -> None:
        self.engines = [w[0] for w in workers]
        self.servers = [w[1] for w in workers]
        self.pool = WorkerPool(tuple(s.address for s in self.servers), 64 << 20, migration=limits)

    async def __aenter__(self) -> _Mesh:
        self.pool.start()
        for _ in range(300):
            if all(h.healthy and h.info is not None for h in self.pool.workers):
                break
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.pool.close()
        for s in self.servers:
            await s._server.stop(0)
        for e in self.engines:
            await e.shutdown()

    def serving(self) -> int:
        return next(i for i, e in enumerate(self.engines) if e.stats().active_requests)


async def _stream(mesh: _Mesh, prompt: Prompt, cut: Any, after: int = 3) -> tuple[list[Delta], Usage | None,
                                                                                  Exception | None]:
    """Run a job; after ``after`` deltas, ``cut(mesh, index of the serving worker)``."""
    job = Job("req", "m", [prompt], SamplingParams(max_tokens=N), n=1, model_dtype=tensor_pb2.DATA_TYPE_FP32)
    deltas: list[Delta] = []
    usage = None
    try:
        async with asyncio.timeout(30):
            async for item in run_job(job, mesh.pool):
                if isinstance(item, Usage):
                    usage = item
                    continue
                deltas.append(item)
                if len(deltas) == after:
                    await cut(mesh, mesh.serving())
    except Unavailable as e:
        return deltas, usage, e
    return deltas, usage, None


async def _kill(mesh: _Mesh, i: int) -> None:
    await mesh.servers[i]._server.stop(0)  # the process is gone: its connections reset


async def _drain(mesh: _Mesh, i: int) -> None:
    await mesh.servers[i].set_serving(False)
    for rid in list(mesh.engines[i]._by_id):
        await mesh.engines[i].abort(rid)  # what a draining worker does to what it still runs


def _migrated() -> float:
    return MIGRATIONS.labels("migrated")._value.get()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", list(PROMPTS))
@pytest.mark.parametrize("cut", [_kill, _drain])
async def test_a_cut_stream_continues_on_the_other_worker_as_if_undisturbed(kind: str, cut: Any) -> None:
    before = _migrated()
    async with _Mesh(await _worker(), await _worker()) as mesh:
        deltas, usage, error = await _stream(mesh, PROMPTS[kind], cut)
    assert error is None
    ids = [t for d in deltas for t in d.token_ids]
    reference = await _reference(PROMPTS[kind])
    assert ids == reference and len(set(reference)) > 6
    assert "".join(d.text for d in deltas) == "".join(f" {t}" for t in reference)
    finishes = [d.finish_reason for d in deltas if d.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED]
    assert finishes == [common_pb2.FINISH_REASON_LENGTH] and deltas[-1].finish_reason == finishes[0]
    assert usage is not None and usage.completion_tokens == N
    assert _migrated() == before + 1


@pytest.mark.asyncio
@pytest.mark.parametrize("limits,second,outcome", [
    (MigrationLimits(max_migrations=0), MockerEngine, "limit"),
    (MigrationLimits(max_positions=21), MockerEngine, "budget"),  # 20 prompt positions + 3 sent > 21
    (None, _Stubborn, "no_worker"),
])
async def test_a_stream_that_cannot_continue_ends_with_worker_lost(limits: MigrationLimits | None,
                                                                   second: type[MockerEngine], outcome: str) -> None:
    counted = MIGRATIONS.labels(outcome)._value.get()
    async with _Mesh(await _worker(), await _worker(second), limits=limits) as mesh:
        if second is _Stubborn:
            mesh.serving = lambda: 0  # type: ignore[method-assign]
            mesh.pool.workers[1].healthy = False  # the first request goes to the worker that resumes
            deltas, usage, error = await _stream_after_restore(mesh)
        else:
            deltas, usage, error = await _stream(mesh, PROMPTS["text"], _kill)
    assert isinstance(error, Unavailable) and error.reason == "WORKER_LOST" and "lost mid-generation" in str(error)
    assert len([t for d in deltas for t in d.token_ids]) == 3 and usage is None
    assert MIGRATIONS.labels(outcome)._value.get() == counted + 1


async def _stream_after_restore(mesh: _Mesh) -> tuple[list[Delta], Usage | None, Exception | None]:
    async def kill_first(m: _Mesh, i: int) -> None:
        m.pool.workers[1].healthy = True  # the stubborn worker is there, but cannot resume
        await _kill(m, 0)

    return await _stream(mesh, PROMPTS["text"], kill_first)


@pytest.mark.asyncio
async def test_a_continuation_that_dies_too_is_continued_again_within_the_limit() -> None:
    async def kill_twice(m: _Mesh, i: int) -> None:
        await _kill(m, i)

    for limit, ok in ((1, False), (2, True)):
        async with _Mesh(await _worker(), await _worker(), await _worker(),
                         limits=MigrationLimits(max_migrations=limit)) as mesh:
            job = Job("req", "m", [PROMPTS["text"]], SamplingParams(max_tokens=N), n=1,
                      model_dtype=tensor_pb2.DATA_TYPE_FP32)
            ids: list[int] = []
            kills = [3, 7]  # cut after the 3rd token, then after the 7th (the continuation's 4th)
            error = None
            try:
                async with asyncio.timeout(30):
                    async for item in run_job(job, mesh.pool):
                        if isinstance(item, Delta):
                            ids.extend(item.token_ids)
                            if kills and len(ids) >= kills[0]:
                                kills.pop(0)
                                await kill_twice(mesh, mesh.serving())
            except Unavailable as e:
                error = e
        if ok:
            assert error is None and ids == await _reference(PROMPTS["text"])
        else:
            assert error is not None and error.reason == "WORKER_LOST" and len(ids) >= 7 and len(ids) < N


def test_the_continuation_request_keeps_the_segments_and_carries_the_sent_ids() -> None:
    req = worker_pb2.GenerateRequest(request_id="r-0-abc", lora_adapter="ad")
    req.sampling.max_tokens = 10
    req.sampling.seed = 4
    req.sampling.prompt_logprobs = 1
    seg = worker_pb2.PromptSegment()
    seg.token_ids.ids.extend([1, 2, 3])
    tail = seg.SerializeToString()
    segments = b"\x12" + bytes([len(tail)]) + tail  # field 2 (segments), as core.transport.wire writes them
    resume = Resume(ids=[7, 8, 9], migrations=1)  # the first try sent 3 of its 10
    new, body = continuation(req, req.SerializeToString() + segments, resume)
    assert isinstance(body, bytes)
    sent = worker_pb2.GenerateRequest.FromString(body)
    assert list(sent.resume_token_ids) == [7, 8, 9] and sent.sampling.max_tokens == 7
    assert sent.sampling.seed == 4 and not sent.sampling.HasField("prompt_logprobs")
    assert sent.request_id == "r-0-abc-m1" != req.request_id and sent.lora_adapter == "ad"
    assert [list(s.token_ids.ids) for s in sent.segments] == [[1, 2, 3]] and new.request_id == sent.request_id
    assert resume.offset == 3
    chunked = ChunkedBody(req.SerializeToString() + segments, (memoryview(b"rows"),))
    _, again = continuation(req, chunked, Resume(ids=[7, 8, 9], migrations=1))
    assert isinstance(again, ChunkedBody) and again.rows == chunked.rows
    assert worker_pb2.GenerateRequest.FromString(again.request) == sent
    # A second cut, 2 tokens into the continuation: 10 - 3 - 2 left, every id sent so far resumed.
    resume.ids.extend([1, 2])
    resume.migrations = 2
    _, third = continuation(new, body, resume)
    last = worker_pb2.GenerateRequest.FromString(third)  # type: ignore[arg-type]
    assert last.sampling.max_tokens == 5 and list(last.resume_token_ids) == [7, 8, 9, 1, 2]
    assert [list(s.token_ids.ids) for s in last.segments] == [[1, 2, 3]] and resume.offset == 5


def test_a_continuation_counts_what_went_before() -> None:
    resume = Resume(offset=3)
    resp = worker_pb2.GenerateResponse(token_ids=[4], completion_tokens=1)
    resp.prompt_logprobs.add(token_id=1)
    out = resume.deliver(resp)
    assert out.completion_tokens == 4 and not out.prompt_logprobs and resume.ids == [4] and resume.started


@pytest.mark.asyncio
async def test_a_failure_after_the_last_delta_ends_nothing_twice() -> None:
    """The worker's stream breaks after the sequence's last delta went out: the client has its whole answer and
    one finish; nothing is continued or raised."""
    import grpc

    from embedmesh.services.preprocessor.pipeline import _one

    class _Call:
        def __aiter__(self) -> Any:
            async def gen() -> Any:
                yield worker_pb2.GenerateResponse(token_ids=[5], text=" 5", completion_tokens=1,
                                                  finish_reason=common_pb2.FINISH_REASON_LENGTH)
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "Connection reset")
            return gen()

        def cancel(self) -> None:
            pass

    async with _Mesh(await _worker(), await _worker()) as mesh:
        for w in mesh.pool.workers:
            w.generate_raw = lambda body: _Call()  # type: ignore[method-assign]
        out: asyncio.Queue[Any] = asyncio.Queue()
        req = worker_pb2.GenerateRequest(request_id="r")
        req.sampling.max_tokens = 4

        async def pick() -> Any:
            return mesh.pool.workers[0]

        before = _migrated()
        await _one(0, req, pick, out, mesh.pool, "m", body=req.SerializeToString(),
                   resume=Resume(MigrationLimits(), 3))
        items = [out.get_nowait() for _ in range(out.qsize())]
    assert len(items) == 1 and items[0][1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert _migrated() == before


@pytest.mark.asyncio
@pytest.mark.parametrize("router_says", [2, 0])
async def test_the_continuation_goes_where_the_router_places_the_prompt_when_it_can(router_says: int) -> None:
    """The first try's picker (the router, by the prompt's hashes) is asked again: its worker takes the
    continuation; when it names the worker just lost, another one that resumes does."""
    from embedmesh.services.preprocessor.pipeline import _one

    async with _Mesh(await _worker(), await _worker(), await _worker()) as mesh:
        picks = iter([0, router_says])

        async def pick() -> Any:
            return mesh.pool.workers[next(picks)]

        req = worker_pb2.GenerateRequest(request_id="r")
        req.sampling.max_tokens = N
        req.segments.add().token_ids.ids.extend(range(20))
        out: asyncio.Queue[Any] = asyncio.Queue()
        task = asyncio.create_task(_one(0, req, pick, out, mesh.pool, "m", body=req.SerializeToString(),
                                        resume=Resume(MigrationLimits(), 20)))
        items = [await out.get() for _ in range(3)]
        await _kill(mesh, 0)
        await asyncio.wait_for(task, 30)
        while not out.empty():
            items.append(out.get_nowait())
        done = [e.stats().completed_requests for e in mesh.engines]
    assert [t for _, r in items for t in r.token_ids] == await _reference(PROMPTS["text"])
    assert done[0] == 0 and (done[2] == 1 if router_says == 2 else done[1] + done[2] == 1)
