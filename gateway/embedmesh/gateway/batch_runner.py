"""The Batch API's runner: a task in the gateway process that runs the lines of active batches through the same
handlers the interactive routes use, below interactive traffic.

Order of work:

- **Batches** take turns: the runner leases the active batch served longest ago (``BatchStore.claim``), runs a
  slice of its lines (``slice_lines``), and goes back for the next, so one tenant's large batch does not hold back
  another's. The lease (renewed while the slice runs) keeps two gateways on one database off the same batch; a
  gateway restarted under the same owner name takes its batches back at once, another one after the lease ends.
- **Lines** run in prefix order (``batch_lines.run_order``), at most ``concurrency`` at once, each recorded in the
  database as it finishes (``BatchStore.finish_line``): after a restart only lines not recorded run again.
- **Interactive first**: a line starts only while ``busy()`` is false (the gateway's interactive requests in
  flight are under the configured bound), and while interactive traffic was seen in the last ``quiet_s`` only
  while fewer than ``busy_concurrency`` lines run; lines already running finish. Across gateways the preprocessor's fair
  share does the rest for keys whose ``priority`` is ``batch``.

A cancelled batch stops starting lines, cancels those running (their gRPC calls with them), and ends with the
lines done so far in its files. So does a batch whose completion window (24 h from its creation, ``expires_at``)
ends before its lines do: it ends ``expired``, each line not done in its error file as ``batch_expired``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import Counter

from embedmesh.core.logs import get_logger
from embedmesh.gateway.batch_store import BatchStore, Work, new_id
from embedmesh.gateway.errors import RETRYABLE

__all__ = ["BatchRunner", "Call"]

log = get_logger("embedmesh.gateway.batches")

LINES = Counter("embedmesh_gateway_batch_lines_total", "Batch lines run by this gateway, by outcome: ok and failed "
                "are recorded in their batch; retried (429/503 from the mesh) run again later", ["outcome"])

Call = Callable[[str, bytes, str], Awaitable[tuple[int, bytes]]]
"""(url, body, Authorization header) -> (HTTP status, response body): one line through its route's handler."""

_BUSY_POLL_S = 0.005


def output_line(work: Work, status: int, body: bytes) -> tuple[bool, bytes]:
    """OpenAI's output/error file line for a finished request, and whether it succeeded."""
    try:
        parsed: Any = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = body.decode("utf-8", "replace")
    ok = 200 <= status < 300
    rid = parsed.get("id") if ok and isinstance(parsed, dict) and isinstance(parsed.get("id"), str) else None
    error = None
    if not ok:
        err = parsed.get("error") if isinstance(parsed, dict) else None
        err = err if isinstance(err, dict) else {}
        error = {"code": err.get("code") or str(status), "message": err.get("message") or "the request failed"}
    line = {"id": new_id("batch_req_"), "custom_id": work.custom_id,
            "response": {"status_code": status, "request_id": rid or new_id("req_"), "body": parsed},
            "error": error}
    return ok, orjson.dumps(line)


