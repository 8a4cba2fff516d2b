"""Thin gRPC adapter for ``InferenceService``: protobuf in → prompts and a Job → pipeline → protobuf out."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors
from embedmesh.core.auth import current_principal, limiter
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import sampling_from_proto
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.services.encoder_cache.tiered import TieredCache
from embedmesh.services.preprocessor.chat import ChatMessage, ChatPart, ChatTemplate, build_chat_prompt
from embedmesh.services.preprocessor.config import PreprocessorConfig
from embedmesh.services.preprocessor.embeddings import embed_inputs
from embedmesh.services.preprocessor.embeds import ModelSpec
from embedmesh.services.preprocessor.pipeline import Delta, Job, Usage, run_job
from embedmesh.services.preprocessor.prompts import EmbedsResolver, RawEmbeds, Tokenizer, build_prompts
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.services.router.route_client import RouteClient
from embedmesh.worker.v1 import worker_pb2

__all__ = ["InferenceServicer"]


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(
        self, pool: WorkerPool, tokenizer: Tokenizer, template: ChatTemplate, config: PreprocessorConfig,
        cache: TieredCache, router: RouteClient | None = None,
    ) -> None:
        self.pool = pool
        self.cache = cache
        self.router = router
        self.tokenizer = tokenizer
        self.template = template
        self.config = config

    def _model(self, model: str, task: int) -> worker_pb2.GetInfoResponse:
        if not model:
            raise InvalidArgument("model is required", field="model", reason="REQUIRED")
        info = self.pool.spec(model)
        if info.task == worker_pb2.MODEL_TASK_EMBED and task != worker_pb2.MODEL_TASK_EMBED:
            raise InvalidArgument(f"model: {model!r} is an embedding model; use /v1/embeddings", field="model",
                                  reason="WRONG_TASK")
        if task == worker_pb2.MODEL_TASK_EMBED and info.task != worker_pb2.MODEL_TASK_EMBED:
            raise InvalidArgument(f"model: {model!r} generates text; pick an embedding model (see /v1/models)",
                                  field="model", reason="WRONG_TASK")
        return info

    async def _job(self, params: inference_pb2.CompletionParams) -> Job:
        info = self._model(params.model, worker_pb2.MODEL_TASK_GENERATE)
        sampling = sampling_from_proto(params.sampling)
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
            tokenizer=self.tokenizer,
            max_prompts=self.config.max_prompts,
            prefix=_raw_embeds(params.prefix, "prompt_embeds_prefix") if params.HasField("prefix") else None,
        )
        rid = params.request_id or f"cmpl-{uuid.uuid4().hex}"
        return Job(rid, params.model, prompts, sampling, n, info.dtype)

    async def _chat_job(self, params: inference_pb2.ChatParams) -> Job:
        info = self._model(params.model, worker_pb2.MODEL_TASK_GENERATE)
        sampling = sampling_from_proto(params.sampling)
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
                else:
                    parts.append(ChatPart(text=part.text))
            messages.append(ChatMessage(m.role, tuple(parts), m.name))
        prompt = await asyncio.to_thread(
            build_chat_prompt, messages, template=self.template, tokenizer=self.tokenizer, spec=spec,
            max_tokens=sampling.max_tokens,
        )
        rid = params.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        return Job(rid, params.model, [prompt], sampling, n, info.dtype)

    async def _stream(self, job: Job, cls: Any) -> AsyncIterator[Any]:
        async for item in run_job(job, self.pool, self.router):
            if isinstance(item, Delta):
                yield cls(id=job.request_id, model=job.model, index=item.index, text=item.text,
                          token_ids=item.token_ids, finish_reason=item.finish_reason)
            else:
                yield cls(id=job.request_id, model=job.model, usage=_usage(item))

    async def StreamComplete(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.StreamCompleteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.StreamCompleteResponse]:
        async for item in self._stream(await self._job(request.params), inference_pb2.StreamCompleteResponse):
            yield item

    async def StreamChat(  # noqa: N802
        self, request: inference_pb2.StreamChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.StreamChatResponse]:
        async for item in self._stream(await self._chat_job(request.params), inference_pb2.StreamChatResponse):
            yield item

    async def Complete(  # noqa: N802
        self, request: inference_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CompleteResponse:
        return await self._collect(await self._job(request.params), inference_pb2.CompleteResponse)

    async def Chat(  # noqa: N802
        self, request: inference_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ChatResponse:
        return await self._collect(await self._chat_job(request.params), inference_pb2.ChatResponse)

    async def _collect(self, job: Job, cls: Any) -> Any:
        count = len(job.prompts) * job.n
        texts: list[list[str]] = [[] for _ in range(count)]
        ids: list[list[int]] = [[] for _ in range(count)]
        finish = [common_pb2.FINISH_REASON_UNSPECIFIED] * count
        usage = None
        async for item in run_job(job, self.pool, self.router):
            if isinstance(item, Delta):
                texts[item.index].append(item.text)
                ids[item.index].extend(item.token_ids)
                if item.finish_reason:
                    finish[item.index] = item.finish_reason
            else:
                usage = item
        assert usage is not None
        return cls(
            id=job.request_id,
            model=job.model,
            choices=[
                inference_pb2.Choice(index=i, text="".join(texts[i]), token_ids=ids[i], finish_reason=finish[i])
                for i in range(count)
            ],
            usage=_usage(usage),
        )

    async def Embed(  # noqa: N802
        self, request: inference_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EmbedResponse:
        self._model(request.model, worker_pb2.MODEL_TASK_EMBED)
        inputs: list[str | list[int]] = [
            i.text if i.WhichOneof("kind") == "text" else list(i.token_ids.ids) for i in request.inputs
        ]
        dimensions = request.dimensions if request.HasField("dimensions") else None
        vectors, tokens = await embed_inputs(self.pool, self.cache, request.model, inputs, dimensions)
        return inference_pb2.EmbedResponse(
            model=request.model, embeddings=tensors.from_numpy(vectors),
            usage=common_pb2.Usage(prompt_tokens=tokens, total_tokens=tokens),
        )

    async def ListModels(  # noqa: N802
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
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
        return inference_pb2.ListModelsResponse(models=out)


def _raw_embeds(pe: inference_pb2.PromptEmbeds, field: str) -> RawEmbeds:
    kind = pe.WhichOneof("source")
    if kind == "tensor":
        arr, dtype = tensors.to_numpy(pe.tensor, field=field)
        return RawEmbeds(array=arr, dtype=dtype)
    if kind == "encoded":
        return RawEmbeds(encoded=pe.encoded.data)
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
