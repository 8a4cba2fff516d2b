"""RouterService on real gRPC servers (free ports) with workers played by plain coroutines around RouterLink (the
real worker-side client): registration, events, gap -> re-sync, liveness, re-registration, two router replicas,
Route decisions, approximate mode, and the bad-input tables (after which the router keeps serving)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from embedmesh.core.errors import from_rpc_error
from embedmesh.core.server import Server, ServerOptions, insecure_channel
from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.services.router.config import RouterConfig
from embedmesh.services.router.indexer import RadixIndexer
from embedmesh.services.router.main import build, sweep_forever
from embedmesh.services.router.servicer import SERVICE_NAME, RouterServicer
from embedmesh.services.worker.router_link import LoadReport, RouterLink
from tests.support.route_many import route_async

BS = 4


class RouterUnderTest:
    def __init__(self, server: Server, servicer: RouterServicer, sweeper: asyncio.Task[None]) -> None:
        self.server, self.servicer, self.sweeper = server, servicer, sweeper
        self.channel = insecure_channel(server.address)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def index(self) -> RadixIndexer:
        return self.servicer.registry.index

    @property
    def workers(self) -> dict[str, Any]:
        return self.servicer.registry.workers

    async def route(self, hashes: list[int], model: str = "m", adapter: str = "") -> router_pb2.RouteResponse:
        return await route_async(self.stub, router_pb2.RouteRequest(
            model=model, block_hashes=hashes, block_size=BS, prompt_tokens=max(1, len(hashes)) * BS,
            lora_adapter=adapter), timeout=5)

    async def close(self) -> None:
        self.sweeper.cancel()
        await self.channel.close()
        await self.server.drain()


async def start_router(stale: float = 1.0, **config: Any) -> RouterUnderTest:
    servicer = build(RouterConfig(port=0, stale_seconds=stale, seed=0, **config))
    server = Server("router-test", ServerOptions(port=0, grace_seconds=0.1))
    server.add(router_pb2_grpc.add_RouterServiceServicer_to_server, servicer, SERVICE_NAME)
    await server.start()
    await server.set_serving(True)
    return RouterUnderTest(server, servicer, asyncio.create_task(sweep_forever(servicer.registry, 0.1)))


@pytest.fixture
async def router() -> AsyncIterator[RouterUnderTest]:
    r = await start_router()
    yield r
    await r.close()


class FakeWorker:
    """A worker with a real (tiny) KV cache: stored chains and evictions update it, and its snapshot reflects it,
    so a re-sync must bring the router back to exactly this state."""

    def __init__(self, routers: list[str], wid: str, events: bool = True, load: int = 0,
                 adapters: tuple[str, ...] = ()) -> None:
        self.wid = wid
        self.cache: dict[int, int] = {}  # hash -> parent (a real radix cache, flattened)
        self.active = load
        self.adapters = adapters
        reg = router_pb2.Registration(worker_id=wid, address=f"10.0.0.{len(wid)}:{abs(hash(wid)) % 1000 + 40000}",
                                      model="m", block_size=BS, engine="fake", publishes_kv_events=events)
        self.link = RouterLink(routers, reg, lambda: LoadReport(self.active, lora_adapters=self.adapters),
                               snapshot=self.snapshot, interval=0.1)

    def snapshot(self) -> list[router_pb2.KvEvent]:
        return [stored(parent, [h]) for h, parent in self.cache.items()]

    def store(self, parent: int, hashes: list[int]) -> None:
        p = parent
        for h in hashes:
            self.cache[h] = p
            p = h
        self.link.publish([stored(parent, hashes)])

    def evict(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cache.pop(h, None)
        self.link.publish([router_pb2.KvEvent(removed=router_pb2.BlocksRemoved(block_hashes=hashes))])

    async def __aenter__(self) -> FakeWorker:
        self.link.start()
        await self.link.wait_registered()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.link.close()


def stored(parent: int, hashes: list[int]) -> router_pb2.KvEvent:
    return router_pb2.KvEvent(stored=router_pb2.BlocksStored(parent_hash=parent, block_hashes=hashes))


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def test_registration_is_listed_and_an_existing_cache_arrives_as_a_snapshot(router: RouterUnderTest) -> None:
    w = FakeWorker([router.address], "a", load=3)
    w.cache = {11: 0, 12: 11}  # cached before the router existed
    async with w:
        await until(lambda: router.index.blocks_of("a") == 2)
        await until(lambda: router.workers["a"].active_requests == 3)
        listed = (await router.stub.ListWorkers(router_pb2.ListWorkersRequest())).workers
        assert [x.registration.worker_id for x in listed] == ["a"]
        assert listed[0].registration.publishes_kv_events and listed[0].blocks == 2
        assert listed[0].load.active_requests == 3 and listed[0].last_event_id == 1
        stats = await router.stub.GetIndexStats(router_pb2.GetIndexStatsRequest())
        assert stats.nodes == 2 and stats.worker_blocks == 2


async def test_events_drive_routing_to_the_overlapping_worker(router: RouterUnderTest) -> None:
    async with FakeWorker([router.address], "a") as a, FakeWorker([router.address], "b"):
        a.store(0, [11, 12, 13])
        await until(lambda: router.index.blocks_of("a") == 3)
        for _ in range(3):
            r = await router.route([11, 12, 13, 14])
            assert r.worker_id == "a" and r.overlap_blocks == 3 and r.address == a.link.registration.address
        assert [c.worker_id for c in r.candidates][0] == "a" and {c.worker_id for c in r.candidates} == {"a", "b"}
        a.evict([12, 13])
        await until(lambda: router.index.blocks_of("a") == 1)
        a.link.publish([router_pb2.KvEvent(cleared=router_pb2.AllBlocksCleared())])
        await until(lambda: router.index.blocks_of("a") == 0)


async def test_unrelated_prompts_spread_over_the_workers(router: RouterUnderTest) -> None:
    ws = [FakeWorker([router.address], f"w{i}") for i in range(4)]
    for w in ws:
        await w.__aenter__()
    try:
        rng = random.Random(1)
        chosen = [(await router.route([rng.randrange(1, 1 << 62) for _ in range(3)])).worker_id for _ in range(8)]
        assert set(chosen) == {w.wid for w in ws}, chosen
    finally:
        for w in ws:
            await w.__aexit__()


async def test_adapter_requests_go_only_to_workers_holding_the_adapter(router: RouterUnderTest) -> None:
    async with FakeWorker([router.address], "a") as a, FakeWorker([router.address], "b", load=5) as b:
        b.adapters = ("sql",)
        await until(lambda: router.workers["b"].adapters == {"sql"})
        a.store(0, [21, 22])  # "a" holds the prefix, and is idle: it would win if it were a candidate
        await until(lambda: router.index.blocks_of("a") == 2)
        for _ in range(4):
            r = await router.route([21, 22], adapter="sql")
            assert r.worker_id == "b" and not r.adapter_missing
            assert [c.worker_id for c in r.candidates] == ["b"]
        assert (await router.route([21, 22])).worker_id == "a", "base-model requests still use every worker"
        listed = {w.registration.worker_id: list(w.load.lora_adapters)
                  for w in (await router.stub.ListWorkers(router_pb2.ListWorkersRequest())).workers}
        assert listed == {"a": [], "b": ["sql"]}
        # Nobody holds "chat": the least-loaded worker, flagged so the caller loads it there first.
        r = await router.route([31], adapter="chat")
        assert r.worker_id == "a" and r.adapter_missing
        b.adapters = ()  # unloaded: the next heartbeat says so
        await until(lambda: router.workers["b"].adapters == frozenset())
        assert (await router.route([21, 22], adapter="sql")).adapter_missing


async def test_gap_triggers_resync_and_the_snapshot_restores_the_workers_state(router: RouterUnderTest) -> None:
    async with FakeWorker([router.address], "a") as a:
        a.store(0, [1, 2])
        await until(lambda: router.index.blocks_of("a") == 2)
        # Two batches get lost on the way: the worker evicted 1, 2 and cached 21, 22, but the router never heard.
        a.cache = {21: 0, 22: 21}
        a.link.peers[0].next_event_id += 2
        a.store(22, [23])  # arrives with an id 2 ahead: gap -> re-sync -> snapshot of the worker's real state
        await until(lambda: router.index.find_matches([21, 22, 23]) == {"a": 3})
        assert router.index.find_matches([1]) == {}, "blocks evicted during the gap are gone after the snapshot"
        assert router.index.blocks_of("a") == len(a.cache) == 3 and a.link.peers[0].resyncs == 1
        a.store(23, [24])  # and ordinary events flow again after it
        await until(lambda: router.index.find_matches([21, 22, 23, 24]) == {"a": 4})


async def test_broken_stream_drops_the_worker_and_it_re_registers(router: RouterUnderTest) -> None:
    async with FakeWorker([router.address], "a") as a:
        a.store(0, [5, 6])
        await until(lambda: router.index.blocks_of("a") == 2)
    await until(lambda: "a" not in router.workers, timeout=3)
    assert router.index.blocks_of("a") == 0
    async with FakeWorker([router.address], "a") as again:
        again.store(0, [7])
        await until(lambda: router.index.blocks_of("a") == 1)
        assert (await router.route([7])).worker_id == "a"


async def test_silent_worker_is_dropped_within_seconds(router: RouterUnderTest) -> None:
    opened = asyncio.Event()

    async def msgs() -> AsyncIterator[router_pb2.WorkerStreamRequest]:
        yield router_pb2.WorkerStreamRequest(registration=router_pb2.Registration(
            worker_id="quiet", address="x:1", model="m", block_size=BS, engine="fake"))
        opened.set()
        await asyncio.sleep(30)  # stream stays open, heartbeats stop

    call = router.stub.WorkerStream(msgs())
    assert (await call.read()).WhichOneof("kind") == "registered"
    await until(lambda: "quiet" in router.workers)
    await until(lambda: "quiet" not in router.workers, timeout=3)  # stale after 1 s, swept every 0.1 s
    call.cancel()


async def test_router_restart_is_survived_by_reconnecting() -> None:
    r1 = await start_router()
    port = r1.server.port
    w = FakeWorker([r1.address], "a")
    w.cache = {1: 0}
    async with w:
        await r1.close()
        await until(lambda: not w.link.peers[0].connected)
        r2 = await _start_on(port)
        try:
            await until(lambda: r2.index.blocks_of("a") == 1, timeout=10)
            # the worker sends its snapshot right after its registration, so the new router may index the blocks
            # before the worker has read the router's answer: wait for that too
            await until(lambda: w.link.peers[0].registrations == 2, timeout=10)
        finally:
            await r2.close()


async def _start_on(port: int) -> RouterUnderTest:
    servicer = build(RouterConfig(port=port, stale_seconds=1, seed=0))
    server = Server("router-test", ServerOptions(port=port, grace_seconds=0.1))
    server.add(router_pb2_grpc.add_RouterServiceServicer_to_server, servicer, SERVICE_NAME)
    await server.start()
    await server.set_serving(True)
    return RouterUnderTest(server, servicer, asyncio.create_task(sweep_forever(servicer.registry, 0.1)))


async def test_two_routers_reach_the_same_index() -> None:
    r1, r2 = await start_router(), await start_router()
    try:
        addrs = [r1.address, r2.address]
        async with FakeWorker(addrs, "a") as a, FakeWorker(addrs, "b") as b:
            a.store(0, [7, 8, 9])
            b.store(0, [7, 8])
            a.evict([9])
            b.store(8, [10])
            want = {"a": 2, "b": 3}
            await until(lambda: r1.index.find_matches([7, 8, 10]) == want == r2.index.find_matches([7, 8, 10]))
            assert r1.index.find_matches([7, 8, 9]) == r2.index.find_matches([7, 8, 9]) == {"a": 2, "b": 2}
            assert (await r1.route([7, 8, 10])).worker_id == (await r2.route([7, 8, 10])).worker_id == "b"
    finally:
        await r1.close()
        await r2.close()


async def test_approximate_tracking_for_workers_without_events(router: RouterUnderTest) -> None:
    async with FakeWorker([router.address], "a", events=False), FakeWorker([router.address], "b", events=False):
        first = await router.route([31, 32, 33])
        assert first.overlap_blocks == 0
        await asyncio.sleep(0.25)  # a heartbeat resets the routed-since-heartbeat count
        second = await router.route([31, 32, 33])
        assert second.worker_id == first.worker_id and second.overlap_blocks == 3
        other = await router.route([41, 42, 43])
        assert other.worker_id != first.worker_id, "an unrelated prompt goes to the less loaded worker"


async def test_approximate_blocks_age_out() -> None:
    r = await start_router(approx_ttl_seconds=0.3)
    try:
        async with FakeWorker([r.address], "a", events=False):
            await r.route([51, 52])
            assert r.index.blocks_of("a") == 2
            await until(lambda: r.index.blocks_of("a") == 0, timeout=3)
    finally:
        await r.close()


@pytest.mark.parametrize(
    "request_,field,code",
    [
        (router_pb2.RouteRequest(block_size=BS, prompt_tokens=4), "model", grpc.StatusCode.INVALID_ARGUMENT),
        (router_pb2.RouteRequest(model="m", block_size=0, prompt_tokens=4), "block_size",
         grpc.StatusCode.INVALID_ARGUMENT),
        (router_pb2.RouteRequest(model="m", block_size=BS), "prompt_tokens", grpc.StatusCode.INVALID_ARGUMENT),
        (router_pb2.RouteRequest(model="m", block_size=BS, prompt_tokens=7, block_hashes=[1, 2]), "block_hashes",
         grpc.StatusCode.INVALID_ARGUMENT),
        (router_pb2.RouteRequest(model="m", block_size=BS, prompt_tokens=8, block_hashes=[0]), "block_hashes",
         grpc.StatusCode.INVALID_ARGUMENT),
        (router_pb2.RouteRequest(model="m", block_size=16, prompt_tokens=16), "block_size",
         grpc.StatusCode.INVALID_ARGUMENT),
        (router_pb2.RouteRequest(model="absent", block_size=BS, prompt_tokens=4), "model",
         grpc.StatusCode.UNAVAILABLE),
        (router_pb2.RouteRequest(model="m", block_size=BS, prompt_tokens=4, lora_adapter="a b"), "lora_adapter",
         grpc.StatusCode.INVALID_ARGUMENT),
        (router_pb2.RouteRequest(model="m", block_size=BS, prompt_tokens=4, lora_adapter="x" * 257), "lora_adapter",
         grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_bad_route_requests(router: RouterUnderTest, request_: Any, field: str, code: Any) -> None:
    async with FakeWorker([router.address], "a"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await route_async(router.stub, request_)
        assert info.value.code() == code and from_rpc_error(info.value).field == field
        assert (await router.route([])).worker_id == "a", "the router keeps serving"


REG = router_pb2.Registration(worker_id="w", address="x:1", model="m", block_size=BS, publishes_kv_events=True)


def _reg(**kw: Any) -> router_pb2.WorkerStreamRequest:
    r = router_pb2.Registration()
    r.CopyFrom(REG)
    for k, v in kw.items():
        setattr(r, k, v)
    return router_pb2.WorkerStreamRequest(registration=r)


def _events(event_id: int, *events: router_pb2.KvEvent) -> router_pb2.WorkerStreamRequest:
    return router_pb2.WorkerStreamRequest(events=router_pb2.KvEventBatch(event_id=event_id, events=events))


@pytest.mark.parametrize(
    "messages,field",
    [
        ([router_pb2.WorkerStreamRequest(load=router_pb2.Load())], "registration"),
        ([_events(1, stored(0, [1]))], "registration"),
        ([_reg(worker_id="")], "registration.worker_id"),
        ([_reg(address="")], "registration.address"),
        ([_reg(model="")], "registration.model"),
        ([_reg(block_size=0)], "registration.block_size"),
        ([_reg(), _reg()], "registration"),
        ([_reg(), router_pb2.WorkerStreamRequest()], "kind"),
        ([_reg(), router_pb2.WorkerStreamRequest(load=router_pb2.Load(kv_usage=1.5))], "load.kv_usage"),
        ([_reg(), router_pb2.WorkerStreamRequest(load=router_pb2.Load(lora_adapters=["has space"]))],
         "load.lora_adapters"),
        ([_reg(), router_pb2.WorkerStreamRequest(load=router_pb2.Load(lora_adapters=["a"] * 1025))],
         "load.lora_adapters"),
        ([_reg(), _events(0, stored(0, [1]))], "events.event_id"),
        ([_reg(), _events(1, stored(0, [1]), router_pb2.KvEvent())], "events.events[1]"),
        ([_reg(), _events(1, stored(0, [1, 0]))], "events.events[0].stored.block_hashes"),
        ([_reg(publishes_kv_events=False), _events(1, stored(0, [1]))], "events"),
    ],
)
async def test_bad_worker_streams(router: RouterUnderTest, messages: list[Any], field: str) -> None:
    async def msgs() -> AsyncIterator[Any]:
        for m in messages:
            yield m
        await asyncio.sleep(5)  # keep the stream open: the router must end it

    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in router.stub.WorkerStream(msgs(), timeout=5):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and from_rpc_error(info.value).field == field
    await until(lambda: "w" not in router.workers)
    assert router.index.blocks_of("w") == 0
    async with FakeWorker([router.address], "ok"):
        assert (await router.route([])).worker_id == "ok", "the router keeps serving"


async def _ask_many(router: RouterUnderTest, *questions: router_pb2.RouteQuestion) -> list[router_pb2.RouteAnswer]:
    call = router.stub.RouteMany(iter([router_pb2.RouteManyRequest(questions=list(questions))]))
    return [a async for m in call for a in m.answers]


@pytest.mark.parametrize("request_,field,code", [
    (router_pb2.RouteRequest(block_size=BS, prompt_tokens=4), "model", grpc.StatusCode.INVALID_ARGUMENT),
    (router_pb2.RouteRequest(model="m", block_size=BS, prompt_tokens=8, block_hashes=[0]), "block_hashes",
     grpc.StatusCode.INVALID_ARGUMENT),
    (router_pb2.RouteRequest(model="absent", block_size=BS, prompt_tokens=4), "model", grpc.StatusCode.UNAVAILABLE),
    (router_pb2.RouteRequest(model="m", block_size=BS, prompt_tokens=4, lora_adapter="a b"), "lora_adapter",
     grpc.StatusCode.INVALID_ARGUMENT),
])
async def test_route_many_answers_each_question_as_route_would(router: RouterUnderTest, request_: Any, field: str,
                                                               code: Any) -> None:
    from embedmesh.core.errors import rpc_error_from_status

    async with FakeWorker([router.address], "a") as a:
        a.store(0, [1, 2])
        await until(lambda: router.index.blocks_of("a") == 2)
        good = router_pb2.RouteRequest(model="m", block_hashes=[1, 2], block_size=BS, prompt_tokens=2 * BS)
        answers = await _ask_many(router, router_pb2.RouteQuestion(id=5, request=request_),
                                  router_pb2.RouteQuestion(id=6, request=good))
        assert [x.id for x in answers] == [5, 6]
        err = rpc_error_from_status(answers[0].error)
        assert err.code() == code and from_rpc_error(err).field == field
        assert answers[1].response.worker_id == "a" and answers[1].response.overlap_blocks == 2
        assert [c.worker_id for c in answers[1].response.candidates] == ["a"]


async def test_route_many_questions_without_an_id_or_a_request_are_refused_by_name(router: RouterUnderTest) -> None:
    from embedmesh.core.errors import rpc_error_from_status

    answers = await _ask_many(router, router_pb2.RouteQuestion(id=0, request=router_pb2.RouteRequest(model="m")),
                              router_pb2.RouteQuestion(id=3))
    fields = [from_rpc_error(rpc_error_from_status(x.error)).field for x in answers]
    assert fields == ["id", "request"]
    assert all(x.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for x in answers)


async def test_a_draining_router_ends_route_many_streams_after_their_next_answer(router: RouterUnderTest) -> None:
    async with FakeWorker([router.address], "a"):
        queue: asyncio.Queue[router_pb2.RouteManyRequest | None] = asyncio.Queue()

        async def questions() -> AsyncIterator[router_pb2.RouteManyRequest]:
            while (q := await queue.get()) is not None:
                yield q

        call = router.stub.RouteMany(questions())
        ask = router_pb2.RouteManyRequest(questions=[router_pb2.RouteQuestion(id=1, request=router_pb2.RouteRequest(
            model="m", block_size=BS, prompt_tokens=BS))])
        queue.put_nowait(ask)
        first = await call.read()
        assert first.answers[0].response.worker_id == "a"
        await router.servicer.start_drain()
        queue.put_nowait(ask)
        second = await call.read()
        assert second.answers[0].response.worker_id == "a"  # answered, then the stream ends though we never hang up
        assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
