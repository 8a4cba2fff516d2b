"""Structured outputs: what a generated text must match (JSON schema, any JSON object, regex, one of some strings,
an EBNF grammar), checked early and enforced token by token.

- ``check_structured`` validates a constraint without a tokenizer (the preprocessor calls it before any work; the
  worker again). It needs no torch: JSON schemas are checked with ``jsonschema`` and, where xgrammar is installed
  (the hf worker's venv), converted to a grammar the way the engine will, so a schema xgrammar cannot follow is
  refused up front instead of failing mid-generation.
- ``StructuredCompiler`` (engines) compiles a constraint for one tokenizer with xgrammar, once per constraint
  (bounded LRU), and hands out a ``Matcher`` per sequence: ``mask`` sets forbidden tokens' logits to -inf, ``accept``
  advances it, ``is_terminated`` says the text is complete (the engine then ends the sequence with STOP without
  emitting the end token).

xgrammar was kept after measuring it beside llguidance (``bench/bench_structured.py``, README): per-token mask work
is comparable (~150-250 µs for a 49k vocabulary on this CPU), llguidance compiles a JSON schema far faster (~1 ms
against ~300 ms the first time) — but compiled grammars are cached per schema here, so that cost is paid once per
schema, and xgrammar is what vLLM's CPU build uses by default, so hf and vllm workers accept and enforce the same
grammar dialect. With many distinct schemas per minute, llguidance is the switch to make (``Matcher`` is the seam).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

from embedmesh.core import json_depth
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import Structured

__all__ = ["check_structured", "StructuredCompiler", "Matcher", "grammar_source"]

_CACHE_SIZE = 256
_checked: OrderedDict[tuple[str, Any], str | None] = OrderedDict()
_checked_lock = threading.Lock()


_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\]\s+\S+:\d+:\s*")

def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:  # the preprocessor's image has no torch, hence no xgrammar: jsonschema/re checks only
        return None
    return xgrammar


def _choice_regex(values: tuple[str, ...]) -> str:
    return "(" + "|".join(re.escape(v) for v in values) + ")"


def grammar_source(s: Structured) -> tuple[str, str]:
    """(what xgrammar compiles: "json_schema" | "json" | "regex" | "ebnf", its text) for a constraint."""
    if s.kind == "json_schema":
        return "json_schema", str(s.value)
    if s.kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if s.kind == "regex":
        return "regex", str(s.value)
    if s.kind == "choice":
        return "regex", _choice_regex(tuple(s.value))
    return "ebnf", str(s.value)


def _check(s: Structured, field: str) -> str | None:
    """The error message for an invalid constraint, or None."""
    if s.kind == "json_schema":
        try:
            schema = json_depth.loads(str(s.value))
        except ValueError as e:
            return f"is not valid JSON ({e})"
        if not isinstance(schema, dict | bool):
            return "must be a JSON schema (an object)"
        try:
            import jsonschema

            jsonschema.Draft202012Validator.check_schema(schema)
        except ImportError:
            pass
        except Exception as e:  # noqa: BLE001 - jsonschema.SchemaError and friends
            return f"is not a valid JSON schema: {getattr(e, 'message', e)}"
    elif s.kind in ("regex", "choice"):
        try:
            re.compile(str(s.value) if s.kind == "regex" else _choice_regex(tuple(s.value)))
        except re.error as e:
            return f"is not a valid regular expression: {e}"
    xgr = _xgrammar()
    if xgr is None:
        return None
    kind, text = grammar_source(s)
    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the reason
        what = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "grammar"}[kind]
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # xgrammar prefixes its C++ log line ("[07:41:50] /project/cpp/grammar_parser.cc:820: "): the client gets
        # the reason, not the library's clock and build paths
        first = _XGRAMMAR_LOG_PREFIX.sub("", first)
        return f"cannot be enforced as a {what}: {first[:300]}"
    return None


def check_structured(s: Structured, field: str) -> None:
    """Raise InvalidArgument (naming ``field``) when the constraint cannot be enforced; results are cached."""
    key = (s.kind, s.value)
    with _checked_lock:
        known = key in _checked
        if known:
            _checked.move_to_end(key)
            problem = _checked[key]
    if not known:
        problem = _check(s, field)
        with _checked_lock:
            _checked[key] = problem
            while len(_checked) > _CACHE_SIZE:
                _checked.popitem(last=False)
    if problem is not None:
        reason = {"json_schema": "INVALID_SCHEMA", "json_object": "INVALID_SCHEMA", "regex": "INVALID_REGEX",
                  "choice": "INVALID_REGEX", "grammar": "INVALID_GRAMMAR"}[s.kind]
        raise InvalidArgument(f"{field} {problem}", field=field, reason=reason)


class Matcher:
    """One sequence's position in a compiled grammar."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._m = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def mask(self, logits_row: Any) -> None:
        """Forbidden tokens' logits -> -inf, in place (1-D float32 CPU row of ``vocab_size`` or more entries)."""
        self._m.fill_next_token_bitmask(self._bitmask)
        row = logits_row[: self.vocab_size].unsqueeze(0)
        self._xgr.apply_token_bitmask_inplace(row, self._bitmask)
        if logits_row.shape[0] > self.vocab_size:  # padding ids past the tokenizer: never allowed
            logits_row[self.vocab_size:] = float("-inf")

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        """True once the text is complete: the grammar accepted its end (a stop token), or nothing else can follow."""
        return bool(self._m.is_terminated())

    def can_end(self) -> bool:
        """Whether the text so far is a complete match (a stop token would be accepted now)."""
        return bool(self._m.is_completed()) if hasattr(self._m, "is_completed") else False


class StructuredCompiler:
    """Compiles constraints for one tokenizer (xgrammar), each once: a bounded, thread-safe LRU."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = 128) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self._info, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, Any], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._cache_size = cache_size

    def compiled(self, s: Structured) -> Any:
        key = (s.kind, s.value)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        check_structured(s, "structured_outputs")
        kind, text = grammar_source(s)
        try:
            if kind == "json_schema":
                grammar = self._compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                grammar = self._compiler.compile_regex(text)
            else:
                grammar = self._compiler.compile_grammar(text)
        except Exception as e:  # noqa: BLE001
            raise InvalidArgument(f"structured_outputs cannot be compiled: {str(e)[:300]}",
                                  field="structured_outputs", reason="INVALID_GRAMMAR") from None
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, s: Structured) -> Matcher:
        return Matcher(self.compiled(s), self.vocab_size)
