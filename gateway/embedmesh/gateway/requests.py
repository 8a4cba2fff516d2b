"""The REST routes' JSON bodies as typed models (msgspec ``Struct``s), and the one way a refused body becomes an
OpenAI 400 naming its ``param``.

A model declares each field of a body, in the order its checks run, with its type, its range (``Meta``; the
sampling ranges are ``core/sampling.py``'s constants) and its wording (``Say``: the message and ``code`` of its
400). What a type cannot say — a value that depends on another field, a JSON schema to check, base64 to decode —
is a *check* (``checks``): a function run after the field it names, which may replace the field's value with
its checked form (the decoded bytes, the schema's JSON text) and refuses with ``Refusal``.

``parse(Model, body)``:

1. ``msgspec.convert(body, Model)``: types and ranges in C, then each struct's checks in order (``__post_init__``).
   The common, valid body takes this path only.
2. When that refuses anything, ``_walk`` goes through the model field by field in its declared order, with the
   same types, wordings and checks, and raises the first refusal as ``errors.bad_request(param, message, code)``
   — so the error a body gets does not depend on the order of its JSON keys, and each message is written once,
   beside its field. ``param`` is the field's path as OpenAI spells it (``messages[0].content[1].data``).

A field typed ``Any`` is one whose JSON shapes overlap in ways a type cannot tell apart (``prompt``: a string, a
list of strings, of token ids or of token-id lists) or whose accepted values are not a type (``encoding_format``
treats every falsy value as the default); its check does the rest.
"""

from __future__ import annotations

import binascii
import math
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

import msgspec
import orjson
import pybase64
from msgspec import Meta

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
from embedmesh.gateway.errors import ApiError, bad_request
from embedmesh.inference.v1 import inference_pb2

__all__ = [
    "Say",
    "Refusal",
    "parse",
    "parse_item",
    "CompletionRequest",
    "ChatRequest",
    "EmbeddingsRequest",
    "LoadLoraRequest",
    "UnloadLoraRequest",
    "PromptEmbedsUpload",
    "decode_base64",
    "known_fields",
    "IGNORED_FIELDS",
]

UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


# --- wording and refusals -----------------------------------------------------------------------------------------
class Say:
    """How a field's refusal reads: ``message`` and ``code``, each a constant or a function of the refused value and
    the body being checked (``None`` for a missing field). ``sub`` is added to the field's param (``".type"``)."""

    __slots__ = ("message", "code", "sub")

    def __init__(self, message: str | Callable[[Any, Any], str], code: str | Callable[[Any, Any], str] =
                 "invalid_value", sub: str | Callable[[Any], str] = "") -> None:
        self.message = message
        self.code = code
        self.sub = sub

    def error(self, param: str, value: Any, obj: Any) -> ApiError:
        message = self.message(value, obj) if callable(self.message) else self.message
        code = self.code(value, obj) if callable(self.code) else self.code
        sub = self.sub(value) if callable(self.sub) else self.sub
        return bad_request(param + sub, message, code)


