"""Parsing a completion/chat body whose base64 ``prompt_embeds`` are big, without making them Python strings.

``orjson.loads`` of a body holding 85 MiB of base64 spends most of its time building that one ``str`` (checking
it as UTF-8, allocating, copying), which the gateway then only decodes. ``loads`` finds each long JSON string of
the body (an opening and a closing ``"`` far apart), parses a copy of the body where those strings are short
placeholders, puts each placeholder found where ``prompt_embeds`` are read (``slots``) back as a ``Base64Text``
holding the bytes decoded straight from the body, and returns that. It gives up (None: the caller parses the body
as usual) unless every long string is found in such a place and decodes as strict base64 — then the body is
exactly what ``orjson.loads`` would have returned, only those strings read already decoded:

* a placeholder stands where the long string stood. Its opening ``"`` is not escaped (no ``\\`` before it), so it
  opens or closes a string; closing is impossible when the copy parses, since a string can't be followed by the
  placeholder's letters. So the copy has a string token exactly where the body has the long one;
* strict base64 is ASCII letters, digits, ``+``, ``/`` and ``=``: no quote, backslash or control character. So
  the long string is a valid JSON string whose value is those characters, with the same tokens around it; the body
  is valid JSON exactly when the copy is, with the same value but for those strings.

Every error (bad JSON, bad base64, a long string elsewhere) is then reported by the usual path, unchanged.
"""

from __future__ import annotations

import binascii
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pybase64

__all__ = ["Base64Text", "loads", "completion_slots", "chat_slots", "upload_slots", "MIN_BODY_BYTES",
           "MIN_STRING_BYTES"]

MIN_BODY_BYTES = 1 << 20
"""Smaller bodies are parsed as usual."""
MIN_STRING_BYTES = 1 << 16
"""A string at least this long is read as base64 (when found in a slot)."""
_MAX_QUOTES = 1 << 14
"""Quotes looked at, at most, from the body's start (later long strings are parsed as usual)."""
_TAG = "b64-" + secrets.token_hex(16)

Slots = Callable[[Any], Iterator[tuple[Any, Any]]]


class Base64Text(str):
    """A JSON string of base64 read by ``loads``: ``decoded`` is its bytes (``decode_base64`` returns them); the
    string itself is only a placeholder."""

    decoded: bytes

    @classmethod
    def of(cls, tag: str, decoded: bytes) -> Base64Text:
        text = cls(tag)
        text.decoded = decoded
        return text


def completion_slots(body: Any) -> Iterator[tuple[Any, Any]]:
    """Where /v1/completions reads base64: ``prompt_embeds`` (a string or list items), ``prompt_embeds_prefix``."""
    if not isinstance(body, dict):
        return
    embeds = body.get("prompt_embeds")
    if isinstance(embeds, str):
        yield body, "prompt_embeds"
    elif isinstance(embeds, list):
        for i, item in enumerate(embeds):
            if isinstance(item, str):
                yield embeds, i
    if isinstance(body.get("prompt_embeds_prefix"), str):
        yield body, "prompt_embeds_prefix"


def upload_slots(body: Any) -> Iterator[tuple[Any, Any]]:
    """Where /v1/prompt_embeds reads base64: ``data``."""
    if isinstance(body, dict) and isinstance(body.get("data"), str):
        yield body, "data"


def chat_slots(body: Any) -> Iterator[tuple[Any, Any]]:
    """Where /v1/chat/completions reads base64: ``messages[i].content[j].data``."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("data"), str):
                    yield part, "data"


def _escaped(raw: bytes, q: int) -> bool:
    """Whether the quote at ``q`` follows an odd number of backslashes."""
    n = 0
    while q > n and raw[q - n - 1] == 0x5C:
        n += 1
    return n % 2 == 1


def _long_strings(raw: bytes) -> list[tuple[int, int]]:
    """(start, end) of the contents of the long strings, at most ``_MAX_QUOTES`` quotes in. Quotes open and close
    strings in turn (an escaped one is part of a string); a body that is not JSON may mislead this, which the
    checks in ``loads`` catch."""
    spans: list[tuple[int, int]] = []
    find = raw.find
    opened = -1
    q = find(b'"')
    for _ in range(_MAX_QUOTES):
        if q < 0:
            break
        if opened < 0:
            opened = q
        elif not _escaped(raw, q):
            if q - opened > MIN_STRING_BYTES and raw[opened - 1] != 0x5C:
                spans.append((opened + 1, q))
            opened = -1
        q = find(b'"', q + 1)
    return spans


def loads(raw: bytes, slots: Slots) -> Any | None:
    """``orjson.loads(raw)`` with each long string found in ``slots`` as a ``Base64Text``; None when it can't be
    (small body, no long strings, one elsewhere or not strict base64, invalid JSON): then parse ``raw`` as usual."""
    if len(raw) < MIN_BODY_BYTES:
        return None
    spans = _long_strings(raw)
    if not spans:
        return None
    tags = [f"{_TAG}-{i}" for i in range(len(spans))]
    view = memoryview(raw)
    parts: list[bytes | memoryview] = []
    prev = 0
    for (start, end), tag in zip(spans, tags, strict=True):
        parts += [view[prev:start], tag.encode()]
        prev = end
    parts.append(view[prev:])
    small = b"".join(parts)
    del parts
    try:
        body = orjson.loads(small)
    except orjson.JSONDecodeError:
        return None
    index = {tag: i for i, tag in enumerate(tags)}
    found: dict[int, tuple[Any, Any]] = {}
    for container, key in slots(body):
        value = container[key]
        i = index.get(value) if type(value) is str else None
        if i is not None:
            if i in found:
                return None
            found[i] = (container, key)
    if len(found) != len(spans):
        return None
    decoded: list[tuple[Any, Any, Base64Text]] = []
    for i, (container, key) in found.items():
        start, end = spans[i]
        try:
            data = pybase64.b64decode(view[start:end], validate=True)
        except (binascii.Error, ValueError):
            return None
        decoded.append((container, key, Base64Text.of(tags[i], data)))
    for container, key, text in decoded:
        container[key] = text
    return body
