"""The mocker engine: a worker with no model whose scheduling and KV cache behave like a paged-attention engine's,
so a fleet of them on one machine shows what the router's choices are worth (prefix hits, time to first token).

One scheduler task runs steps while there is work, continuous-batching style:

1. admit waiting sequences in arrival order while the batch has room (``max_batch_size``) and the cache can
   reserve their blocks (``kv_cache.PagedKvCache.allocate``: the cached prefix is shared, the rest reserved);
2. sleep for the step's simulated time (``timing.Timing``): the prefill of the admitted sequences' *uncached*
   positions plus one decode step of the whole batch;
3. the admitted sequences' prompt blocks are stored (KV events), every running sequence gets one token; a finished
   one releases its blocks (those its generated tokens filled are stored first).

Token ids are drawn from a generator seeded by ``--mocker-seed``, the prompt's last block hash (or its length) and
the request's own seed, so the same prompt gives the same output whatever else runs. Sampling parameters other than
``max_tokens`` and ``seed`` are ignored; there is no stop string or end-of-sequence token. A resumed request (a
migrated stream, ``GenerationRequest.resumed``) holds its resumed tokens in the cache after the prompt and draws as
many ids first, so it continues exactly where the lost worker's stream stopped.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from embedmesh.core.block_hash import adapter_block_hashes, block_hashes
from embedmesh.core.kv_events import KvEvent
from embedmesh.services.worker.engines.base import (
    Engine,
    EngineStats,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    KvEventSource,
    ModelInfo,
    Segment,
    TokenSegment,
)
from embedmesh.services.worker.engines.mocker.config import MockerOptions
from embedmesh.services.worker.engines.mocker.kv_cache import Allocation, PagedKvCache
from embedmesh.services.worker.engines.mocker.timing import Timing

__all__ = ["MockerEngine"]


@dataclass
class _Seq:
    request: GenerationRequest
    hashes: list[int]
    prompt_len: int
    max_tokens: int
    rng: random.Random
    out: asyncio.Queue[GenerationDelta | Exception] = field(default_factory=asyncio.Queue)
    """Deltas, or the error that ended the scheduler."""
    alloc: Allocation | None = None
    generated: list[int] = field(default_factory=list)
    cached: int = 0
    """Prompt positions found in the cache at admission (never the last one: its logits must be computed)."""
    aborted: bool = False
    done: bool = False


class MockerEngine(Engine, KvEventSource):
    """Simulated engine (see the module docstring); ``sleep`` is injectable for tests."""

    resumes = True

    def __init__(self, served_name: str, block_size: int, options: MockerOptions,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        o = options
        self.options = o
        self.block_size = block_size
        self.timing = Timing(o.mocker_prefill_ms_per_token, o.mocker_decode_ms, o.mocker_decode_ms_per_seq,
                             o.mocker_speedup)
        self._info = ModelInfo(served_name, "mocker", o.mocker_hidden_size, o.mocker_max_context_tokens,
                               "float32", o.mocker_vocab_size, o.max_batch_size)
        self._listeners: list[Callable[[list[KvEvent]], None]] = []
        self.cache = PagedKvCache(o.mocker_num_blocks, block_size, self._publish)
        self._sleep = sleep
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stats = EngineStats()
        self._adapters: dict[str, str] = {}
        self._failed: Exception | None = None
        """Why the scheduler stopped (a bug): every request then fails with it and check_health raises it."""
        self.counters = {"prompt_tokens": 0, "cached_tokens": 0, "prefilled_tokens": 0, "steps": 0}
        """Positions asked for, found in the cache, and prefilled; scheduler steps run."""

    # --- Engine ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="mocker-scheduler")

    def info(self) -> ModelInfo:
        return self._info

    def stats(self) -> EngineStats:
        self._stats.active_requests = len(self._running) + len(self._waiting)
        self._stats.queued_requests = len(self._waiting)
        return self._stats

    def kv_usage(self) -> float:
        return self.cache.used_blocks / self.cache.num_blocks

    def kv_event_source(self) -> KvEventSource:
        return self

    async def check_health(self) -> None:
        if self._failed is not None:
            raise self._failed

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        if self._failed is not None:
            raise self._failed
        seq = self._sequence(request)
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        self._wake.set()
        try:
            while True:
                delta = await seq.out.get()
                if isinstance(delta, Exception):
                    raise delta
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not seq.done:  # the caller went away: free what it holds at the next step
                seq.aborted = True
                self._wake.set()

    async def abort(self, request_id: str) -> bool:
        seq = self._by_id.get(request_id)
        if seq is None or seq.done:
            return False
        seq.aborted = True
        self._wake.set()
        return True

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def clear_kv_blocks(self) -> bool:
        return self.cache.clear()

    # --- LoRA: any folder "loads" (there are no weights); the name keys the adapter's block-hash chain ---------
    async def load_lora(self, name: str, path: str) -> bool:
        if name in self._adapters:
            return False
        self._adapters[name] = path
        return True

    async def unload_lora(self, name: str) -> bool:
        return self._adapters.pop(name, None) is not None

    async def list_loras(self) -> dict[str, str]:
        return dict(self._adapters)

    def lora_names(self) -> list[str]:
        return list(self._adapters)

    # --- KvEventSource ---------------------------------------------------------------------------------------
    def on_kv_events(self, listener: Callable[[list[KvEvent]], None]) -> None:
        self._listeners.append(listener)

    def kv_snapshot(self) -> list[KvEvent]:
        return self.cache.snapshot()

    def _publish(self, events: list[KvEvent]) -> None:
        for listener in self._listeners:
            listener(events)

    def metrics_collector(self, worker_id: str) -> Any:
        return _Collector(self, worker_id)

    # --- scheduling ------------------------------------------------------------------------------------------
    def _sequence(self, request: GenerationRequest) -> _Seq:
        prompt = _pieces(request.segments)
        hashes = adapter_block_hashes(block_hashes(prompt, self.block_size), request.lora_adapter)
        seed = f"{self.options.mocker_seed}:{hashes[-1] if hashes else request.prompt_len}:{request.sampling.seed}"
        rng = random.Random(seed)
        if request.resumed:  # the ids the lost worker drew: drawn again, so the next one is the one it would draw
            for _ in request.resumed:
                rng.randrange(self.options.mocker_vocab_size)
            hashes = adapter_block_hashes(block_hashes([*prompt, request.resumed], self.block_size),
                                          request.lora_adapter)
        return _Seq(request, hashes, request.positions, max(request.sampling.max_tokens, 1), rng)

    async def _run(self) -> None:
        try:
            while True:
                if not self._waiting and not self._running:
                    await self._wake.wait()
                self._wake.clear()
                await self.step()
        except Exception as e:  # a bug: fail what waits and runs instead of leaving it hanging
            self._failed = RuntimeError(f"the mocker's scheduler stopped: {e!r}")
            for s in (*self._waiting, *self._running):
                s.done = True
                s.out.put_nowait(self._failed)
            self._waiting.clear()
            self._running.clear()
            raise

    async def step(self) -> None:
        """One scheduler step (see the module docstring); returns at once when there is nothing to do."""
        self._drop_aborted()
        admitted = self._admit()
        if not self._running:
            await asyncio.sleep(0)
            return
        uncached = sum(s.prompt_len - s.cached for s in admitted)
        self.counters["steps"] += 1
        self._stats.max_batch_seen = max(self._stats.max_batch_seen, len(self._running))
        self.counters["prefilled_tokens"] += uncached
        await self._sleep(self.timing.step_seconds(uncached, len(self._running)))
        self._drop_aborted()
        for s in admitted:
            if s.alloc is not None and not s.done:  # aborted during the step: its blocks are released already
                self.cache.commit_prefill(s.alloc)
        for s in list(self._running):
            self._emit_token(s)

    def _admit(self) -> list[_Seq]:
        admitted = []
        while self._waiting and len(self._running) < self.options.max_batch_size:
            s = self._waiting[0]
            total = -(-(s.prompt_len + s.max_tokens) // self.block_size)
            alloc = self.cache.allocate(s.hashes, total)
            if alloc is None:
                break  # first come, first served: nothing overtakes a sequence waiting for room
            self._waiting.popleft()
            s.alloc = alloc
            self.counters["prompt_tokens"] += s.prompt_len
            # A prompt held whole still computes its last position (the logits of the first token come from it).
            s.cached = min(alloc.hit * self.block_size, s.prompt_len - 1)
            self.counters["cached_tokens"] += s.cached
            self._running.append(s)
            admitted.append(s)
        return admitted

    def _emit_token(self, s: _Seq) -> None:
        token = s.rng.randrange(self.options.mocker_vocab_size)
        s.generated.append(token)
        n = len(s.generated)
        last = n >= s.max_tokens
        self._stats.generated_tokens += 1
        if last:
            self._finish(s, full=True)
            self._stats.completed_requests += 1
        s.out.put_nowait(GenerationDelta(f" {token}", (token,), n, FinishReason.LENGTH if last else None))

    def _finish(self, s: _Seq, *, full: bool) -> None:
        s.done = True
        self._by_id.pop(s.request.request_id, None)
        if s in self._running:
            self._running.remove(s)
        if s.alloc is not None:
            hashes: list[int] = []
            if full:
                pieces = [*_pieces(s.request.segments), tuple(s.request.resumed) + tuple(s.generated)]
                hashes = adapter_block_hashes(block_hashes(pieces, self.block_size), s.request.lora_adapter)
            self.cache.release(s.alloc, hashes)

    def _drop_aborted(self) -> None:
        for s in [s for s in (*self._waiting, *self._running) if s.aborted and not s.done]:
            if s in self._waiting:
                self._waiting.remove(s)
            self._finish(s, full=False)
            self._stats.aborted_requests += 1
            s.out.put_nowait(GenerationDelta("", (), len(s.generated), FinishReason.ABORT))


def _pieces(segments: list[Segment]) -> list[Any]:
    return [s.ids if isinstance(s, TokenSegment) else s.rows for s in segments]


class _Collector:
    """The mocker's figures for Prometheus (read at scrape time): prefix-cache lookups and hits in positions,
    blocks stored and evicted, blocks in use and cached."""

    def __init__(self, engine: MockerEngine, worker_id: str) -> None:
        self.engine = engine
        self.worker_id = worker_id

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        e, wid = self.engine, self.worker_id
        for name, doc, value in (
            ("embedmesh_mocker_prompt_tokens", "Prompt positions looked up in the simulated cache",
             e.counters["prompt_tokens"]),
            ("embedmesh_mocker_cached_tokens", "Prompt positions found in the simulated cache",
             e.counters["cached_tokens"]),
            ("embedmesh_mocker_stored_blocks", "Blocks published as stored", e.cache.counters["stored_blocks"]),
            ("embedmesh_mocker_removed_blocks", "Blocks evicted (published as removed)",
             e.cache.counters["removed_blocks"]),
        ):
            c = CounterMetricFamily(name, doc, labels=["worker_id"])
            c.add_metric([wid], value)
            yield c
        for name, doc, value in (
            ("embedmesh_mocker_used_blocks", "Blocks held by running sequences", e.cache.used_blocks),
            ("embedmesh_mocker_cached_blocks", "Blocks cached with no sequence holding them", e.cache.cached_blocks),
        ):
            g = GaugeMetricFamily(name, doc, labels=["worker_id"])
            g.add_metric([wid], value)
            yield g