class Refusal(ValueError):
    """A check's refusal: ``param`` relative to the struct being checked ("" = the struct itself). A ValueError, so
    msgspec reports it as a ValidationError while converting (and ``parse`` then walks the body for the error)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code


def _join(prefix: str, param: str) -> str:
    if not prefix:
        return param
    if not param:
        return prefix
    return prefix + param if param[0] == "[" else f"{prefix}.{param}"


Check = Callable[[Any], None]


class Model(msgspec.Struct, kw_only=True):
    """A body or a part of one. ``checks``: field name -> function of the struct, run after that field in declared
    order, skipped for a null field unless the field is in ``always``. ``unknown``: the wording for a field
    the model does not declare (None: ignored).

    ``__post_init__`` only has to find *whether* a body is refused (the walk then finds the first refusal), so it
    skips the checks of null fields; the checks still run in order, as some use what an earlier one left."""

    checks: ClassVar[dict[str, Check]] = {}
    always: ClassVar[frozenset[str]] = frozenset()
    unknown: ClassVar[str | None] = None

    _fast: ClassVar[tuple[tuple[str, Check, bool], ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._fast = tuple((name, check, name in cls.always) for name, check in cls.checks.items())

    def __post_init__(self) -> None:
        for name, check, always in self._fast:
            if always or getattr(self, name) is not None:
                check(self)


T = TypeVar("T", bound=Model)


def parse(model: type[T], body: dict[str, Any]) -> T:
    """``body`` checked as ``model``; the first refusal, in the model's order, as a 400 (module docstring)."""
    try:
        return msgspec.convert(body, model)
    except msgspec.ValidationError as e:
        err = _walk(model, body, "")
        if err is None:  # the model and its walk disagree: still a 400 naming the place msgspec names
            message, _, path = str(e).partition(" - at `$")
            err = bad_request(path.rstrip("`").lstrip(".") or "body", message, "invalid_value")
        raise err from None


def parse_item(model: type[T], value: Any, param: str, say: Say) -> T:
    """``value`` (one item of a list a check goes through) checked as ``model``; refusals name ``param`` (relative
    to the struct being checked), ``say`` words a value that is not an object."""
    if not isinstance(value, dict):
        raise Refusal(param, *_said(say, value))
    try:
        return msgspec.convert(value, model)
    except msgspec.ValidationError:
        err = _walk(model, value, "")
        if err is None:  # pragma: no cover - the model and its walk disagree
            raise
        raise Refusal(_join(param, err.param or ""), _unprefixed(err), err.code or "invalid_value") from None


def _said(say: Say, value: Any) -> tuple[str, str]:
    message = say.message(value, None) if callable(say.message) else say.message
    code = say.code(value, None) if callable(say.code) else say.code
    return message, code


def _unprefixed(err: ApiError) -> str:
    """The message of a 400 without the ``param: `` that ``bad_request`` put before it."""
    prefix = f"{err.param}: "
    return err.message[len(prefix):] if err.param and err.message.startswith(prefix) else err.message


# --- the walk: the same model, field by field, for the first refusal -----------------------------------------------
_MISSING: Any = object()


class _Partial:
    """The body as a check sees it during the walk: fields already checked hold their converted values, the others
    their raw JSON (or their default)."""


def _fields(model: type[Model]) -> tuple[tuple[str, Any, Any], ...]:
    cached = model.__dict__.get("_walk_fields")
    if cached is None:
        hints = typing.get_type_hints(model, include_extras=True)
        cached = tuple((f.name, hints[f.name], f.default if f.default is not msgspec.NODEFAULT else
                        (f.default_factory() if f.default_factory is not msgspec.NODEFAULT else _MISSING))
                       for f in msgspec.structs.fields(model))
        model._walk_fields = cached  # type: ignore[attr-defined]
    return cached


def _walk(model: type[Model], body: Any, prefix: str) -> ApiError | None:
    if model.unknown is not None:
        names = {name for name, _, _ in _fields(model)}
        for name in body:
            if name not in names:
                return bad_request(_join(prefix, name), model.unknown, "unknown_parameter")
    obj = _Partial()
    for name, _, default in _fields(model):
        value = body.get(name, _MISSING)
        setattr(obj, name, value if value is not _MISSING else default)
    checks = model.checks
    for name, tp, default in _fields(model):
        value = body.get(name, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                return _say(tp).error(_join(prefix, name), None, obj)
        else:
            try:
                setattr(obj, name, msgspec.convert(value, tp))
            except msgspec.ValidationError:
                return _refused(tp, value, _join(prefix, name), obj, None) or \
                    _say(tp).error(_join(prefix, name), value, obj)
        check = checks.get(name)
        if check is not None and (name in model.always or getattr(obj, name) is not None):
            try:
                check(obj)
            except Refusal as r:
                return bad_request(_join(prefix, r.param), r.message, r.code)
    return None


def _say(tp: Any, say: Say | None = None) -> Say:
    """The nearest wording of a type (the outermost ``Say`` in its annotations)."""
    found = _find_say(tp)
    return found or say or Say("has the wrong type", "invalid_type")


def _find_say(tp: Any) -> Say | None:
    if typing.get_origin(tp) is Annotated:
        for m in tp.__metadata__:
            if isinstance(m, Say):
                return m
        return _find_say(typing.get_args(tp)[0])
    if typing.get_origin(tp) in (Union, types.UnionType):
        for member in typing.get_args(tp):
            if member is not type(None) and (found := _find_say(member)) is not None:
                return found
    return None


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Model)


