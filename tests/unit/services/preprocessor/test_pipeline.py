"""Running a completion (``preprocessor/pipeline.py``): responses that queue up while the reader is slow go out
merged per choice, in order, errors in place; the worker for a sequence is the router's choice while usable, else
the pool's; a job fans its choices out with their seeds and accounts usage; and worker failures — with real gRPC
workers on loopback and with scripted ones: a worker that dies or refuses before producing anything is retried once
on another (a dead one marked unhealthy), a worker lost mid-stream ends the request with UNAVAILABLE
``WORKER_LOST`` and no address in the message."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.core.errors import EmbedmeshError, InvalidArgument, ResourceExhausted, Unavailable, to_status
from embedmesh.core.sampling import SamplingParams
from embedmesh.core.server import Server, ServerOptions
from embedmesh.services.preprocessor.pipeline import (
    Delta,
    Job,
    Usage,
    _coalesce,
    _one,
    _picker,
    _transport_failure,
    run_job,
)
from embedmesh.services.preprocessor.prompts import Prompt
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.services.router.route_client import RouteDecision
from embedmesh.services.worker.many import ManyStreams
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc

LENGTH = common_pb2.FINISH_REASON_LENGTH


def _r(text: str, ids: list[int], finish: int = 0, tokens: int = 0, lp: float | None = None,
       plp: bool = False) -> worker_pb2.GenerateResponse:
    r = worker_pb2.GenerateResponse(text=text, token_ids=ids, finish_reason=finish, completion_tokens=tokens)
    if lp is not None:
        r.logprobs.add(token_id=ids[0], logprob=lp)
    if plp:
        r.prompt_logprobs.add(token_id=1)
    return r


def test_consecutive_deltas_of_one_choice_merge() -> None:
    err = RuntimeError("boom")
    out = _coalesce([(0, _r("a", [1], lp=-0.1, plp=True)), (0, _r("b", [2], lp=-0.2)), (1, _r("x", [9])),
                     (0, _r("c", [3], LENGTH, 3, lp=-0.3)), (0, _r("late", [4])), err, (1, _r("y", [8], LENGTH, 2))])
    assert len(out) == 6
    d0, n0 = out[0]  # type: ignore[misc]
    assert isinstance(d0, Delta) and (d0.index, d0.text, d0.token_ids) == (0, "ab", (1, 2)) and n0 == 0
    assert [lp.token_id for lp in d0.logprobs] == [1, 2] and len(d0.prompt_logprobs) == 1
    assert out[1][0].text == "x"  # type: ignore[index]
    d2, n2 = out[2]  # type: ignore[misc]
    assert (d2.text, d2.finish_reason, n2) == ("c", LENGTH, 3)
    # A delta after a finished one is never merged into it.
    assert out[3][0].text == "late"  # type: ignore[index]
    assert out[4] is err
    assert out[5][0].text == "y" and out[5][1] == 2  # type: ignore[index]


def test_a_finished_choice_absorbs_its_queued_tokens() -> None:
    out = _coalesce([(2, _r("p", [5])), (2, _r("q", [6])), (2, _r("", [], LENGTH, 2))])
    assert len(out) == 1
    d, n = out[0]  # type: ignore[misc]
    assert (d.index, d.text, d.token_ids, d.finish_reason, n) == (2, "pq", (5, 6), LENGTH, 2)


# --- worker failures with real gRPC workers on loopback ---------------------------------------------------------


class _Worker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, tokens: int, die_after: int | None = None) -> None:
        self.tokens = tokens
        self.die_after = die_after
        self.calls = 0
        self.server: Server | None = None
        self.many = ManyStreams(self.generate, lambda request: None)

    async def GetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        return worker_pb2.GetInfoResponse(model="m", worker_id=f"w-{id(self)}", hidden_size=4)

    async def GenerateMany(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        async for results in self.many.serve(request_iterator):
            yield results

    async def generate(self, request: Any, arrival: Any = None) -> AsyncIterator[Any]:
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


# --- the worker for a sequence: the router's choice while it is usable, else the pool's ----------------------


class _Router:
    block_size = 2

    def __init__(self, decision: RouteDecision | None) -> None:
        self.decision = decision
        self.asked: list[tuple[Any, ...]] = []

    async def route(self, model: str, hashes: Any, prompt_tokens: int, request_id: str = "",
                    adapter: str = "") -> RouteDecision | None:
        self.asked.append((model, list(hashes), prompt_tokens, request_id, adapter))
        return self.decision

    async def close(self) -> None:
        return None


def _fake_pool(*healthy: bool, adapters: tuple[set[str], ...] = ()) -> WorkerPool:
    pool = WorkerPool(tuple(f"127.0.0.1:{9 + i}" for i in range(len(healthy))), 1 << 20)
    for i, (w, ok) in enumerate(zip(pool.workers, healthy, strict=True)):
        w.info = worker_pb2.GetInfoResponse(model="m", worker_id=f"w{i}")
        w.healthy = ok
        w.adapters = adapters[i] if i < len(adapters) else set()
    return pool


def test_the_routers_healthy_choice_is_taken() -> None:
    async def run() -> None:
        pool = _fake_pool(True, True)
        router = _Router(RouteDecision("w1", pool.workers[1].address))
        pick = _picker(pool, router, "m", [7, 8], 4, "r-1")  # type: ignore[arg-type]
        got = [await pick() for _ in range(3)]
        assert all(w is pool.workers[1] for w in got)
        assert router.asked[0] == ("m", [7, 8], 4, "r-1", "")
        await pool.close()

    asyncio.run(run())


def test_an_unhealthy_routed_worker_falls_back_to_a_healthy_one() -> None:
    async def run() -> None:
        pool = _fake_pool(False, True, True)
        pick = _picker(pool, _Router(RouteDecision("w0", pool.workers[0].address)), "m", [], 1, "r")  # type: ignore[arg-type]
        got = [await pick() for _ in range(4)]
        assert pool.workers[0] not in got and set(got) == {pool.workers[1], pool.workers[2]}
        await pool.close()

    asyncio.run(run())


def test_no_router_or_no_decision_means_round_robin() -> None:
    async def run() -> None:
        pool = _fake_pool(True, True)
        for router in (None, _Router(None)):
            pick = _picker(pool, router, "m", [], 1, "r")  # type: ignore[arg-type]
            assert {await pick() for _ in range(2)} == set(pool.workers)
        await pool.close()

    asyncio.run(run())


def test_a_worker_only_the_router_knows_is_added_and_used() -> None:
    async def run() -> None:
        pool = _fake_pool(True)
        pick = _picker(pool, _Router(RouteDecision("new", "127.0.0.1:77")), "m", [], 1, "r")  # type: ignore[arg-type]
        w = await pick()
        assert w.address == "127.0.0.1:77" and w.healthy and pool.workers[-1] is w
        await pool.close()

    asyncio.run(run())


def test_adapter_requests_go_where_the_adapter_is() -> None:
    async def run() -> None:
        pool = _fake_pool(True, True, adapters=({"a"}, set()))
        ensured: list[Any] = []

        async def ensure(model: str, adapter: str, preferred: Any = None, exclude: Any = None) -> Any:
            ensured.append((model, adapter, preferred))
            return pool.workers[0]

        pool.ensure_adapter = ensure  # type: ignore[method-assign]
        holder = _picker(pool, _Router(RouteDecision("w0", pool.workers[0].address)), "m", [], 1, "r", "a")  # type: ignore[arg-type]
        assert await holder() is pool.workers[0] and ensured == []
        # Routed to a worker without it: the router knew nobody holds it (picked by load) -> load it there.
        missing = RouteDecision("w1", pool.workers[1].address, adapter_missing=True)
        assert await _picker(pool, _Router(missing), "m", [], 1, "r", "a")() is pool.workers[0]  # type: ignore[arg-type]
        assert ensured == [("m", "a", pool.workers[1])]
        # Routed to a worker our view says lacks it, the router not saying so: our view wins, no preference.
        stale = RouteDecision("w1", pool.workers[1].address)
        await _picker(pool, _Router(stale), "m", [], 1, "r", "a")()  # type: ignore[arg-type]
        assert ensured[-1] == ("m", "a", None)
        await pool.close()

    asyncio.run(run())


# --- a whole job over fake workers ------------------------------------------------------------------------------


def _stream(*responses: worker_pb2.GenerateResponse) -> Any:
    async def gen() -> AsyncIterator[worker_pb2.GenerateResponse]:
        for r in responses:
            yield r

    class _Call:
        def __init__(self) -> None:
            self._it = gen()

        def __aiter__(self) -> Any:
            return self._it

        def cancel(self) -> None:
            pass

    return _Call()


def test_run_job_fans_choices_out_with_their_seeds_and_accounts_usage() -> None:
    async def run() -> None:
        pool = _fake_pool(True, adapters=({"ad"},))
        bodies: list[worker_pb2.GenerateRequest] = []

        def generate_raw(body: bytes) -> Any:
            req = worker_pb2.GenerateRequest.FromString(body)
            bodies.append(req)
            n = len(bodies)
            return _stream(worker_pb2.GenerateResponse(text=f"t{n}", token_ids=[n]),
                           worker_pb2.GenerateResponse(text="!", token_ids=[0], finish_reason=LENGTH,
                                                       completion_tokens=2))

        pool.workers[0].generate_raw = generate_raw  # type: ignore[method-assign]
        job = Job("req", "m", [Prompt.of_ids((1, 2, 3)), Prompt.of_ids((4,))], SamplingParams(max_tokens=2, seed=5),
                  n=2, model_dtype=tensor_pb2.DATA_TYPE_FP32, adapter="ad", base_model="m")
        items = [i async for i in run_job(job, pool)]
        usage = items[-1]
        assert isinstance(usage, Usage) and (usage.prompt_tokens, usage.completion_tokens) == (4, 8)
        deltas = [d for d in items[:-1] if isinstance(d, Delta)]
        assert sorted({d.index for d in deltas}) == [0, 1, 2, 3]
        finished = [d for d in deltas if d.finish_reason == LENGTH]
        assert sorted(d.index for d in finished) == [0, 1, 2, 3]
        assert len(bodies) == 4 and all(b.lora_adapter == "ad" for b in bodies)
        assert sorted(b.sampling.seed for b in bodies) == [5, 5, 6, 6]
        by_id = {b.request_id.split("-")[1]: b for b in bodies}
        assert [list(by_id[str(i)].segments[0].token_ids.ids) for i in range(4)] == [[1, 2, 3], [1, 2, 3], [4], [4]]
        assert [by_id[str(i)].sampling.seed for i in range(4)] == [5, 6, 5, 6]
        assert all(b.request_id.startswith("req-") for b in bodies)
        await pool.close()

    asyncio.run(run())


def test_run_job_raises_a_workers_error_in_place() -> None:
    async def run() -> None:
        pool = _fake_pool(True)

        def generate_raw(body: bytes) -> Any:
            raise _rpc(InvalidArgument("prompt: bad", field="prompt", reason="BAD"))

        pool.workers[0].generate_raw = generate_raw  # type: ignore[method-assign]
        job = Job("r", "m", [Prompt.of_ids((1,))], SamplingParams(max_tokens=1), n=1,
                  model_dtype=tensor_pb2.DATA_TYPE_FP32)
        with pytest.raises(InvalidArgument) as e:
            [i async for i in run_job(job, pool)]
        assert (e.value.field, e.value.reason) == ("prompt", "BAD")
        await pool.close()

    asyncio.run(run())


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, trailing: Any, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), trailing, details=details)


def _rpc(err: EmbedmeshError) -> _RpcError:
    status = to_status(err)
    return _RpcError(status.code, grpc.aio.Metadata(*status.trailing_metadata), status.details)


def _transport() -> _RpcError:
    return _RpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), "Connection refused")


def test_a_transport_failure_is_unavailable_without_status_details() -> None:
    assert _transport_failure(_transport())
    assert not _transport_failure(_rpc(Unavailable("draining", reason="DRAINING")))
    assert not _transport_failure(_rpc(InvalidArgument("x", field="f")))


async def _one_with(pool: WorkerPool, behaviours: list[Any]) -> list[Any]:
    """Run ``_one`` with the pool's workers answering as ``behaviours`` (a list of responses or an exception)."""
    for w, b in zip(pool.workers, behaviours, strict=True):
        def generate_raw(body: bytes, b: Any = b, w: Any = w) -> Any:
            w.calls = getattr(w, "calls", 0) + 1
            if isinstance(b, BaseException):
                raise b
            return _stream(*b)

        w.generate_raw = generate_raw  # type: ignore[method-assign]
    out: asyncio.Queue[Any] = asyncio.Queue()

    async def pick() -> Any:
        return pool.workers[0]

    await _one(0, worker_pb2.GenerateRequest(request_id="r"), pick, out, pool, "m", body=b"")
    return [out.get_nowait() for _ in range(out.qsize())]


