"""Run a completion: fan each (prompt, choice) out to a worker, merge the workers' streams into one stream of
deltas tagged by choice index, and account usage. Cancelling the consumer cancels every worker call.

Choice i of prompt p has index ``p * n + i``; with a seed, choice i samples with ``seed + i`` (wrapped into int64,
``sampling.choice_seed``) so choices differ while the same request repeated gives the same text.

Worker failures: a sequence whose worker cannot be reached, refuses it (busy, draining) or aborts it before any
output is retried once on another healthy worker; a worker lost at the transport is marked unhealthy at once
(``WorkerPool.mark_lost``). A worker lost or draining mid-stream has the sequence continued on another worker from
its prompt plus the tokens already sent (``migration.py``, within its limits); one that cannot continue ends the
request with UNAVAILABLE ``WORKER_LOST`` and a retry delay. Messages sent to clients never name a worker's address
(the log does).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc
import numpy as np

from embedmesh.common.v1 import common_pb2
from embedmesh.core.block_hash import adapter_block_hashes, block_hashes
from embedmesh.core.errors import EmbedmeshError, Unavailable, answered_by_peer, from_rpc_error
from embedmesh.core.logs import get_logger
from embedmesh.core.sampling import SamplingParams, choice_seed, sampling_to_proto
from embedmesh.core.transport import wire
from embedmesh.core.transport.received import Arriving
from embedmesh.core.transport.thresholds import ROUTE_BYTES, WORKER_PIECES_MIN
from embedmesh.services.preprocessor.metrics import (
    GENERATED_TOKENS,
    PROMPT_TOKENS,
    REQUEST_TOKENS_PER_SECOND,
    TTFT,
    WORKER_FAILURES,
    WORKER_RETRIES,
)
from embedmesh.services.preprocessor.migration import Resume, continuation
from embedmesh.services.preprocessor.prompts import Prompt
from embedmesh.services.preprocessor.tools import ToolSpec
from embedmesh.services.preprocessor.worker_chunks import ChunkedBody
from embedmesh.services.preprocessor.workers import WorkerHandle, WorkerPool
from embedmesh.services.router.route_client import Routes
from embedmesh.worker.v1 import worker_pb2

__all__ = ["Job", "Delta", "run_job"]

log = get_logger(__name__)

@dataclass(frozen=True)
class Job:
    request_id: str
    model: str
    prompts: list[Prompt]
    sampling: SamplingParams
    n: int
    model_dtype: int
    echo: tuple[str, ...] | None = None
    """With ``echo``: each prompt's text, put before its choices' text."""
    tools: ToolSpec | None = None
    """Chat with tools that may be called: the output is parsed into tool calls."""
    adapter: str = ""
    """The LoRA adapter named as ``model`` (then ``base_model`` is the model it applies to); "" = a base model."""
    base_model: str = ""

    @property
    def served_model(self) -> str:
        """The model whose workers run the job."""
        return self.base_model or self.model


@dataclass(frozen=True)
class Delta:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: int
    """common_pb2.FinishReason; UNSPECIFIED until the choice's last delta."""
    logprobs: tuple[common_pb2.TokenLogprob, ...] = ()
    """One per token id, when the request asked for log-probabilities."""
    prompt_logprobs: tuple[common_pb2.TokenLogprob, ...] = ()
    """On the choice's first delta, when the request asked for the prompt's."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


BACKLOG = 256
"""Worker responses queued for one job before its workers' streams are no longer read (a slow reader)."""


def _segments(prompt: Prompt, dtype: int) -> list[bytes | memoryview]:
    """A prompt's segments as GenerateRequest wire parts; embedding rows stay views of the validated array until
    each request's bytes are joined (one copy per request, see ``core.transport.wire``)."""
    return [part for piece in prompt.pieces for part in wire.segment_parts(piece, dtype)]


