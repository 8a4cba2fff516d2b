"""Weighted fair share of the workers between tenants, when more work waits than they can take.

First come, first served lets a tenant that sends ten times more requests take ten times more of the workers, and
every other tenant waits behind its queue. With ``--fair-share-slots N`` (about the workers' batch slots in all: the
requests the mesh runs at once at full speed), the preprocessor runs at most N generations at once; the rest wait
here, one queue per tenant, and a freed slot goes to the next tenant by deficit round robin over their API keys'
``weight`` (a tenant of weight 4 gets four slots for each one of a tenant of weight 1 while both have work waiting;
an idle tenant's share goes to the others — nothing is reserved). A key's ``priority``: ``batch`` work runs only
while no ``interactive`` work waits.

Nothing waits while a slot is free, so below saturation this costs one counter. A waiter whose client went away
leaves its queue; a slot granted to it as it left is given back.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from embedmesh.core.auth import PRIORITIES
from embedmesh.services.preprocessor.metrics import FAIR_SHARE_WAITING as WAITING

__all__ = ["FairShare", "INTERACTIVE", "BATCH", "PRIORITIES"]

INTERACTIVE, BATCH = PRIORITIES
"""A key's priorities, served in this order: a batch request waits while any interactive one does."""


@dataclass
class _Tenant:
    weight: float
    queue: collections.deque[asyncio.Future[None]] = field(default_factory=collections.deque)
    deficit: float = 0.0
    topped_up: bool = False
    """Whether it got its quantum on this visit at the head of the ring (deficit round robin)."""


class FairShare:
    """At most ``slots`` holders at once; waiters served by priority, then by weighted deficit round robin."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.active = 0
        self._tenants: dict[tuple[str, str], _Tenant] = {}
        self._rings: dict[str, collections.deque[tuple[str, str]]] = {p: collections.deque() for p in PRIORITIES}

    @property
    def waiting(self) -> int:
        return sum(len(t.queue) for t in self._tenants.values())

    async def acquire(self, tenant: str, weight: float = 1.0, priority: str = INTERACTIVE) -> None:
        """Wait for a slot (at once when one is free and nobody waits); ``release`` it when done."""
        if not self.slots:
            return
        if self.active < self.slots and not self.waiting:
            self.active += 1
            return
        key = (priority, tenant)
        t = self._tenants.get(key)
        if t is None:
            t = self._tenants[key] = _Tenant(weight)
            self._rings[priority].append(key)
        t.weight = weight
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        t.queue.append(fut)
        WAITING.labels(priority).inc()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted as the caller left: the slot goes to the next one
            raise
        finally:
            WAITING.labels(priority).dec()

    def release(self) -> None:
        if not self.slots:
            return
        self.active -= 1
        while self.active < self.slots:
            fut = self._next()
            if fut is None:
                return
            self.active += 1
            fut.set_result(None)

    def _next(self) -> asyncio.Future[None] | None:
        """The next waiter to serve (None: nobody waits). Deficit round robin within a priority: the tenant at the
        head of the ring gets its weight as quantum once per visit and is served while it has a whole slot's
        credit; then the next tenant's turn."""
        for priority in PRIORITIES:
            ring = self._rings[priority]
            while ring:
                key = ring[0]
                t = self._tenants[key]
                while t.queue and t.queue[0].done():  # left while waiting
                    t.queue.popleft()
                if not t.queue:
                    ring.popleft()
                    del self._tenants[key]  # bounded by the tenants with work waiting
                    continue
                if t.deficit < 1.0:
                    if t.topped_up:  # its turn is over: the next tenant's
                        t.topped_up = False
                        ring.rotate(-1)
                        continue
                    t.deficit += t.weight
                    t.topped_up = True
                    continue
                t.deficit -= 1.0
                return t.queue.popleft()
        return None