OK = [worker_pb2.GenerateResponse(text="ok", token_ids=[1], finish_reason=LENGTH, completion_tokens=1)]


@pytest.mark.parametrize("first", [
    _rpc(ResourceExhausted("busy", reason="WORKER_BUSY", retry_after_seconds=1.0)),
    _rpc(Unavailable("draining", reason="DRAINING")),
    [worker_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_ABORT)],
])
def test_a_refusal_before_any_output_is_retried_once_elsewhere(first: Any) -> None:
    async def run() -> None:
        pool = _fake_pool(True, True)
        items = await _one_with(pool, [first, OK])
        assert [i[1].text for i in items] == ["ok"]
        assert pool.workers[1].calls == 1  # type: ignore[attr-defined]
        assert pool.workers[0].healthy and [w.inflight for w in pool.workers] == [0, 0]
        await pool.close()

    asyncio.run(run())


def test_both_workers_busy_is_unavailable_workers_busy() -> None:
    async def run() -> None:
        pool = _fake_pool(True, True)
        busy = _rpc(ResourceExhausted("busy", reason="WORKER_BUSY", retry_after_seconds=1.0))
        (err,) = await _one_with(pool, [busy, busy])
        assert isinstance(err, Unavailable) and err.reason == "WORKERS_BUSY" and err.retry_after_seconds == 1.0
        await pool.close()

    asyncio.run(run())