def _structural(tp: Any) -> bool:
    """Whether a type holds models (which the walk enters)."""
    tp = _strip(tp)
    if _is_model(tp):
        return True
    return any(_structural(a) for a in typing.get_args(tp)) if typing.get_origin(tp) in (list, Union,
                                                                                          types.UnionType) else False


def _refused(tp: Any, value: Any, param: str, obj: Any, say: Say | None) -> ApiError | None:
    """Where inside a structured value (models, lists of them, tagged unions of them) the refusal lies; None when
    the value is refused as a whole (its ``Say`` then tells why)."""
    if not _structural(tp):
        return None
    if typing.get_origin(tp) is Annotated:
        return _refused(typing.get_args(tp)[0], value, param, obj, _find_say(tp) or say)
    if typing.get_origin(tp) in (Union, types.UnionType):
        some = [m for m in typing.get_args(tp) if m is not type(None)]
        if len(some) == 1:
            return _refused(some[0], value, param, obj, say)
        members = [_strip(m) for m in some]
        models = [m for m in members if _is_model(m)]
        if models and len(models) == len(members):  # a tagged union of models
            if not isinstance(value, dict):
                return (say or _say(tp)).error(param, value, obj)
            tag_field = models[0].__struct_config__.tag_field
            match = [m for m in models if m.__struct_config__.tag == value.get(tag_field)]
            if not match:
                return (say or _say(tp)).error(param, value, obj)
            return _walk(match[0], value, param)
        for m in typing.get_args(tp):
            base = _strip(m)
            if isinstance(value, list) and typing.get_origin(base) is list:
                return _refused(m, value, param, obj, say)
            if isinstance(value, dict) and _is_model(base):
                return _refused(m, value, param, obj, say)
        return None
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            return None
        for i, x in enumerate(value):
            try:
                msgspec.convert(x, item)
            except msgspec.ValidationError:
                return _refused(item, x, f"{param}[{i}]", obj, None) or _say(item, say).error(f"{param}[{i}]", x,
                                                                                               obj)
        return None
    if _is_model(tp):
        if not isinstance(value, dict):
            return (say or _say(tp)).error(param, value, obj)
        return _walk(tp, value, param)
    return None


# --- shared pieces ------------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
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


def _base64(value: Any, param: str) -> bytes:
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
    """``_base64`` for a route that checks a body field by field: a 400 naming ``param``."""
    try:
        return _base64(value, param)
    except Refusal as r:
        raise bad_request(r.param, r.message, r.code) from None


def embeds_source(value: Any, param: str) -> bytes | inference_pb2.PromptEmbeds:
    """A base64 torch.save/safetensors string -> its bytes; {"id": "emb-..."} of a tensor uploaded to
    /v1/prompt_embeds -> the message naming it. Refusals name ``param`` (relative to the struct checked)."""
    if isinstance(value, dict):
        key = value.get("id")
        if not isinstance(key, str) or not key:
            raise Refusal(_join(param, "id"), "must be the id returned by POST /v1/prompt_embeds", "missing")
        return inference_pb2.PromptEmbeds(cache_id=key)
    return _base64(value, param)


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema (object, or JSON text of one) checked as a schema -> its JSON text."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            raise Refusal(param, "must be a JSON schema (an object, or a string of JSON)", "invalid_value") from None
    if not isinstance(value, dict):
        raise Refusal(param, "must be a JSON schema (an object)", "invalid_type")
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


