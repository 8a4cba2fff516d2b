"""OpenAI JSON <-> the public gRPC messages.

Where each check lives: the gateway checks only the *shape* of the JSON — types, the ranges a field can have in
OpenAI's API, parameters this server does not support, base64 — so it can build the protobuf message; a bad
value is a 400 whose ``param`` names the field. Rules about prompts, models and tensors (a prompt is required,
token ids within the vocabulary, the tensor's dtype/shape/hidden size/NaN, the context length) live in the
preprocessor, the single source for REST and gRPC clients alike; the gateway maps its INVALID_ARGUMENT (with the
field in the status details) to the same 400 shape.

``prompt`` in /v1/completions: a string, a list of strings, a list of token ids or a list of token-id lists.
``prompt_embeds`` (vLLM's extra parameter): base64 of ``torch.save(tensor)`` or of a safetensors file, a string or
a list of them, sent as ``EncodedTensor`` with an unspecified encoding (the preprocessor sniffs which); or
``{"id": ...}`` of a tensor uploaded to /v1/prompt_embeds. The openai SDK requires ``prompt``, so ``prompt=""``
(or a list of only empty strings) beside ``prompt_embeds`` is dropped.
"""

from __future__ import annotations

import binascii
import math
from collections.abc import Callable
from typing import Any

import pybase64

from embedmesh.common.v1 import common_pb2
from embedmesh.gateway.errors import ApiError, bad_request
from embedmesh.inference.v1 import inference_pb2
from embedmesh.tensor.v1 import tensor_pb2

__all__ = [
    "completion_params",
    "chat_params",
    "FINISH",
    "usage_json",
    "decode_base64",
]

FINISH = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_ABORT: "abort",
}

