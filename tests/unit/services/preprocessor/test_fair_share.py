"""The preprocessor's fair share of generation slots: free slots are taken at once; under saturation waiters are
served by weighted deficit round robin (4:1 weights → 4:1 grants while both wait), an idle tenant's share goes to
the others, batch work waits for interactive work, and a waiter that leaves gives its place (or its slot) back."""

from __future__ import annotations

import asyncio

import pytest

from embedmesh.services.preprocessor.fair_share import BATCH, FairShare


async def _order(fs: FairShare, waiters: list[tuple[str, float, str]], grants: int) -> list[str]:
    """Queue ``waiters`` (tenant, weight, priority) behind full slots, then release ``grants`` times; the tenants
    in the order they got a slot."""
    served: list[str] = []

    async def one(tenant: str, weight: float, priority: str) -> None:
        await fs.acquire(tenant, weight, priority)
        served.append(tenant)

    tasks = [asyncio.create_task(one(*w)) for w in waiters]
    await asyncio.sleep(0)
    assert fs.waiting == len(waiters)
    for _ in range(grants):
        fs.release()
        await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return served


async def test_free_slots_are_taken_at_once_and_nothing_waits_below_saturation() -> None:
    fs = FairShare(2)
    await fs.acquire("a")
    await fs.acquire("b")
    assert fs.active == 2 and fs.waiting == 0
    fs.release()
    await fs.acquire("a")
    assert fs.active == 2


async def test_off_means_no_bound() -> None:
    fs = FairShare(0)
    for _ in range(1000):
        await fs.acquire("a")
    assert fs.active == 0 and fs.waiting == 0


async def test_weights_4_to_1_share_the_slots_4_to_1_while_both_wait() -> None:
    fs = FairShare(1)
    await fs.acquire("x")  # the one slot is held
    waiters = [("heavy", 4.0, "interactive")] * 50 + [("light", 1.0, "interactive")] * 50
    served = await _order(fs, waiters, 40)
    assert served.count("heavy") == 32 and served.count("light") == 8  # 40 slots at 4:1
    # interleaved, not all of one first: the light tenant waits at most one heavy turn
    gaps = [i for i, t in enumerate(served) if t == "light"]
    assert max(b - a for a, b in zip([-1, *gaps], gaps, strict=False)) <= 5


async def test_a_flood_does_not_delay_a_light_tenant_beyond_its_share() -> None:
    """Tenant A queues 100 requests first, B then queues 3, equal weights: B is served within its first turns,
    not after A's 100 (first come, first served would serve B last)."""
    fs = FairShare(1)
    await fs.acquire("x")
    served = await _order(fs, [("a", 1.0, "interactive")] * 100 + [("b", 1.0, "interactive")] * 3, 8)
    assert served[:6] == ["a", "b", "a", "b", "a", "b"]


async def test_an_idle_tenants_share_goes_to_the_others() -> None:
    fs = FairShare(1)
    await fs.acquire("x")
    served = await _order(fs, [("a", 1.0, "interactive")] * 10 + [("b", 9.0, "interactive")] * 2, 10)
    assert served.count("b") == 2 and served.count("a") == 8  # b had only 2: the rest of its share went to a


async def test_batch_waits_while_interactive_work_waits() -> None:
    fs = FairShare(1)
    await fs.acquire("x")
    served = await _order(fs, [("bulk", 100.0, BATCH)] * 5 + [("chat", 1.0, "interactive")] * 3, 6)
    assert served == ["chat", "chat", "chat", "bulk", "bulk", "bulk"]


async def test_a_waiter_that_leaves_gives_its_place_back() -> None:
    fs = FairShare(1)
    await fs.acquire("x")
    leaving = asyncio.create_task(fs.acquire("a"))
    staying = asyncio.create_task(fs.acquire("b"))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    fs.release()
    await asyncio.wait_for(staying, 1)  # the slot went to b, not to the caller that left
    assert fs.active == 1 and fs.waiting == 0


@pytest.mark.parametrize("rounds", [200])
async def test_slots_are_never_over_granted_under_churn(rounds: int) -> None:
    import random

    fs = FairShare(3)
    rng = random.Random(7)
    peak = 0

    async def user(i: int) -> None:
        nonlocal peak
        for _ in range(5):
            await fs.acquire(f"t{i % 4}", 1.0 + i % 3)
            peak = max(peak, fs.active)
            await asyncio.sleep(rng.random() / 1000)
            fs.release()

    await asyncio.gather(*(user(i) for i in range(rounds // 5)))
    assert peak <= 3 and fs.active == 0 and fs.waiting == 0
