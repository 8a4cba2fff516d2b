"""Thin gRPC adapter for ``InferenceService``: protobuf in → prompts and a Job → pipeline → protobuf out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import grpc

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import sampling_from_proto
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.services.preprocessor.config import PreprocessorConfig
from embedmesh.services.preprocessor.embeds import ModelSpec
from embedmesh.services.preprocessor.pipeline import Delta, Job, Usage, run_job
from embedmesh.services.preprocessor.prompts import RawEmbeds, Tokenizer, build_prompts
from embedmesh.services.preprocessor.workers import WorkerPool

__all__ = ["InferenceServicer"]


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, pool: WorkerPool, tokenizer: Tokenizer, config: PreprocessorConfig) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.config = config

    async def _job(self, params: inference_pb2.CompletionParams) -> Job:
        if not params.model:
            raise InvalidArgument("model is required", field="model", reason="REQUIRED")
        info = self.pool.spec(params.model)
        sampling = sampling_from_proto(params.sampling)
        n = params.n if params.HasField("n") else 1
        if not 1 <= n <= self.config.max_n:
            raise InvalidArgument(f"n must be in [1, {self.config.max_n}]", field="n", reason="OUT_OF_RANGE")
        raw: list[RawEmbeds] = []
        for i, pe in enumerate(params.prompt_embeds):
            kind = pe.WhichOneof("source")
            field = "prompt_embeds" if len(params.prompt_embeds) == 1 else f"prompt_embeds[{i}]"
            if kind == "tensor":
                arr, dtype = tensors.to_numpy(pe.tensor, field=field)
                raw.append(RawEmbeds(array=arr, dtype=dtype))
            elif kind == "encoded":
                raw.append(RawEmbeds(encoded=pe.encoded.data))
            else:
                raise InvalidArgument(f"{field}: neither tensor nor encoded is set", field=field, reason="REQUIRED")
        spec = ModelSpec(hidden_size=info.hidden_size, max_context_tokens=info.max_context_tokens, dtype=info.dtype)
        prompts = await build_prompts(
            texts=list(params.prompts),
            token_prompts=[list(t.ids) for t in params.prompt_token_ids],
            embeds=raw,
            spec=spec,
            vocab_size=info.vocab_size,
            max_tokens=sampling.max_tokens,
            max_embeds_bytes=self.config.max_embeds_bytes,
            tokenizer=self.tokenizer,
            max_prompts=self.config.max_prompts,
        )
        rid = params.request_id or f"cmpl-{uuid.uuid4().hex}"
        return Job(rid, params.model, prompts, sampling, n, info.dtype)

    async def StreamComplete(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.StreamCompleteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.StreamCompleteResponse]:
        job = await self._job(request.params)
        async for item in run_job(job, self.pool):
            if isinstance(item, Delta):
                yield inference_pb2.StreamCompleteResponse(
                    id=job.request_id, model=job.model, index=item.index, text=item.text,
                    token_ids=item.token_ids, finish_reason=item.finish_reason,  # type: ignore[arg-type]
                )
            else:
                yield inference_pb2.StreamCompleteResponse(id=job.request_id, model=job.model, usage=_usage(item))

    async def Complete(  # noqa: N802
        self, request: inference_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CompleteResponse:
        job = await self._job(request.params)
        count = len(job.prompts) * job.n
        texts: list[list[str]] = [[] for _ in range(count)]
        ids: list[list[int]] = [[] for _ in range(count)]
        finish = [common_pb2.FINISH_REASON_UNSPECIFIED] * count
        usage = None
        async for item in run_job(job, self.pool):
            if isinstance(item, Delta):
                texts[item.index].append(item.text)
                ids[item.index].extend(item.token_ids)
                if item.finish_reason:
                    finish[item.index] = item.finish_reason
            else:
                usage = item
        assert usage is not None
        return inference_pb2.CompleteResponse(
            id=job.request_id,
            model=job.model,
            choices=[
                inference_pb2.Choice(index=i, text="".join(texts[i]), token_ids=ids[i], finish_reason=finish[i])
                for i in range(count)
            ],
            usage=_usage(usage),
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
                    created=self.pool.created.get(name, int(time.time())),
                )
            )
        return inference_pb2.ListModelsResponse(models=out)


def _usage(u: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
    )
