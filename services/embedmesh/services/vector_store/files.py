"""What an uploaded file may be: text-like only (plain text, Markdown, JSON / JSON Lines), UTF-8, not empty.

The type comes from the file name's extension, or, without one, from the declared media type. Anything else is
refused at upload with a 400 naming the type, so no unreadable file ever reaches ingestion.
"""

from __future__ import annotations

import json
import os

from embedmesh.core.errors import InvalidArgument

__all__ = ["PURPOSES", "detect_media_type", "check_purpose", "decode_text", "EXTENSIONS"]

PURPOSES = ("assistants", "user_data", "batch", "fine-tune", "vision", "evals")

EXTENSIONS = {
    ".txt": "text/plain", ".text": "text/plain", ".log": "text/plain",
    ".md": "text/markdown", ".markdown": "text/markdown",
    ".json": "application/json", ".jsonl": "application/jsonl",
}
_MEDIA = {"text/plain": "text/plain", "text/markdown": "text/markdown", "text/x-markdown": "text/markdown",
          "application/json": "application/json", "application/jsonl": "application/jsonl",
          "application/x-ndjson": "application/jsonl"}


def check_purpose(purpose: str) -> str:
    if purpose not in PURPOSES:
        raise InvalidArgument(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", field="purpose",
                              reason="INVALID_PURPOSE")
    return purpose


def detect_media_type(filename: str, content_type: str) -> str:
    """The file's media type, or InvalidArgument naming the unsupported type."""
    ext = os.path.splitext(filename)[1].lower()
    if ext in EXTENSIONS:
        return EXTENSIONS[ext]
    declared = content_type.split(";")[0].strip().lower()
    if not ext and declared in _MEDIA:
        return _MEDIA[declared]
    what = " ".join(x for x in (repr(declared) if declared else "", f"({ext})" if ext else "") if x) or "unknown"
    raise InvalidArgument(
        f"file: unsupported file type {what}; only text-like files are accepted: "
        f"{', '.join(sorted(EXTENSIONS))} (text/plain, text/markdown, application/json)",
        field="file", reason="UNSUPPORTED_FILE_TYPE")


def decode_text(content: bytes, media_type: str) -> str:
    """UTF-8 text of a non-empty, non-binary file; JSON must parse (JSON Lines: every non-blank line)."""
    if not content:
        raise InvalidArgument("file: the file is empty", field="file", reason="EMPTY_FILE")
    if b"\x00" in content:
        raise InvalidArgument("file: the content is binary (NUL bytes), not text", field="file",
                              reason="BINARY_CONTENT")
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"file: the content is not UTF-8 text (invalid byte at offset {e.start})",
                              field="file", reason="BINARY_CONTENT") from None
    if not text.strip():
        raise InvalidArgument("file: the file holds only whitespace", field="file", reason="EMPTY_FILE")
    try:
        if media_type == "application/json":
            json.loads(text)
        elif media_type == "application/jsonl":
            for line in text.splitlines():
                if line.strip():
                    json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"file: not valid JSON: {e}", field="file", reason="INVALID_JSON") from None
    return text
