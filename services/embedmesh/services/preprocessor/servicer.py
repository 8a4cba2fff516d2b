"""Thin gRPC adapter for ``InferenceService``: protobuf in -> a domain request -> ``service.InferenceDomain`` ->
protobuf out. Errors are domain exceptions (``core.errors``), mapped to gRPC status by the server; what a request
means (model, sampling, ``n``, prompts, chat, tools, stream merging, usage) lives in ``service.py``. Besides the
inference calls it keeps admission (``--max-inflight``) and the admin calls over the worker pool (models, sleep,
LoRA adapters, mesh health)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument, NotFound, Unavailable, from_rpc_error
from embedmesh.core.server import mesh_channel
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.services.encoder_cache.tiered import TieredCache
from embedmesh.services.preprocessor.chat import ChatTemplate
from embedmesh.services.preprocessor.config import PreprocessorConfig
from embedmesh.services.preprocessor.metrics import INFLIGHT, REJECTED
from embedmesh.services.preprocessor.pipeline import Usage
from embedmesh.services.preprocessor.prompt_embeds import RawEmbeds
from embedmesh.services.preprocessor.prompts import Tokenizer
from embedmesh.services.preprocessor.service import (
    ChatMessageRequest,
    ChatPartRequest,
    ChatRequest,
    Choice,
    Completion,
    CompletionRequest,
    InferenceDomain,
    Limits,
    ServedModels,
    Stream,
)
from embedmesh.services.preprocessor.tools import tool_request_from_proto
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.services.router.route_client import RouteClient
from embedmesh.worker.v1 import worker_pb2

__all__ = ["InferenceServicer", "Admission"]

_ROUTER_HEALTH_TIMEOUT_S = 1.0


class Admission:
    """At most ``limit`` requests in flight; one more is refused at once (UNAVAILABLE ``OVERLOADED`` with a retry
    delay, a 503 + Retry-After at the gateway) instead of queueing behind the others without bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inflight = 0

    @contextlib.contextmanager
    def slot(self, rpc: str) -> Iterator[None]:
        if self.inflight >= self.limit:
            REJECTED.labels(rpc).inc()
            raise Unavailable(f"the mesh is at capacity ({self.limit} requests in flight); retry shortly",
                              reason="OVERLOADED", retry_after_seconds=1.0)
        self.inflight += 1
        INFLIGHT.inc()
        try:
            yield
        finally:
            self.inflight -= 1
            INFLIGHT.dec()


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(
        self, pool: WorkerPool, tokenizer: Tokenizer, template: ChatTemplate, config: PreprocessorConfig,
        cache: TieredCache, router: RouteClient | None = None,
        texts: dict[str, tuple[Tokenizer, ChatTemplate]] | None = None,
    ) -> None:
        self.pool = pool
        self.config = config
        self.domain = InferenceDomain(
            pool, cache, ServedModels(pool, tokenizer, template, texts),
            Limits(max_n=config.max_n, max_prompts=config.max_prompts, max_embeds_bytes=config.max_embeds_bytes),
            router)
        self.admission = Admission(config.max_inflight)
        self._router_health: list[health_pb2_grpc.HealthStub] = []

    # --- inference --------------------------------------------------------------------------------------------
    async def StreamComplete(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.StreamCompleteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.StreamCompleteResponse]:
        with self.admission.slot("StreamComplete"):
            stream = await self.domain.stream_complete(_completion_request(request.params))
            async for item in stream.items:
                yield _stream_message(inference_pb2.StreamCompleteResponse, stream, item)

    async def StreamChat(  # noqa: N802
        self, request: inference_pb2.StreamChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.StreamChatResponse]:
        with self.admission.slot("StreamChat"):
            stream = await self.domain.stream_chat(_chat_request(request.params))
            async for item in stream.items:
                yield _stream_message(inference_pb2.StreamChatResponse, stream, item)

    async def Complete(  # noqa: N802
        self, request: inference_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CompleteResponse:
        with self.admission.slot("Complete"):
            result = await self.domain.complete(_completion_request(request.params))
        return _response(inference_pb2.CompleteResponse, result)

    async def Chat(  # noqa: N802
        self, request: inference_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ChatResponse:
        with self.admission.slot("Chat"):
            result = await self.domain.chat(_chat_request(request.params))
        return _response(inference_pb2.ChatResponse, result)

    async def Embed(  # noqa: N802
        self, request: inference_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EmbedResponse:
        self.domain.embedding_model(request.model)
        inputs: list[str | list[int]] = [
            i.text if i.WhichOneof("kind") == "text" else list(i.token_ids.ids) for i in request.inputs
        ]
        dimensions = request.dimensions if request.HasField("dimensions") else None
        with self.admission.slot("Embed"):
            vectors, tokens = await self.domain.embed(request.model, inputs, dimensions)
        return inference_pb2.EmbedResponse(
            model=request.model, embeddings=tensors.from_numpy(vectors),
            usage=common_pb2.Usage(prompt_tokens=tokens, total_tokens=tokens),
        )

    # --- models and admin -------------------------------------------------------------------------------------
    async def ListModels(  # noqa: N802
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        await asyncio.gather(*(self.pool.refresh_adapters(w) for w in self.pool.workers if w.healthy))
        out = []
        for name, group in sorted(self.pool.models().items()):
            info = group[0].info
            assert info is not None
            out.append(
                inference_pb2.Model(
                    id=name,
                    hidden_size=info.hidden_size,
                    max_context_tokens=info.max_context_tokens,
                    dtype=info.dtype,
                    engines=sorted({w.info.engine for w in group if w.info}),
                    ready_workers=sum(1 for w in group if w.healthy),
                    task="embed" if info.task == worker_pb2.MODEL_TASK_EMBED else "generate",
                    embedding_size=info.embedding_size,
                    created=self.pool.created.get(name, int(time.time())),
                )
            )
        base = {m.id: m for m in out}
        for name, (parent, holders) in sorted(self.pool.adapters().items()):
            if name in base or parent not in base:
                continue
            p = base[parent]
            out.append(inference_pb2.Model(
                id=name, parent=parent, hidden_size=p.hidden_size, max_context_tokens=p.max_context_tokens,
                dtype=p.dtype, engines=sorted({w.info.engine for w in holders if w.info}), task="generate",
                ready_workers=sum(1 for w in holders if w.healthy), created=p.created))
        return inference_pb2.ListModelsResponse(models=out)

    # --- sleep mode (admin) -----------------------------------------------------------------------------------
    async def SleepWorkers(  # noqa: N802
        self, request: inference_pb2.SleepWorkersRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.SleepWorkersResponse:
        if request.level not in (1, 2):
            raise InvalidArgument("level must be 1 or 2", field="level", reason="OUT_OF_RANGE")
        targets = _generative(self.pool, request.workers)
        await self._all(targets, lambda w: w.stub.Sleep(worker_pb2.SleepRequest(level=request.level), timeout=300))
        return inference_pb2.SleepWorkersResponse(workers=[w.name for w in targets])

    async def WakeUpWorkers(  # noqa: N802
        self, request: inference_pb2.WakeUpWorkersRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.WakeUpWorkersResponse:
        targets = [w for w in self.pool.workers if w.info is not None and w.info.task != worker_pb2.MODEL_TASK_EMBED
                   and (not request.workers or w.name in set(request.workers))]
        _generative(self.pool, request.workers)  # unknown ids refused
        await self._all(targets, lambda w: w.stub.WakeUp(worker_pb2.WakeUpRequest(), timeout=300))
        return inference_pb2.WakeUpWorkersResponse(workers=[w.name for w in targets])

    async def IsSleeping(  # noqa: N802
        self, request: inference_pb2.IsSleepingRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.IsSleepingResponse:
        targets = [w for w in self.pool.workers if w.info is not None and w.info.task != worker_pb2.MODEL_TASK_EMBED]
        stats = await asyncio.gather(*(w.stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10) for w in targets),
                                     return_exceptions=True)
        asleep = [w.name for w, s in zip(targets, stats, strict=True)
                  if not isinstance(s, BaseException) and s.sleeping]
        return inference_pb2.IsSleepingResponse(is_sleeping=bool(targets) and len(asleep) == len(targets),
                                                sleeping=asleep)

    async def _all(self, targets: list[Any], call: Any) -> None:
        """Call every target; the first refusal (e.g. sleep mode unavailable) is the answer."""
        results = await asyncio.gather(*(call(w) for w in targets), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise from_rpc_error(failed) if isinstance(failed, grpc.aio.AioRpcError) else failed

    # --- LoRA adapters (admin) --------------------------------------------------------------------------------
    async def LoadLoraAdapter(  # noqa: N802
        self, request: inference_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.LoadLoraAdapterResponse:
        name = request.lora_name
        if not name or len(name) > 256 or any(c.isspace() or not c.isprintable() for c in name):
            raise InvalidArgument("lora_name is required: a name without spaces (at most 256 characters)",
                                  field="lora_name", reason="INVALID_NAME")
        if not request.lora_path:
            raise InvalidArgument("lora_path is required", field="lora_path", reason="REQUIRED")
        if name in self.pool.models():
            raise InvalidArgument(f"lora_name {name!r} is the name of a served model", field="lora_name",
                                  reason="NAME_TAKEN")
        targets = [w for w in self.pool.workers
                   if w.healthy and w.info is not None and w.info.task != worker_pb2.MODEL_TASK_EMBED]
        if request.workers:
            ids = {w.name for w in targets}
            unknown = [x for x in request.workers if x not in ids]
            if unknown:
                raise InvalidArgument(f"workers: {unknown} are not serving generative workers (see /health)",
                                      field="workers", reason="UNKNOWN_WORKER")
            targets = [w for w in targets if w.name in set(request.workers)]
        if not targets:
            raise Unavailable("no generative worker is serving; retry shortly", reason="NO_HEALTHY_WORKER",
                              retry_after_seconds=1.0)
        held = self.pool.adapters().get(name)
        if held is not None and any(w.info is not None and w.info.model != held[0] for w in targets):
            raise InvalidArgument(f"lora_name {name!r} is already loaded for model {held[0]!r}",
                                  field="lora_name", reason="NAME_TAKEN")
        req = worker_pb2.LoadLoraAdapterRequest(name=name, path=request.lora_path)
        results = await asyncio.gather(*(w.stub.LoadLoraAdapter(req, timeout=300) for w in targets),
                                       return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            # Nothing half-loaded: undo the loads this call made, then report the first failure.
            undo = [w for w, r in zip(targets, results, strict=True) if not isinstance(r, BaseException) and r.loaded]
            await asyncio.gather(*(w.stub.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(name=name),
                                                            timeout=60) for w in undo), return_exceptions=True)
            await asyncio.gather(*(self.pool.refresh_adapters(w) for w in targets))
            raise _lora_error(failed)
        await asyncio.gather(*(self.pool.refresh_adapters(w) for w in targets))
        return inference_pb2.LoadLoraAdapterResponse(
            workers=[w.name for w in targets], loaded=any(r.loaded for r in results))  # type: ignore[union-attr]

    async def UnloadLoraAdapter(  # noqa: N802
        self, request: inference_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.UnloadLoraAdapterResponse:
        name = request.lora_name
        if not name:
            raise InvalidArgument("lora_name is required", field="lora_name", reason="REQUIRED")
        holders = [w for w in self.pool.workers if name in w.adapters]
        if not holders and self.pool.lora_load_on_demand and self.pool.catalog.pop(name, None) is not None:
            return inference_pb2.UnloadLoraAdapterResponse()  # loaded nowhere now; forgotten for load on demand
        if not holders:
            raise NotFound(f"lora_name: no worker holds an adapter named {name!r}", field="lora_name",
                           reason="ADAPTER_NOT_FOUND")
        results = await asyncio.gather(*(w.stub.UnloadLoraAdapter(
            worker_pb2.UnloadLoraAdapterRequest(name=name), timeout=300) for w in holders), return_exceptions=True)
        await asyncio.gather(*(self.pool.refresh_adapters(w) for w in holders))
        if not any(name in w.adapters for w in self.pool.workers):
            self.pool.catalog.pop(name, None)  # unloaded on purpose: load on demand must not bring it back
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise _lora_error(failed)
        return inference_pb2.UnloadLoraAdapterResponse(
            workers=[w.name for w, r in zip(holders, results, strict=True) if r.unloaded])  # type: ignore[union-attr]

    async def GetMeshHealth(  # noqa: N802
        self, request: inference_pb2.GetMeshHealthRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetMeshHealthResponse:
        workers: list[inference_pb2.ServiceHealth] = []
        generating = 0
        for i, w in enumerate(self.pool.workers):
            embed = w.info is not None and w.info.task == worker_pb2.MODEL_TASK_EMBED
            if w.healthy and not embed:
                generating += 1
            detail = "" if w.healthy else ("not serving (draining, stopped or failed)" if w.seen_serving
                                           else "not serving yet (starting) or unreachable")
            workers.append(inference_pb2.ServiceHealth(
                service="embedding-worker" if embed else "worker", name=w.name or f"worker-{i}",
                status="serving" if w.healthy else "down", model=w.info.model if w.info else "", detail=detail))
        routers = await self._routers_health()
        if not any(w.healthy for w in self.pool.workers):
            own, detail = "down", "no worker is serving"
        elif generating == 0:
            own, detail = "degraded", "no generation worker is serving (embeddings only)"
        elif any(s.status != "serving" for s in [*workers, *routers]):
            own, detail = "degraded", "some workers or routers are not serving"
        else:
            own, detail = "serving", ""
        me = inference_pb2.ServiceHealth(service="preprocessor", name="preprocessor", status=own, detail=detail)
        return inference_pb2.GetMeshHealthResponse(services=[me, *workers, *routers])

    async def _routers_health(self) -> list[inference_pb2.ServiceHealth]:
        if not self._router_health:
            self._router_health = [health_pb2_grpc.HealthStub(mesh_channel(a)) for a in self.config.routers]

        async def one(i: int, stub: health_pb2_grpc.HealthStub) -> inference_pb2.ServiceHealth:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=_ROUTER_HEALTH_TIMEOUT_S)
                ok, detail = r.status == health_pb2.HealthCheckResponse.SERVING, "not serving"
            except grpc.aio.AioRpcError as e:
                ok, detail = False, f"unreachable ({e.code().name}); requests are routed round robin"
            return inference_pb2.ServiceHealth(service="router", name=f"router-{i}",
                                               status="serving" if ok else "down", detail="" if ok else detail)

        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(self._router_health))))


# --- proto -> domain ---------------------------------------------------------------------------------------------


def _raw_embeds(pe: inference_pb2.PromptEmbeds, field: str) -> RawEmbeds:
    """One PromptEmbeds as received; a raw tensor is read (and checked) by the domain, in the request's order."""
    kind = pe.WhichOneof("source")
    if kind == "tensor":
        return RawEmbeds(tensor=pe.tensor)
    if kind == "encoded":
        views = tensors.wire_views()  # the bytes cut out of the received request (core.wire), if they were
        view = views.get(field) if views and not pe.encoded.data else None
        return RawEmbeds(encoded=view if view is not None else pe.encoded.data)
    if kind == "cache_id":
        return RawEmbeds(cache_id=pe.cache_id)
    return RawEmbeds()  # nothing set: refused by the domain under ``field``


def _completion_request(params: inference_pb2.CompletionParams) -> CompletionRequest:
    n = len(params.prompt_embeds)
    return CompletionRequest(
        model=params.model, sampling=params.sampling, n=params.n if params.HasField("n") else None,
        texts=list(params.prompts), token_prompts=[list(t.ids) for t in params.prompt_token_ids],
        embeds=[_raw_embeds(pe, "prompt_embeds" if n == 1 else f"prompt_embeds[{i}]")
                for i, pe in enumerate(params.prompt_embeds)],
        prefix=_raw_embeds(params.prefix, "prompt_embeds_prefix") if params.HasField("prefix") else None,
        echo=params.echo, request_id=params.request_id)


def _chat_request(params: inference_pb2.ChatParams) -> ChatRequest:
    return ChatRequest(
        model=params.model, sampling=params.sampling, n=params.n if params.HasField("n") else None,
        messages=[ChatMessageRequest(
            role=m.role, name=m.name, tool_call_id=m.tool_call_id,
            parts=[ChatPartRequest(embeds=_raw_embeds(part.prompt_embeds, f"messages[{i}].content[{j}]"))
                   if part.WhichOneof("kind") == "prompt_embeds" else ChatPartRequest(text=part.text)
                   for j, part in enumerate(m.parts)],
            tool_calls=[(c.name, c.arguments) for c in m.tool_calls]) for i, m in enumerate(params.messages)],
        tools=tool_request_from_proto(params), request_id=params.request_id)


# --- domain -> proto ---------------------------------------------------------------------------------------------


def _usage(u: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                            total_tokens=u.prompt_tokens + u.completion_tokens)


def _choice_fields(c: Choice) -> dict[str, Any]:
    return {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "logprobs": c.logprobs, "prompt_logprobs": c.prompt_logprobs, "tool_calls": c.tool_calls}


def _stream_message(cls: Any, stream: Stream, item: Choice | Usage) -> Any:
    if isinstance(item, Usage):
        return cls(id=stream.id, model=stream.model, usage=_usage(item))
    return cls(id=stream.id, model=stream.model, **_choice_fields(item))


def _response(cls: Any, result: Completion) -> Any:
    return cls(id=result.id, model=result.model, usage=_usage(result.usage),
               choices=[inference_pb2.Choice(**_choice_fields(c)) for c in result.choices])


def _generative(pool: WorkerPool, ids: Any) -> list[Any]:
    """Serving generative workers, or those of ``ids`` (worker ids; an unknown one is an INVALID_ARGUMENT)."""
    targets = [w for w in pool.workers
               if w.healthy and w.info is not None and w.info.task != worker_pb2.MODEL_TASK_EMBED]
    if ids:
        known = {w.name for w in pool.workers}
        unknown = [x for x in ids if x not in known]
        if unknown:
            raise InvalidArgument(f"workers: {unknown} are not workers of this mesh (see /health)", field="workers",
                                  reason="UNKNOWN_WORKER")
        targets = [w for w in pool.workers if w.name in set(ids)]
    return targets


def _lora_error(e: BaseException) -> Exception:
    """A worker's refusal of a LoRA call, re-named in the client's fields (path -> lora_path, name -> lora_name)."""
    if not isinstance(e, grpc.aio.AioRpcError):
        return e if isinstance(e, Exception) else Unavailable("the LoRA call was interrupted")
    err = from_rpc_error(e)
    field = {"path": "lora_path", "name": "lora_name"}.get(err.field or "", err.field)
    message = str(err).replace("path:", "lora_path:", 1) if err.field == "path" else str(err)
    return type(err)(message, field=field, reason=err.reason, retry_after_seconds=err.retry_after_seconds)
