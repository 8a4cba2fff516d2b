"""The preprocessor's domain: what a completion, chat or embeddings request means, with no gRPC in sight.

The servicer parses a protobuf request into one of the requests below (plain dataclasses: its sampling already
resolved by ``core.sampling.sampling_from_proto``, so the ranges every worker applies too are checked there, before
anything here), calls one method of ``InferenceDomain`` and turns what comes back into protobuf. Everything in
between happens here, in this order (the order decides which error a request with several faults gets, so keep it):

    model      ``ServedModels.resolve``: a name is required, served (a base model, or a LoRA adapter of one),
               and fit for the task (generation vs. embeddings); it brings the model's spec, tokenizer and chat
               template (one pair per served model)
    sampling   the model-dependent rules: the model's vocabulary for logit_bias (``check_sampling_for_model``),
               structured-output syntax; ``echo`` with log-probabilities scores the prompt
    n          ``1 <= n <= max_n``
    prompts    completions: ``prompts.build_prompts`` (text, token ids, ``prompt_embeds`` through the linear
               ``prompt_embeds`` module); chat: parts resolved in order, the template rendered in a thread
               (``chat.build_chat_prompt``), tools checked and, when a call is required, turned into a constraint
    run        ``pipeline.run_job`` fans the choices out to workers; ``max_tokens: 0`` without prompt scoring needs
               no worker; results are merged per choice (echo put first, tool calls parsed at a choice's end)
    usage      every finished request's tokens are charged to its tenant's tokens-per-minute budget
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from embedmesh.common.v1 import common_pb2
from embedmesh.core.auth import current_principal, limiter
from embedmesh.core.embeds import ModelSpec
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.model_rules import check_sampling_for_model
from embedmesh.core.sampling import SamplingParams, Structured
from embedmesh.core.structured import check_structured
from embedmesh.services.encoder_cache.tiered import TieredCache
from embedmesh.services.preprocessor import prompt_embeds
from embedmesh.services.preprocessor.chat import ChatMessage, ChatPart, ChatTemplate, build_chat_prompt, check_role
from embedmesh.services.preprocessor.embedding_requests import embed_inputs
from embedmesh.services.preprocessor.fair_share import INTERACTIVE, FairShare
from embedmesh.services.preprocessor.pipeline import Delta, Job, Usage, run_job
from embedmesh.services.preprocessor.prompt_embeds import EmbedsResolver, RawEmbeds
from embedmesh.services.preprocessor.prompts import Tokenizer, build_prompts
from embedmesh.services.preprocessor.tools import (
    ToolCall,
    ToolParser,
    ToolRequest,
    call_text,
    check_tools,
    tool_response_text,
)
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.services.router.route_client import Routes
from embedmesh.vision.stage import ImageSource, VisionStage
from embedmesh.worker.v1 import worker_pb2

__all__ = ["MAX_MODEL_NAME", "MAX_REQUEST_ID", "Limits", "ModelInfo", "ServedModel", "ServedModels",
           "CompletionRequest", "ChatPartRequest", "ChatMessageRequest",
           "ChatRequest", "Choice", "Completion", "Stream", "InferenceDomain"]


# --- served models ------------------------------------------------------------------------------------------------

MAX_MODEL_NAME = 256
"""Longest model name a request may give (the gateway holds names to the same bound); refused before any lookup."""
MAX_REQUEST_ID = 256
"""Longest client request id (it is echoed as the response's id)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the domain reads of a base model's worker description (``GetInfo``), as plain values."""

    model: str
    task: int
    """worker_pb2.ModelTask."""
    vocab_size: int
    hidden_size: int
    max_context_tokens: int
    dtype: int
    """tensor_pb2.DataType of its prompt embeddings."""

    @classmethod
    def from_proto(cls, info: worker_pb2.GetInfoResponse) -> ModelInfo:
        return cls(info.model, info.task, info.vocab_size, info.hidden_size, info.max_context_tokens, info.dtype)


@dataclass(frozen=True)
class ServedModel:
    """A requested model name resolved: the base model's worker description, its tokenizer and chat template, and
    the LoRA adapter when the name was one."""

    name: str
    """As the client named it (the adapter's name for an adapter)."""
    info: ModelInfo
    tokenizer: Tokenizer
    template: ChatTemplate

    @property
    def spec(self) -> ModelSpec:
        """What prompt embeddings must match."""
        return ModelSpec(hidden_size=self.info.hidden_size, max_context_tokens=self.info.max_context_tokens,
                         dtype=self.info.dtype)

    @property
    def adapter(self) -> str:
        """The LoRA adapter named as the model ("" for a base model)."""
        return "" if self.name == self.info.model else self.name

    def job_fields(self) -> dict[str, str]:
        """Job fields for a request naming a LoRA adapter as its model (empty for a base model)."""
        return {"adapter": self.name, "base_model": self.info.model} if self.adapter else {}


class ServedModels:
    """The models this preprocessor serves: the workers' descriptions (from the pool), and a tokenizer and chat
    template per served base model (``texts``; models not listed there use the default pair)."""

    def __init__(self, pool: WorkerPool, tokenizer: Tokenizer, template: ChatTemplate,
                 texts: dict[str, tuple[Tokenizer, ChatTemplate]] | None = None) -> None:
        self.pool = pool
        self.default = (tokenizer, template)
        self.texts = dict(texts or {})

    def text(self, model: str) -> tuple[Tokenizer, ChatTemplate]:
        """The tokenizer and chat template of a served (base) model."""
        return self.texts.get(model) or self.default

    def resolve(self, model: str, task: int) -> ServedModel:
        """A requested name -> what serves it; refuses a missing, unknown or wrong-task model (naming ``model``)."""
        if not model:
            raise InvalidArgument("model is required", field="model", reason="REQUIRED")
        if len(model) > MAX_MODEL_NAME:
            raise InvalidArgument(f"model: a name is at most {MAX_MODEL_NAME} characters, got {len(model)}",
                                  field="model", reason="TOO_LONG")
        base = self.pool.known_adapter(model) if model not in self.pool.models() else None
        info = ModelInfo.from_proto(self.pool.spec(base if base is not None else model))
        if info.task == worker_pb2.MODEL_TASK_EMBED and task != worker_pb2.MODEL_TASK_EMBED:
            raise InvalidArgument(f"model: {model!r} is an embedding model; use /v1/embeddings", field="model",
                                  reason="WRONG_TASK")
        if task == worker_pb2.MODEL_TASK_EMBED and info.task != worker_pb2.MODEL_TASK_EMBED:
            raise InvalidArgument(f"model: {model!r} generates text; pick an embedding model (see /v1/models)",
                                  field="model", reason="WRONG_TASK")
        tokenizer, template = self.text(info.model)
        return ServedModel(model, info, tokenizer, template)


# --- requests and results -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The preprocessor's per-request bounds (from its config)."""

    max_n: int
    max_prompts: int
    max_embeds_bytes: int
    max_messages: int = 2048
    """Most messages in one chat request; checked before any message is read."""
    max_images: int = 16
    """Most image parts in one chat request; checked before any image is fetched, decoded or encoded."""


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    sampling: SamplingParams
    """Resolved by the caller (``sampling_from_proto``, with ``echo`` allowing ``max_tokens: 0``); the model's own
    rules are applied after the model checks."""
    n: int | None = None
    texts: Sequence[str] = ()
    token_prompts: Sequence[Sequence[int]] = ()
    embeds: Sequence[RawEmbeds] = ()
    prefix: RawEmbeds | None = None
    echo: bool = False
    request_id: str = ""


@dataclass(frozen=True)
class ChatPartRequest:
    """A text part, a prompt_embeds part (``embeds`` set) or an image part (``image`` set)."""

    text: str = ""
    embeds: RawEmbeds | None = None
    image: ImageSource | None = None


@dataclass(frozen=True)
class ChatMessageRequest:
    role: str
    parts: Sequence[ChatPartRequest] = ()
    name: str = ""
    tool_call_id: str = ""
    tool_calls: Sequence[tuple[str, str]] = ()
    """(name, arguments) of the calls an assistant message made."""


@dataclass(frozen=True)
class ChatRequest:
    model: str
    sampling: SamplingParams
    """Resolved by the caller (``sampling_from_proto``); the model's own rules are applied after the model checks."""
    messages: Sequence[ChatMessageRequest] = ()
    tools: ToolRequest = field(default_factory=ToolRequest)
    n: int | None = None
    request_id: str = ""


@dataclass(frozen=True)
class Choice:
    """One choice, whole (``complete``/``chat``) or a piece of it (a stream's item)."""

    index: int
    text: str = ""
    token_ids: Sequence[int] = ()
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    logprobs: Sequence[common_pb2.TokenLogprob] = ()
    """The workers' protobuf, passed through (docs/ARCHITECTURE.md, "Decisions taken here": a dataclass would cost
    more than the rest of a token's path)."""
    prompt_logprobs: Sequence[common_pb2.TokenLogprob] = ()
    tool_calls: Sequence[ToolCall] = ()


@dataclass(frozen=True)
class Completion:
    id: str
    model: str
    choices: list[Choice]
    usage: Usage


@dataclass(frozen=True)
class Stream:
    """A streamed answer: its id and model, then choices' pieces as they come and one Usage last."""

    id: str
    model: str
    items: AsyncIterator[Choice | Usage]


# --- the service --------------------------------------------------------------------------------------------------


class InferenceDomain:
    """Completions, chat and embeddings over the worker pool (see the module docstring for the order of rules)."""

    def __init__(self, pool: WorkerPool, cache: TieredCache, models: ServedModels, limits: Limits,
                 router: Routes | None = None, fair: FairShare | None = None,
                 vision: VisionStage | None = None) -> None:
        self.pool = pool
        self.cache = cache
        self.models = models
        self.limits = limits
        self.router = router
        self.fair = fair or FairShare(0)
        self.vision = vision
        """The encode stage for image parts (``embedmesh.vision``); None: image parts are refused."""

    # --- completions and chat -------------------------------------------------------------------------------------
    async def complete(self, request: CompletionRequest) -> Completion:
        return await self._collect(await self.completion_job(request))

    async def stream_complete(self, request: CompletionRequest) -> Stream:
        job = await self.completion_job(request)
        return Stream(job.request_id, job.model, self._stream(job))

    async def chat(self, request: ChatRequest) -> Completion:
        return await self._collect(await self.chat_job(request))

    async def stream_chat(self, request: ChatRequest) -> Stream:
        job = await self.chat_job(request)
        return Stream(job.request_id, job.model, self._stream(job))

    def _sampling(self, sampling: SamplingParams, model: ServedModel, *, echo: bool = False) -> SamplingParams:
        """Apply the model-dependent rules to resolved sampling before any work (the worker applies them again)."""
        check_sampling_for_model(sampling, model.info.vocab_size)
        if sampling.structured is not None:
            check_structured(sampling.structured, _structured_field(sampling.structured))
        if echo and sampling.logprobs is not None and sampling.prompt_logprobs is None:
            # Echo with log-probabilities: the prompt's tokens are scored too (loglikelihood evaluation).
            sampling = replace(sampling, prompt_logprobs=sampling.logprobs)
        return sampling

    def _n(self, n: int | None) -> int:
        n = 1 if n is None else n
        if not 1 <= n <= self.limits.max_n:
            raise InvalidArgument(f"n must be in [1, {self.limits.max_n}]", field="n", reason="OUT_OF_RANGE")
        return n

    def _resolver(self, model: ServedModel, sampling: SamplingParams) -> EmbedsResolver:
        return EmbedsResolver(self.cache, model.spec, self.limits.max_embeds_bytes, sampling.max_tokens)

    async def completion_job(self, request: CompletionRequest) -> Job:
        _check_request_id(request.request_id)
        model = self.models.resolve(request.model, worker_pb2.MODEL_TASK_GENERATE)
        sampling = self._sampling(request.sampling, model, echo=request.echo)
        n = self._n(request.n)
        embeds = [prompt_embeds.read(raw, "prompt_embeds" if len(request.embeds) == 1 else f"prompt_embeds[{i}]")
                  for i, raw in enumerate(request.embeds)]
        prefix = prompt_embeds.read(request.prefix, "prompt_embeds_prefix") if request.prefix is not None else None
        token_prompts = [list(t) for t in request.token_prompts]
        prompts = await build_prompts(
            texts=list(request.texts),
            token_prompts=token_prompts,
            embeds=embeds,
            spec=model.spec,
            vocab_size=model.info.vocab_size,
            max_tokens=sampling.max_tokens,
            resolve=self._resolver(model, sampling),
            tokenizer=model.tokenizer,
            max_prompts=self.limits.max_prompts,
            prefix=prefix,
        )
        with_embeds = bool(embeds) or prefix is not None
        if with_embeds and request.echo:
            raise InvalidArgument("echo: a prompt made of embeddings has no text to echo; send a text or token-id "
                                  "prompt to use echo", field="echo", reason="ECHO_WITH_EMBEDS")
        if with_embeds and sampling.prompt_logprobs is not None:
            raise InvalidArgument("prompt_logprobs: log-probabilities of the prompt need token ids; embedding rows "
                                  "have no token to score", field="prompt_logprobs",
                                  reason="PROMPT_LOGPROBS_WITH_EMBEDS")
        echo = None
        if request.echo:
            texts = [t for t in request.texts if t != ""] if token_prompts else list(request.texts)
            echo = tuple([model.tokenizer.decode(ids) for ids in token_prompts] + texts)
        rid = request.request_id or f"cmpl-{uuid.uuid4().hex}"
        return Job(rid, request.model, prompts, sampling, n, model.info.dtype, echo=echo, **model.job_fields())

    def check_message_count(self, count: int) -> None:
        """At most ``max_messages`` messages: the servicer asks before it converts a single one."""
        if count > self.limits.max_messages:
            raise InvalidArgument(f"messages: at most {self.limits.max_messages} messages per request, got "
                                  f"{count}", field="messages", reason="TOO_MANY")

    def _check_chat_size(self, messages: Sequence[ChatMessageRequest]) -> None:
        """At most ``max_messages`` messages and ``max_images`` image parts, each role a known one: checked before
        any part is read (an image fetched, decoded or encoded)."""
        self.check_message_count(len(messages))
        seen = 0
        for i, m in enumerate(messages):
            check_role(i, m.role)
            for j, part in enumerate(m.parts):
                if part.image is None:
                    continue
                seen += 1
                if seen > self.limits.max_images:
                    raise InvalidArgument(f"messages[{i}].content[{j}]: at most {self.limits.max_images} images per "
                                          "request", field=f"messages[{i}].content[{j}]", reason="TOO_MANY_IMAGES")

    async def chat_job(self, request: ChatRequest) -> Job:
        _check_request_id(request.request_id)
        self._check_chat_size(request.messages)
        model = self.models.resolve(request.model, worker_pb2.MODEL_TASK_GENERATE)
        sampling = self._sampling(request.sampling, model)
        if sampling.prompt_logprobs is not None:
            raise InvalidArgument("prompt_logprobs is not available for chat; use /v1/completions with the "
                                  "rendered prompt", field="prompt_logprobs", reason="UNSUPPORTED")
        tools = check_tools(request.tools)
        if tools is not None and tools.constrained:
            if sampling.structured is not None:
                raise InvalidArgument("tool_choice: a required or named tool call cannot be combined with "
                                      "response_format or structured_outputs", field="tool_choice",
                                      reason="CONFLICT")
            constraint = tools.constraint()
            check_structured(constraint, "tools")
            sampling = replace(sampling, structured=constraint)
        n = self._n(request.n)
        resolve = self._resolver(model, sampling)
        messages = []
        for i, m in enumerate(request.messages):
            parts = []
            for j, part in enumerate(m.parts):
                if part.embeds is not None:
                    name = f"messages[{i}].content[{j}]"
                    parts.append(ChatPart(embeds=await resolve(part.embeds, name)))
                elif part.image is not None:
                    parts.append(ChatPart(embeds=await self._image_rows(part.image, model, sampling, i, j)))
                elif m.role == "tool":
                    parts.append(ChatPart(text=tool_response_text(part.text)))
                else:
                    parts.append(ChatPart(text=part.text))
            if m.role == "tool" and not m.tool_call_id:
                raise InvalidArgument(f"messages[{i}].tool_call_id is required for a tool message",
                                      field=f"messages[{i}].tool_call_id", reason="REQUIRED")
            parts.extend(ChatPart(text=call_text(name, arguments)) for name, arguments in m.tool_calls)
            messages.append(ChatMessage(m.role, tuple(parts), m.name))
        # Rendering and tokenizing a long conversation takes milliseconds: off the event loop.
        prompt = await asyncio.to_thread(build_chat_prompt, messages, template=model.template,
                                         tokenizer=model.tokenizer, spec=model.spec, max_tokens=sampling.max_tokens,
                                         tools=tools)
        rid = request.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        return Job(rid, request.model, [prompt], sampling, n, model.info.dtype, tools=tools, **model.job_fields())

    async def _image_rows(self, image: ImageSource, model: ServedModel, sampling: SamplingParams, i: int,
                          j: int) -> np.ndarray:
        """An image part -> rows for ``model`` (the encode stage; its rows then travel as a prompt_embeds part's)."""
        field = f"messages[{i}].content[{j}]." + ("image.data" if image.data is not None else "image_url")
        if self.vision is None:
            raise InvalidArgument(f"{field}: images are not accepted by this server", field=field,
                                  reason="IMAGES_DISABLED")
        return await self.vision.rows(image, model=model.info.model, spec=model.spec, field=field,
                                      max_tokens=sampling.max_tokens)

    async def _items(self, job: Job) -> AsyncIterator[Delta | Usage]:
        """The job's deltas and usage; ``max_tokens: 0`` without prompt scoring needs no worker (echo only)."""
        if job.sampling.max_tokens == 0 and job.sampling.prompt_logprobs is None:
            for index in range(len(job.prompts) * job.n):
                yield Delta(index, "", (), common_pb2.FINISH_REASON_LENGTH)
            yield Usage(sum(len(p) for p in job.prompts), 0)
            return
        # Under saturation, the tenant's turn by its key's weight and priority (fair_share.py); at once otherwise.
        p = current_principal()
        key = p.key
        slot = await self.fair.acquire(p.tenant, key.weight if key else 1.0, key.priority if key else INTERACTIVE)
        try:
            async for item in run_job(job, self.pool, self.router):
                yield item
        finally:
            self.fair.release(slot)

    async def _stream(self, job: Job) -> AsyncIterator[Choice | Usage]:
        """Deltas as they come (echo before a choice's first); with tools, each choice whole at its end, its calls
        parsed (one item per choice)."""
        started: set[int] = set()
        held: dict[int, list[Delta]] = {}
        parser = ToolParser(job.tools) if job.tools is not None else None
        async for item in self._items(job):
            if not isinstance(item, Delta):
                yield _charged(item)
                continue
            text = item.text
            if job.echo is not None and item.index not in started:
                text = job.echo[item.index // job.n] + text
            started.add(item.index)
            if parser is None:
                yield Choice(item.index, text, item.token_ids, item.finish_reason, item.logprobs,
                             item.prompt_logprobs)
                continue
            held.setdefault(item.index, []).append(item)
            if item.finish_reason:
                parts = held.pop(item.index)
                rest, calls = parser.parse("".join(d.text for d in parts))
                yield Choice(item.index, rest, [t for d in parts for t in d.token_ids], item.finish_reason,
                             [lp for d in parts for lp in d.logprobs], tool_calls=calls)

    async def _collect(self, job: Job) -> Completion:
        count = len(job.prompts) * job.n
        texts: list[list[str]] = [[] for _ in range(count)]
        token_ids: list[list[int]] = [[] for _ in range(count)]
        logprobs: list[list[common_pb2.TokenLogprob]] = [[] for _ in range(count)]
        prompt_logprobs: list[tuple[common_pb2.TokenLogprob, ...]] = [() for _ in range(count)]
        finish = [common_pb2.FINISH_REASON_UNSPECIFIED] * count
        usage = None
        async for item in self._items(job):
            if isinstance(item, Delta):
                i = item.index
                texts[i].append(item.text)
                token_ids[i].extend(item.token_ids)
                logprobs[i].extend(item.logprobs)
                if not prompt_logprobs[i]:  # the first delta carries them; never count them twice
                    prompt_logprobs[i] = item.prompt_logprobs
                if item.finish_reason:
                    finish[i] = item.finish_reason
            else:
                usage = item
        assert usage is not None
        parser = ToolParser(job.tools) if job.tools is not None else None
        choices = []
        for i in range(count):
            text = (job.echo[i // job.n] if job.echo is not None else "") + "".join(texts[i])
            calls: list[ToolCall] = []
            if parser is not None:
                text, calls = parser.parse(text)
            choices.append(Choice(i, text, token_ids[i], finish[i], logprobs[i], prompt_logprobs[i], calls))
        return Completion(job.request_id, job.model, choices, _charged(usage))

    # --- embeddings -----------------------------------------------------------------------------------------------
    def embedding_model(self, model: str) -> ServedModel:
        """The embedding model a request names (refused like any other model check)."""
        return self.models.resolve(model, worker_pb2.MODEL_TASK_EMBED)

    async def embed(self, model: str, inputs: Sequence[str | list[int]],
                    dimensions: int | None) -> tuple[np.ndarray, int]:
        """Vectors ``(len(inputs), dim)`` in input order and the prompt tokens over all inputs."""
        return await embed_inputs(self.pool, self.cache, model, inputs, dimensions)


def _check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID:
        raise InvalidArgument(f"request_id: at most {MAX_REQUEST_ID} characters, got {len(request_id)}",
                              field="request_id", reason="TOO_LONG")


def _charged(u: Usage) -> Usage:
    """Every completed request's tokens count against its tenant's tokens-per-minute limit (when it has one)."""
    limiter().charge_tokens(current_principal(), u.prompt_tokens + u.completion_tokens)
    return u


def _structured_field(s: Structured) -> str:
    """The request field a constraint came from, as clients spell it (the gateway maps OpenAI's names onto it)."""
    return {"json_schema": "response_format.json_schema.schema", "json_object": "response_format",
            "regex": "structured_outputs.regex", "choice": "structured_outputs.choice",
            "grammar": "structured_outputs.grammar"}[s.kind]