def _token_ids(ids: list[int], param: str, message: str) -> list[int]:
    """Token ids must fit the proto's int32; whether they are in the vocabulary is the preprocessor's rule."""
    if any(not INT32_MIN <= t <= INT32_MAX for t in ids):
        raise Refusal(param, message, "invalid_value")
    return ids


# --- /v1/completions and /v1/chat/completions ---------------------------------------------------------------------
_UNKNOWN = "is not a parameter this server knows; remove it (see docs/openai-fields.md for the accepted ones)"

IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
"""Accepted and ignored (they change nothing a client can observe here; ``store`` only when false); listed in
docs/openai-fields.md."""


def _unsupported(name: str, is_set: Callable[[Any], bool], why: str) -> Check:
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
    return TEMPERATURE_RANGE if _is_num(v) and v > TEMPERATURE_MAX else f"must be a number >= {TEMPERATURE_MIN:g}"


def _temperature_code(v: Any, obj: Any) -> str:
    return "out_of_range" if _is_num(v) and v > TEMPERATURE_MAX else "invalid_value"


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


def _type_or_value(v: Any, obj: Any) -> str:
    return "invalid_value" if _is_int(v) else "invalid_type"


_MaxTokens = int_field(0, UINT32_MAX, _max_tokens_message, _type_or_value)
_Penalty = float_field(f"must be a number in [{PENALTY_MIN:g}, {PENALTY_MAX:g}]", ge=PENALTY_MIN, le=PENALTY_MAX)
_Logprobs = int_field(0, MAX_LOGPROBS, f"must be an integer in [0, {MAX_LOGPROBS}]")


def _check_max_tokens(obj: Any) -> None:
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
        if not _is_num(value) or not LOGIT_BIAS_MIN <= value <= LOGIT_BIAS_MAX:
            raise Refusal("logit_bias", f"the bias of token {key} must be a number in [{LOGIT_BIAS_MIN:g}, "
                                        f"{LOGIT_BIAS_MAX:g}]", "invalid_value")
        out[token] = float(value)
    obj.logit_bias = out


# Output constraints: each check leaves its field as a list of (kind, value) for the StructuredOutput message
# ("json_schema" with the schema's JSON text, "json_object", "regex", "choice", "grammar"); [] = none.
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _constraint(kind: str, value: Any, param: str) -> tuple[str, Any]:
    if kind == "json":
        return "json_schema", _schema_text(value, param)
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
        obj.response_format = [("json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema"))]
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
Model_ = Annotated[str, Meta(min_length=1), Say("is required (a served model name; see GET /v1/models)", "missing")]
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


def _sampling_checks() -> dict[str, Check]:
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


_COMPLETION_UNSUPPORTED = {
    "best_of": _unsupported("best_of", lambda v: v not in (None, 1), "is not supported by this server: only 1 is "
                                                                     "accepted (use n)"),
}


def _check_prompt_embeds(obj: Any) -> None:
    """-> a list of sources (decoded bytes, or the message naming an upload), or None."""
    embeds = obj.prompt_embeds
    if embeds == [] and obj.prompt not in (None, "", []):
        embeds = None  # vLLM: an empty list beside a text prompt means no embeddings
    if embeds is None:
        obj.prompt_embeds = None
        return
    items = [embeds] if isinstance(embeds, str | dict) else embeds
    if not isinstance(items, list) or not items:
        raise Refusal("prompt_embeds", "must be a base64 string or a non-empty list of them", "invalid_type")
    single = not isinstance(embeds, list) or len(items) == 1
    obj.prompt_embeds = [embeds_source(item, "prompt_embeds" if single else f"prompt_embeds[{i}]")
                         for i, item in enumerate(items)]


