"""The field types, wordings and checks several route areas' models share: numbers and their ranges (the sampling
ranges are ``core/sampling.py``'s constants), base64 and uploads' ids, JSON schemas, token ids, the parameters
this server refuses, and the sampling and output-constraint fields both completion routes declare."""

from __future__ import annotations

import binascii
import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
import orjson
import pybase64
from msgspec import Meta

from embedmesh.core import json_depth
from embedmesh.core.sampling import (
    LOGIT_BIAS_MAX,
    LOGIT_BIAS_MIN,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP,
    PENALTY_MAX,
    PENALTY_MIN,
    REPETITION_PENALTY_MAX,
    SEED_MAX,
    SEED_MIN,
    TEMPERATURE_MAX,
    TEMPERATURE_MIN,
    TEMPERATURE_RANGE,
    TOP_P_MAX,
)
from embedmesh.gateway.embeds_json import Base64Text
from embedmesh.gateway.errors import bad_request
from embedmesh.gateway.requests.model import Check, Refusal, Say, join
from embedmesh.inference.v1 import inference_pb2

UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past float's range (orjson never makes one; a caller with Python ints can)
        return False


def int_field(low: int, high: int, message: str | Callable[[Any, Any], str],
              code: str | Callable[[Any, Any], str] = "invalid_value") -> Any:
    """An integer in [low, high] (a bool is not one), refused in ``Say(message, code)``."""
    return Annotated[int, Meta(ge=low, le=high), Say(message, code)]


def float_field(message: str | Callable[[Any, Any], str], code: str | Callable[[Any, Any], str] = "invalid_value",
                **bounds: float) -> Any:
    """A number (an int is one, a bool is not) within ``bounds`` (Meta's ge/gt/le), refused in ``Say``."""
    return Annotated[float, Meta(**bounds), Say(message, code)]


Bool = Annotated[bool, Say("must be a boolean", "invalid_type")]


def base64_bytes(value: Any, param: str) -> bytes:
    """The bytes of a base64 JSON string (strict: standard alphabet, padding)."""
    if not isinstance(value, str):
        raise Refusal(param, f"must be a base64 string, got {type(value).__name__}", "invalid_type")
    if type(value) is Base64Text:  # decoded already, as it was read (embeds_json)
        return value.decoded
    try:
        return pybase64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise Refusal(param, "is not valid base64 (standard alphabet, with padding)", "invalid_base64") from None


def decode_base64(value: Any, param: str) -> bytes:
    """``base64_bytes`` for a route that checks a body field by field: a 400 naming ``param``."""
    try:
        return base64_bytes(value, param)
    except Refusal as r:
        raise bad_request(r.param, r.message, r.code) from None


def embeds_source(value: Any, param: str) -> bytes | inference_pb2.PromptEmbeds:
    """A base64 torch.save/safetensors string -> its bytes; {"id": "emb-..."} of a tensor uploaded to
    /v1/prompt_embeds -> the message naming it. Refusals name ``param`` (relative to the struct checked)."""
    if isinstance(value, dict):
        key = value.get("id")
        if not isinstance(key, str) or not key:
            raise Refusal(join(param, "id"), "must be the id returned by POST /v1/prompt_embeds", "missing")
        return inference_pb2.PromptEmbeds(cache_id=key)
    return base64_bytes(value, param)


