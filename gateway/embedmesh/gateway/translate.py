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
import re
from collections.abc import Callable
from typing import Any

import orjson
import pybase64

from embedmesh.common.v1 import common_pb2
from embedmesh.gateway.embeds_json import Base64Text
from embedmesh.gateway.errors import ApiError, bad_request
from embedmesh.gateway.wire_body import placeholder
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
# what to tell the caller). Neutral values (best_of=1, suffix="") are accepted and ignored.
_Check = tuple[Callable[[Any], bool], str]
_UNSUPPORTED_BOTH: dict[str, _Check] = {
    "store": (lambda v: v is not None and v is not False,
              "is not supported by this server: it stores no completions (only false is accepted)"),
    "min_p": (lambda v: v is not None and not (_is_num(v) and v == 0),
              "is not supported by this server (top_k and top_p are; only 0 is accepted)"),
}
_UNSUPPORTED_COMPLETIONS: dict[str, _Check] = {
    **_UNSUPPORTED_BOTH,
    "suffix": (lambda v: v not in (None, ""), "is not supported by this server: it does no insertion (fill-in-the-"
                                              "middle) completion"),
    "best_of": (lambda v: v not in (None, 1), "is not supported by this server: only 1 is accepted (use n)"),
}
_UNSUPPORTED_CHAT: dict[str, _Check] = {
    **_UNSUPPORTED_BOTH,
    "functions": (lambda v: bool(v), "is not supported by this server: use tools (the functions API is "
                                     "deprecated)"),
    "function_call": (lambda v: v is not None, "is not supported by this server: use tool_choice"),
    "audio": (lambda v: v is not None, "is not supported by this server: it generates text only"),
    "modalities": (lambda v: v not in (None, ["text"]), "is not supported by this server: it generates text only"),
    "prediction": (lambda v: v is not None, "is not supported by this server (no predicted outputs)"),
    "web_search_options": (lambda v: v is not None, "is not supported by this server (no web search)"),
}

# Every field a request may carry. Any other is a 400 naming it: nothing a client asks for is silently dropped.
_SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream", "stream_options",
    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
})
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
"""Accepted and ignored (they change nothing a client can observe here; ``store`` only when false); listed in
docs/openai-fields.md."""
COMPLETION_FIELDS = _SAMPLING_FIELDS | IGNORED_FIELDS | frozenset(_UNSUPPORTED_COMPLETIONS) | {
    "prompt", "prompt_embeds", "prompt_embeds_prefix", "echo", "logprobs", "prompt_logprobs",
}
CHAT_FIELDS = _SAMPLING_FIELDS | IGNORED_FIELDS | frozenset(_UNSUPPORTED_CHAT) | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
}
_MAX_LOGPROBS = 20


def _unknown_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    for name in body:
        if name not in known:
            raise bad_request(name, "is not a parameter this server knows; remove it (see docs/openai-fields.md "
                                    "for the accepted ones)", "unknown_parameter")


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
    if type(value) is Base64Text:  # decoded already, as it was read (embeds_json)
        return value.decoded
    try:
        return pybase64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(param, "is not valid base64 (standard alphabet, with padding)", "invalid_base64") from None


def embeds_source(value: Any, param: str, blobs: list[bytes] | None = None) -> inference_pb2.PromptEmbeds:
    """A base64 torch.save/safetensors string, or {"id": "emb-..."} for a tensor uploaded to /v1/prompt_embeds.

    With ``blobs``, the decoded bytes are appended there and the message holds ``wire_body.placeholder`` of their
    index instead (copying tens of MiB into protobuf messages, again at each nesting, is what ``wire_body``
    avoids)."""
    if isinstance(value, dict):
        key = value.get("id")
        if not isinstance(key, str) or not key:
            raise bad_request(f"{param}.id", 'must be the id returned by POST /v1/prompt_embeds', "missing")
        return inference_pb2.PromptEmbeds(cache_id=key)
    data = decode_base64(value, param)
    if blobs is not None:
        blobs.append(data)
        data = placeholder(len(blobs) - 1)
    return inference_pb2.PromptEmbeds(encoded=tensor_pb2.EncodedTensor(data=data))