def test_an_abort_after_output_ends_the_request() -> None:
    async def run() -> None:
        pool = _fake_pool(True, True)
        aborted = [worker_pb2.GenerateResponse(text="a", token_ids=[1]),
                   worker_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_ABORT)]
        items = await _one_with(pool, [aborted, OK])
        assert items[0][1].text == "a"
        assert isinstance(items[1], Unavailable) and items[1].reason == "WORKER_ABORTED"
        assert getattr(pool.workers[1], "calls", 0) == 0
        await pool.close()

    asyncio.run(run())


def test_a_workers_refusal_of_the_request_is_passed_on_not_retried() -> None:
    async def run() -> None:
        pool = _fake_pool(True, True)
        (err,) = await _one_with(pool, [_rpc(InvalidArgument("prompt: no", field="prompt", reason="X")), OK])
        assert isinstance(err, InvalidArgument) and (err.field, err.reason) == ("prompt", "X")
        assert getattr(pool.workers[1], "calls", 0) == 0
        await pool.close()

    asyncio.run(run())


def test_a_worker_lost_at_the_transport_is_marked_and_the_sequence_retried() -> None:
    async def run() -> None:
        pool = _fake_pool(True, True)
        items = await _one_with(pool, [_transport(), OK])
        assert [i[1].text for i in items] == ["ok"] and not pool.workers[0].healthy
        await pool.close()

    asyncio.run(run())