def _check_prefix(obj: Any) -> None:
    if obj.prompt_embeds_prefix is not None:
        obj.prompt_embeds_prefix = embeds_source(obj.prompt_embeds_prefix, "prompt_embeds_prefix")


_PROMPT_SHAPES = "must be a string, a list of strings, a list of token ids or a list of token-id lists"
_IDS = "token ids must be integers in [0, vocabulary size)"


def _check_prompt(obj: Any) -> None:
    """-> (texts, token-id lists). ``prompt=""`` (or only empty strings) beside prompt_embeds is dropped: the openai
    SDK requires a prompt."""
    prompt = obj.prompt
    if prompt is None:
        return
    texts: list[str] = []
    ids: list[list[int]] = []
    if isinstance(prompt, str):
        if prompt or not obj.prompt_embeds:
            texts.append(prompt)
    elif isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            if any(prompt) or not obj.prompt_embeds:
                texts = prompt
        elif all(_is_int(p) for p in prompt):
            ids.append(_token_ids(prompt, "prompt", _IDS))
        elif all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            ids = [_token_ids(p, "prompt" if len(prompt) == 1 else f"prompt[{i}]", _IDS) for i, p in enumerate(prompt)]
        else:
            raise Refusal("prompt", _PROMPT_SHAPES, "invalid_type")
    else:
        raise Refusal("prompt", _PROMPT_SHAPES, "invalid_type")
    obj.prompt = (texts, ids)