class BatchRunner:
    """Runs active batches until ``stop``; ``wake`` after creating or cancelling one to skip the poll wait."""

    def __init__(self, store: BatchStore, call: Call, *, owner: str, unseal: Callable[[str], str],
                 concurrency: int = 4, busy: Callable[[], bool] = lambda: False, lease_s: float = 10.0,
                 slice_lines: int = 64, poll_s: float = 1.0, quiet_s: float = 1.0, busy_concurrency: int = 1,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.call = call
        self.owner = owner
        self.unseal = unseal
        self.concurrency = concurrency
        self.busy = busy
        self.lease_s = lease_s
        self.slice_lines = slice_lines
        self.poll_s = poll_s
        self.quiet_s = quiet_s
        self.busy_concurrency = busy_concurrency
        self.clock = clock
        """Wall-clock seconds, read against a batch's ``expires_at``."""
        self._busy_at = float("-inf")
        """When interactive traffic was last seen in flight (the loop's clock)."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._cancelled: set[str] = set()
        """Batches cancelled through this gateway since their slice started (others are seen at lease renewal)."""

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop at once: running lines are cancelled, unrecorded, and run again by the next runner."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wake(self, cancelled: str | None = None) -> None:
        if cancelled:
            self._cancelled.add(cancelled)
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            try:
                claimed = await self.store.claim(self.owner, self.lease_s)
                if claimed is not None:
                    await self._serve(*claimed)
                    continue
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the database failed: said, and tried again after the poll wait
                log.exception("batch runner failed; retrying")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def _serve(self, bid: str, tenant: str, status: str, sealed: str, expires_at: int) -> None:
        """One turn at one batch: start it, run a slice of its lines, or end it."""
        if status in ("validating", "in_progress") and self.clock() >= expires_at:
            await self.store.finalize(bid, expired=True)
            return
        if status == "validating":
            await self.store.start(bid)
        if status in ("cancelling", "finalizing"):
            self._cancelled.discard(bid)
            await self.store.finalize(bid, cancelled=status == "cancelling")
            return
        work = await self.store.todo(bid, self.slice_lines)
        if not work:
            await self.store.finalize(bid, cancelled=False)
            return
        status = await self._slice(bid, self.unseal(sealed), work, expires_at)
        if status == "cancelling":
            self._cancelled.discard(bid)
            await self.store.finalize(bid, cancelled=True)
        elif status == "expired":
            await self.store.finalize(bid, expired=True)

    async def _slice(self, bid: str, auth: str, work: list[Work], expires_at: int) -> str | None:
        """Run ``work``; the batch's status at the end (``cancelling`` when cancelled meanwhile, ``expired`` when
        its window ended), None when the lease was lost."""
        status: list[str | None] = ["in_progress"]
        slots = asyncio.Semaphore(self.concurrency)
        running: set[asyncio.Task[None]] = set()

        async def keep_lease() -> None:
            while True:
                await asyncio.sleep(self.lease_s / 3)
                status[0] = await self.store.renew(bid, self.owner, self.lease_s)
                if status[0] == "in_progress" and self.clock() >= expires_at:
                    status[0] = "expired"
                if status[0] != "in_progress":
                    for t in running:
                        t.cancel()
                    return

        def stopped() -> bool:
            if bid in self._cancelled:
                status[0] = "cancelling"
            elif status[0] == "in_progress" and self.clock() >= expires_at:
                status[0] = "expired"
            return status[0] != "in_progress"

        async def watch() -> None:  # interactive traffic seen between line starts counts too (the quiet window)
            loop = asyncio.get_running_loop()
            while True:
                if self.busy():
                    self._busy_at = loop.time()
                await asyncio.sleep(_BUSY_POLL_S)

        lease = asyncio.get_running_loop().create_task(keep_lease())
        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            for w in work:
                await slots.acquire()
                await self._turn(running, stopped)
                if stopped():
                    slots.release()
                    break
                t = asyncio.get_running_loop().create_task(self._line(bid, auth, w))
                running.add(t)
                t.add_done_callback(lambda t: (running.discard(t), slots.release()))
            if stopped():
                for t in running:
                    t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        finally:
            lease.cancel()
            watcher.cancel()
            for t in running:
                t.cancel()
        if stopped():
            return status[0]
        return await self.store.renew(bid, self.owner, self.lease_s)

    async def _turn(self, running: set[asyncio.Task[None]], stopped: Callable[[], bool]) -> None:
        """Wait until a line may start: no interactive request in flight, and while there were some in the last
        ``quiet_s``, fewer than ``busy_concurrency`` batch lines running (1: the batch trickles, one line at a time,
        between interactive requests; 0: it waits for a quiet spell); at full concurrency once they stopped."""
        loop = asyncio.get_running_loop()
        while not stopped():
            if self.busy():
                self._busy_at = loop.time()
            elif len(running) < self.busy_concurrency or loop.time() - self._busy_at >= self.quiet_s:
                return
            await asyncio.sleep(_BUSY_POLL_S)

    async def _line(self, bid: str, auth: str, w: Work) -> None:
        status, body = await self.call(w.url, w.body, auth)
        if status in RETRYABLE:  # the mesh is saturated or restarting: not the line's fault, it runs again later
            LINES.labels("retried").inc()
            await asyncio.sleep(1.0)
            return
        ok, line = output_line(w, status, body)
        try:
            if await self.store.finish_line(bid, w.idx, ok, line):
                LINES.labels("ok" if ok else "failed").inc()
        except Exception:  # noqa: BLE001 - not recorded: the line runs again on a later turn
            log.exception("could not record a batch line", extra={"batch": bid})
