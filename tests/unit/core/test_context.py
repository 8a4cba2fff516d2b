"""The one context-length rule (core/context.py): the bound, and each caller's wording kept as it was."""

from __future__ import annotations

import pytest

from embedmesh.core.context import ENGINE, REQUEST, ROWS, TOKENS, check_context, fits_context
from embedmesh.core.errors import InvalidArgument


def test_the_bound_is_inclusive() -> None:
    assert fits_context(90, 10, 100)
    assert not fits_context(91, 10, 100)
    check_context(90, 10, 100, field="prompt")  # exactly full: accepted


@pytest.mark.parametrize(("wording", "field", "message"), [
    (TOKENS, "prompt", "prompt: 91 prompt tokens + max_tokens 10 exceed the model's context of 100"),
    (ROWS, "prompt_embeds", "prompt_embeds: 91 rows + max_tokens 10 exceed the model's context of 100 positions"),
    (REQUEST, "max_tokens", "max_tokens: prompt (91) + max_tokens (10) exceeds the context of 100"),
    (ENGINE, "max_tokens", "prompt (91) + max_tokens (10) exceeds the context of 100"),
])
def test_each_wording_is_what_clients_saw(wording: str, field: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        check_context(91, 10, 100, field=field, wording=wording)
    assert str(e.value) == message
    assert e.value.field == field
    assert e.value.reason == "CONTEXT_OVERFLOW"
