"""The context-length rule, once: a prompt of ``positions`` (token ids and embedding rows) plus the ``max_tokens``
it may generate must fit the model's context. Every place that checks it (the preprocessor's prompts and chat,
the prompt-embeddings rules of ``core.embeds``, the worker's ``validate.py``) calls :func:`check_context`; each
keeps the wording its clients have always seen, chosen from the templates below, and the reason is always
``CONTEXT_OVERFLOW``.
"""

from __future__ import annotations

from embedmesh.core.errors import InvalidArgument

__all__ = ["ROWS", "TOKENS", "REQUEST", "ENGINE", "fits_context", "check_context"]

ROWS = "{field}: {positions} rows + max_tokens {max_tokens} exceed the model's context of {context} positions"
"""Embedding rows of one ``prompt_embeds`` tensor (``core.embeds``, the preprocessor's resolver)."""
TOKENS = "{field}: {positions} prompt tokens + max_tokens {max_tokens} exceed the model's context of {context}"
"""A whole prompt as the preprocessor built it (text, token ids, chat, a prefix)."""
REQUEST = "max_tokens: prompt ({positions}) + max_tokens ({max_tokens}) exceeds the context of {context}"
"""A worker's GenerateRequest (``worker/validate.py``; the field is ``max_tokens``)."""
ENGINE = "prompt ({positions}) + max_tokens ({max_tokens}) exceeds the context of {context}"
"""The same refusal as an engine words it (the vLLM engine)."""


def fits_context(positions: int, max_tokens: int, context: int) -> bool:
    """Whether ``positions`` prompt positions plus ``max_tokens`` generated ones fit a context of ``context``."""
    return positions + max_tokens <= context


def check_context(positions: int, max_tokens: int, context: int, *, field: str, wording: str = TOKENS) -> None:
    """Refuse a prompt that does not fit (InvalidArgument naming ``field``, reason CONTEXT_OVERFLOW)."""
    if not fits_context(positions, max_tokens, context):
        raise InvalidArgument(
            wording.format(field=field, positions=positions, max_tokens=max_tokens, context=context),
            field=field, reason="CONTEXT_OVERFLOW")
