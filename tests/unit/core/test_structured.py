"""core.structured: what xgrammar compiles for each kind of constraint; ``check_structured`` refuses a constraint
that cannot be enforced with INVALID_ARGUMENT naming the field and the kind's reason (and caches the verdict); the
compiler turns a constraint into a per-sequence matcher that masks every token the grammar forbids."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from embedmesh.core import structured
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import Structured
from embedmesh.core.structured import check_structured, grammar_source


@pytest.mark.parametrize("s,source", [
    (Structured("json_schema", '{"type": "integer"}'), ("json_schema", '{"type": "integer"}')),
    (Structured("json_object"), ("json_schema", '{"type": "object"}')),
    (Structured("regex", "[a-c]+"), ("regex", "[a-c]+")),
    (Structured("choice", ("yes", "no")), ("regex", "(yes|no)")),
    (Structured("grammar", 'root ::= "a"'), ("ebnf", 'root ::= "a"')),
])
def test_grammar_source_per_kind(s: Structured, source: tuple[str, str]) -> None:
    assert grammar_source(s) == source


def test_choices_are_literal_text_not_patterns() -> None:
    kind, text = grammar_source(Structured("choice", ("a.b", "(x)", "1+1")))
    assert kind == "regex"
    pattern = re.compile(text)
    assert pattern.fullmatch("a.b") and pattern.fullmatch("(x)") and pattern.fullmatch("1+1")
    assert not pattern.fullmatch("axb") and not pattern.fullmatch("11")


@pytest.mark.parametrize("s", [
    Structured("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})),
    Structured("json_schema", "true"),
    Structured("json_object"),
    Structured("regex", r"\d{3}-[a-z]+"),
    Structured("choice", ("red", "green", "a|b")),
    Structured("grammar", 'root ::= "yes" | "no"'),
])
def test_enforceable_constraints_pass(s: Structured) -> None:
    check_structured(s, "response_format")


@pytest.mark.parametrize("s,field,reason,message", [
    (Structured("json_schema", "{not json"), "response_format", "INVALID_SCHEMA",
     "response_format is not valid JSON"),
    (Structured("json_schema", "[1, 2]"), "response_format", "INVALID_SCHEMA",
     "response_format must be a JSON schema (an object)"),
    (Structured("json_schema", '{"type": "no-such-type"}'), "response_format", "INVALID_SCHEMA",
     "response_format is not a valid JSON schema"),
    (Structured("regex", "(unclosed"), "structured_outputs.regex", "INVALID_REGEX",
     "structured_outputs.regex is not a valid regular expression"),
    (Structured("grammar", "this is not ebnf ::= ::="), "structured_outputs.grammar", "INVALID_GRAMMAR",
     "structured_outputs.grammar cannot be enforced as a grammar"),
])
def test_unenforceable_constraints_are_refused_naming_the_field(s: Structured, field: str, reason: str,
                                                                message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_structured(s, field)
    assert info.value.field == field and info.value.reason == reason
    assert info.value.message.startswith(message), info.value.message
    # the library's reason, not its log line: no clock, no source path of its build
    assert ".cc:" not in info.value.message and not re.search(r"\[\d\d:\d\d:\d\d\]", info.value.message)


def test_verdicts_are_cached_per_constraint(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    real = structured._check

    def counting(s: Structured, field: str) -> str | None:
        calls.append(s)
        return real(s, field)

    monkeypatch.setattr(structured, "_check", counting)
    bad = Structured("regex", "(cached-bad")
    for field in ("a", "b"):
        with pytest.raises(InvalidArgument) as info:
            check_structured(bad, field)
        assert info.value.field == field  # the cached verdict still names this call's field
    check_structured(Structured("regex", "cached-good"), "a")
    check_structured(Structured("regex", "cached-good"), "a")
    assert calls == [bad, Structured("regex", "cached-good")]


def test_without_xgrammar_only_the_syntax_checks_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(structured, "_xgrammar", lambda: None)
    assert structured._check(Structured("grammar", "anything ::= at all ::="), "g") is None
    assert "not a valid regular expression" in (structured._check(Structured("regex", "("), "r") or "")


# --- the compiler (xgrammar with a real tokenizer) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler() -> Any:
    pytest.importorskip("xgrammar")
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from embedmesh.models import ensure_default_model

    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    return tok, structured.StructuredCompiler(tok, vocab_size=len(tok), cache_size=2)


def _allowed(matcher: structured.Matcher, width: int) -> set[int]:
    import torch

    row = torch.zeros(width, dtype=torch.float32)
    matcher.mask(row)
    return {int(i) for i in torch.nonzero(row != float("-inf")).flatten()}


def test_matcher_allows_only_tokens_that_continue_a_choice(compiler: Any) -> None:
    tok, comp = compiler
    m = comp.matcher(Structured("choice", ("yes", "no")))
    allowed = _allowed(m, len(tok) + 5)
    assert allowed and all(i < len(tok) for i in allowed)  # padding ids past the vocabulary are never allowed
    texts = {tok.decode([i]) for i in allowed}
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    (yes,) = tok("yes", add_special_tokens=False).input_ids[:1]
    assert yes in allowed
    for t in tok("yes", add_special_tokens=False).input_ids:
        assert m.accept(t)
    assert m.can_end()
    assert not m.accept(tok("zzz", add_special_tokens=False).input_ids[0])


def test_compiled_grammars_are_cached_and_bounded(compiler: Any) -> None:
    _, comp = compiler
    a, b, c = (Structured("regex", p) for p in ("a+", "b+", "c+"))
    first = comp.compiled(a)
    assert comp.compiled(a) is first
    comp.compiled(b)
    comp.compiled(c)  # cache_size=2: 'a' is the least recently used and goes
    assert list(comp._cache) == [("regex", "b+"), ("regex", "c+")]
    assert comp.compiled(a) is not first


def test_compiler_refuses_what_check_structured_refuses(compiler: Any) -> None:
    _, comp = compiler
    with pytest.raises(InvalidArgument) as info:
        comp.compiled(Structured("regex", "(broken"))
    assert info.value.field == "structured_outputs" and info.value.reason == "INVALID_REGEX"
