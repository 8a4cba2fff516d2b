"""Thin gRPC adapter for ``InferenceService``: protobuf in → prompts and a Job → pipeline → protobuf out."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Counter, Gauge

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors
from embedmesh.core.auth import current_principal, limiter
from embedmesh.core.embeds import ModelSpec
from embedmesh.core.errors import InvalidArgument, NotFound, Unavailable, from_rpc_error
from embedmesh.core.sampling import SamplingParams, Structured, sampling_from_proto
from embedmesh.core.server import mesh_channel
from embedmesh.core.structured import check_structured
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.services.encoder_cache.tiered import TieredCache
from embedmesh.services.preprocessor.chat import ChatMessage, ChatPart, ChatTemplate, build_chat_prompt
from embedmesh.services.preprocessor.config import PreprocessorConfig
from embedmesh.services.preprocessor.embeddings import embed_inputs
from embedmesh.services.preprocessor.pipeline import Delta, Job, Usage, run_job
from embedmesh.services.preprocessor.prompts import EmbedsResolver, RawEmbeds, Tokenizer, build_prompts
from embedmesh.services.preprocessor.tools import ToolParser, call_text, tool_response_text, tools_from_proto
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.services.router.route_client import RouteClient
from embedmesh.services.worker.validate import check_sampling_for_model
from embedmesh.worker.v1 import worker_pb2

__all__ = ["InferenceServicer", "Admission"]

INFLIGHT = Gauge("embedmesh_preprocessor_inflight_requests", "Requests the preprocessor is serving now")
REJECTED = Counter("embedmesh_preprocessor_rejected_total", "Requests refused at once because the preprocessor "
                   "was at --max-inflight", ["rpc"])
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
        self.cache = cache
        self.router = router
        self.tokenizer = tokenizer
        self.template = template
        self.texts = texts or {}
        """Served model -> its tokenizer and chat template; models not listed use the default pair above."""
        self.config = config
        self.admission = Admission(config.max_inflight)
        self._router_health: list[health_pb2_grpc.HealthStub] = []

    def _model(self, model: str, task: int) -> worker_pb2.GetInfoResponse:
        if not model:
            raise InvalidArgument("model is required", field="model", reason="REQUIRED")
        base = self.pool.known_adapter(model) if model not in self.pool.models() else None
        info = self.pool.spec(base if base is not None else model)
        if info.task == worker_pb2.MODEL_TASK_EMBED and task != worker_pb2.MODEL_TASK_EMBED:
            raise InvalidArgument(f"model: {model!r} is an embedding model; use /v1/embeddings", field="model",
                                  reason="WRONG_TASK")
        if task == worker_pb2.MODEL_TASK_EMBED and info.task != worker_pb2.MODEL_TASK_EMBED:
            raise InvalidArgument(f"model: {model!r} generates text; pick an embedding model (see /v1/models)",
                                  field="model", reason="WRONG_TASK")
        return info

    def _sampling(self, p: common_pb2.SamplingParams, info: worker_pb2.GetInfoResponse, *,
                  echo: bool = False) -> SamplingParams:
        """Resolve sampling and apply the model-dependent rules before any work (the worker applies them again)."""
        sampling = sampling_from_proto(p, allow_zero_max_tokens=echo)
        check_sampling_for_model(sampling, info.vocab_size)
        if sampling.structured is not None:
            check_structured(sampling.structured, _structured_field(sampling.structured))
        if echo and sampling.logprobs is not None and sampling.prompt_logprobs is None:
            # Echo with log-probabilities: the prompt's tokens are scored too (loglikelihood evaluation).
            sampling = replace(sampling, prompt_logprobs=sampling.logprobs)
        return sampling

    async def _job(self, params: inference_pb2.CompletionParams) -> Job:
        info = self._model(params.model, worker_pb2.MODEL_TASK_GENERATE)
        lora = self._adapter_of(params.model, info)
        sampling = self._sampling(params.sampling, info, echo=params.echo)
        n = params.n if params.HasField("n") else 1
        if not 1 <= n <= self.config.max_n:
            raise InvalidArgument(f"n must be in [1, {self.config.max_n}]", field="n", reason="OUT_OF_RANGE")
        raw = [
            _raw_embeds(pe, "prompt_embeds" if len(params.prompt_embeds) == 1 else f"prompt_embeds[{i}]")
            for i, pe in enumerate(params.prompt_embeds)
        ]
        spec = ModelSpec(hidden_size=info.hidden_size, max_context_tokens=info.max_context_tokens, dtype=info.dtype)
        prompts = await build_prompts(
            texts=list(params.prompts),
            token_prompts=[list(t.ids) for t in params.prompt_token_ids],
            embeds=raw,
            spec=spec,
            vocab_size=info.vocab_size,
            max_tokens=sampling.max_tokens,
            resolve=EmbedsResolver(self.cache, spec, self.config.max_embeds_bytes, sampling.max_tokens),
            tokenizer=self._text(info.model)[0],
            max_prompts=self.config.max_prompts,
            prefix=_raw_embeds(params.prefix, "prompt_embeds_prefix") if params.HasField("prefix") else None,
        )
        with_embeds = bool(raw) or params.HasField("prefix")
        if with_embeds and params.echo:
            raise InvalidArgument("echo: a prompt made of embeddings has no text to echo; send a text or token-id "
                                  "prompt to use echo", field="echo", reason="ECHO_WITH_EMBEDS")
        if with_embeds and sampling.prompt_logprobs is not None:
            raise InvalidArgument("prompt_logprobs: log-probabilities of the prompt need token ids; embedding rows "
                                  "have no token to score", field="prompt_logprobs",
                                  reason="PROMPT_LOGPROBS_WITH_EMBEDS")
        echo = None
        if params.echo:
            token_prompts = [list(t.ids) for t in params.prompt_token_ids]
            texts = [t for t in params.prompts if t != ""] if token_prompts else list(params.prompts)
            echo = tuple([self._text(info.model)[0].decode(ids) for ids in token_prompts] + texts)
        rid = params.request_id or f"cmpl-{uuid.uuid4().hex}"
        return Job(rid, params.model, prompts, sampling, n, info.dtype, echo=echo, **lora)

    async def _chat_job(self, params: inference_pb2.ChatParams) -> Job:
        info = self._model(params.model, worker_pb2.MODEL_TASK_GENERATE)
        lora = self._adapter_of(params.model, info)
        sampling = self._sampling(params.sampling, info)
        if sampling.prompt_logprobs is not None:
            raise InvalidArgument("prompt_logprobs is not available for chat; use /v1/completions with the "
                                  "rendered prompt", field="prompt_logprobs", reason="UNSUPPORTED")
        tools = tools_from_proto(params)
        if tools is not None and tools.constrained:
            if sampling.structured is not None:
                raise InvalidArgument("tool_choice: a required or named tool call cannot be combined with "
                                      "response_format or structured_outputs", field="tool_choice",
                                      reason="CONFLICT")
            constraint = tools.constraint()
            check_structured(constraint, "tools")
            sampling = replace(sampling, structured=constraint)
        n = params.n if params.HasField("n") else 1
        if not 1 <= n <= self.config.max_n:
            raise InvalidArgument(f"n must be in [1, {self.config.max_n}]", field="n", reason="OUT_OF_RANGE")
        spec = ModelSpec(hidden_size=info.hidden_size, max_context_tokens=info.max_context_tokens, dtype=info.dtype)
        resolve = EmbedsResolver(self.cache, spec, self.config.max_embeds_bytes, sampling.max_tokens)
        messages = []
        for i, m in enumerate(params.messages):
            parts = []
            for j, part in enumerate(m.parts):
                if part.WhichOneof("kind") == "prompt_embeds":
                    field = f"messages[{i}].content[{j}]"
                    parts.append(ChatPart(embeds=await resolve(_raw_embeds(part.prompt_embeds, field), field)))
                elif m.role == "tool":
                    parts.append(ChatPart(text=tool_response_text(part.text)))
                else:
                    parts.append(ChatPart(text=part.text))
            if m.role == "tool" and not m.tool_call_id:
                raise InvalidArgument(f"messages[{i}].tool_call_id is required for a tool message",
                                      field=f"messages[{i}].tool_call_id", reason="REQUIRED")
            parts.extend(ChatPart(text=call_text(c.name, c.arguments)) for c in m.tool_calls)
            messages.append(ChatMessage(m.role, tuple(parts), m.name))
        prompt = await asyncio.to_thread(
            build_chat_prompt, messages, template=self._text(info.model)[1], tokenizer=self._text(info.model)[0],
            spec=spec,
            max_tokens=sampling.max_tokens, tools=tools,
        )
        rid = params.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        return Job(rid, params.model, [prompt], sampling, n, info.dtype, tools=tools, **lora)

    def _text(self, model: str) -> tuple[Tokenizer, ChatTemplate]:
        """The tokenizer and chat template of a served (base) model."""
        return self.texts.get(model) or (self.tokenizer, self.template)

    def _adapter_of(self, model: str, info: worker_pb2.GetInfoResponse) -> dict[str, str]:
        """Job fields for a request naming a LoRA adapter as its model (empty for a base model)."""
        if model == info.model:
            return {}
        return {"adapter": model, "base_model": info.model}

    async def _items(self, job: Job) -> AsyncIterator[Delta | Usage]:
        """The job's deltas and usage; ``max_tokens: 0`` without prompt scoring needs no worker (echo only)."""
        if job.sampling.max_tokens == 0 and job.sampling.prompt_logprobs is None:
            for index in range(len(job.prompts) * job.n):
                yield Delta(index, "", (), common_pb2.FINISH_REASON_LENGTH)
            yield Usage(sum(len(p) for p in job.prompts), 0)
            return
        async for item in run_job(job, self.pool, self.router):
            yield item

    async def _stream(self, job: Job, cls: Any) -> AsyncIterator[Any]:
        started: set[int] = set()
        held: dict[int, list[Delta]] = {}
        parser = ToolParser(job.tools) if job.tools is not None else None
        async for item in self._items(job):
            if not isinstance(item, Delta):
                yield cls(id=job.request_id, model=job.model, usage=_usage(item))
                continue
            text = item.text
            if job.echo is not None and item.index not in started:
                text = job.echo[item.index // job.n] + text
            started.add(item.index)
            msg = cls(id=job.request_id, model=job.model, index=item.index, text=text, token_ids=item.token_ids,
                      finish_reason=item.finish_reason, logprobs=item.logprobs,
                      prompt_logprobs=item.prompt_logprobs)
            if parser is None:
                yield msg
                continue
            # With tools the choice is sent whole at its end, its calls parsed (one message per choice).
            held.setdefault(item.index, []).append(item)
            if item.finish_reason:
                parts = held.pop(item.index)
                rest, calls = parser.parse("".join(d.text for d in parts))
                yield cls(id=job.request_id, model=job.model, index=item.index, text=rest,
                          token_ids=[t for d in parts for t in d.token_ids], finish_reason=item.finish_reason,
                          logprobs=[lp for d in parts for lp in d.logprobs], tool_calls=calls)

    async def StreamComplete(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.StreamCompleteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.StreamCompleteResponse]:
        with self.admission.slot("StreamComplete"):
            async for item in self._stream(await self._job(request.params), inference_pb2.StreamCompleteResponse):
                yield item

    async def StreamChat(  # noqa: N802
        self, request: inference_pb2.StreamChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.StreamChatResponse]:
        with self.admission.slot("StreamChat"):
            async for item in self._stream(await self._chat_job(request.params), inference_pb2.StreamChatResponse):
                yield item

    async def Complete(  # noqa: N802
        self, request: inference_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CompleteResponse:
        with self.admission.slot("Complete"):
            return await self._collect(await self._job(request.params), inference_pb2.CompleteResponse)

    async def Chat(  # noqa: N802
        self, request: inference_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ChatResponse:
        with self.admission.slot("Chat"):
            return await self._collect(await self._chat_job(request.params), inference_pb2.ChatResponse)

    async def _collect(self, job: Job, cls: Any) -> Any:
        count = len(job.prompts) * job.n
        choices = [inference_pb2.Choice(index=i) for i in range(count)]
        texts: list[list[str]] = [[] for _ in range(count)]
        usage = None
        async for item in self._items(job):
            if isinstance(item, Delta):
                c = choices[item.index]
                texts[item.index].append(item.text)
                c.token_ids.extend(item.token_ids)
                c.logprobs.extend(item.logprobs)
                if not len(c.prompt_logprobs):  # the first delta carries them; never count them twice
                    c.prompt_logprobs.extend(item.prompt_logprobs)
                if item.finish_reason:
                    c.finish_reason = item.finish_reason
            else:
                usage = item
        assert usage is not None
        parser = ToolParser(job.tools) if job.tools is not None else None
        for i, c in enumerate(choices):
            c.text = (job.echo[i // job.n] if job.echo is not None else "") + "".join(texts[i])
            if parser is not None:
                c.text, calls = parser.parse(c.text)
                c.tool_calls.extend(calls)
        return cls(id=job.request_id, model=job.model, choices=choices, usage=_usage(usage))

    async def Embed(  # noqa: N802
        self, request: inference_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EmbedResponse:
        self._model(request.model, worker_pb2.MODEL_TASK_EMBED)
        inputs: list[str | list[int]] = [
            i.text if i.WhichOneof("kind") == "text" else list(i.token_ids.ids) for i in request.inputs
        ]
        dimensions = request.dimensions if request.HasField("dimensions") else None
        with self.admission.slot("Embed"):
            vectors, tokens = await embed_inputs(self.pool, self.cache, request.model, inputs, dimensions)
        return inference_pb2.EmbedResponse(
            model=request.model, embeddings=tensors.from_numpy(vectors),
            usage=common_pb2.Usage(prompt_tokens=tokens, total_tokens=tokens),
        )

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


def _raw_embeds(pe: inference_pb2.PromptEmbeds, field: str) -> RawEmbeds:
    kind = pe.WhichOneof("source")
    if kind == "tensor":
        arr, dtype = tensors.to_numpy(pe.tensor, field=field)
        return RawEmbeds(array=arr, dtype=dtype)
    if kind == "encoded":
        views = tensors.wire_views()  # the bytes cut out of the received request (core.wire), if they were
        view = views.get(field) if views and not pe.encoded.data else None
        return RawEmbeds(encoded=view if view is not None else pe.encoded.data)
    if kind == "cache_id":
        return RawEmbeds(cache_id=pe.cache_id)
    raise InvalidArgument(f"{field}: neither tensor nor encoded is set", field=field, reason="REQUIRED")


def _usage(u: Usage) -> common_pb2.Usage:
    # Every completed request's tokens count against its tenant's tokens-per-minute limit (when it has one).
    limiter().charge_tokens(current_principal(), u.prompt_tokens + u.completion_tokens)
    return common_pb2.Usage(
        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
    )


def _structured_field(s: Structured) -> str:
    """The request field a constraint came from, as clients spell it (the gateway maps OpenAI's names onto it)."""
    return {"json_schema": "response_format.json_schema.schema", "json_object": "response_format",
            "regex": "structured_outputs.regex", "choice": "structured_outputs.choice",
            "grammar": "structured_outputs.grammar"}[s.kind]


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
