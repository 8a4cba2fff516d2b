"""How a REST body is checked: the typed models' base (msgspec ``Struct``s), and the one way a refused body becomes
an OpenAI 400 naming its ``param``. The route areas' models live beside this module (``completion``, ``chat``,
``embedding``, ``adapter``, ``upload``), the field types they share in ``fields``.

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

import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, TypeVar, Union

import msgspec

from embedmesh.gateway.errors import ApiError, bad_request

__all__ = ["Say", "Refusal", "Check", "Model", "parse", "parse_item", "join", "known_fields"]


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


def join(prefix: str, param: str) -> str:
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
        raise Refusal(join(param, err.param or ""), _unprefixed(err), err.code or "invalid_value") from None


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
                return bad_request(join(prefix, name), model.unknown, "unknown_parameter")
    obj = _Partial()
    for name, _, default in _fields(model):
        value = body.get(name, _MISSING)
        setattr(obj, name, value if value is not _MISSING else default)
    checks = model.checks
    for name, tp, default in _fields(model):
        value = body.get(name, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                return _say(tp).error(join(prefix, name), None, obj)
        else:
            try:
                setattr(obj, name, msgspec.convert(value, tp))
            except msgspec.ValidationError:
                return _refused(tp, value, join(prefix, name), obj, None) or \
                    _say(tp).error(join(prefix, name), value, obj)
        check = checks.get(name)
        if check is not None and (name in model.always or getattr(obj, name) is not None):
            try:
                check(obj)
            except Refusal as r:
                return bad_request(join(prefix, r.param), r.message, r.code)
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
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _refused(typing.get_args(tp)[0], value, param, obj, _find_say(tp) or say)
    if origin in (Union, types.UnionType):
        return _refused_union(tp, value, param, obj, say)
    if origin is list:
        return _refused_list(tp, value, param, obj, say)
    if _is_model(tp):
        return _refused_model(tp, value, param, obj, say)
    return None


def _refused_model(model: type[Model], value: Any, param: str, obj: Any, say: Say | None) -> ApiError | None:
    """A model's value: refused as a whole unless it is an object, else walked."""
    if not isinstance(value, dict):
        return (say or _say(model)).error(param, value, obj)
    return _walk(model, value, param)


def _refused_union(tp: Any, value: Any, param: str, obj: Any, say: Say | None) -> ApiError | None:
    some = [m for m in typing.get_args(tp) if m is not type(None)]
    if len(some) == 1:
        return _refused(some[0], value, param, obj, say)
    members = [_strip(m) for m in some]
    models = [m for m in members if _is_model(m)]
    if models and len(models) == len(members):  # a tagged union of models: the member its tag names
        tag = value.get(models[0].__struct_config__.tag_field) if isinstance(value, dict) else _MISSING
        match = [m for m in models if m.__struct_config__.tag == tag]
        if not match:
            return (say or _say(tp)).error(param, value, obj)
        return _walk(match[0], value, param)
    for m in typing.get_args(tp):  # the member shaped like the value (a list, or an object for a model)
        base = _strip(m)
        if (isinstance(value, list) and typing.get_origin(base) is list) or (isinstance(value, dict)
                                                                             and _is_model(base)):
            return _refused(m, value, param, obj, say)
    return None


def _refused_list(tp: Any, value: Any, param: str, obj: Any, say: Say | None) -> ApiError | None:
    """The first item refused, by its own place (``param[i]``)."""
    (item,) = typing.get_args(tp)
    if not isinstance(value, list):
        return None
    for i, x in enumerate(value):
        try:
            msgspec.convert(x, item)
        except msgspec.ValidationError:
            return _refused(item, x, f"{param}[{i}]", obj, None) or _say(item, say).error(f"{param}[{i}]", x, obj)
    return None


def known_fields(model: type[Model]) -> frozenset[str]:
    """Every field a body of ``model`` may carry."""
    return frozenset(model.__struct_fields__)
