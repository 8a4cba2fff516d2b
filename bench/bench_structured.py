"""How the grammar library was picked: compile time and per-token mask time on the default model's tokenizer
(49,152 tokens), xgrammar (the project's choice; also vLLM's default) beside llguidance (when installed:
`pip install llguidance`), for the constraints the API accepts. Each step fills the next-token mask and advances
the matcher by one token of a valid output (the same text for both libraries).

    python bench/bench_structured.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
                                           "count": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "tags", "count", "ok"], "additionalProperties": False}
CASES = [
    ("JSON schema (4 props)", "json", json.dumps(SCHEMA),
     '{"name": "Riverton", "tags": ["small", "quiet"], "count": 1200, "ok": true}'),
    ("regex [0-9]{3}-[a-z]{2}", "regex", "[0-9]{3}-[a-z]{2}", "123-ab"),
    ("choice (3 strings)", "regex", "(yes|no|maybe)", "maybe"),
]
VOCAB = 49152


def _xgrammar(tok: Any, kind: str, source: str, text: str) -> tuple[float, list[float]]:
    import torch
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    grammar = compiler.compile_json_schema(source, any_whitespace=False) if kind == "json" \
        else compiler.compile_regex(source)
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    logits = torch.zeros(1, VOCAB)
    steps = []
    for token in tok.encode(text, add_special_tokens=False):
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        matcher.accept_token(token)
        steps.append(time.perf_counter() - t0)
    return compile_s, steps


def _llguidance(tok: Any, kind: str, source: str, text: str) -> tuple[float, list[float]] | None:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        import torch
    except ImportError:
        return None
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(source) if kind == "json" \
        else llguidance.LLMatcher.grammar_from_regex(source)
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    bitmask = llguidance.torch.allocate_token_bitmask(1, VOCAB)
    logits = torch.zeros(1, VOCAB)
    steps = []
    for token in tok.encode(text, add_special_tokens=False):
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
        matcher.consume_token(token)
        steps.append(time.perf_counter() - t0)
    return compile_s, steps


def main() -> None:
    from transformers import AutoTokenizer

    from embedmesh.models import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    print("| constraint | library | compile ms | mask + advance per token, median µs | p99 µs |")
    print("|---|---|---|---|---|")
    for name, kind, source, text in CASES:
        for lib, fn in (("xgrammar", _xgrammar), ("llguidance", _llguidance)):
            fn(tok, kind, source, text)  # warm-up (library caches, tokenizer tables)
            got = fn(tok, kind, source, text)
            if got is None:
                print(f"| {name} | {lib} | (not installed) | | |")
                continue
            compile_s, steps = got
            steps.sort()
            p99 = steps[min(len(steps) - 1, int(len(steps) * 0.99))]
            print(f"| {name} | {lib} | {compile_s * 1e3:.2f} | {statistics.median(steps) * 1e6:.0f} | "
                  f"{p99 * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
