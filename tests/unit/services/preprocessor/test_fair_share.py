"""The preprocessor's fair share of generation slots: free slots are taken at once; under saturation the slot-time
(how long requests hold their slots) goes to tenants by weight, whatever their requests' lengths; a tenant under its
share gets the next free slot ahead of one over it; an idle tenant's share goes to the others and idleness saves no
credit; batch work waits for interactive work; a waiter that leaves gives its place (or its slot) back.

The slot-time tests run closed-loop clients on a simulated clock: each client acquires, holds its slot for its
request's simulated duration, releases (from its own task, as the preprocessor does) and asks again. What each
tenant got is computed here from the grant and release times, not read from the scheduler."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
from dataclasses import dataclass, field

import pytest

from embedmesh.services.preprocessor.fair_share import BATCH, FairShare, Slot


@dataclass
class _Sim:
    """A simulated clock driving closed-loop clients through a FairShare."""

    slots: int
    now: float = 0.0
    fs: FairShare = field(init=False)
    held: list[tuple[str, float, float]] = field(default_factory=list)
    """(tenant, granted at, released at) of every finished hold."""
    grants: list[tuple[float, str]] = field(default_factory=list)
    asked: list[tuple[float, str]] = field(default_factory=list)
    _ends: list[tuple[float, int, asyncio.Future[None]]] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.fs = FairShare(self.slots, clock=lambda: self.now)

    async def client(self, tenant: str, weight: float, hold: float, *, start: float = 0.0, think: float = 0.0,
                     priority: str = "interactive") -> None:
        await self.wait_until(start)
        while True:
            self.asked.append((self.now, tenant))
            slot = await self.fs.acquire(tenant, weight, priority)
            granted = self.now
            self.grants.append((granted, tenant))
            await self.wait_until(self.now + hold)
            self.held.append((tenant, granted, self.now))
            self.fs.release(slot)
            if think:
                await self.wait_until(self.now + think)

    def wait_until(self, t: float) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._ends, (t, next(self._order), fut))
        return fut

    async def run(self, clients: list[asyncio.Task[None]], until: float) -> None:
        """Advance the clock event by event to ``until``, letting every woken client act at each instant."""
        try:
            while True:
                for _ in range(20):  # woken clients release, granted waiters wake and register their holds
                    await asyncio.sleep(0)
                if not self._ends or self._ends[0][0] > until:
                    return
                t, _, fut = heapq.heappop(self._ends)
                self.now = t
                fut.set_result(None)
        finally:
            for c in clients:
                c.cancel()
            await asyncio.gather(*clients, return_exceptions=True)

    def slot_time(self, tenant: str, since: float, until: float) -> float:
        """Slot-seconds ``tenant`` held in [since, until] (holds still open at ``until`` counted up to it)."""
        done = sum(max(0.0, min(e, until) - max(g, since)) for n, g, e in self.held if n == tenant)
        ended = {(n, g) for n, g, _ in self.held}
        open_ = sum(max(0.0, until - max(g, since)) for g, n in self.grants if n == tenant and (n, g) not in ended)
        return done + open_


async def _order(fs: FairShare, held: list[Slot | None], waiters: list[tuple[str, float, str]],
                 grants: int) -> list[str]:
    """Queue ``waiters`` (tenant, weight, priority) behind the full slots ``held``, then release ``grants`` slots
    (the held ones first, then those granted, oldest first); the tenants in the order they got a slot."""
    served: list[str] = []
    slots = list(held)

    async def one(tenant: str, weight: float, priority: str) -> None:
        slots.append(await fs.acquire(tenant, weight, priority))
        served.append(tenant)

    tasks = [asyncio.create_task(one(*w)) for w in waiters]
    await asyncio.sleep(0)
    assert fs.waiting == len(waiters)
    for _ in range(grants):
        fs.release(slots.pop(0))
        await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return served


async def test_free_slots_are_taken_at_once_and_nothing_waits_below_saturation() -> None:
    fs = FairShare(2)
    await fs.acquire("a")
    b = await fs.acquire("b")
    assert fs.active == 2 and fs.waiting == 0
    assert b is not None and b.tenant == "b"
    fs.release(b)
    await fs.acquire("a")
    assert fs.active == 2


async def test_off_means_no_bound() -> None:
    fs = FairShare(0)
    for _ in range(1000):
        assert await fs.acquire("a") is None
    fs.release(None)
    assert fs.active == 0 and fs.waiting == 0


@pytest.mark.parametrize(("hold_a", "hold_b", "think"), [(1.0, 1.0, 0.0), (1.0, 2.5, 0.0), (3.0, 0.7, 0.0),
                                                        (1.0, 1.0, 0.25)])
async def test_weights_4_to_1_share_slot_time_4_to_1_whatever_the_request_lengths(hold_a: float, hold_b: float,
                                                                                   think: float) -> None:
    """Both tenants backlogged on 8 slots (B's share 1.6: not a whole number of slots), requests of different
    lengths per tenant: slot-time 4:1 within 10 %. Counting grants instead would give 4 x hold_a : hold_b. With
    ``think``, each client pauses before asking again: B's requests, all ending at once, leave it idle a moment,
    which must not wipe out what it has taken over its share (it would get 2 slots of 8, 3:1)."""
    sim = _Sim(8)
    clients = [asyncio.create_task(sim.client("a", 4.0, hold_a, think=think)) for _ in range(20)]
    clients += [asyncio.create_task(sim.client("b", 1.0, hold_b, think=think)) for _ in range(8)]
    await sim.run(clients, 400.0)
    a, b = sim.slot_time("a", 20.0, 400.0), sim.slot_time("b", 20.0, 400.0)
    assert a + b == pytest.approx(8 * 380.0, rel=0.01)  # saturated: no slot left idle
    assert a / b == pytest.approx(4.0, rel=0.10)


async def test_a_tenant_under_its_share_gets_the_next_free_slot() -> None:
    """A (weight 4) keeps 30 requests waiting; B (weight 1, demand one slot: under its share of 1.6) asks again
    as soon as its request ends. Every one of B's requests gets the first slot freed after it asked, although A's
    waiters came first."""
    sim = _Sim(8)
    clients = [asyncio.create_task(sim.client("a", 4.0, 1.0)) for _ in range(30)]
    clients.append(asyncio.create_task(sim.client("b", 1.0, 1.3, start=5.05, think=0.21)))
    await sim.run(clients, 200.0)
    b_asked = [t for t, n in sim.asked if n == "b"]
    assert len(b_asked) > 80
    for asked in b_asked[:-1]:
        first_after = next(n for t, n in sim.grants if t >= asked)  # grants are listed in the order given
        assert first_after == "b", f"B asked at {asked}, the next slot went to {first_after}"


async def test_a_tenant_over_its_share_waits_for_one_under_it() -> None:
    """Equal weights; A holds 7 of 8 slots and has waiters queued first, B holds 1 and waits for a second: the
    next free slot is B's (first come, first served would give it to A)."""
    sim = _Sim(8)
    clients = [asyncio.create_task(sim.client("a", 1.0, 10.0)) for _ in range(7)]
    clients.append(asyncio.create_task(sim.client("b", 1.0, 10.0)))
    clients += [asyncio.create_task(sim.client("a", 1.0, 10.0, start=1.0)) for _ in range(5)]
    clients.append(asyncio.create_task(sim.client("b", 1.0, 10.0, start=2.0)))
    await sim.run(clients, 10.0)
    assert [n for t, n in sim.grants if t == 10.0][0] == "b"


async def test_an_idle_tenants_share_goes_to_the_others() -> None:
    """B (weight 9: a share of 3.6 of 4 slots) runs one request at a time: A (weight 1) gets every slot B does
    not use; none is kept idle for B's share."""
    sim = _Sim(4)
    clients = [asyncio.create_task(sim.client("a", 1.0, 1.0)) for _ in range(10)]
    clients.append(asyncio.create_task(sim.client("b", 9.0, 1.0)))
    await sim.run(clients, 100.0)
    a, b = sim.slot_time("a", 0.0, 100.0), sim.slot_time("b", 0.0, 100.0)
    assert a + b == pytest.approx(400.0, rel=0.01)
    assert 75.0 <= b <= 100.0 and a >= 300.0


async def test_idleness_saves_no_credit() -> None:
    """A runs alone for 100 s, then B (same weight) arrives backlogged: from then on they share 1:1; B does not
    take every slot to catch up A's 100 s, and A is not shut out."""
    sim = _Sim(4)
    clients = [asyncio.create_task(sim.client("a", 1.0, 1.0)) for _ in range(10)]
    clients += [asyncio.create_task(sim.client("b", 1.0, 1.0, start=100.0)) for _ in range(10)]
    await sim.run(clients, 130.0)
    assert sim.slot_time("b", 0.0, 100.0) == 0.0
    a, b = sim.slot_time("a", 101.0, 130.0), sim.slot_time("b", 101.0, 130.0)
    assert a == pytest.approx(b, rel=0.10)


async def test_credit_saved_while_holding_less_than_a_share_is_bounded() -> None:
    """Equal weights, 4 slots: for 100 s X holds 3 and Y 1 (one long request; neither asks for more), then both
    flood. Y has held 200 slot-seconds less, but takes the slots for about one hold, not for the tens of seconds
    it would need to catch up: X keeps getting slots, and from then on they share 1:1."""
    sim = _Sim(4)
    clients = [asyncio.create_task(sim.client("x", 1.0, 1.0)) for _ in range(3)]
    clients.append(asyncio.create_task(sim.client("y", 1.0, 1000.0)))
    clients += [asyncio.create_task(sim.client(n, 1.0, 1.0, start=100.5)) for n in ("x", "y") for _ in range(8)]
    await sim.run(clients, 140.0)
    assert sim.slot_time("x", 0.0, 100.0) == pytest.approx(300.0) and sim.slot_time("y", 0.0, 100.0) == 100.0
    assert sim.slot_time("x", 100.0, 110.0) >= 10.0
    assert sim.slot_time("x", 110.0, 140.0) == pytest.approx(sim.slot_time("y", 110.0, 140.0), rel=0.10)
    assert sim.slot_time("y", 0.0, 140.0) < sim.slot_time("x", 0.0, 140.0)  # Y did not catch up


async def test_batch_waits_while_interactive_work_waits() -> None:
    fs = FairShare(1)
    x = await fs.acquire("x")
    served = await _order(fs, [x], [("bulk", 100.0, BATCH)] * 5 + [("chat", 1.0, "interactive")] * 3, 6)
    assert served == ["chat", "chat", "chat", "bulk", "bulk", "bulk"]


async def test_batch_waits_even_when_the_interactive_tenant_is_over_its_share() -> None:
    """Priority comes before share: an interactive tenant that has held far more than a batch tenant still goes
    first."""
    sim = _Sim(2)
    clients = [asyncio.create_task(sim.client("chat", 1.0, 1.0)) for _ in range(4)]
    clients += [asyncio.create_task(sim.client("bulk", 100.0, 1.0, start=0.5, priority=BATCH))]
    await sim.run(clients, 50.0)
    assert sim.slot_time("bulk", 0.0, 50.0) == 0.0 and sim.slot_time("chat", 0.0, 50.0) == 100.0


async def test_a_waiter_that_leaves_gives_its_place_back() -> None:
    fs = FairShare(1)
    x = await fs.acquire("x")
    leaving = asyncio.create_task(fs.acquire("a"))
    staying = asyncio.create_task(fs.acquire("b"))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    assert fs.waiting == 1
    fs.release(x)
    await asyncio.wait_for(staying, 1)  # the slot went to b, not to the caller that left
    assert fs.active == 1 and fs.waiting == 0


async def test_a_slot_granted_as_its_waiter_leaves_goes_to_the_next() -> None:
    fs = FairShare(1)
    x = await fs.acquire("x")
    leaving = asyncio.create_task(fs.acquire("a"))
    staying = asyncio.create_task(fs.acquire("b"))
    await asyncio.sleep(0)
    fs.release(x)  # granted to a ...
    leaving.cancel()  # ... which leaves before it runs
    assert isinstance((await asyncio.gather(leaving, return_exceptions=True))[0], asyncio.CancelledError)
    await asyncio.wait_for(staying, 1)
    assert fs.active == 1 and fs.waiting == 0


@pytest.mark.parametrize("rounds", [200])
async def test_slots_are_never_over_granted_under_churn(rounds: int) -> None:
    fs = FairShare(3)
    rng = random.Random(7)
    peak = 0

    async def user(i: int) -> None:
        nonlocal peak
        for _ in range(5):
            slot = await fs.acquire(f"t{i % 4}", 1.0 + i % 3, BATCH if i % 5 == 0 else "interactive")
            peak = max(peak, fs.active)
            await asyncio.sleep(rng.random() / 1000)
            fs.release(slot)

    async def leaver(i: int) -> None:
        task = asyncio.create_task(fs.acquire(f"t{i % 4}"))
        await asyncio.sleep(rng.random() / 1000)
        task.cancel()
        got = (await asyncio.gather(task, return_exceptions=True))[0]
        if not isinstance(got, BaseException):
            fs.release(got)

    await asyncio.gather(*(user(i) for i in range(rounds // 5)), *(leaver(i) for i in range(rounds // 5)))
    assert peak <= 3 and fs.active == 0 and fs.waiting == 0
    assert not fs._tenants  # nothing kept for tenants that are gone


async def test_a_slot_given_back_from_another_task_is_its_own_tenants() -> None:
    """A generation's slot may be given back by whoever closes it (an abandoned stream closed later): the slot
    names its tenant, so the right tenant's hold ends."""
    fs = FairShare(2)
    a = await fs.acquire("a")
    await fs.acquire("b")
    await asyncio.create_task(_release_later(fs, a))
    assert set(fs._tenants) == {"b"} and fs._tenants["b"].active == 1 and fs.active == 1


async def _release_later(fs: FairShare, slot: Slot | None) -> None:
    await asyncio.sleep(0)
    fs.release(slot)