# Parameters of OpenAI's API this server does not implement: (is it set to something other than the default?,
# what to tell the caller). Neutral values (echo=false, best_of=1, penalties of 0) are accepted and ignored.
_Check = tuple[Callable[[Any], bool], str]
_NO_LOGPROBS = "is not supported by this server: it returns no log-probabilities"
_NO_PENALTY = "is not supported by this server: only 0 (no penalty) is accepted"
_UNSUPPORTED_COMPLETIONS: dict[str, _Check] = {
    "echo": (lambda v: v not in (None, False),
             "is not supported by this server (and an embeddings prompt has no text to echo)"),
    "suffix": (lambda v: v not in (None, ""), "is not supported by this server: it does no insertion (fill-in-the-"
                                              "middle) completion"),
    "logprobs": (lambda v: v is not None, _NO_LOGPROBS),
    "prompt_logprobs": (lambda v: v is not None, _NO_LOGPROBS),
    "best_of": (lambda v: v not in (None, 1), "is not supported by this server: only 1 is accepted (use n)"),
    "logit_bias": (lambda v: bool(v), "is not supported by this server"),
    "frequency_penalty": (lambda v: v not in (None, 0, 0.0), _NO_PENALTY),
    "presence_penalty": (lambda v: v not in (None, 0, 0.0), _NO_PENALTY),
}
_UNSUPPORTED_CHAT: dict[str, _Check] = {
    "logprobs": (lambda v: v not in (None, False), _NO_LOGPROBS),
    "top_logprobs": (lambda v: v is not None, _NO_LOGPROBS),
    "logit_bias": (lambda v: bool(v), "is not supported by this server"),
    "frequency_penalty": (lambda v: v not in (None, 0, 0.0), _NO_PENALTY),
    "presence_penalty": (lambda v: v not in (None, 0, 0.0), _NO_PENALTY),
    "tools": (lambda v: bool(v), "is not supported by this server: it does no tool calling"),
    "functions": (lambda v: bool(v), "is not supported by this server: it does no tool calling"),
    "response_format": (lambda v: v not in (None, {"type": "text"}), "is not supported by this server: only "
                                                                     '{"type": "text"} is accepted'),
    "audio": (lambda v: v is not None, "is not supported by this server: it generates text only"),
    "modalities": (lambda v: v not in (None, ["text"]), "is not supported by this server: it generates text only"),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_UINT32_MAX = 2**32 - 1


def _is_num(v: Any) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past float's range (orjson never makes one; a caller with Python ints can)
        return False


def decode_base64(value: Any, param: str) -> bytes:
    if not isinstance(value, str):
        raise bad_request(param, f"must be a base64 string, got {type(value).__name__}", "invalid_type")
    try:
        return pybase64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(param, "is not valid base64 (standard alphabet, with padding)", "invalid_base64") from None


def embeds_source(value: Any, param: str) -> inference_pb2.PromptEmbeds:
    """A base64 torch.save/safetensors string, or {"id": "emb-..."} for a tensor uploaded to /v1/prompt_embeds."""
    if isinstance(value, dict):
        key = value.get("id")
        if not isinstance(key, str) or not key:
            raise bad_request(f"{param}.id", 'must be the id returned by POST /v1/prompt_embeds', "missing")
        return inference_pb2.PromptEmbeds(cache_id=key)
    return inference_pb2.PromptEmbeds(encoded=tensor_pb2.EncodedTensor(data=decode_base64(value, param)))


def _sampling(body: dict[str, Any], *, chat: bool) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    max_name = "max_tokens"
    max_tokens = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        max_name, max_tokens = "max_completion_tokens", body["max_completion_tokens"]
    if max_tokens is not None:
        if not _is_int(max_tokens) or not 1 <= max_tokens <= _UINT32_MAX:
            raise bad_request(max_name, "must be an integer >= 1", "invalid_type" if not _is_int(max_tokens)
                              else "invalid_value")
        s.max_tokens = max_tokens
    temperature = body.get("temperature")
    if temperature is not None:
        if not _is_num(temperature) or temperature < 0:
            raise bad_request("temperature", "must be a number >= 0", "invalid_value")
        s.temperature = float(temperature)
    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_num(top_p) or not 0 < top_p <= 1:
            raise bad_request("top_p", "must be a number in (0, 1]", "invalid_value")
        s.top_p = float(top_p)
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or not -1 <= top_k <= _UINT32_MAX:
            raise bad_request("top_k", "must be an integer >= 0 (-1 or 0 disables it)", "invalid_value")
        if top_k > 0:
            s.top_k = top_k
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not -(2**63) <= seed < 2**63:
            raise bad_request("seed", "must be a 64-bit integer", "invalid_type")
        s.seed = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise bad_request("stop", "must be a string or a list of strings", "invalid_type")
        if len(stops) > 16:
            raise bad_request("stop", "at most 16 stop strings", "invalid_value")
        s.stop.extend(x for x in stops if x)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise bad_request("ignore_eos", "must be a boolean", "invalid_type")
        s.ignore_eos = ignore_eos
    return s


def _common(body: dict[str, Any], unsupported: dict[str, _Check], chat: bool) -> tuple[str, int | None]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model", "is required (a served model name; see GET /v1/models)", "missing")
    for name, (is_set, why) in unsupported.items():
        if is_set(body.get(name)):
            raise bad_request(name, why, "unsupported_parameter")
    n = body.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= _UINT32_MAX):
        raise bad_request("n", "must be an integer >= 1", "invalid_value")
    for flag in ("stream",):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise bad_request(flag, "must be a boolean", "invalid_type")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
        raise bad_request("stream_options", 'must be an object like {"include_usage": true}', "invalid_type")
    return model, n