class CompletionRequest(Model, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/completions``. After ``parse``: ``structured_outputs`` is the one output constraint (kind, value)
    or None, ``logit_bias`` {token id: bias}, ``prompt_embeds`` a list of sources or None, ``prompt`` (texts,
    token-id lists)."""

    unknown = _UNKNOWN
    model: Model_
    store: Store | None = None
    min_p: MinP | None = None
    suffix: Suffix | None = None
    best_of: Any = None
    n: N | None = None
    stream: Bool | None = None
    stream_options: Stream | None = None
    max_tokens: _MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    ignore_eos: Bool | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MinTokens | None = None
    logit_bias: LogitBias | None = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    echo: Bool | None = None
    logprobs: _Logprobs | None = None
    prompt_logprobs: _Logprobs | None = None
    prompt_embeds: Any = None
    prompt_embeds_prefix: Any = None
    prompt: Any = None
    user: Any = None
    metadata: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None

    checks = {**_COMPLETION_UNSUPPORTED, "max_tokens": _check_max_tokens, **_sampling_checks(),
              "prompt_embeds": _check_prompt_embeds, "prompt_embeds_prefix": _check_prefix, "prompt": _check_prompt}
    always = frozenset({"guided_grammar"})


# Chat messages ------------------------------------------------------------------------------------------------------
class TextPart(Model, kw_only=True, tag_field="type", tag="text"):
    text: Annotated[str, Say("is required for a text part", "missing")]


def _check_embeds_part(obj: Any) -> None:
    """-> ``data`` holds the source (decoded bytes, or the message naming an upload)."""
    if obj.id is not None:
        obj.data = embeds_source({"id": obj.id}, "")
    elif obj.data is None:
        raise Refusal("data", "is required for a prompt_embeds part (base64 of torch.save(tensor)), or give the id "
                              "of an upload", "missing")
    else:
        obj.data = embeds_source(obj.data, "data")


class EmbedsPart(Model, kw_only=True, tag_field="type", tag="prompt_embeds"):
    id: Any = None
    data: Any = None

    checks = {"data": _check_embeds_part}
    always = frozenset({"data"})


def _part_message(v: Any, obj: Any) -> str:
    if not isinstance(v, dict):
        return "must be an object with a type"
    return (f"unsupported content part type {v.get('type')!r}; this server accepts 'text' and 'prompt_embeds'")


Part = Annotated[TextPart | EmbedsPart, Say(_part_message, lambda v, o: "unsupported_type" if isinstance(v, dict)
                                            else "invalid_type", lambda v: ".type" if isinstance(v, dict) else "")]


def _check_tool_calls(obj: Any) -> None:
    """-> a list of ToolCall messages, or None."""
    calls = obj.tool_calls
    if calls is None:
        return
    if obj.role != "assistant" or not isinstance(calls, list):
        raise Refusal("tool_calls", "must be a list, on an assistant message", "invalid_value")
    out = []
    for j, call in enumerate(calls):
        where = f"tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise Refusal(f"{where}.function.name", "is required", "missing")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise Refusal(f"{where}.function.arguments", "must be a string of JSON", "invalid_type")
        cid = call.get("id", "")
        if not isinstance(cid, str):
            raise Refusal(f"{where}.id", "must be a string", "invalid_type")
        out.append(inference_pb2.ToolCall(id=cid, name=fn["name"], arguments=args))
    obj.tool_calls = out


def _check_tool_call_id(obj: Any) -> None:
    if obj.role == "tool":
        cid = obj.tool_call_id
        if not isinstance(cid, str) or not cid:
            raise Refusal("tool_call_id", "is required for a tool message: the id of the call it answers", "missing")


def _check_content(obj: Any) -> None:
    if obj.content is None and obj.role != "assistant":
        raise Refusal("content", "must be a string or a list of content parts", "invalid_type")


class Message(Model, kw_only=True):
    role: Annotated[str, Say("is required", "missing")]
    name: Annotated[str, Say("must be a string", "invalid_type")] | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    content: Annotated[str | list[Part], Say("must be a string or a list of content parts", "invalid_type")] | None \
        = None

    checks = {"tool_calls": _check_tool_calls, "tool_call_id": _check_tool_call_id, "content": _check_content}
    always = frozenset({"tool_call_id", "content"})


# Tools ---------------------------------------------------------------------------------------------------------------
def _check_parameters(obj: Any) -> None:
    """-> the schema's JSON text."""
    if obj.parameters is not None:
        obj.parameters = _schema_text(obj.parameters, "parameters")


ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$"), Say("is required: 1-64 letters, digits, '_' or '-'",
                                                                      lambda v, o: "missing" if v is None
                                                                      else "invalid_value")]
ToolType = Annotated[Literal["function"], Say('must be "function"')]


class Function(Model, kw_only=True):
    name: ToolName
    description: Annotated[str, Say("must be a string", "invalid_type")] = ""
    parameters: Any = None
    strict: Bool | None = None

    checks = {"parameters": _check_parameters}


class Tool(Model, kw_only=True):
    type: ToolType = "function"
    function: Annotated[Function, Say("is required", "missing")]


class _FunctionName(Model, kw_only=True):
    name: ToolName


class _ToolName(Model, kw_only=True):
    """A tool up to its function's name: a name given twice is refused before the rest of that tool is read."""

    type: ToolType = "function"
    function: Annotated[_FunctionName, Say("is required", "missing")]


_NOT_A_TOOL = Say('must be "function"')


def _check_tools(obj: Any) -> None:
    """-> a list of Tool."""
    tools = obj.tools
    if not isinstance(tools, list):
        raise Refusal("tools", 'must be a list of {"type": "function", "function": {...}}', "invalid_type")
    names: set[str] = set()
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise Refusal(f"{where}.type", 'must be "function"')
        name = parse_item(_ToolName, t, where, _NOT_A_TOOL).function.name
        if name in names:
            raise Refusal(f"{where}.function.name", f"{name!r} is given twice", "invalid_value")
        names.add(name)
        out.append(parse_item(Tool, t, where, _NOT_A_TOOL))
    obj.tools = out


