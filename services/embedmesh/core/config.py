"""One config mechanism for every process: a frozen dataclass is the schema; flags and env vars are derived from it.

A process's config is a frozen dataclass that subclasses :class:`Settings`, naming its service once::

    @dataclass(frozen=True)
    class RouterConfig(Settings, service="router", prog="embedmesh-router", description="Run the KV-aware router."):
        port: int = 50081
        \"\"\"gRPC port (0 = any free port).\"\"\"
        approx_ttl_seconds: float = option(120.0, flags=("--approx-ttl",), aliases=("EMBEDMESH_ROUTER_APPROX_TTL",))
        \"\"\"Workers without KV events: ...\"\"\"

        def __post_init__(self) -> None:   # every range rule, as ValueError
            ...

``RouterConfig.from_args(argv, env)`` then reads, for every field:

- its flag ``--field-name`` (plus any older spellings in ``flags``), converted by the field's type;
- else its environment variable ``EMBEDMESH_<SERVICE>_<FIELD>`` (``env=`` overrides the name), else the older or
  shared names in ``aliases`` in the order given;
- else the dataclass default.

**Precedence**: a flag beats every variable; the service's own variable beats its aliases (a shared variable such as
``EMBEDMESH_DRAIN_GRACE_SECONDS`` or ``EMBEDMESH_ROUTERS`` is the general setting, the service's own the specific
one); the first alias set wins among aliases. A variable set to the empty string counts as unset.

Types: ``str``, ``int``, ``float``, ``X | None`` (only a value can be given; unset = ``None``), ``bool`` (flag
``--x`` / ``--no-x``; variable 1/true/yes/on or 0/false/no/off, any case), ``tuple[str, ...]`` (a comma list, or
with ``nargs="*"`` separate arguments and a space-separated variable), ``tuple[tuple[str, str], ...]`` (items
``name=value``). ``choices`` restrict a scalar's values; a bad value in a flag or a variable is argparse's usage
error naming it (exit status 2, no traceback), and so is every ``ValueError`` of ``__post_init__``.

Help comes from the field's docstring (the string literal under it) or ``option(help=...)``; ``--help`` shows it
with the variable names and the default. :func:`options` lists every (flags, env, aliases, default, help) for
documentation (``scripts/config_table.py`` writes ``docs/configuration.md``'s tables from it).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

__all__ = ["Settings", "option", "inverse", "OptionInfo", "options", "add_arguments", "read_values"]

_KEY = "embedmesh.config"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class Inverse:
    """An alias variable of a bool field that means its opposite (``..._NO_REQUEUE=1`` sets ``requeue=False``)."""

    name: str


def inverse(name: str) -> Inverse:
    """Mark an alias variable of a bool field as meaning the opposite value."""
    return Inverse(name)


@dataclass(frozen=True)
class _Option:
    flags: tuple[str, ...] = ()
    env: str | None = None
    aliases: tuple[str | Inverse, ...] = ()
    help: str | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    nargs: str | None = None
    repeat: bool = False


def option(default: Any = dataclasses.MISSING, *, flags: Sequence[str] = (), env: str | None = None,
           aliases: Sequence[str | Inverse] = (), help: str | None = None, choices: Sequence[Any] | None = None,
           metavar: str | None = None, nargs: str | None = None, repeat: bool = False) -> Any:
    """A dataclass field with more than the defaults of :class:`Settings`.

    ``flags``: further spellings of the flag, accepted besides ``--field-name`` (the older flags keep working);
    ``env``: the variable's name when it is not ``EMBEDMESH_<SERVICE>_<FIELD>``; ``aliases``: older or shared
    variables also read (after the main one; :func:`inverse` for a bool's opposite); ``help``: instead of the
    field's docstring; ``choices``: the allowed values; ``metavar``: one item's form (``name=folder``) for tuples,
    the value's name otherwise; ``nargs="*"``: a tuple given as separate arguments (and a space-separated variable);
    ``repeat``: a tuple given by repeating the flag (``--model a --model b``; the variable is a comma list).
    """
    if nargs not in (None, "*"):
        raise ValueError(f"nargs must be None or '*', got {nargs!r}")
    if nargs and repeat:
        raise ValueError("nargs and repeat exclude each other")
    meta = {_KEY: _Option(tuple(flags), env, tuple(aliases), help, None if choices is None else tuple(choices),
                          metavar, nargs, repeat)}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class OptionInfo:
    """One field as an operator sees it: for ``--help``, the README's table and the tests."""

    field: str
    flags: tuple[str, ...]
    """The flag first, then older spellings (a bool also takes ``--no-<flag>``)."""
    env: str
    """The field's own variable."""
    aliases: tuple[str, ...]
    """Older or shared variables also read, in precedence order (an inverse one is written ``!NAME``)."""
    default: str
    """The default as an operator would write it."""
    help: str
    choices: tuple[str, ...] | None
    switch: bool = False
    """A bool: each flag also has its ``--no-`` form."""


class Settings:
    """Base of every process's config dataclass; the class keywords name its service and its command line."""

    _service: ClassVar[str]
    _prog: ClassVar[str | None]
    _description: ClassVar[str | None]

    def __init_subclass__(cls, *, service: str | None = None, prog: str | None = None,
                          description: str | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if service is not None:  # a subclass of a config keeps its service unless it names one
            cls._service = service
        if prog is not None or not hasattr(cls, "_prog"):
            cls._prog = prog
        if description is not None or not hasattr(cls, "_description"):
            cls._description = description

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        """The command line of this config: one flag per field, the variables and defaults in each help."""
        p = argparse.ArgumentParser(
            prog=cls._prog, description=cls._description, formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="Each flag also reads its environment variable (env:); a flag beats its variable, the first\n"
                   "variable named beats the later ones (also:), and a variable beats the default. A variable\n"
                   "set to the empty string counts as unset.")
        add_arguments(p, cls)
        return p

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Self:
        """Parse ``argv`` (default ``sys.argv[1:]``) over ``env`` (default ``os.environ``) over the defaults.

        A bad value, or a ``ValueError`` from ``__post_init__``, is argparse's usage error (exit status 2)."""
        p = cls.parser()
        ns = p.parse_args(None if argv is None else list(argv))
        values = read_values(cls, ns, os.environ if env is None else env, p)
        try:
            return cls(**values)
        except ValueError as e:  # a bad value: argparse's usage + message, exit status 2, no traceback
            p.error(str(e))

    @classmethod
    def options(cls) -> list[OptionInfo]:
        """Every field's flags, variables, default and help (for documentation)."""
        return options(cls)

    def describe(self) -> dict[str, object]:
        """The config as a plain dict (for the start-up log)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]


# --- the schema of one field ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Field:
    name: str
    kind: str  # "str" "int" "float" "bool" "list" "pairs"
    scalar: Callable[[str], Any]  # converts one value (or one list item)
    optional: bool
    default: Any
    opt: _Option
    flags: tuple[str, ...]
    env: str
    help: str


def _service_prefix(cls: type) -> str:
    service = getattr(cls, "_service", None)
    if service is None:
        raise TypeError(f"{cls.__name__} must subclass Settings with service=...")
    return "EMBEDMESH_" + (service.upper().replace("-", "_") + "_" if service else "")


@functools.cache
def _docstrings(cls: type) -> dict[str, str]:
    """The string literal under each annotated field of ``cls`` (and of its dataclass bases)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, [*body[1:], None], strict=True):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                out[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return out


def _kind(name: str, hint: Any) -> tuple[str, Callable[[str], Any], bool]:
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"field {name}: only X | None unions are supported, got {hint}")
        hint, optional = args[0], True
    if hint is bool:
        return "bool", _bool, optional
    if hint in (str, int, float):
        return hint.__name__, hint, optional
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] is str:
                return "list", str, optional
            if typing.get_origin(args[0]) is tuple and typing.get_args(args[0]) == (str, str):
                return "pairs", str, optional
    raise TypeError(f"field {name}: type {hint} is not supported (str, int, float, bool, X | None, "
                    "tuple[str, ...], tuple[tuple[str, str], ...])")