async def run_job(job: Job, pool: WorkerPool, router: Routes | None = None) -> AsyncIterator[Delta | Usage]:
    """Yield deltas as workers produce them, then one Usage."""
    out: asyncio.Queue[tuple[int, worker_pb2.GenerateResponse] | BaseException] = asyncio.Queue()
    tasks: list[asyncio.Task[None]] = []
    for p_index, prompt in enumerate(job.prompts):
        rows_bytes = sum(piece.nbytes for piece in prompt.pieces if not isinstance(piece, tuple))
        arriving = prompt.arriving
        chunked = rows_bytes >= WORKER_PIECES_MIN or arriving is not None
        if chunked:  # the rows follow the request in pieces (``worker_chunks.py``)
            head, rows = wire.chunked_segments(prompt.pieces, job.model_dtype)
            segment: list[bytes | memoryview] = []
        else:
            segment = _segments(prompt, job.model_dtype)
        hashes: list[int] = []
        if router is not None:
            hashes = adapter_block_hashes(await _routing_hashes(prompt, arriving, router.block_size), job.adapter)
        ready = arriving.wait if arriving else None
        for i in range(job.n):
            index = p_index * job.n + i
            sampling = job.sampling
            if sampling.seed is not None and i:
                sampling = replace(sampling, seed=choice_seed(sampling.seed, i))
            req = worker_pb2.GenerateRequest(
                request_id=f"{job.request_id}-{index}-{uuid.uuid4().hex[:6]}",
                sampling=sampling_to_proto(sampling),
                lora_adapter=job.adapter,
            )
            body: bytes | ChunkedBody = ChunkedBody(req.SerializeToString() + head, tuple(rows), ready) \
                if chunked else b"".join([req.SerializeToString(), *segment])
            pick = _picker(pool, router, job.served_model, hashes, len(job.prompts[p_index]), req.request_id,
                           job.adapter)
            resume = Resume(pool.migration, len(prompt))
            tasks.append(asyncio.create_task(_one(index, req, pick, out, pool, job.served_model, job.adapter,
                                                  body=body, resume=resume)))
    remaining = len(tasks)
    completion = 0
    t0 = time.perf_counter()
    first: float | None = None
    try:
        while remaining:
            items = [await out.get()]
            while not out.empty():  # a reader slower than the workers: what queued meanwhile goes out merged
                items.append(out.get_nowait())
            for item in _coalesce(items):
                if isinstance(item, BaseException):
                    raise item
                delta, tokens = item
                if first is None and delta.token_ids:
                    first = time.perf_counter()
                    TTFT.labels(job.model).observe(first - t0)
                yield delta
                if delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    remaining -= 1
                    completion += tokens
        yield _usage(job, completion, len(tasks), first)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(job: Job, completion: int, sequences: int, first: float | None) -> Usage:
    """The job's usage, counted into the token metrics (``first``: when the first token came)."""
    prompt_tokens = sum(len(p) for p in job.prompts)
    for p in job.prompts:
        for piece in p.pieces:
            kind = "text" if isinstance(piece, tuple) else "embeds"
            PROMPT_TOKENS.labels(job.model, kind).inc(len(piece))
    GENERATED_TOKENS.labels(job.model).inc(completion)
    if first is not None and completion > sequences:
        REQUEST_TOKENS_PER_SECOND.labels(job.model).observe(
            (completion - sequences) / max(time.perf_counter() - first, 1e-6))
    return Usage(prompt_tokens, completion)


