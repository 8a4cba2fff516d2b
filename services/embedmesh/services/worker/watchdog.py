"""The worker's watchdog: a worker whose engine is stuck or dead leaves the mesh and exits, so its supervisor
(Kubernetes, the launcher) replaces it, instead of holding requests forever while reporting SERVING.

Once a second it reads ``Engine.progress()`` (engines answering None are not watched) and trips when
- the engine reports itself failed (its thread died): ENGINE_FAILED, at once; or
- work is queued or running and the step counter has not moved for ``stall_seconds``: ENGINE_STALLED.
Tripping: log an error, report NOT_SERVING (routers and load balancers stop sending), fail every queued and running
request with a retryable UNAVAILABLE (``Engine.fail_all``, which also refuses later arrivals), run the extra hooks
(leave the routers), wait ``exit_delay`` so those errors reach the callers, then exit with ``EXIT_CODE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Sequence

from embedmesh.core.errors import Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.services.worker.engines.base import Engine

__all__ = ["Watchdog", "EXIT_CODE"]

log = get_logger(__name__)

EXIT_CODE = 3
"""Process exit status after the watchdog tripped (any non-zero status makes a supervisor restart the worker)."""

_STEP_SECONDS = 5.0
"""Bound on each tripping step (health flip, leaving the routers): a stuck one must not keep the worker alive."""


class Watchdog:
    """Watches one engine; see the module docstring. ``exit`` and ``clock`` are injectable for tests."""

    def __init__(
        self,
        engine: Engine,
        stall_seconds: float,
        *,
        set_not_serving: Callable[[], Awaitable[None]],
        on_trip: Sequence[Callable[[], Awaitable[None]]] = (),
        exit: Callable[[int], object] = os._exit,  # noqa: A002 - the process exit to call
        exit_delay: float = 1.0,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.stall_seconds = stall_seconds
        """No progress for this long with work queued trips the watchdog; 0 turns the stall check off (a failed
        engine still trips it)."""
        self._set_not_serving = set_not_serving
        self._on_trip = list(on_trip)
        self._exit = exit
        self._exit_delay = exit_delay
        self._interval = interval
        self._clock = clock
        self._last_steps: int | None = None
        self._since = clock()
        """When the engine was last seen idle or making progress."""
        self._task: asyncio.Task[None] | None = None
        self.tripped: Unavailable | None = None
        """The error queued requests were failed with, once tripped."""

    def add_on_trip(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Also run ``hook`` when tripping, after NOT_SERVING (e.g. leave the routers)."""
        self._on_trip.append(hook)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-watchdog")

    async def stop(self) -> None:
        """Stop watching (the worker is draining: the engine is shut on purpose)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # noqa: BLE001 - the watchdog must outlive a bad poll
                log.exception("watchdog poll failed")
            await asyncio.sleep(self._interval)

    async def poll(self) -> Unavailable | None:
        """One check. Returns the error the watchdog tripped with now, else None."""
        if self.tripped is not None:
            return None
        p = self.engine.progress()
        if p is None:
            return None
        now = self._clock()
        if p.failed is not None:
            return await self._trip(Unavailable(
                "the worker's engine failed; retry, another worker will take the request", reason="ENGINE_FAILED",
                retry_after_seconds=1.0), p.failed)
        if not p.busy or p.steps != self._last_steps:
            self._last_steps, self._since = p.steps, now
            return None
        idle = now - self._since
        if self.stall_seconds > 0 and idle >= self.stall_seconds:
            return await self._trip(Unavailable(
                f"the worker's engine made no progress for {idle:.0f} s with work queued; retry, another worker will "
                "take the request", reason="ENGINE_STALLED", retry_after_seconds=1.0),
                f"no progress for {idle:.1f} s at step {p.steps}")
        return None

    async def _trip(self, error: Unavailable, detail: str) -> Unavailable:
        self.tripped = error
        log.error("engine watchdog tripped: reporting NOT_SERVING, failing queued requests and exiting",
                  extra={"reason": error.reason, "detail": detail, "exit_code": EXIT_CODE})
        # Leave the mesh first, so requests failed below and retried elsewhere are not routed back here.
        for step in (self._set_not_serving, *self._on_trip):
            try:
                await asyncio.wait_for(step(), _STEP_SECONDS)
            except Exception:  # noqa: BLE001 - exiting matters more than any one step
                log.exception("watchdog step failed")
        failed = self.engine.fail_all(error)
        log.error("engine watchdog failed the pending requests", extra={"failed_requests": failed})
        # Give the errors time to reach the callers before the process (and its connections) goes away.
        await asyncio.sleep(self._exit_delay)
        self._exit(EXIT_CODE)
        return error