_CHOICE = "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"


def _check_tool_choice(obj: Any) -> None:
    """-> ("mode", "none"/"auto"/"required"), ("function", name) or None."""
    choice = obj.tool_choice
    if choice is None:
        return
    names = [t.function.name for t in obj.tools or ()]
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise Refusal("tool_choice", _CHOICE, "invalid_value")
        if choice != "none" and not names:
            raise Refusal("tool_choice", f"{choice!r} needs tools", "invalid_value")
        obj.tool_choice = ("mode", choice)
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise Refusal("tool_choice", _CHOICE, "invalid_value")
    if name not in names:
        raise Refusal("tool_choice", f"names the function {name!r}, which is not among the tools", "invalid_value")
    obj.tool_choice = ("function", name)


def _check_chat_max_tokens(obj: Any) -> None:
    """``max_tokens`` counts only without ``max_completion_tokens`` (which replaces it in OpenAI's chat API)."""
    v = obj.max_tokens
    if obj.max_completion_tokens is None and v is not None and (not _is_int(v) or not 1 <= v <= UINT32_MAX):
        raise Refusal("max_tokens", "must be an integer >= 1", "invalid_value" if _is_int(v) else "invalid_type")


def _check_top_logprobs(obj: Any) -> None:
    if obj.top_logprobs is not None and obj.logprobs is not True:
        raise Refusal("top_logprobs", "needs logprobs: true", "invalid_value")


_CHAT_UNSUPPORTED = {
    "functions": _unsupported("functions", bool, "is not supported by this server: use tools (the functions API is "
                                                 "deprecated)"),
    "modalities": _unsupported("modalities", lambda v: v not in (None, ["text"]), "is not supported by this server: "
                                                                                  "it generates text only"),
}


