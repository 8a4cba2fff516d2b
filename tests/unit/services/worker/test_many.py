"""GenerateMany on the worker (``worker/many.py``): generations interleave on one stream and each ends with ``end``
or its own error result (code, message, details), frames that break the rules get an error naming the field,
cancel aborts one generation in the engine, the caller's end of the stream lets running generations finish, and a
drain refuses new generations and ends the stream once the running ones are done."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from embedmesh.common.v1 import common_pb2
from embedmesh.services.worker.engines.echo.engine import EchoEngine
from embedmesh.services.worker.servicer import WorkerServicer
from embedmesh.worker.v1 import worker_pb2
from tests.support.engines import SlowEcho

pytestmark = pytest.mark.asyncio


def _gen(request_id: str, max_tokens: int = 3, ids: tuple[int, ...] = (1, 2, 3)) -> worker_pb2.GenerateRequest:
    req = worker_pb2.GenerateRequest(request_id=request_id)
    req.segments.add().token_ids.ids.extend(ids)
    req.sampling.max_tokens = max_tokens
    return req


def _start(gid: int, req: worker_pb2.GenerateRequest) -> worker_pb2.GenerateManyRequest:
    return worker_pb2.GenerateManyRequest(frames=[worker_pb2.GenerateFrame(id=gid, generate=req)])


class _Frames:
    """The caller's side of the request stream: frames put in are read by the stream; ``end()`` half-closes."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[worker_pb2.GenerateManyRequest | None] = asyncio.Queue()

    def put(self, frames: worker_pb2.GenerateManyRequest) -> None:
        self.queue.put_nowait(frames)

    def end(self) -> None:
        self.queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateManyRequest]:
        while (item := await self.queue.get()) is not None:
            yield item


