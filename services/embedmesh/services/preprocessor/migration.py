"""Streams that survive their worker: a sequence whose worker is lost (transport error, UNAVAILABLE) or drains
(it aborts the sequence, or ends its stream) after output already went to the client is continued on another
worker, from its prompt plus the tokens the client got (``GenerateRequest.resume_token_ids``), so the client sees
one uninterrupted stream.

The continuation is the same request with: a new request id, ``max_tokens`` reduced by the tokens already sent, no
prompt log-probabilities (they went out with the first delta), and the ids sent so far as ``resume_token_ids`` — the
worker prefills them after the prompt (text, ``prompt_embeds`` rows and chat embedding parts alike: the prompt's
segments are sent as they were) and continues with the same sampling state (greedy: the undisturbed text; a seed:
its offset; penalties and the grammar see the resumed tokens). Its responses' ``completion_tokens`` count only
what it generated: the pipeline adds what went before, so usage counts the whole. Tokens the lost worker generated
but the client never got are generated again, never duplicated: the cut is where the client's stream stopped.

The continuation goes where the router places the prompt (its block hashes: the worker holding the prompt
prefills least) when that is another worker that resumes, else round robin over those. Only workers whose GetInfo
says ``resumes_generation`` take a continuation (hf, mocker, echo, vLLM; an SGLang worker never gets one). A
worker that takes it may still refuse what it cannot continue exactly (vLLM: seeded sampling, penalties counting
output tokens, structured outputs) with ``RESUME_UNSUPPORTED``. Limits (``PreprocessorConfig``):
``migration_limit`` continuations per sequence, ``migration_max_positions`` (prompt + tokens sent) a continuation
may prefill again. A sequence that cannot continue — a limit reached, no other worker that resumes, its
continuation refused — ends with the cut's error, today's UNAVAILABLE ``WORKER_LOST``. Each decision counts in
``embedmesh_stream_migrations_total`` by outcome and is an event on the request's span.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace
from prometheus_client import Counter

from embedmesh.common.v1 import common_pb2
from embedmesh.core.sampling import DEFAULT_MAX_TOKENS
from embedmesh.services.preprocessor.worker_chunks import ChunkedBody
from embedmesh.worker.v1 import worker_pb2

if TYPE_CHECKING:
    from embedmesh.services.preprocessor.workers import WorkerHandle, WorkerPool

__all__ = ["MigrationLimits", "Resume", "MIGRATIONS", "continuation"]

MIGRATIONS = Counter("embedmesh_stream_migrations_total", "Sequences cut after output went to the client (worker lost "
                     "or draining), by outcome: migrated (continued on another worker), or why not (limit, budget, "
                     "no_worker, not_migratable)", ["outcome"])


@dataclass(frozen=True)
class MigrationLimits:
    max_migrations: int = 1
    """Continuations one sequence may have (0 = a cut stream ends with WORKER_LOST, as before migration)."""
    max_positions: int = 32768
    """Most positions (prompt + tokens already sent) a continuation may prefill again; 0 = no limit."""

    def __post_init__(self) -> None:
        if self.max_migrations < 0 or self.max_positions < 0:
            raise ValueError("migration_limit and migration_max_positions must be >= 0")


@dataclass
class Resume:
    """One sequence's output so far, across the workers that served it."""

    limits: MigrationLimits = field(default_factory=lambda: MigrationLimits(max_migrations=0))
    prompt_len: int = 0
    ids: list[int] = field(default_factory=list)
    """Token ids the client got."""
    started: bool = False
    """Some output went to the client (from then on a failure is a cut, not a retry)."""
    finished: bool = False
    """The sequence's last delta (with its finish reason) went to the client: a failure after it cuts nothing."""
    migrations: int = 0
    offset: int = 0
    """Tokens sent before the worker now serving took over (added to its ``completion_tokens``)."""

    def deliver(self, resp: worker_pb2.GenerateResponse) -> worker_pb2.GenerateResponse:
        """A worker's response as the client's stream counts it (recorded; a continuation's counts made whole)."""
        self.started = True
        self.finished = resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        self.ids.extend(resp.token_ids)
        if self.offset:
            resp.completion_tokens += self.offset
            del resp.prompt_logprobs[:]
        return resp

    def refusal(self, pool: WorkerPool | None, model: str, adapter: str, failed: WorkerHandle | None,
                cut: tuple[grpc.StatusCode | None, str]) -> str:
        """Why this sequence cannot continue after a cut (``cut``: the failure's code, None when the worker
        aborted it, and reason), or "" when it can."""
        code, reason = cut
        if code is not None and code != grpc.StatusCode.UNAVAILABLE:
            return "not_migratable"
        if pool is None or self.migrations >= self.limits.max_migrations:
            return "limit"
        if self.limits.max_positions and self.prompt_len + len(self.ids) > self.limits.max_positions:
            return "budget"
        if not pool.resumable(model, adapter, exclude=failed):
            return "no_worker"
        return ""

    def decide(self, pool: WorkerPool | None, model: str, adapter: str, failed: WorkerHandle | None,
               cut: tuple[grpc.StatusCode | None, str], request_id: str) -> bool:
        """Whether to continue (counted, and an event on the current span either way)."""
        refused = self.refusal(pool, model, adapter, failed, cut)
        outcome = refused or "migrated"
        MIGRATIONS.labels(outcome).inc()
        trace.get_current_span().add_event("stream migration", {
            "outcome": outcome, "request_id": request_id, "tokens_sent": len(self.ids),
            "migration": self.migrations + 1})
        if refused:
            return False
        self.migrations += 1
        return True


def continuation(req: worker_pb2.GenerateRequest, body: bytes | ChunkedBody | None, resume: Resume
                 ) -> tuple[worker_pb2.GenerateRequest, bytes | ChunkedBody | None]:
    """``req`` (the request of the try just cut) and its serialized ``body`` (``req``'s bytes, then its segments)
    made a continuation after the tokens ``resume`` recorded (see the module docstring); the segments' bytes are
    reused as they are. From now on ``resume`` counts the continuation's tokens after those."""
    head = len(req.SerializeToString())
    new = worker_pb2.GenerateRequest()
    new.CopyFrom(req)
    new.request_id = f"{req.request_id}-m{resume.migrations}"
    left = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    new.sampling.max_tokens = max(left - (len(resume.ids) - resume.offset), 1)  # less what the cut try sent
    resume.offset = len(resume.ids)
    new.sampling.ClearField("prompt_logprobs")
    new.resume_token_ids[:] = resume.ids
    if body is None:
        return new, None
    if isinstance(body, ChunkedBody):
        return new, replace(body, request=new.SerializeToString() + body.request[head:])
    return new, new.SerializeToString() + bytes(body[head:])
