"""OpenAI JSON <-> the public gRPC messages.

Where each check lives: the gateway checks only the *shape* of the JSON — types, the ranges a field can have in
OpenAI's API (the sampling ranges are ``core/sampling.py``'s), parameters this server does not support, base64 —
so it can build the protobuf message; a bad value is a 400 whose ``param`` names the field. The checks are the
typed request models in ``requests/`` (``parse``); this module turns a checked request into the message.
Rules about prompts, models and tensors (a prompt is required, token ids within the vocabulary, the tensor's
dtype/shape/hidden size/NaN, the context length) live in the preprocessor, the single source for REST and gRPC
clients alike; the gateway maps its INVALID_ARGUMENT (with the field in the status details) to the same 400 shape.

``prompt`` in /v1/completions: a string, a list of strings, a list of token ids or a list of token-id lists.
``prompt_embeds`` (vLLM's extra parameter): base64 of ``torch.save(tensor)`` or of a safetensors file, a string or
a list of them, sent as ``EncodedTensor`` with an unspecified encoding (the preprocessor sniffs which); or
``{"id": ...}`` of a tensor uploaded to /v1/prompt_embeds. The openai SDK requires ``prompt``, so ``prompt=""``
(or a list of only empty strings) beside ``prompt_embeds`` is dropped.
"""

from __future__ import annotations

from typing import Any

from embedmesh.common.v1 import common_pb2
from embedmesh.gateway import affinity
from embedmesh.gateway.errors import ApiError
from embedmesh.gateway.requests import (
    IGNORED_FIELDS,
    ChatRequest,
    CompletionRequest,
    ImagePart,
    TextPart,
    decode_base64,
    known_fields,
    parse,
)
from embedmesh.gateway.wire_body import placeholder
from embedmesh.inference.v1 import inference_pb2
from embedmesh.tensor.v1 import tensor_pb2

__all__ = [
    "completion_params",
    "chat_params",
    "FINISH",
    "usage_json",
    "decode_base64",
    "COMPLETION_FIELDS",
    "CHAT_FIELDS",
    "IGNORED_FIELDS",
]

FINISH = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_ABORT: "abort",
}

COMPLETION_FIELDS = known_fields(CompletionRequest)
"""Every field a /v1/completions body may carry; any other is a 400 naming it (docs/openai-fields.md)."""
CHAT_FIELDS = known_fields(ChatRequest)
"""Every field a /v1/chat/completions body may carry."""


def _embeds(source: bytes | inference_pb2.PromptEmbeds, blobs: list[bytes] | None) -> inference_pb2.PromptEmbeds:
    """A checked source (decoded bytes, or the message naming an upload) as a PromptEmbeds message. With ``blobs``,
    the bytes are appended there and the message holds ``wire_body.placeholder`` of their index instead (copying
    tens of MiB into protobuf messages, again at each nesting, is what ``wire_body`` avoids)."""
    if not isinstance(source, bytes):
        return source
    if blobs is not None:
        blobs.append(source)
        source = placeholder(len(blobs) - 1)
    return inference_pb2.PromptEmbeds(encoded=tensor_pb2.EncodedTensor(data=source))


def _sampling(r: CompletionRequest | ChatRequest, max_tokens: Any) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    if max_tokens is not None:
        s.max_tokens = max_tokens
    if r.temperature is not None:
        s.temperature = r.temperature
    if r.top_p is not None:
        s.top_p = r.top_p
    if r.top_k is not None and r.top_k > 0:
        s.top_k = r.top_k
    if r.seed is not None:
        s.seed = r.seed
    stop = r.stop
    if stop is not None:
        s.stop.extend(x for x in ([stop] if isinstance(stop, str) else stop) if x)
    if r.ignore_eos is not None:
        s.ignore_eos = r.ignore_eos
    if r.presence_penalty:
        s.presence_penalty = r.presence_penalty
    if r.frequency_penalty:
        s.frequency_penalty = r.frequency_penalty
    if r.repetition_penalty is not None and r.repetition_penalty != 1:
        s.repetition_penalty = r.repetition_penalty
    if r.min_tokens:
        s.min_tokens = r.min_tokens
    if r.logit_bias:
        for token, bias in r.logit_bias.items():
            s.logit_bias[token] = bias
    constraint = r.structured_outputs
    if constraint is not None:
        kind, value = constraint
        if kind == "json_object":
            s.structured.json_object = True
        elif kind == "choice":
            s.structured.choice.values.extend(value)
        else:
            setattr(s.structured, kind, value)
    return s