def schema_text(value: Any, param: str) -> str:
    """A JSON schema (object, or JSON text of one) checked as a schema -> its JSON text."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise Refusal(param, "must be a JSON schema (an object, or a string of JSON)", "invalid_value") from None
    if not isinstance(value, dict):
        raise Refusal(param, "must be a JSON schema (an object)", "invalid_type")
    if json_depth.too_deep(value):
        raise Refusal(param, f"is nested more than {json_depth.MAX_JSON_DEPTH} levels deep", "invalid_schema")
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a base dependency; the preprocessor checks again regardless
        pass
    else:
        try:
            jsonschema.Draft202012Validator.check_schema(value)
        except jsonschema.SchemaError as e:
            raise Refusal(param, f"is not a valid JSON schema: {e.message}", "invalid_schema") from None
    return orjson.dumps(value).decode()


def token_ids(ids: list[int], param: str, message: str) -> list[int]:
    """Token ids must fit the proto's int32; whether they are in the vocabulary is the preprocessor's rule."""
    if any(not INT32_MIN <= t <= INT32_MAX for t in ids):
        raise Refusal(param, message, "invalid_value")
    return ids


# --- the parameters both completion routes know ----------------------------------------------------------------------
UNKNOWN = "is not a parameter this server knows; remove it (see docs/openai-fields.md for the accepted ones)"

IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
"""Accepted and ignored (they change nothing a client can observe here; ``store`` only when false); listed in
docs/openai-fields.md."""


def unsupported(name: str, is_set: Callable[[Any], bool], why: str) -> Check:
    """A parameter of OpenAI's API this server does not implement: refused unless it has a neutral value (those
    whose neutral values are a type, like ``Store``, say it in their type instead)."""
    def check(obj: Any) -> None:
        if is_set(getattr(obj, name)):
            raise Refusal(name, why, "unsupported_parameter")
    return check


def _no(why: str) -> Say:
    return Say(f"is not supported by this server{why}", "unsupported_parameter")


# Unsupported parameters whose neutral values are a type: null, or the one value that changes nothing.
Store = Annotated[Literal[False], _no(": it stores no completions (only false is accepted)")]
MinP = Annotated[float, Meta(ge=0.0, le=0.0), _no(" (top_k and top_p are; only 0 is accepted)")]
Suffix = Annotated[Literal[""], _no(": it does no insertion (fill-in-the-middle) completion")]
FunctionCall = Annotated[None, _no(": use tool_choice")]
Audio = Annotated[None, _no(": it generates text only")]
Prediction = Annotated[None, _no(" (no predicted outputs)")]
WebSearch = Annotated[None, _no(" (no web search)")]


class StreamOptions(msgspec.Struct):
    """Not a ``Model``: refused as a whole, in the words of the field that holds it."""

    include_usage: bool = False


def _temperature_message(v: Any, obj: Any) -> str:
    return TEMPERATURE_RANGE if is_num(v) and v > TEMPERATURE_MAX else f"must be a number >= {TEMPERATURE_MIN:g}"


def _temperature_code(v: Any, obj: Any) -> str:
    return "out_of_range" if is_num(v) and v > TEMPERATURE_MAX else "invalid_value"


def _stop_message(v: Any, obj: Any) -> str:
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return f"at most {MAX_STOP} stop strings"
    return "must be a string or a list of strings"


def _stop_code(v: Any, obj: Any) -> str:
    return "invalid_value" if isinstance(v, list) and all(isinstance(x, str) for x in v) else "invalid_type"


def _lowest_max_tokens(obj: Any) -> int:
    """max_tokens 0 scores the prompt only (echo), as OpenAI's completions allow."""
    return 0 if getattr(obj, "echo", None) is True else 1


def _max_tokens_message(v: Any, obj: Any) -> str:
    return f"must be an integer >= {_lowest_max_tokens(obj)}"


def type_or_value(v: Any, obj: Any) -> str:
    return "invalid_value" if is_int(v) else "invalid_type"


MaxTokens = int_field(0, UINT32_MAX, _max_tokens_message, type_or_value)
Penalty = float_field(f"must be a number in [{PENALTY_MIN:g}, {PENALTY_MAX:g}]", ge=PENALTY_MIN, le=PENALTY_MAX)
Logprobs = int_field(0, MAX_LOGPROBS, f"must be an integer in [0, {MAX_LOGPROBS}]")


def check_max_tokens(obj: Any) -> None:
    if obj.max_tokens is not None and obj.max_tokens < _lowest_max_tokens(obj):
        raise Refusal("max_tokens", f"must be an integer >= {_lowest_max_tokens(obj)}", "invalid_value")


def _check_logit_bias(obj: Any) -> None:
    """-> {token id: bias}."""
    bias = obj.logit_bias
    if bias is None:
        return
    if len(bias) > MAX_LOGIT_BIAS:
        raise Refusal("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} token ids", "invalid_value")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise Refusal("logit_bias", f"key {key!r} is not a token id (an integer)", "invalid_value") from None
        if not 0 <= token <= INT32_MAX:
            raise Refusal("logit_bias", f"token id {key} is outside the vocabulary", "invalid_value")
        if not is_num(value) or not LOGIT_BIAS_MIN <= value <= LOGIT_BIAS_MAX:
            raise Refusal("logit_bias", f"the bias of token {key} must be a number in [{LOGIT_BIAS_MIN:g}, "
                                        f"{LOGIT_BIAS_MAX:g}]", "invalid_value")
        out[token] = float(value)
    obj.logit_bias = out


# Output constraints: each check leaves its field as a list of (kind, value) for the StructuredOutput message
# ("json_schema" with the schema's JSON text, "json_object", "regex", "choice", "grammar"); [] = none.
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _constraint(kind: str, value: Any, param: str) -> tuple[str, Any]:
    if kind == "json":
        return "json_schema", schema_text(value, param)
    if kind == "json_object":
        if value is not True:
            raise Refusal(param, "must be true", "invalid_value")
        return "json_object", True
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise Refusal(param, "must be a non-empty list of non-empty strings", "invalid_value")
        return "choice", value
    if not isinstance(value, str) or not value:
        raise Refusal(param, "must be a non-empty string", "invalid_value")
    return kind, value


def _check_response_format(obj: Any) -> None:
    fmt = obj.response_format
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise Refusal("response_format", 'must be {"type": "text"}, {"type": "json_object"} or '
                                         '{"type": "json_schema", "json_schema": {...}}', "invalid_value")
    if fmt["type"] == "json_object":
        obj.response_format = [("json_object", True)]
    elif fmt["type"] == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise Refusal("response_format.json_schema.schema", "is required: the JSON schema the output must "
                                                                "follow", "missing")
        obj.response_format = [("json_schema", schema_text(spec["schema"], "response_format.json_schema.schema"))]
    else:
        obj.response_format = []