def _sampling(body: dict[str, Any], *, chat: bool) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    max_name = "max_tokens"
    max_tokens = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        max_name, max_tokens = "max_completion_tokens", body["max_completion_tokens"]
    # max_tokens 0 scores the prompt only (echo), as OpenAI's completions allow.
    lowest = 0 if not chat and body.get("echo") is True else 1
    if max_tokens is not None:
        if not _is_int(max_tokens) or not lowest <= max_tokens <= _UINT32_MAX:
            raise bad_request(max_name, f"must be an integer >= {lowest}", "invalid_type" if not _is_int(max_tokens)
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
    for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        value = body.get(name)
        if value is not None:
            if not _is_num(value) or not low <= value <= high:
                raise bad_request(name, f"must be a number in [{low:g}, {high:g}]", "invalid_value")
            if value:
                setattr(s, name, float(value))
    rep = body.get("repetition_penalty")
    if rep is not None:
        if not _is_num(rep) or not 0 < rep <= 2:
            raise bad_request("repetition_penalty", "must be a number in (0, 2] (1 = none)", "invalid_value")
        if rep != 1:
            s.repetition_penalty = float(rep)
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if not _is_int(min_tokens) or not 0 <= min_tokens <= _UINT32_MAX:
            raise bad_request("min_tokens", "must be an integer >= 0", "invalid_value")
        if min_tokens:
            s.min_tokens = min_tokens
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad_request("logit_bias", 'must be an object mapping token ids to a bias, like {"50256": -100}',
                              "invalid_type")
        if len(bias) > 300:
            raise bad_request("logit_bias", "may hold at most 300 token ids", "invalid_value")
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request("logit_bias", f"key {key!r} is not a token id (an integer)", "invalid_value") \
                    from None
            if not 0 <= token < 2**31:
                raise bad_request("logit_bias", f"token id {key} is outside the vocabulary", "invalid_value")
            if not _is_num(value) or not -100 <= value <= 100:
                raise bad_request("logit_bias", f"the bias of token {key} must be a number in [-100, 100]",
                                  "invalid_value")
            s.logit_bias[token] = float(value)
    _structured(body, s)
    return s


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema (object, or JSON text of one) checked as a schema -> its JSON text."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise bad_request(param, "must be a JSON schema (an object, or a string of JSON)", "invalid_value") \
                from None
    if not isinstance(value, dict):
        raise bad_request(param, "must be a JSON schema (an object)", "invalid_type")
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a base dependency; the preprocessor checks again regardless
        pass
    else:
        try:
            jsonschema.Draft202012Validator.check_schema(value)
        except jsonschema.SchemaError as e:
            raise bad_request(param, f"is not a valid JSON schema: {e.message}", "invalid_schema") from None
    return orjson.dumps(value).decode()


def _structured(body: dict[str, Any], s: common_pb2.SamplingParams) -> None:
    """response_format, vLLM's structured_outputs and its older guided_* fields -> one StructuredOutput."""
    found: list[str] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise bad_request("response_format", 'must be {"type": "text"}, {"type": "json_object"} or '
                                                 '{"type": "json_schema", "json_schema": {...}}', "invalid_value")
        if fmt["type"] == "json_object":
            s.structured.json_object = True
            found.append("response_format")
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise bad_request("response_format.json_schema.schema", "is required: the JSON schema the output "
                                  "must follow", "missing")
            s.structured.json_schema = _schema_text(spec["schema"], "response_format.json_schema.schema")
            found.append("response_format")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs", "must be an object with one of json, regex, choice, grammar, "
                                                    "json_object", "invalid_type")
        set_keys = [k for k, v in so.items() if v is not None and v is not False]
        for k in set_keys:
            if k not in ("json", "regex", "choice", "grammar", "json_object"):
                raise bad_request(f"structured_outputs.{k}", "is not a constraint this server knows (json, regex, "
                                  "choice, grammar, json_object)", "unknown_parameter")
        if len(set_keys) > 1:
            raise bad_request("structured_outputs", "must set exactly one of json, regex, choice, grammar, "
                                                    "json_object", "invalid_value")
        found += [f"structured_outputs.{k}" for k in set_keys]
        for k in set_keys:
            _constraint(k, so[k], f"structured_outputs.{k}", s)
    for legacy, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                         ("guided_grammar", "grammar")):
        if body.get(legacy) is not None:
            found.append(legacy)
            _constraint(kind, body[legacy], legacy, s)
    if len(found) > 1:
        raise bad_request(found[1], f"cannot be combined with {found[0]}: give one output constraint",
                          "invalid_value")


def _constraint(kind: str, value: Any, param: str, s: common_pb2.SamplingParams) -> None:
    if kind == "json":
        s.structured.json_schema = _schema_text(value, param)
    elif kind == "json_object":
        if value is not True:
            raise bad_request(param, "must be true", "invalid_value")
        s.structured.json_object = True
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise bad_request(param, "must be a non-empty list of non-empty strings", "invalid_value")
        s.structured.choice.values.extend(value)
    else:
        if not isinstance(value, str) or not value:
            raise bad_request(param, "must be a non-empty string", "invalid_value")
        setattr(s.structured, kind, value)


def _common(body: dict[str, Any], unsupported: dict[str, _Check], chat: bool) -> tuple[str, int | None]:
    _unknown_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
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


