"""Run a completion: fan each (prompt, choice) out to a worker, merge the workers' streams into one stream of
deltas tagged by choice index, and account usage. Cancelling the consumer cancels every worker call.

Choice i of prompt p has index ``p * n + i``; with a seed, choice i samples with ``seed + i`` (wrapped into int64,
``sampling.choice_seed``) so choices differ while the same request repeated gives the same text.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

import grpc
from prometheus_client import Counter, Histogram

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors
from embedmesh.core.block_hash import block_hashes
from embedmesh.core.errors import EmbedmeshError, Unavailable, from_rpc_error
from embedmesh.core.logs import get_logger
from embedmesh.core.sampling import SamplingParams, choice_seed
from embedmesh.services.preprocessor.prompts import Prompt
from embedmesh.services.preprocessor.workers import WorkerHandle, WorkerPool
from embedmesh.services.router.route_client import RouteClient
from embedmesh.worker.v1 import worker_pb2

__all__ = ["Job", "Delta", "run_job"]

log = get_logger(__name__)

TTFT = Histogram("embedmesh_time_to_first_token_seconds", "Request start to the first generated text, per model",
                 ["model"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
PROMPT_TOKENS = Counter("embedmesh_prompt_tokens_total", "Prompt positions (text tokens + embedding rows)",
                        ["model", "kind"])
GENERATED_TOKENS = Counter("embedmesh_generated_tokens_total", "Tokens generated, per model", ["model"])
REQUEST_TOKENS_PER_SECOND = Histogram("embedmesh_request_tokens_per_second", "Decode speed seen by one request",
                                      ["model"], buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000))


@dataclass(frozen=True)
class Job:
    request_id: str
    model: str
    prompts: list[Prompt]
    sampling: SamplingParams
    n: int
    model_dtype: int


@dataclass(frozen=True)
class Delta:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: int
    """common_pb2.FinishReason; UNSPECIFIED until the choice's last delta."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


def _segments(prompt: Prompt, dtype: int) -> list[worker_pb2.PromptSegment]:
    return [
        worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=piece))
        if isinstance(piece, tuple)
        else worker_pb2.PromptSegment(embeds=tensors.from_numpy(piece, dtype))
        for piece in prompt.pieces
    ]


def _sampling_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, stop=list(s.stop), ignore_eos=s.ignore_eos
    )
    if s.top_k:
        p.top_k = s.top_k
    if s.seed is not None:
        p.seed = s.seed
    return p


async def run_job(job: Job, pool: WorkerPool, router: RouteClient | None = None) -> AsyncIterator[Delta | Usage]:
    """Yield deltas as workers produce them, then one Usage."""
    out: asyncio.Queue[tuple[int, worker_pb2.GenerateResponse] | BaseException] = asyncio.Queue()
    tasks: list[asyncio.Task[None]] = []
    segments = [_segments(p, job.model_dtype) for p in job.prompts]
    for p_index, segment in enumerate(segments):
        hashes = block_hashes(job.prompts[p_index].pieces, router.block_size) if router else []
        for i in range(job.n):
            index = p_index * job.n + i
            sampling = job.sampling
            if sampling.seed is not None and i:
                sampling = replace(sampling, seed=choice_seed(sampling.seed, i))
            req = worker_pb2.GenerateRequest(
                request_id=f"{job.request_id}-{index}-{uuid.uuid4().hex[:6]}",
                segments=segment,
                sampling=_sampling_proto(sampling),
            )
            pick = _picker(pool, router, job.model, hashes, len(job.prompts[p_index]), req.request_id)
            tasks.append(asyncio.create_task(_one(index, req, pick, out, pool, job.model)))
    remaining = len(tasks)
    completion = 0
    t0 = time.perf_counter()
    first: float | None = None
    try:
        while remaining:
            item = await out.get()
            if isinstance(item, BaseException):
                raise item
            index, resp = item
            if first is None and resp.token_ids:
                first = time.perf_counter()
                TTFT.labels(job.model).observe(first - t0)
            yield Delta(index, resp.text, tuple(resp.token_ids), resp.finish_reason)
            if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                remaining -= 1
                completion += resp.completion_tokens
        prompt_tokens = sum(len(p) for p in job.prompts)
        for p in job.prompts:
            for piece in p.pieces:
                kind = "text" if isinstance(piece, tuple) else "embeds"
                PROMPT_TOKENS.labels(job.model, kind).inc(len(piece))
        GENERATED_TOKENS.labels(job.model).inc(completion)
        if first is not None and completion > len(tasks):
            REQUEST_TOKENS_PER_SECOND.labels(job.model).observe(
                (completion - len(tasks)) / max(time.perf_counter() - first, 1e-6))
        yield Usage(prompt_tokens, completion)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _picker(pool: WorkerPool, router: RouteClient | None, model: str, hashes: list[int], prompt_len: int,
            request_id: str) -> Callable[[], Awaitable[WorkerHandle]]:
    """The worker for one sequence: the KV router's choice, else round robin (router absent or unreachable)."""

    async def pick() -> WorkerHandle:
        if router is not None:
            decision = await router.route(model, hashes, prompt_len, request_id)
            if decision is not None:
                return pool.handle_for(decision.address)
        return pool.pick(model)

    return pick


async def _one(
    index: int,
    req: worker_pb2.GenerateRequest,
    pick: Callable[[], Awaitable[WorkerHandle]],
    out: asyncio.Queue[tuple[int, worker_pb2.GenerateResponse] | BaseException],
    pool: WorkerPool | None = None,
    model: str = "",
) -> None:
    """Stream one sequence from a worker into ``out``. A worker found dead before it produced anything (it died
    after the router chose it) is marked unhealthy and the sequence is retried once on another worker."""
    for attempt in range(2):
        worker = None
        call = None
        sent = False
        try:
            worker = await pick() if attempt == 0 or pool is None else pool.pick(model)
            worker.inflight += 1
            call = worker.stub.Generate(req)
            async for resp in call:
                if resp.finish_reason == common_pb2.FINISH_REASON_ABORT:
                    raise Unavailable(f"worker {worker.address} aborted the sequence; retry",
                                      reason="WORKER_ABORTED")
                sent = True
                out.put_nowait((index, resp))
            return
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                if worker is not None:
                    worker.healthy = False
                if not sent and attempt == 0 and pool is not None:
                    log.warning("worker unavailable; retrying on another", extra={"worker": worker and worker.address})
                    continue
                out.put_nowait(Unavailable(f"worker {worker.address if worker else '?'} is unavailable: "
                                           f"{e.details()}", reason="WORKER_UNAVAILABLE"))
            else:
                out.put_nowait(from_rpc_error(e))
            return
        except EmbedmeshError as e:
            out.put_nowait(e)
            return
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which maps it to INTERNAL
            out.put_nowait(e)
            return
        finally:
            if call is not None:
                call.cancel()
            if worker is not None:
                worker.inflight -= 1