async def _routing_hashes(prompt: Prompt, arriving: Arriving | None, block_size: int) -> list[int]:
    """The block hashes the router decides on: the whole prompt's, or, for rows still arriving, those of their
    first ``thresholds.ROUTE_BYTES`` (waited for; the whole prompt when smaller), so the rows can go on to the worker
    while the rest arrive."""
    if arriving is None:
        return block_hashes(prompt.pieces, block_size)
    rows = prompt.pieces[0]
    assert isinstance(rows, np.ndarray)
    row_bytes = rows.shape[1] * rows.itemsize
    take = min(int(rows.shape[0]), max(ROUTE_BYTES // row_bytes, 1))
    await arriving.wait(take * row_bytes)
    return block_hashes([rows[:take]], block_size)


def _coalesce(items: list[tuple[int, worker_pb2.GenerateResponse] | BaseException]
              ) -> list[tuple[Delta, int] | BaseException]:
    """Worker responses in arrival order as (delta, completion tokens); consecutive responses of one choice
    become one delta (text, ids and log-probabilities joined; the last one's finish), so a slow reader gets fewer,
    larger messages instead of a growing backlog. An error stays in its place."""
    out: list[tuple[Delta, int] | BaseException] = []
    for item in items:
        if isinstance(item, BaseException):
            out.append(item)
            continue
        index, resp = item
        delta = Delta(index, resp.text, tuple(resp.token_ids), resp.finish_reason, tuple(resp.logprobs),
                      tuple(resp.prompt_logprobs))
        prev = out[-1] if out else None
        if (isinstance(prev, tuple) and prev[0].index == index
                and prev[0].finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED):
            p = prev[0]
            delta = Delta(index, p.text + delta.text, p.token_ids + delta.token_ids, delta.finish_reason,
                          p.logprobs + delta.logprobs, p.prompt_logprobs + delta.prompt_logprobs)
            out[-1] = (delta, resp.completion_tokens)
        else:
            out.append((delta, resp.completion_tokens))
    return out


def _picker(pool: WorkerPool, router: Routes | None, model: str, hashes: list[int], prompt_len: int,
            request_id: str, adapter: str = "") -> Callable[[], Awaitable[WorkerHandle]]:
    """The worker for one sequence: the KV router's choice, else round robin (router absent or unreachable)."""

    async def pick() -> WorkerHandle:
        preferred: WorkerHandle | None = None
        if router is not None:
            decision = await router.route(model, hashes, prompt_len, request_id, adapter)
            if decision is not None:
                handle = pool.handle_for(decision.address)
                if handle.healthy and (not adapter or adapter in handle.adapters):
                    return handle
                if handle.healthy and decision.adapter_missing:
                    preferred = handle  # no worker holds the adapter: the router's pick by load, if we load it
                else:
                    # The router has not seen it leave (draining or just lost) or unload yet: our view wins.
                    log.info("routed worker is not usable; picking another",
                             extra={"worker": decision.address, "request_id": request_id})
        if adapter:
            return await pool.ensure_adapter(model, adapter, preferred)
        return pool.pick(model)

    return pick


def _transport_failure(e: grpc.aio.AioRpcError) -> bool:
    """UNAVAILABLE made by gRPC itself (connection refused or reset: the worker is gone), not by the worker."""
    return e.code() == grpc.StatusCode.UNAVAILABLE and not answered_by_peer(e)


@dataclass
class _Attempt:
    """One try of a sequence on one worker: the worker picked, its call, whether any output went to the client."""

    worker: WorkerHandle | None = None
    call: Any = None
    sent: bool = False


@dataclass(frozen=True)
class _Failure:
    """How a try ended short, as the retry rules read it: the worker aborted the sequence (``rpc`` None), or its
    call failed (``lost``: at the transport, the worker is gone)."""

    rpc: grpc.aio.AioRpcError | None = None
    reason: str = ""
    lost: bool = False

    @property
    def code(self) -> grpc.StatusCode | None:
        return self.rpc.code() if self.rpc is not None else None

    def error(self, sent: bool) -> EmbedmeshError:
        """What the client gets when the failure is not retried."""
        if self.rpc is None:
            return Unavailable("the worker stopped this generation (it is shutting down); retry",
                               reason="WORKER_ABORTED", retry_after_seconds=1.0)
        if self.lost:
            what = "was lost mid-generation" if sent else "could not be reached"
            return Unavailable(f"the worker serving this request {what}; retry the request",
                               reason="WORKER_LOST", retry_after_seconds=1.0)
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return Unavailable("every worker for this model is at capacity; retry shortly",
                               reason="WORKERS_BUSY", retry_after_seconds=1.0)
        return from_rpc_error(self.rpc)


@dataclass(frozen=True)
class _Retry:
    """A failure retried once on another worker, when nothing was sent yet (``WORKER_RETRIES`` counts it by
    ``label``); ``refresh``: our view of the failed worker's adapters is stale, read them again first."""

    applies: Callable[[_Failure, str, WorkerHandle | None], bool]
    """(failure, adapter, failed worker) -> whether this rule retries it."""
    label: Callable[[_Failure], str]
    refresh: bool = False


_RETRIES = (
    # The worker aborted the sequence before any output (it is draining).
    _Retry(lambda f, adapter, worker: f.rpc is None, lambda f: "aborted"),
    # Unreachable, lost, or refused as busy: another worker may take it.
    _Retry(lambda f, adapter, worker: f.code == grpc.StatusCode.UNAVAILABLE or (
        f.code == grpc.StatusCode.RESOURCE_EXHAUSTED and f.reason == "WORKER_BUSY"),
           lambda f: "lost" if f.lost else f.code.name.lower() if f.code is not None else ""),
    # The adapter was unloaded behind our back, or the worker restarted.
    _Retry(lambda f, adapter, worker: bool(adapter) and worker is not None and f.reason == "LORA_NOT_LOADED",
           lambda f: "lora_not_loaded", refresh=True),
)
"""The retry rules, in the order they are tried; a failure no rule takes goes to the client as ``error``."""


async def _one(
    index: int,
    req: worker_pb2.GenerateRequest,
    pick: Callable[[], Awaitable[WorkerHandle]],
    out: asyncio.Queue[tuple[int, worker_pb2.GenerateResponse] | BaseException],
    pool: WorkerPool | None = None,
    model: str = "",
    adapter: str = "",
    *,
    body: bytes | ChunkedBody | None = None,
    resume: Resume | None = None,
) -> None:
    """Stream one sequence from a worker into ``out`` (``body``: ``req`` with its segments, already serialized;
    without it ``req`` is sent as it is): pick a worker, call it, classify how the call ended; a failure before
    any output that a rule of ``_RETRIES`` takes is retried once on another worker, a cut after output is continued
    on another worker when ``resume``'s limits allow (see the module docstring)."""
    failed: WorkerHandle | None = None
    resume = resume or Resume()
    cut: _Failure | None = None
    """The failure that first cut the stream after output went out: what the client gets if it cannot continue."""
    attempt = 0
    while True:
        a = _Attempt()
        try:
            failure = await _call(a, index, req, pick, out, pool, model, adapter, body, attempt, failed, resume)
            if failure is None or resume.finished:  # ended (a failure after the last delta cuts nothing)
                return
            if resume.started:
                cut = cut or failure
                if _ended_at_cut(index, req, resume, out):
                    return
                if not resume.decide(pool, model, adapter, a.worker, (failure.code, failure.reason),
                                     req.request_id):
                    out.put_nowait(cut.error(True))
                    return
                req, body = continuation(req, body, resume)
                log.info("continuing a stream on another worker", extra={
                    "request_id": req.request_id, "tokens_sent": len(resume.ids), "migration": resume.migrations})
            else:
                rule = None
                if attempt == 0 and pool is not None:
                    rule = next((r for r in _RETRIES if r.applies(failure, adapter, a.worker)), None)
                if rule is None:
                    out.put_nowait(failure.error(False))
                    return
                if rule.refresh and pool is not None and a.worker is not None:
                    await pool.refresh_adapters(a.worker)
                WORKER_RETRIES.labels(rule.label(failure)).inc()
            failed = a.worker
            attempt += 1
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which maps it to INTERNAL
            out.put_nowait(e)
            return
        finally:
            if a.call is not None:
                a.call.cancel()
            if a.worker is not None:
                a.worker.inflight -= 1


def _ended_at_cut(index: int, req: worker_pb2.GenerateRequest, resume: Resume,
                  out: asyncio.Queue[tuple[int, worker_pb2.GenerateResponse] | BaseException]) -> bool:
    """Every token the request asked for went out before the cut (only the finish was lost): end the sequence here
    instead of continuing it."""
    if not req.sampling.HasField("max_tokens") or len(resume.ids) < req.sampling.max_tokens + resume.offset:
        return False
    out.put_nowait((index, worker_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                                       completion_tokens=len(resume.ids))))
    return True


async def _resuming_worker(pick: Callable[[], Awaitable[WorkerHandle]], pool: WorkerPool, model: str, adapter: str,
                           failed: WorkerHandle | None) -> WorkerHandle:
    """Where a continuation goes: the first try's choice again (the router's, by the prompt's block hashes: the
    worker holding the prompt prefills least) when it is another worker that resumes, else the pool's round robin
    over those."""
    try:
        worker = await pick()
    except EmbedmeshError:
        worker = None
    if worker is None or worker is failed or worker not in pool.resumable(model, adapter):
        worker = pool.pick(model, exclude=failed, adapter=adapter, resuming=True)
    return worker


async def _call(a: _Attempt, index: int, req: worker_pb2.GenerateRequest,
                pick: Callable[[], Awaitable[WorkerHandle]],
                out: asyncio.Queue[tuple[int, worker_pb2.GenerateResponse] | BaseException],
                pool: WorkerPool | None, model: str, adapter: str, body: bytes | ChunkedBody | None, attempt: int,
                failed: WorkerHandle | None, resume: Resume) -> _Failure | None:
    """One try: pick (the first try asks ``pick``; the retry the pool, past the failed worker; a continuation a
    worker that resumes), call and stream into ``out``. None when the sequence ended; else how the try failed."""
    try:
        if attempt == 0 or pool is None:
            a.worker = await pick()
        elif resume.started:
            a.worker = await _resuming_worker(pick, pool, model, adapter, failed)
        elif adapter:
            a.worker = await pool.ensure_adapter(model, adapter, exclude=failed)
        else:
            a.worker = pool.pick(model, exclude=failed)
        a.worker.inflight += 1
        a.call = a.worker.generate_raw(body if body is not None else req.SerializeToString())
        async for resp in a.call:
            if resp.finish_reason == common_pb2.FINISH_REASON_ABORT:
                log.warning("worker aborted a sequence", extra={"worker": a.worker.address,
                                                                "request_id": req.request_id, "sent": a.sent})
                return _Failure()
            a.sent = True
            out.put_nowait((index, resume.deliver(resp)))
            while out.qsize() > BACKLOG:  # the reader is behind: stop reading the worker (gRPC flow control
                await asyncio.sleep(0.002)  # holds it back) until the reader took what is queued
        return None
    except grpc.aio.AioRpcError as e:
        code = e.code()
        lost = _transport_failure(e)
        WORKER_FAILURES.labels(code.name).inc()
        if lost and a.worker is not None and pool is not None:
            pool.mark_lost(a.worker)
        log.warning("worker call failed", extra={
            "worker": a.worker.address if a.worker else "", "request_id": req.request_id, "code": code.name,
            "details": e.details(), "sent": a.sent, "attempt": attempt})
        return _Failure(e, from_rpc_error(e).reason or "", lost)