def completion_params(body: dict[str, Any], blobs: list[bytes] | None = None) -> inference_pb2.CompletionParams:
    """/v1/completions body -> CompletionParams. With ``blobs``: see ``embeds_source``."""
    model, n = _common(body, _UNSUPPORTED_COMPLETIONS, chat=False)
    params = inference_pb2.CompletionParams(model=model, sampling=_sampling(body, chat=False))
    if n is not None:
        params.n = n
    echo = body.get("echo")
    if echo is not None:
        if not isinstance(echo, bool):
            raise bad_request("echo", "must be a boolean", "invalid_type")
        params.echo = echo
    for name in ("logprobs", "prompt_logprobs"):
        k = body.get(name)
        if k is not None:
            if not _is_int(k) or not 0 <= k <= _MAX_LOGPROBS:
                raise bad_request(name, f"must be an integer in [0, {_MAX_LOGPROBS}]", "invalid_value")
            setattr(params.sampling, name, k)
    embeds = body.get("prompt_embeds")
    if embeds == [] and body.get("prompt") not in (None, "", []):
        embeds = None  # vLLM: an empty list beside a text prompt means no embeddings
    if embeds is not None:
        items = [embeds] if isinstance(embeds, str | dict) else embeds
        if not isinstance(items, list) or not items:
            raise bad_request("prompt_embeds", "must be a base64 string or a non-empty list of them", "invalid_type")
        for i, item in enumerate(items):
            param = "prompt_embeds" if not isinstance(embeds, list) or len(items) == 1 else f"prompt_embeds[{i}]"
            params.prompt_embeds.append(embeds_source(item, param, blobs))
    prefix = body.get("prompt_embeds_prefix")
    if prefix is not None:
        params.prefix.CopyFrom(embeds_source(prefix, "prompt_embeds_prefix", blobs))
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


def chat_params(body: dict[str, Any], blobs: list[bytes] | None = None) -> inference_pb2.ChatParams:
    """/v1/chat/completions body -> ChatParams. Content parts: text and prompt_embeds. With ``blobs``: see
    ``embeds_source``."""
    model, n = _common(body, _UNSUPPORTED_CHAT, chat=True)
    params = inference_pb2.ChatParams(model=model, sampling=_sampling(body, chat=True))
    if n is not None:
        params.n = n
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("logprobs", "must be a boolean (use top_logprobs for alternatives)", "invalid_type")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= _MAX_LOGPROBS:
            raise bad_request("top_logprobs", f"must be an integer in [0, {_MAX_LOGPROBS}]", "invalid_value")
        if logprobs is not True:
            raise bad_request("top_logprobs", "needs logprobs: true", "invalid_value")
    if logprobs:
        params.sampling.logprobs = top or 0
    _tools(body, params)
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
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad_request(f"messages[{i}].tool_calls", "must be a list, on an assistant message",
                                  "invalid_value")
            for j, call in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise bad_request(f"{where}.function.name", "is required", "missing")
                args = fn.get("arguments", "{}")
                if not isinstance(args, str):
                    raise bad_request(f"{where}.function.arguments", "must be a string of JSON", "invalid_type")
                cid = call.get("id", "")
                if not isinstance(cid, str):
                    raise bad_request(f"{where}.id", "must be a string", "invalid_type")
                msg.tool_calls.append(inference_pb2.ToolCall(id=cid, name=fn["name"], arguments=args))
        if role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise bad_request(f"messages[{i}].tool_call_id", "is required for a tool message: the id of the "
                                  "call it answers", "missing")
            msg.tool_call_id = cid
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
                        source = embeds_source(part["data"], f"{where}.data", blobs)
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


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _tools(body: dict[str, Any], params: inference_pb2.ChatParams) -> None:
    tools = body.get("tools")
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools", "must be a list of {\"type\": \"function\", \"function\": {...}}",
                              "invalid_type")
        for i, t in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(t, dict) or t.get("type", "function") != "function":
                raise bad_request(f"{where}.type", 'must be "function"', "invalid_value")
            fn = t.get("function")
            if not isinstance(fn, dict):
                raise bad_request(f"{where}.function", "is required", "missing")
            name = fn.get("name")
            if not isinstance(name, str) or not _TOOL_NAME.match(name):
                raise bad_request(f"{where}.function.name", "is required: 1-64 letters, digits, '_' or '-'",
                                  "missing" if name is None else "invalid_value")
            if name in names:
                raise bad_request(f"{where}.function.name", f"{name!r} is given twice", "invalid_value")
            names.append(name)
            description = fn.get("description", "")
            if not isinstance(description, str):
                raise bad_request(f"{where}.function.description", "must be a string", "invalid_type")
            parameters = fn.get("parameters")
            schema = _schema_text(parameters, f"{where}.function.parameters") if parameters is not None else ""
            strict = fn.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise bad_request(f"{where}.function.strict", "must be a boolean", "invalid_type")
            params.tools.append(inference_pb2.Tool(name=name, description=description, parameters_json=schema,
                                                   strict=bool(strict)))
    choice = body.get("tool_choice")
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                                             "\"function\": {\"name\": ...}}", "invalid_value")
        if choice != "none" and not names:
            raise bad_request("tool_choice", f"{choice!r} needs tools", "invalid_value")
        params.tool_choice.mode = choice
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                                         "\"function\": {\"name\": ...}}", "invalid_value")
    if name not in names:
        raise bad_request("tool_choice", f"names the function {name!r}, which is not among the tools",
                          "invalid_value")
    params.tool_choice.function = name


def usage_json(u: common_pb2.Usage) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body