class _Collector:
    """Reads a GenerateMany response stream in the background, results grouped by generation id."""

    def __init__(self, stream: AsyncIterator[worker_pb2.GenerateManyResponse]) -> None:
        self.by_id: dict[int, list[worker_pb2.GenerateResult]] = {}
        self.order: list[int] = []
        self.task = asyncio.ensure_future(self._run(stream))

    async def _run(self, stream: AsyncIterator[worker_pb2.GenerateManyResponse]) -> None:
        async for message in stream:
            for r in message.results:
                self.by_id.setdefault(r.id, []).append(r)
                self.order.append(r.id)

    def ended(self, gid: int) -> bool:
        rs = self.by_id.get(gid, [])
        return bool(rs) and rs[-1].WhichOneof("result") in ("end", "error")

    async def until(self, cond: Any, timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(0.005)


def _text(results: list[worker_pb2.GenerateResult]) -> str:
    return "".join(r.response.text for r in results if r.WhichOneof("result") == "response")


def _details(err: common_pb2.RpcStatus) -> tuple[str, str]:
    status = status_pb2.Status.FromString(err.status_details)
    info = error_details_pb2.ErrorInfo()
    for d in status.details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            d.Unpack(info)
    return info.reason, info.metadata.get("field", "")


async def _served(engine: EchoEngine | None = None) -> tuple[WorkerServicer, _Frames, _Collector]:
    servicer = WorkerServicer(engine or EchoEngine("m", hidden_size=4), "w-1")
    await servicer.engine.start()
    frames = _Frames()
    return servicer, frames, _Collector(servicer.many.serve(frames))


async def test_generations_interleave_and_each_ends_with_end_and_its_own_text() -> None:
    servicer, frames, out = await _served()
    frames.put(worker_pb2.GenerateManyRequest(frames=[worker_pb2.GenerateFrame(id=7, generate=_gen("a", 2)),
                                                 worker_pb2.GenerateFrame(id=9, generate=_gen("b", 5))]))
    await out.until(lambda: out.ended(7) and out.ended(9))
    # The same request as a Generate call gives the same text.
    direct = "".join([r.text async for r in servicer.generate(_gen("c", 5))])
    assert _text(out.by_id[9]) == direct and len(direct) > 0
    assert out.by_id[7][-1].WhichOneof("result") == "end"
    assert out.by_id[9][-1].WhichOneof("result") == "end"
    last = [r for r in out.by_id[9] if r.WhichOneof("result") == "response"][-1]
    assert last.response.finish_reason != 0
    frames.end()
    await asyncio.wait_for(out.task, 5)  # the caller hung up and nothing runs: the stream ends


async def test_a_refused_request_ends_only_its_generation_with_the_status_a_call_gives() -> None:
    servicer, frames, out = await _served()
    bad = _gen("", 2)  # no request_id
    frames.put(worker_pb2.GenerateManyRequest(frames=[worker_pb2.GenerateFrame(id=1, generate=bad),
                                                 worker_pb2.GenerateFrame(id=2, generate=_gen("ok", 2))]))
    await out.until(lambda: out.ended(1) and out.ended(2))
    err = out.by_id[1][-1].error
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "request_id" in err.message
    assert _details(err) == ("REQUIRED", "request_id")
    assert out.by_id[2][-1].WhichOneof("result") == "end"


@pytest.mark.parametrize(("frame", "gid", "reason", "field"), [
    (worker_pb2.GenerateFrame(id=0, generate=_gen("z")), 0, "OUT_OF_RANGE", "id"),
    (worker_pb2.GenerateFrame(id=4), 4, "REQUIRED", "action"),
], ids=["id 0", "no action"])
async def test_frames_that_break_the_rules_get_an_error_naming_the_field(
        frame: worker_pb2.GenerateFrame, gid: int, reason: str, field: str) -> None:
    _, frames, out = await _served()
    frames.put(worker_pb2.GenerateManyRequest(frames=[frame]))
    await out.until(lambda: gid in out.by_id)
    err = out.by_id[gid][0].error
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and _details(err) == (reason, field)
    frames.end()
    await asyncio.wait_for(out.task, 5)


async def test_a_second_start_of_a_running_id_is_refused_and_the_first_goes_on() -> None:
    engine = SlowEcho(0.02)
    _, frames, out = await _served(engine)
    frames.put(_start(3, _gen("first", 500)))
    await out.until(lambda: 3 in out.by_id)
    frames.put(_start(3, _gen("second", 2)))
    await out.until(lambda: out.ended(3))
    err = out.by_id[3][-1]
    assert err.WhichOneof("result") == "error" and _details(err.error) == ("DUPLICATE_ID", "id")
    count = len(out.by_id[3])
    await out.until(lambda: len(out.by_id[3]) > count)  # the first one still produces
    frames.put(worker_pb2.GenerateManyRequest(frames=[worker_pb2.GenerateFrame(id=3, cancel={})]))
    frames.end()
    await asyncio.wait_for(out.task, 10)
    assert engine.closed == ["first"]  # the second never started


async def test_cancel_aborts_one_generation_in_the_engine_and_nothing_more_of_it_comes() -> None:
    engine = SlowEcho(0.02)
    _, frames, out = await _served(engine)
    frames.put(worker_pb2.GenerateManyRequest(frames=[worker_pb2.GenerateFrame(id=1, generate=_gen("long", 200)),
                                                 worker_pb2.GenerateFrame(id=2, generate=_gen("short", 3))]))
    await out.until(lambda: len(out.by_id.get(1, [])) >= 2)
    frames.put(worker_pb2.GenerateManyRequest(frames=[worker_pb2.GenerateFrame(id=1, cancel={}),
                                                 worker_pb2.GenerateFrame(id=99, cancel={})]))  # unknown: ignored
    await out.until(lambda: "long" in engine.closed)
    seen = len(out.by_id[1])
    await out.until(lambda: out.ended(2))
    await asyncio.sleep(0.1)
    assert len(out.by_id[1]) == seen and not out.ended(1)
    assert out.by_id[2][-1].WhichOneof("result") == "end"
    frames.end()
    await asyncio.wait_for(out.task, 5)


async def test_running_generations_finish_after_the_caller_ends_its_stream() -> None:
    engine = SlowEcho(0.01)
    _, frames, out = await _served(engine)
    frames.put(_start(1, _gen("a", 10)))
    frames.end()
    await asyncio.wait_for(out.task, 10)
    assert out.by_id[1][-1].WhichOneof("result") == "end" and len(_text(out.by_id[1])) == 10


async def test_a_drain_refuses_new_generations_and_ends_the_stream_once_running_ones_are_done() -> None:
    engine = SlowEcho(0.01)
    servicer, frames, out = await _served(engine)
    frames.put(_start(1, _gen("a", 15)))
    await out.until(lambda: 1 in out.by_id)
    await servicer.many.start_drain()
    frames.put(_start(2, _gen("b", 2)))
    await out.until(lambda: out.ended(2))
    err = out.by_id[2][-1].error
    assert err.code == grpc.StatusCode.UNAVAILABLE.value[0] and _details(err)[0] == "WORKER_DRAINING"
    # The caller never hangs up, yet the stream ends once generation 1 is done.
    await asyncio.wait_for(out.task, 10)
    assert out.by_id[1][-1].WhichOneof("result") == "end" and len(_text(out.by_id[1])) == 15


async def test_an_engine_failure_is_internal_with_an_incident_and_no_internals() -> None:
    class Broken(EchoEngine):
        async def generate(self, request: Any) -> AsyncIterator[Any]:
            raise RuntimeError("secret /etc/path detail")
            yield  # pragma: no cover

    _, frames, out = await _served(Broken("m", hidden_size=4))
    frames.put(_start(5, _gen("x", 2)))
    await out.until(lambda: out.ended(5))
    err = out.by_id[5][-1].error
    assert err.code == grpc.StatusCode.INTERNAL.value[0]
    assert "incident" in err.message and "secret" not in err.message
    frames.end()
    await asyncio.wait_for(out.task, 5)


async def test_a_caller_that_does_not_read_pauses_the_generations_at_the_backlog(monkeypatch: Any) -> None:
    from embedmesh.services.worker import many

    monkeypatch.setattr(many, "BACKLOG", 8)
    servicer = WorkerServicer(EchoEngine("m", hidden_size=4), "w-1")
    await servicer.engine.start()
    frames = _Frames()
    stream = servicer.many.serve(frames).__aiter__()
    for gid in range(1, 41):
        frames.put(_start(gid, _gen(f"r{gid}", 256)))
    first = await stream.__anext__()  # then nobody reads for a while
    await asyncio.sleep(0.5)
    queued = [r for m in [await stream.__anext__()] for r in m.results]
    # Unread results stop at the backlog (plus at most one per generation that was emitting when it filled).
    assert len(queued) <= 8 + 40
    # Reading again lets every generation run to its end.
    done = {r.id for r in [*first.results, *queued] if r.WhichOneof("result") == "end"}
    tokens = sum(len(r.response.token_ids) for r in [*first.results, *queued])
    async with asyncio.timeout(10):
        while len(done) < 40:
            for r in (await stream.__anext__()).results:
                tokens += len(r.response.token_ids)
                if r.WhichOneof("result") == "end":
                    done.add(r.id)
    assert tokens == 40 * 256
    await stream.aclose()


class _Ctx:
    """Not used by GenerateMany: present so the handler signature matches."""


async def test_the_servicer_serves_it_as_a_grpc_method() -> None:
    servicer = WorkerServicer(EchoEngine("m", hidden_size=4), "w-1")
    await servicer.engine.start()
    frames = _Frames()
    frames.put(_start(1, _gen("a", 2)))
    frames.end()
    got = [m async for m in servicer.GenerateMany(frames, _Ctx())]  # type: ignore[arg-type]
    kinds = [r.WhichOneof("result") for m in got for r in m.results]
    assert kinds[-1] == "end" and "response" in kinds