def _check_structured_outputs(obj: Any) -> None:
    so = obj.structured_outputs
    if so is None:
        return
    if not isinstance(so, dict):
        raise Refusal("structured_outputs", "must be an object with one of json, regex, choice, grammar, "
                                            "json_object", "invalid_type")
    set_keys = [k for k, v in so.items() if v is not None and v is not False]
    for k in set_keys:
        if k not in _KINDS:
            raise Refusal(f"structured_outputs.{k}", "is not a constraint this server knows (json, regex, choice, "
                                                     "grammar, json_object)", "unknown_parameter")
    if len(set_keys) > 1:
        raise Refusal("structured_outputs", "must set exactly one of json, regex, choice, grammar, json_object",
                      "invalid_value")
    obj.structured_outputs = [(f"structured_outputs.{k}", _constraint(k, so[k], f"structured_outputs.{k}"))
                              for k in set_keys]


def _guided(name: str, kind: str) -> Check:
    def check(obj: Any) -> None:
        value = getattr(obj, name)
        if value is not None:
            setattr(obj, name, _constraint(kind, value, name))
    return check


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _check_one_constraint(obj: Any) -> None:
    """At most one output constraint among response_format, structured_outputs and the guided_* fields."""
    if (obj.response_format is None and obj.structured_outputs is None and obj.guided_json is None
            and obj.guided_regex is None and obj.guided_choice is None and obj.guided_grammar is None):
        return
    found = [("response_format", c) for c in obj.response_format or ()] + (obj.structured_outputs or [])
    found += [(name, getattr(obj, name)) for name in _GUIDED if getattr(obj, name) is not None]
    if len(found) > 1:
        raise Refusal(found[1][0], f"cannot be combined with {found[0][0]}: give one output constraint",
                      "invalid_value")
    obj.structured_outputs = found[0][1] if found else None


# The field types both completion routes share (each model lists its fields in the order they are checked).
MAX_MODEL_NAME = 256
"""Longest model name a request may give (the preprocessor holds names to the same bound): a longer one is refused
before it is looked up, echoed or sent on."""


def model_field(required: str) -> Any:
    """A request's ``model``: a non-empty string of at most ``MAX_MODEL_NAME`` characters."""
    def message(value: Any, _obj: Any) -> str:
        if isinstance(value, str) and len(value) > MAX_MODEL_NAME:
            return f"must be at most {MAX_MODEL_NAME} characters (got {len(value)})"
        return required

    def code(value: Any, _obj: Any) -> str:
        return "too_long" if isinstance(value, str) and len(value) > MAX_MODEL_NAME else "missing"

    return Annotated[str, Meta(min_length=1, max_length=MAX_MODEL_NAME), Say(message, code)]


Model_ = model_field("is required (a served model name; see GET /v1/models)")
N = int_field(1, UINT32_MAX, "must be an integer >= 1")
Stream = Annotated[StreamOptions, Say('must be an object like {"include_usage": true}', "invalid_type")]
Temperature = float_field(_temperature_message, _temperature_code, ge=TEMPERATURE_MIN, le=TEMPERATURE_MAX)
TopP = float_field(f"must be a number in (0, {TOP_P_MAX:g}]", gt=0.0, le=TOP_P_MAX)
TopK = int_field(-1, UINT32_MAX, "must be an integer >= 0 (-1 or 0 disables it)")
Seed = int_field(SEED_MIN, SEED_MAX, "must be a 64-bit integer", "invalid_type")
Stop = Annotated[str | Annotated[list[str], Meta(max_length=MAX_STOP)], Say(_stop_message, _stop_code)]
RepetitionPenalty = float_field(f"must be a number in (0, {REPETITION_PENALTY_MAX:g}] (1 = none)", gt=0.0,
                          le=REPETITION_PENALTY_MAX)
MinTokens = int_field(0, UINT32_MAX, "must be an integer >= 0")
LogitBias = Annotated[dict[str, Any], Say('must be an object mapping token ids to a bias, like {"50256": -100}',
                                          "invalid_type")]


def sampling_checks() -> dict[str, Check]:
    """The checks after the sampling fields, in order; the last one also refuses two output constraints."""
    guided_grammar = _guided("guided_grammar", "grammar")

    def last(obj: Any) -> None:
        if obj.guided_grammar is not None:
            guided_grammar(obj)
        _check_one_constraint(obj)

    return {"logit_bias": _check_logit_bias, "response_format": _check_response_format,
            "structured_outputs": _check_structured_outputs, "guided_json": _guided("guided_json", "json"),
            "guided_regex": _guided("guided_regex", "regex"), "guided_choice": _guided("guided_choice", "choice"),
            "guided_grammar": last}

