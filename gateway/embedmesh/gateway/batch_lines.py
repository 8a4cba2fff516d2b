"""A Batch API input file (OpenAI's JSONL): one request per line, checked when the file is uploaded.

Each line is ``{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}``. What is checked here is
the file's shape only: UTF-8, one JSON object per line, those four keys, ``custom_id`` unique in the file, ``url``
one the gateway can run. A refusal is a 400 naming the line (``line 7: ...``) and the key. The body's own rules are
the route's: the runner hands it to the same handler an interactive request reaches, so a bad body fails its line
alone, with that handler's 400 in the error file.

Bounds come before allocation: the caller caps the bytes while they arrive, and the line count is counted on the
raw bytes before any line is split out or parsed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from embedmesh.gateway.errors import ApiError

__all__ = ["BatchLine", "BATCH_URLS", "parse", "prefix_key", "run_order"]

BATCH_URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses")
"""Endpoints a batch line may name (``/v1/responses`` only while the gateway serves it)."""
MAX_CUSTOM_ID = 512
_KEYS = frozenset({"custom_id", "method", "url", "body"})
_PREFIX_CHARS = 4096
"""How much of a prompt orders the lines: enough to group lines that share a long system prompt."""


@dataclass(frozen=True)
class BatchLine:
    """One request of the file; ``number`` is its 1-based line in the file, ``body`` its JSON bytes."""

    number: int
    custom_id: str
    url: str
    body: bytes
    stream: bool
    """The body asks for a stream, which a batch cannot return: the line fails alone."""
    prefix: str
    """What orders it for the prefix cache (``prefix_key``)."""


def _refuse(number: int, message: str, code: str = "invalid_batch_line") -> ApiError:
    return ApiError(400, f"line {number}: {message}", param="file", code=code)


def _line(number: int, raw: bytes, urls: Iterable[str]) -> BatchLine:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise _refuse(number, f"is not valid JSON ({e}); a batch file is JSONL: one JSON object per line",
                      "invalid_jsonl") from None
    if not isinstance(obj, dict):
        raise _refuse(number, f"must be a JSON object, got {type(obj).__name__}", "invalid_jsonl")
    extra = sorted(set(obj) - _KEYS)
    if extra:
        raise _refuse(number, f"unknown key {extra[0]!r}; a line has custom_id, method, url and body")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not 0 < len(cid) <= MAX_CUSTOM_ID:
        raise _refuse(number, f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters")
    if obj.get("method") != "POST":
        raise _refuse(number, f"method must be 'POST', got {obj.get('method')!r}")
    url = obj.get("url")
    allowed = tuple(urls)
    if url not in allowed:
        raise _refuse(number, f"url must be one of {', '.join(allowed)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _refuse(number, "body must be a JSON object (the request the url takes)")
    return BatchLine(number, cid, url, orjson.dumps(body), body.get("stream") not in (None, False),
                     prefix_key(url, body))


def parse(data: bytes, *, max_lines: int, urls: Iterable[str] = BATCH_URLS) -> list[BatchLine]:
    """The file's requests in file order, or a 400 naming the first bad line. Blank lines are skipped."""
    allowed = tuple(urls)
    physical = data.count(b"\n") + (0 if data.endswith(b"\n") else 1)
    if physical > max_lines:  # counted on the raw bytes before any line is split out (blank lines count too)
        raise ApiError(400, f"the file has more than {max_lines} lines, the limit of a batch", param="file",
                       code="too_many_lines")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _refuse(data.count(b"\n", 0, e.start) + 1, "is not UTF-8 text", "invalid_jsonl") from None
    del text
    out: list[BatchLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        line = _line(number, raw, allowed)
        first = seen.setdefault(line.custom_id, number)
        if first != number:
            raise _refuse(number, f"custom_id {line.custom_id!r} is already the custom_id of line {first}; each "
                                  "line needs its own", "duplicate_custom_id")
        out.append(line)
    if not out:
        raise ApiError(400, "the file holds no request (one JSON object per line)", param="file",
                       code="empty_file")
    return out


def prefix_key(url: str, body: dict[str, Any]) -> str:
    """The start of the line's prompt as one string: sorting lines by it puts lines that share a prefix (a system
    prompt, a document) next to each other, so the workers' prefix caches still hold it for the next line."""
    model = body.get("model")
    if url == "/v1/chat/completions":
        prompt: Any = body.get("messages")
    elif url == "/v1/completions":
        prompt = body.get("prompt", body.get("prompt_embeds"))
    elif url == "/v1/embeddings":
        prompt = body.get("input")
    else:
        prompt = [body.get("instructions"), body.get("input")]
    try:
        text = orjson.dumps(prompt).decode()
    except TypeError:  # a value orjson cannot write (an integer over 64 bits): unordered
        text = ""
    return f"{model if isinstance(model, str) else ''}\x00{text[:_PREFIX_CHARS]}"


def run_order(lines: list[BatchLine]) -> list[int]:
    """Each line's rank in the run: by prefix, then by file order among equal prefixes."""
    ranked = sorted(range(len(lines)), key=lambda i: (lines[i].prefix, i))
    order = [0] * len(lines)
    for rank, i in enumerate(ranked):
        order[i] = rank
    return order