def _bool(value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(value)


@functools.cache
def _fields(cls: type) -> tuple[_Field, ...]:
    prefix = _service_prefix(cls)
    hints = typing.get_type_hints(cls)
    docs = _docstrings(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        opt = f.metadata.get(_KEY, _Option())
        kind, scalar, optional = _kind(f.name, hints[f.name])
        if kind != "bool" and any(isinstance(a, Inverse) for a in opt.aliases):
            raise TypeError(f"field {f.name}: only a bool field can have an inverse alias")
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        help_ = opt.help if opt.help is not None else docs.get(f.name, "")
        flags = ("--" + f.name.replace("_", "-"), *(x for x in opt.flags if x != "--" + f.name.replace("_", "-")))
        out.append(_Field(f.name, kind, scalar, optional, default, opt, flags,
                          opt.env or prefix + f.name.upper(), help_))
    return tuple(out)


def _alias_names(fld: _Field) -> tuple[str, ...]:
    return tuple(f"!{a.name}" if isinstance(a, Inverse) else a for a in fld.opt.aliases)


def _show(fld: _Field, value: Any) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if fld.kind == "pairs":
        return ",".join(f"{k}={v}" for k, v in value) or "(empty)"
    if fld.kind == "list":
        return (" " if fld.opt.nargs else ",").join(value) or "(empty)"
    if value == "":
        return "(empty)"
    return str(value)


# --- the public API ---------------------------------------------------------------------------------------------


def options(cls: type) -> list[OptionInfo]:
    """Every field of the config dataclass ``cls`` as (flags, env, aliases, default, help, choices)."""
    return [OptionInfo(f.name, f.flags, f.env, _alias_names(f), _show(f, f.default), f.help,
                       None if f.opt.choices is None else tuple(map(str, f.opt.choices)), f.kind == "bool")
            for f in _fields(cls)]


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """Add one flag per field of ``cls`` to ``parser`` (values left unset unless given; see :func:`read_values`)."""
    for f in _fields(cls):
        also = ", ".join(a.lstrip("!") + (" (inverse)" if a.startswith("!") else "") for a in _alias_names(f))
        text = f.help.rstrip(".") + "." if f.help else ""
        if f.opt.repeat:
            text += " Repeat the flag for more; the variable is a comma list."
        text += f" [env: {f.env}" + (f"; also: {also}" if also else "") + f"] (default: {_show(f, f.default)})"
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text.strip().replace("%", "%%")}
        if f.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif f.kind in ("list", "pairs"):
            item = f.opt.metavar or ("NAME=VALUE" if f.kind == "pairs" else "VALUE")
            if f.opt.nargs:
                kw["nargs"] = "*"
                kw["metavar"] = item
            elif f.opt.repeat:
                kw["action"] = "append"
                kw["metavar"] = item
            else:
                kw["metavar"] = f"{item}[,...]"
        else:
            kw["type"] = f.scalar
            if f.opt.choices is not None:
                kw["choices"] = f.opt.choices
            if f.opt.metavar:
                kw["metavar"] = f.opt.metavar
        parser.add_argument(*f.flags, **kw)


def read_values(cls: type, ns: argparse.Namespace, env: Mapping[str, str],
                parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The keyword arguments for ``cls``: each field's flag from ``ns``, else its variables from ``env``.

    Fields set by neither are left out (the dataclass default applies). A bad value exits through
    ``parser.error`` naming the flag or the variable."""
    values: dict[str, Any] = {}
    for f in _fields(cls):
        if hasattr(ns, f.name):
            raw = getattr(ns, f.name)
            if f.kind in ("list", "pairs"):
                items = raw if f.opt.nargs or f.opt.repeat else raw.split(",")
                values[f.name] = _items(f, items, f.flags[0], parser)
            else:
                values[f.name] = raw
            continue
        for alias in (f.env, *f.opt.aliases):
            name, invert = (alias.name, True) if isinstance(alias, Inverse) else (alias, False)
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            values[f.name] = _from_env(f, name, raw, invert, parser)
            break
    return values


def _items(f: _Field, items: Sequence[str], where: str, parser: argparse.ArgumentParser) -> tuple[Any, ...]:
    out: list[Any] = []
    for item in (x.strip() for x in items):
        if not item:
            continue
        if f.kind == "pairs":
            name, sep, value = item.partition("=")
            if not sep or not name or not value:
                parser.error(f"{where}: {item!r} is not {f.opt.metavar or 'NAME=VALUE'}")
            out.append((name, value))
        else:
            out.append(item)
    return tuple(out)


def _from_env(f: _Field, name: str, raw: str, invert: bool, parser: argparse.ArgumentParser) -> Any:
    if f.kind in ("list", "pairs"):
        return _items(f, raw.split() if f.opt.nargs else raw.split(","), name, parser)
    try:
        value = f.scalar(raw)
    except ValueError:
        what = "a boolean (1/true/yes/on or 0/false/no/off)" if f.kind == "bool" else f"a valid {f.kind}"
        parser.error(f"{name}={raw!r} is not {what}")
    if f.kind == "bool" and invert:
        value = not value
    if f.opt.choices is not None and value not in f.opt.choices:
        parser.error(f"{name}: invalid choice: {raw!r} (choose from {', '.join(map(repr, f.opt.choices))})")
    return value
