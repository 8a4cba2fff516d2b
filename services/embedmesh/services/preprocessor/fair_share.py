"""Weighted fair share of the workers between tenants, when more work waits than they can take.

First come, first served lets a tenant that sends ten times more requests take ten times more of the workers, and
every other tenant waits behind its queue. With ``--fair-share-slots N`` (about the workers' batch slots in all: the
requests the mesh runs at once at full speed), the preprocessor runs at most N generations at once; the rest wait
here, one queue per tenant and priority.

What is shared is slot-time, not grants: a request holds its slot for as long as it generates, so counting grants
would give a tenant of long requests more than its share. Each busy tenant (holding or waiting for a slot) has a
*usage*: the slot-seconds it has held, divided by its key's ``weight``, growing by ``active / weight`` per second.
A freed slot goes to the waiting tenant whose usage would be least one typical hold later were it granted the slot
(``usage + (active + 1) x hold / weight``, the hold a running mean; then the one waiting longest): the slots it
holds now count as well as its past, so slots freed at the same instant are spread by weight rather than all given
to one tenant. So a tenant of weight 4 holds four times the slot-time of a tenant of weight 1 while both have work
waiting, and a tenant under its share gets the next free slot ahead of the tenants over theirs. A tenant that
becomes busy again starts at the least usage of the busy tenants: no credit is saved while idle (an idle tenant's
share goes to the others: nothing is reserved). Nor while busy beyond a bound: a tenant that held less than its
share for a long while (not asking for more) is raised to within ``slots x hold / weight`` of the most used busy
tenant, so a burst of it takes the slots for about one hold, not until its usage has caught up. A key's
``priority``: ``batch`` work runs only while no ``interactive`` work waits.

Nothing waits while a slot is free, so below saturation this costs a little bookkeeping. A waiter whose client went
away leaves its queue; a slot granted to it as it left is given back. ``release`` is called by the task that
acquired (the preprocessor's request handler), which tells whose slot it was.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from embedmesh.core.auth import PRIORITIES
from embedmesh.services.preprocessor.metrics import FAIR_SHARE_WAITING as WAITING

__all__ = ["FairShare", "Slot", "INTERACTIVE", "BATCH", "PRIORITIES"]

INTERACTIVE, BATCH = PRIORITIES
"""A key's priorities, served in this order: a batch request waits while any interactive one does."""


@dataclass(eq=False)
class Slot:
    """One granted slot: whose it is and since when; handed back to ``FairShare.release`` once."""

    tenant: str
    since: float


@dataclass
class _Waiter:
    order: int
    fut: asyncio.Future[Slot]


@dataclass
class _Tenant:
    weight: float
    used: float
    """Weighted slot-seconds held up to ``since``."""
    since: float
    active: int = 0
    queues: dict[str, collections.deque[_Waiter]] = field(
        default_factory=lambda: {p: collections.deque() for p in PRIORITIES})
    """Waiters by priority, in arrival order."""

    def usage(self, now: float) -> float:
        return self.used + self.active * (now - self.since) / self.weight

    def settle(self, now: float) -> None:
        """Fold the time since ``since`` into ``used`` (before ``active`` or ``weight`` changes)."""
        self.used = self.usage(now)
        self.since = now

    def head(self, priority: str) -> _Waiter | None:
        """The first waiter of ``priority`` still waiting (those that left are dropped)."""
        q = self.queues[priority]
        while q and q[0].fut.done():
            q.popleft()
        return q[0] if q else None


class FairShare:
    """At most ``slots`` holders at once; waiters served by priority, then by least weighted slot-time."""

    def __init__(self, slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.active = 0
        self.waiting = 0
        """Waiters still waiting (those that left are not counted)."""
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        """Busy tenants only (holding or waiting): bounded by the slots and the waiters."""
        self._hold = 0.0
        """Running mean of how long a slot is held (seconds)."""
        self._arrivals = itertools.count()

    async def acquire(self, tenant: str, weight: float = 1.0, priority: str = INTERACTIVE) -> Slot | None:
        """Wait for a slot (at once when one is free and nobody waits); hand it to ``release`` when done (None:
        fair share is off, nothing to give back)."""
        if not self.slots:
            return None
        now = self._clock()
        t = self._tenant(tenant, weight, now)
        if self.active < self.slots and not self.waiting:
            return self._grant(t, tenant, now)
        fut: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        t.queues[priority].append(_Waiter(next(self._arrivals), fut))
        self.waiting += 1
        WAITING.labels(priority).inc()
        try:
            return await fut  # granted in ``release``
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # granted as the caller left: the slot goes to the next one
            else:
                self.waiting -= 1
                self._forget_if_idle(tenant)
            raise
        finally:
            WAITING.labels(priority).dec()

    def release(self, slot: Slot | None) -> None:
        """Give ``slot`` back (once); the next waiter, if any, gets it."""
        if slot is None or not self.slots:
            return
        now = self._clock()
        name, since = slot.tenant, slot.since
        self._hold = now - since if not self._hold else 0.9 * self._hold + 0.1 * (now - since)
        t = self._tenants[name]
        t.settle(now)
        t.active -= 1
        self.active -= 1
        self._forget_if_idle(name)
        if self.waiting:
            self._bound_credit(now)
        while self.active < self.slots and self.waiting:
            picked = self._next(now)
            if picked is None:
                return
            name, w = picked
            self.waiting -= 1
            w.fut.set_result(self._grant(self._tenants[name], name, now))

    def _tenant(self, name: str, weight: float, now: float) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:  # busy again: starts level with the least used busy tenant (no credit saved while idle)
            start = min((o.usage(now) for o in self._tenants.values()), default=0.0)
            t = self._tenants[name] = _Tenant(weight, start, now)
        elif t.weight != weight:
            t.settle(now)
            t.weight = weight
        return t

    def _grant(self, t: _Tenant, name: str, now: float) -> Slot:
        t.settle(now)
        t.active += 1
        self.active += 1
        return Slot(name, now)

    def _forget_if_idle(self, name: str) -> None:
        t = self._tenants.get(name)
        if t is not None and not t.active and all(t.head(p) is None for p in PRIORITIES):
            del self._tenants[name]

    def _bound_credit(self, now: float) -> None:
        """Raise each busy tenant's usage to within ``slots x hold / weight`` of the most used one's."""
        top = max((t.usage(now) for t in self._tenants.values()), default=0.0)
        for t in self._tenants.values():
            floor = top - self.slots * self._hold / t.weight
            if t.usage(now) < floor:
                t.used, t.since = floor, now

    def _next(self, now: float) -> tuple[str, _Waiter] | None:
        """The next waiter to serve: the first priority with waiters; in it, the tenant of least usage one hold
        later were it granted the slot, then the one waiting longest."""
        for priority in PRIORITIES:
            best: tuple[float, int] | None = None
            picked: tuple[str, _Waiter] | None = None
            for name, t in self._tenants.items():
                head = t.head(priority)
                if head is None:
                    continue
                rank = (t.usage(now) + (t.active + 1) * self._hold / t.weight, head.order)
                if best is None or rank < best:
                    best, picked = rank, (name, head)
            if picked is not None:
                self._tenants[picked[0]].queues[priority].popleft()
                return picked
        return None