def completion_params(body: dict[str, Any]) -> inference_pb2.CompletionParams:
    """/v1/completions body -> CompletionParams."""
    model, n = _common(body, _UNSUPPORTED_COMPLETIONS, chat=False)
    params = inference_pb2.CompletionParams(model=model, sampling=_sampling(body, chat=False))
    if n is not None:
        params.n = n
    embeds = body.get("prompt_embeds")
    if embeds is not None:
        items = [embeds] if isinstance(embeds, str | dict) else embeds
        if not isinstance(items, list) or not items:
            raise bad_request("prompt_embeds", "must be a base64 string or a non-empty list of them", "invalid_type")
        for i, item in enumerate(items):
            param = "prompt_embeds" if not isinstance(embeds, list) or len(items) == 1 else f"prompt_embeds[{i}]"
            params.prompt_embeds.append(embeds_source(item, param))
    prefix = body.get("prompt_embeds_prefix")
    if prefix is not None:
        params.prefix.CopyFrom(embeds_source(prefix, "prompt_embeds_prefix"))
    prompt = body.get("prompt")
    if prompt is None:
        pass
    elif isinstance(prompt, str):
        if prompt or not params.prompt_embeds:
            params.prompts.append(prompt)
    elif isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            if any(prompt) or not params.prompt_embeds:
                params.prompts.extend(prompt)
        elif all(_is_int(p) for p in prompt):
            _check_ids(prompt, "prompt")
            params.prompt_token_ids.append(inference_pb2.TokenIds(ids=prompt))
        elif all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            for i, p in enumerate(prompt):
                _check_ids(p, "prompt" if len(prompt) == 1 else f"prompt[{i}]")
            params.prompt_token_ids.extend(inference_pb2.TokenIds(ids=p) for p in prompt)
        else:
            raise bad_request("prompt", "must be a string, a list of strings, a list of token ids or a list of "
                                        "token-id lists", "invalid_type")
    else:
        raise bad_request("prompt", "must be a string, a list of strings, a list of token ids or a list of "
                                    "token-id lists", "invalid_type")
    # Neither prompt nor prompt_embeds: the preprocessor's INVALID_ARGUMENT (field "prompt"), as for gRPC clients.
    return params


def _check_ids(ids: list[int], param: str) -> None:
    """Token ids must fit the proto's int32; whether they are in the vocabulary is the preprocessor's rule."""
    if any(not -(2**31) <= t < 2**31 for t in ids):
        raise bad_request(param, "token ids must be integers in [0, vocabulary size)", "invalid_value")


def chat_params(body: dict[str, Any]) -> inference_pb2.ChatParams:
    """/v1/chat/completions body -> ChatParams. Content parts: text and prompt_embeds."""
    model, n = _common(body, _UNSUPPORTED_CHAT, chat=True)
    params = inference_pb2.ChatParams(model=model, sampling=_sampling(body, chat=True))
    if n is not None:
        params.n = n
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "must be a non-empty list of messages", "invalid_value")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}]", "must be an object with role and content", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"messages[{i}].role", "is required", "missing")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(f"messages[{i}].name", "must be a string", "invalid_type")
        msg = inference_pb2.ChatMessage(role=role, name=name or "")
        content = m.get("content")
        if isinstance(content, str):
            msg.parts.append(inference_pb2.ChatContentPart(text=content))
        elif isinstance(content, list):
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if not isinstance(part, dict):
                    raise bad_request(where, "must be an object with a type", "invalid_type")
                kind = part.get("type")
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise bad_request(f"{where}.text", "is required for a text part", "missing")
                    msg.parts.append(inference_pb2.ChatContentPart(text=part["text"]))
                elif kind == "prompt_embeds":
                    if part.get("id") is not None:
                        source = embeds_source({"id": part["id"]}, where)
                    elif part.get("data") is None:
                        raise bad_request(f"{where}.data", "is required for a prompt_embeds part (base64 of "
                                          "torch.save(tensor)), or give the id of an upload", "missing")
                    else:
                        source = embeds_source(part["data"], f"{where}.data")
                    msg.parts.append(inference_pb2.ChatContentPart(prompt_embeds=source))
                else:
                    raise bad_request(f"{where}.type", f"unsupported content part type {kind!r}; this server "
                                                       "accepts 'text' and 'prompt_embeds'", "unsupported_type")
        elif content is None and role == "assistant":
            pass
        else:
            raise bad_request(f"messages[{i}].content", "must be a string or a list of content parts", "invalid_type")
        params.messages.append(msg)
    return params


def usage_json(u: common_pb2.Usage) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body