class ChatRequest(Model, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/chat/completions``. After ``parse``: as ``CompletionRequest`` for the sampling fields;
    ``tool_choice`` ("mode", m), ("function", name) or None; each tool's ``function.parameters`` the schema's JSON
    text; each message's ``tool_calls`` ToolCall messages and each prompt_embeds part's ``data`` its source."""

    unknown = _UNKNOWN
    model: Model_
    store: Store | None = None
    min_p: MinP | None = None
    functions: Any = None
    function_call: FunctionCall = None
    audio: Audio = None
    modalities: Any = None
    prediction: Prediction = None
    web_search_options: WebSearch = None
    n: N | None = None
    stream: Bool | None = None
    stream_options: Stream | None = None
    max_completion_tokens: int_field(1, UINT32_MAX, "must be an integer >= 1", _type_or_value) | None = None
    max_tokens: Any = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    ignore_eos: Bool | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MinTokens | None = None
    logit_bias: LogitBias | None = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    logprobs: Annotated[bool, Say("must be a boolean (use top_logprobs for alternatives)", "invalid_type")] | None \
        = None
    top_logprobs: _Logprobs | None = None
    tools: Any = None
    tool_choice: Any = None
    messages: Annotated[list[Annotated[Message, Say("must be an object with role and content", "invalid_type")]],
                        Meta(min_length=1), Say("must be a non-empty list of messages")]
    user: Any = None
    metadata: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None

    checks = {**_CHAT_UNSUPPORTED, "max_tokens": _check_chat_max_tokens, **_sampling_checks(),
              "top_logprobs": _check_top_logprobs, "tools": _check_tools, "tool_choice": _check_tool_choice}
    always = frozenset({"guided_grammar"})


# --- /v1/embeddings -----------------------------------------------------------------------------------------------
def _check_input(obj: Any) -> None:
    """-> a list of EmbedInput messages."""
    raw = obj.input
    if isinstance(raw, str):
        out = [inference_pb2.EmbedInput(text=raw)]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        out = [inference_pb2.EmbedInput(text=x) for x in raw]
    elif isinstance(raw, list) and raw and all(_is_int(x) for x in raw):
        out = [inference_pb2.EmbedInput(token_ids=inference_pb2.TokenIds(
            ids=_token_ids(raw, "input", "token ids must fit in int32")))]
    elif isinstance(raw, list) and raw and all(isinstance(x, list) and all(_is_int(t) for t in x) for x in raw):
        out = [inference_pb2.EmbedInput(token_ids=inference_pb2.TokenIds(
            ids=_token_ids(x, "input" if len(raw) == 1 else f"input[{i}]", "token ids must fit in int32")))
            for i, x in enumerate(raw)]
    elif raw == [] or raw is None:
        raise Refusal("input", "must not be empty", "missing")
    else:
        raise Refusal("input", "must be a string, a list of strings, a list of token ids or a list of token-id lists",
                      "invalid_type")
    obj.input = out


def _check_encoding_format(obj: Any) -> None:
    """Any falsy value means the default, "float"."""
    fmt = obj.encoding_format or "float"
    if fmt not in ("float", "base64"):
        raise Refusal("encoding_format", f"must be 'float' or 'base64', got {fmt!r}", "invalid_value")
    obj.encoding_format = fmt


class EmbeddingsRequest(Model, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/embeddings``. After ``parse``: ``input`` is a list of EmbedInput messages, ``encoding_format``
    "float" or "base64"."""

    unknown = _UNKNOWN
    model: Annotated[str, Meta(min_length=1), Say("is required (an embedding model; see GET /v1/models)",
                                                  "missing")]
    input: Any = None
    encoding_format: Any = "float"
    dimensions: int_field(1, INT32_MAX, "must be a positive integer") | None = None
    user: Any = None

    checks = {"input": _check_input, "encoding_format": _check_encoding_format}
    always = frozenset({"input", "encoding_format"})


# --- /v1/load_lora_adapter, /v1/unload_lora_adapter ---------------------------------------------------------------
_NonEmpty = Annotated[str, Meta(min_length=1), Say("is required (a non-empty string)",
                                                   lambda v, o: "missing" if v is None else "invalid_type")]


def _check_workers(obj: Any) -> None:
    """Any falsy value means every worker ([])."""
    workers = obj.workers or []
    if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
        raise Refusal("workers", "must be a list of worker ids (see /health)", "invalid_type")
    obj.workers = workers


class LoadLoraRequest(Model, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``/v1/load_lora_adapter`` body (``load_inplace`` accepted and ignored)."""

    unknown = "is not a parameter of this route"
    workers: Any = None
    lora_name: _NonEmpty
    lora_path: _NonEmpty
    load_inplace: Any = None

    checks = {"workers": _check_workers}
    always = frozenset({"workers"})


class UnloadLoraRequest(Model, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``/v1/unload_lora_adapter`` body (``lora_int_id`` accepted and ignored)."""

    unknown = "is not a parameter of this route"
    lora_name: _NonEmpty
    lora_int_id: Any = None


# --- /v1/prompt_embeds --------------------------------------------------------------------------------------------
def _check_upload_data(obj: Any) -> None:
    """-> the decoded bytes of the tensor file."""
    obj.data = _base64(obj.data, "data")


class PromptEmbedsUpload(Model, kw_only=True):
    """``POST /v1/prompt_embeds``: ``data`` base64 of torch.save(tensor) or of a safetensors file (after ``parse``:
    its bytes), ``ttl_seconds`` an integer >= 1 or absent (the server's maximum is the preprocessor's rule). Other
    fields are ignored."""

    data: Any = None
    ttl_seconds: Annotated[int, Meta(ge=1), Say("must be an integer >= 1")] | None = None

    checks = {"data": _check_upload_data}
    always = frozenset({"data"})


def known_fields(model: type[Model]) -> frozenset[str]:
    """Every field a body of ``model`` may carry."""
    return frozenset(model.__struct_fields__)