def completion_params(body: dict[str, Any], blobs: list[bytes] | None = None) -> inference_pb2.CompletionParams:
    """/v1/completions body -> CompletionParams. With ``blobs``: see ``_embeds``."""
    r = parse(CompletionRequest, body)
    params = inference_pb2.CompletionParams(model=r.model, sampling=_sampling(r, r.max_tokens))
    if r.n is not None:
        params.n = r.n
    if r.echo is not None:
        params.echo = r.echo
    if r.logprobs is not None:
        params.sampling.logprobs = r.logprobs
    if r.prompt_logprobs is not None:
        params.sampling.prompt_logprobs = r.prompt_logprobs
    for source in r.prompt_embeds or ():
        params.prompt_embeds.append(_embeds(source, blobs))
    if r.prompt_embeds_prefix is not None:
        params.prefix.CopyFrom(_embeds(r.prompt_embeds_prefix, blobs))
    if r.prompt is not None:
        texts, ids = r.prompt
        if texts:
            params.prompts.extend(texts)
        if ids:
            params.prompt_token_ids.extend(inference_pb2.TokenIds(ids=p) for p in ids)
    # Neither prompt nor prompt_embeds: the preprocessor's INVALID_ARGUMENT (field "prompt"), as for gRPC clients.
    return params


def chat_params(body: dict[str, Any], blobs: list[bytes] | None = None) -> inference_pb2.ChatParams:
    """/v1/chat/completions body -> ChatParams. Content parts: text, images and prompt_embeds. With ``blobs``: see
    ``_embeds``. Sets the request's image affinity key from its first image part (``affinity.remember``)."""
    r = parse(ChatRequest, body)
    first_image: str | None = None
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    params = inference_pb2.ChatParams(model=r.model, sampling=_sampling(r, max_tokens))
    if r.n is not None:
        params.n = r.n
    if r.logprobs:
        params.sampling.logprobs = r.top_logprobs or 0
    for tool in r.tools or ():
        fn = tool.function
        params.tools.append(inference_pb2.Tool(name=fn.name, description=fn.description,
                                               parameters_json=fn.parameters or "", strict=bool(fn.strict)))
    if r.tool_choice is not None:
        kind, value = r.tool_choice
        if kind == "mode":
            params.tool_choice.mode = value
        else:
            params.tool_choice.function = value
    for m in r.messages:
        msg = inference_pb2.ChatMessage(role=m.role, name=m.name or "")
        if m.tool_calls is not None:
            msg.tool_calls.extend(m.tool_calls)
        if m.role == "tool":
            msg.tool_call_id = m.tool_call_id
        content = m.content
        if isinstance(content, str):
            msg.parts.append(inference_pb2.ChatContentPart(text=content))
        elif content is not None:
            for part in content:
                if isinstance(part, TextPart):
                    msg.parts.append(inference_pb2.ChatContentPart(text=part.text))
                elif isinstance(part, ImagePart):
                    if first_image is None:
                        first_image = part.image_url
                    msg.parts.append(inference_pb2.ChatContentPart(image=inference_pb2.ImageInput(
                        url=part.image_url)))
                else:
                    msg.parts.append(inference_pb2.ChatContentPart(prompt_embeds=_embeds(part.data, blobs)))
        params.messages.append(msg)
    affinity.remember(first_image)
    return params


def usage_json(u: common_pb2.Usage) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body
