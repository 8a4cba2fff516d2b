"""Thin gRPC adapter for ``InferenceService``: protobuf in -> a domain request -> ``service.InferenceDomain`` ->
protobuf out. Errors are domain exceptions (``core.errors``), mapped to gRPC status by the server; what a request
means (model, sampling, ``n``, prompts, chat, tools, stream merging, usage) lives in ``service.py``, and the
operations over the whole pool (models, sleep, LoRA adapters, mesh health) in ``admin.py``. The servicer itself
keeps only admission (``--max-inflight``), which is about calls, not requests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict
from typing import Any

import grpc

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.core.sampling import sampling_from_proto
from embedmesh.core.transport import pieces, wire
from embedmesh.core.transport.received import Received
from embedmesh.core.transport.thresholds import FORWARD_MIN
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.services.preprocessor.admin import MeshAdmin
from embedmesh.services.preprocessor.metrics import GENERATE_CALLS, INFLIGHT, REJECTED
from embedmesh.services.preprocessor.pipeline import Usage
from embedmesh.services.preprocessor.prompt_embeds import RawEmbeds
from embedmesh.services.preprocessor.service import (
    ChatMessageRequest,
    ChatPartRequest,
    ChatRequest,
    Choice,
    Completion,
    CompletionRequest,
    InferenceDomain,
    Stream,
)
from embedmesh.services.preprocessor.tools import tool_request_from_proto
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.vision.stage import ImageSource
from embedmesh.worker.v1 import worker_pb2

__all__ = ["InferenceServicer", "Admission"]

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
    request_parsers = {
        # the header's inline tensors stay views of the received bytes; rows after it are handed over uncopied
        "Generate": wire.parse_chunk(inference_pb2.GenerateRequest, wire.split_generate_header),
        # the same bytes as a one-message Generate stream, given as a ``Received`` (its cut-out tensors by path)
        "GenerateInline": wire.parse_message(inference_pb2.GenerateInlineRequest, wire.split_generate_header),
    }
    """Request deserializers handed to ``Server.add`` (``core.transport.wire``)."""
    upload_streams = frozenset({"Generate"})
    """Request streams that are uploads with an end: a refusal waits for the client to finish sending."""

    def __init__(self, domain: InferenceDomain, admin: MeshAdmin, max_inflight: int) -> None:
        self.domain = domain
        self.admin = admin
        self.admission = Admission(max_inflight)

    # --- inference --------------------------------------------------------------------------------------------
    async def Generate(  # noqa: N802
        self, request_iterator: AsyncIterator[inference_pb2.GenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """The one generation call: a header (completion or chat, stream or not), then the rows of its tensors
        that came without data (a pieces stream, ``core.transport.pieces``); events back (see inference.proto)."""
        with self.admission.slot("Generate"):  # taken first: a mesh at capacity does not read the rows
            arrival = await self._arrival(request_iterator, _generate_tensors, self._generate_scan)
            received = arrival.received()
            header: inference_pb2.GenerateHeader = received.message
            task = _task(header, "pieces" if arrival.buffers else "message")
            async with self._serving(arrival):
                async for event in self._answer(header, received, task, arrival.finished):
                    yield event

    async def GenerateInline(  # noqa: N802
        self, request: Received, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """``Generate`` for a request in one message (a unary request): the same header served by the same code,
        without a pieces stream to read, so every tensor carries its bytes (in ``data``, or cut out of the
        received bytes: ``request`` is the ``Received`` that ``request_parsers`` made of them)."""
        with self.admission.slot("GenerateInline"):
            message: inference_pb2.GenerateInlineRequest = request.message
            if not message.HasField("request"):
                raise InvalidArgument("request: GenerateInline takes a header (completion or chat)",
                                      field="request", reason="REQUIRED")
            header = message.request
            _inline_only(header, request)
            task = _task(header, "message")
            async for event in self._answer(header, request, task, None):
                yield event

    async def _answer(self, header: inference_pb2.GenerateHeader, received: Received, task: str,
                      finished: Callable[[], Awaitable[None]] | None) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """The events answering ``header`` (Generate's and GenerateInline's), its tensors' bytes in ``received``:
        one whole completion or chat, or its chunks. ``finished`` (a pieces stream's end) is awaited before the
        first chunk goes out: nothing is answered before the client's stream ended within the rules."""
        if not header.stream:
            if task == "completion":
                result = await self.domain.complete(_completion_request(header.completion, received))
                yield inference_pb2.GenerateResponse(completion=_response(inference_pb2.CompleteResponse, result))
            else:
                result = await self.domain.chat(self._chat_request(header.chat, received))
                yield inference_pb2.GenerateResponse(chat=_response(inference_pb2.ChatResponse, result))
            return
        if task == "completion":
            stream = await self.domain.stream_complete(_completion_request(header.completion, received))
            chunk, cls = "completion_chunk", inference_pb2.StreamCompleteResponse
        else:
            stream = await self.domain.stream_chat(self._chat_request(header.chat, received))
            chunk, cls = "chat_chunk", inference_pb2.StreamChatResponse
        async for item in stream.items:
            if finished is not None:
                await finished()
                finished = None
            yield inference_pb2.GenerateResponse(**{chunk: _stream_message(cls, stream, item)})

    def _chat_request(self, params: inference_pb2.ChatParams, received: Received) -> ChatRequest:
        """``_chat_request`` once the message count is within the limit (a request of 100,000 messages is refused
        before any of them is converted)."""
        self.domain.check_message_count(len(params.messages))
        return _chat_request(params, received)

    def _generate_scan(self, header: inference_pb2.GenerateHeader) -> pieces.Scan | None:
        """A completion's one big prompt tensor is checked as it arrives and sent on (``_completion_scan``)."""
        if header.WhichOneof("task") != "completion":
            return None
        return self._completion_scan(header.completion)

    async def _arrival(self, messages: AsyncIterator[Any], tensors_of: pieces.Tensors,
                       scan_for: Callable[[Any], pieces.Scan | None] | None = None) -> pieces.Arrival:
        """A pieces stream once its request arrived, at most the embeddings byte cap: with every byte too, unless
        ``scan_for`` made its bytes checked as they arrive (then they may be used while the rest arrive)."""
        arrival = await pieces.start(messages, tensors_of, self.domain.limits.max_embeds_bytes, scan_for=scan_for)
        if not arrival.scanned:
            await arrival.finished()
        return arrival

    @contextlib.asynccontextmanager
    async def _serving(self, arrival: pieces.Arrival) -> AsyncIterator[None]:
        """Serve the request over the arrival's tensors (``Arrival.received``: by the request's field names,
        ``prompt_embeds`` or ``messages[i].content[j]``, those still arriving marked so) and end only once the
        client's stream ended within the rules. When that stream broke a rule, that is the answer, whatever it made
        fail downstream."""
        try:
            yield
            await arrival.finished()
        except Exception:
            if arrival.error is not None and not isinstance(arrival.error, asyncio.CancelledError):
                raise arrival.error from None
            raise
        finally:
            arrival.cancel()

    def _completion_scan(self, params: inference_pb2.CompletionParams) -> pieces.Scan | None:
        """For one prompt of one raw tensor of ``thresholds.FORWARD_MIN`` bytes or more, 2-D and already in the model's
        dtype and hidden size, without a prefix: the NaN/Inf check its bytes pass as they arrive, so they go on to the
        worker while the rest arrive (routed on their first blocks, ``thresholds.ROUTE_BYTES``). Anything else waits for
        every byte, then takes the one-message path (None)."""
        if len(params.prompt_embeds) != 1 or params.HasField("prefix"):
            return None
        pe = params.prompt_embeds[0]
        info = tensors.DTYPES.get(pe.tensor.dtype)
        shape = [int(d) for d in pe.tensor.shape]
        if pe.WhichOneof("source") != "tensor" or len(pe.tensor.data) or info is None or len(shape) != 2:
            return None
        if shape[0] * shape[1] * info.numpy.itemsize < FORWARD_MIN:
            return None
        try:
            spec = self.domain.models.resolve(params.model, worker_pb2.MODEL_TASK_GENERATE).spec
        except Exception:  # noqa: BLE001 - no model to stream to: the ordinary path words the error
            return None
        if spec.dtype != pe.tensor.dtype or spec.hidden_size != shape[1]:
            return None
        return pieces.finite_scan(spec.dtype, "prompt_embeds")

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
        return inference_pb2.ListModelsResponse(
            models=[inference_pb2.Model(**asdict(m)) for m in await self.admin.list_models()])

    # --- sleep mode (admin) -----------------------------------------------------------------------------------
    async def SleepWorkers(  # noqa: N802
        self, request: inference_pb2.SleepWorkersRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.SleepWorkersResponse:
        return inference_pb2.SleepWorkersResponse(workers=await self.admin.sleep(request.level, list(request.workers)))

    async def WakeUpWorkers(  # noqa: N802
        self, request: inference_pb2.WakeUpWorkersRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.WakeUpWorkersResponse:
        return inference_pb2.WakeUpWorkersResponse(workers=await self.admin.wake_up(list(request.workers)))

    async def IsSleeping(  # noqa: N802
        self, request: inference_pb2.IsSleepingRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.IsSleepingResponse:
        all_asleep, asleep = await self.admin.sleeping()
        return inference_pb2.IsSleepingResponse(is_sleeping=all_asleep, sleeping=asleep)

    # --- LoRA adapters (admin) --------------------------------------------------------------------------------
    async def LoadLoraAdapter(  # noqa: N802
        self, request: inference_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.LoadLoraAdapterResponse:
        workers, loaded = await self.admin.load_adapter(request.lora_name, request.lora_path, list(request.workers))
        return inference_pb2.LoadLoraAdapterResponse(workers=workers, loaded=loaded)

    async def UnloadLoraAdapter(  # noqa: N802
        self, request: inference_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.UnloadLoraAdapterResponse:
        return inference_pb2.UnloadLoraAdapterResponse(workers=await self.admin.unload_adapter(request.lora_name))

    async def GetMeshHealth(  # noqa: N802
        self, request: inference_pb2.GetMeshHealthRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetMeshHealthResponse:
        return inference_pb2.GetMeshHealthResponse(
            services=[inference_pb2.ServiceHealth(**asdict(h)) for h in await self.admin.mesh_health()])


# --- proto -> domain ---------------------------------------------------------------------------------------------


def _raw_embeds(pe: inference_pb2.PromptEmbeds, field: str, received: Received) -> RawEmbeds:
    """One PromptEmbeds as received (its bytes from ``received`` when they travelled apart from the message, by
    ``field``); a raw tensor is read (and checked) by the domain, in the request's order."""
    kind = pe.WhichOneof("source")
    if kind == "tensor":
        return RawEmbeds(tensor=received.tensor(field, pe.tensor))
    if kind == "encoded":
        view = received.views.get(field) if not pe.encoded.data else None
        return RawEmbeds(encoded=view if view is not None else pe.encoded.data)
    if kind == "cache_id":
        return RawEmbeds(cache_id=pe.cache_id)
    return RawEmbeds()  # nothing set: refused by the domain under ``field``


def _completion_tensors(params: inference_pb2.CompletionParams) -> Iterator[tuple[str, tensor_pb2.Tensor]]:
    """The raw tensors of a completion in the order their bytes follow its request in a pieces stream
    (prompt_embeds in order, then the prefix), by the field names ``_completion_request`` reads them with."""
    n = len(params.prompt_embeds)
    for i, pe in enumerate(params.prompt_embeds):
        if pe.WhichOneof("source") == "tensor":
            yield ("prompt_embeds" if n == 1 else f"prompt_embeds[{i}]"), pe.tensor
    if params.HasField("prefix") and params.prefix.WhichOneof("source") == "tensor":
        yield "prompt_embeds_prefix", params.prefix.tensor


def _chat_tensors(params: inference_pb2.ChatParams) -> Iterator[tuple[str, tensor_pb2.Tensor]]:
    """The raw tensors of a chat's prompt_embeds parts, in message and part order, by the field names the chat
    path reads them with."""
    for i, m in enumerate(params.messages):
        for j, part in enumerate(m.parts):
            if part.WhichOneof("kind") == "prompt_embeds" and part.prompt_embeds.WhichOneof("source") == "tensor":
                yield f"messages[{i}].content[{j}]", part.prompt_embeds.tensor


def _generate_tensors(header: inference_pb2.GenerateHeader) -> Iterator[tuple[str, tensor_pb2.Tensor]]:
    """A Generate header's raw tensors in the order their bytes follow it, under the field names of its task."""
    task = header.WhichOneof("task")
    if task == "completion":
        yield from _completion_tensors(header.completion)
    elif task == "chat":
        yield from _chat_tensors(header.chat)


def _task(header: inference_pb2.GenerateHeader, transport: str) -> str:
    """The header's task ("completion" or "chat"), refused by name when it has none; the call is counted."""
    task = header.WhichOneof("task")
    if task is None:
        raise InvalidArgument("request.task: the header must hold a completion or a chat",
                              field="request.task", reason="REQUIRED")
    GENERATE_CALLS.labels(task, "true" if header.stream else "false", transport).inc()
    return task


def _inline_only(header: inference_pb2.GenerateHeader, received: Received) -> None:
    """GenerateInline has no rows after its header: a raw tensor whose shape wants bytes and that carries none (in
    ``data``, or cut out of the received bytes) is refused by name, pointing at Generate."""
    for path, tensor in _generate_tensors(header):
        if len(tensor.data) or path in received.views or not tensor.shape or not all(d > 0 for d in tensor.shape):
            continue  # bytes inline, or no rows to want (an odd shape is refused by name by the domain)
        raise InvalidArgument(
            f"{path}.data: GenerateInline takes every tensor's bytes inline; a tensor without data (its rows sent "
            f"after the header) needs Generate's pieces stream", field=f"{path}.data", reason="PIECES_NEED_GENERATE")


def _completion_request(params: inference_pb2.CompletionParams, received: Received) -> CompletionRequest:
    """The domain's completion request: sampling resolved and range-checked here (``echo`` allows ``max_tokens:
    0``), so a bad range is refused before the model is looked up."""
    n = len(params.prompt_embeds)
    return CompletionRequest(
        model=params.model, sampling=sampling_from_proto(params.sampling, allow_zero_max_tokens=params.echo),
        n=params.n if params.HasField("n") else None,
        texts=list(params.prompts), token_prompts=[list(t.ids) for t in params.prompt_token_ids],
        embeds=[_raw_embeds(pe, "prompt_embeds" if n == 1 else f"prompt_embeds[{i}]", received)
                for i, pe in enumerate(params.prompt_embeds)],
        prefix=_raw_embeds(params.prefix, "prompt_embeds_prefix", received) if params.HasField("prefix") else None,
        echo=params.echo, request_id=params.request_id)


def _chat_part(part: inference_pb2.ChatContentPart, i: int, j: int, received: Received) -> ChatPartRequest:
    kind = part.WhichOneof("kind")
    if kind == "prompt_embeds":
        return ChatPartRequest(embeds=_raw_embeds(part.prompt_embeds, f"messages[{i}].content[{j}]", received))
    if kind == "image":
        image = part.image
        return ChatPartRequest(image=ImageSource(url=image.url) if image.WhichOneof("source") != "data"
                               else ImageSource(data=image.data))
    return ChatPartRequest(text=part.text)


def _chat_request(params: inference_pb2.ChatParams, received: Received) -> ChatRequest:
    """The domain's chat request: sampling resolved and range-checked here (after the message count, before the
    messages' roles, images and model are checked by the domain)."""
    return ChatRequest(
        model=params.model, sampling=sampling_from_proto(params.sampling),
        n=params.n if params.HasField("n") else None,
        messages=[ChatMessageRequest(
            role=m.role, name=m.name, tool_call_id=m.tool_call_id,
            parts=[_chat_part(part, i, j, received) for j, part in enumerate(m.parts)],
            tool_calls=[(c.name, c.arguments) for c in m.tool_calls]) for i, m in enumerate(params.messages)],
        tools=tool_request_from_proto(params), request_id=params.request_id)


# --- domain -> proto ---------------------------------------------------------------------------------------------


def _usage(u: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                            total_tokens=u.prompt_tokens + u.completion_tokens)


def _choice_fields(c: Choice) -> dict[str, Any]:
    return {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "logprobs": c.logprobs, "prompt_logprobs": c.prompt_logprobs,
            "tool_calls": [inference_pb2.ToolCall(id=t.id, name=t.name, arguments=t.arguments) for t in c.tool_calls]}


def _stream_message(cls: Any, stream: Stream, item: Choice | Usage) -> Any:
    if isinstance(item, Usage):
        return cls(id=stream.id, model=stream.model, usage=_usage(item))
    return cls(id=stream.id, model=stream.model, **_choice_fields(item))


def _response(cls: Any, result: Completion) -> Any:
    return cls(id=result.id, model=result.model, usage=_usage(result.usage),
               choices=[inference_pb2.Choice(**_choice_fields(c)) for c in result.choices])
