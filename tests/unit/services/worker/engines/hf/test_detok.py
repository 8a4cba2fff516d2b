"""Incremental detokenization against the real SmolLM2 tokenizer: deltas add up to the full decode, stop strings
cut before themselves, nothing half-decoded is released."""

from __future__ import annotations

from typing import Any

import pytest

from embedmesh.services.worker.engines.hf.detok import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    from embedmesh.models import ensure_default_model

    return AutoTokenizer.from_pretrained(ensure_default_model())


TEXTS = ["Hello, world! The answer is 42.", "naïve café – 東京 🚀 done", "line one\nline two\n\n  indented"]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tok: Any, text: str) -> None:
    ids = tok(text).input_ids
    d = IncrementalDetokenizer(tok)
    parts = [d.add(t)[0] for t in ids]
    parts.append(d.finish()[0])
    assert "".join(parts) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in parts)


@pytest.mark.parametrize("stop", ["answer", " is 4", "!", "42."])
def test_stop_string_cuts_before_itself(tok: Any, stop: str) -> None:
    text = TEXTS[0]
    ids = tok(text).input_ids
    d = IncrementalDetokenizer(tok, (stop,))
    out, stopped = [], False
    for t in ids:
        delta, stopped = d.add(t)
        out.append(delta)
        if stopped:
            break
    assert stopped
    assert "".join(out) == text[: text.index(stop)]


def test_text_that_may_start_a_stop_string_is_held_back(tok: Any) -> None:
    d = IncrementalDetokenizer(tok, ("STOPHERE",))
    released = "".join(d.add(t)[0] for t in tok("abc STOP").input_ids)
    assert not released.endswith("STOP")
    rest, stopped = d.finish()
    assert not stopped
    assert released + rest == "abc STOP"
