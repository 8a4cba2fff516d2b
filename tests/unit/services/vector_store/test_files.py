"""vector_store.files: an upload's type from its extension (or, without one, its declared media type), the purposes
accepted, and the text rules (UTF-8, not empty, not binary, JSON that parses) — each refusal naming ``file`` or
``purpose`` with its reason."""

from __future__ import annotations

import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.services.vector_store.files import PURPOSES, check_purpose, decode_text, detect_media_type


@pytest.mark.parametrize("filename,content_type,media", [
    ("notes.txt", "", "text/plain"),
    ("NOTES.TXT", "application/octet-stream", "text/plain"),  # the extension wins over what the client declared
    ("server.log", "", "text/plain"),
    ("readme.md", "", "text/markdown"),
    ("readme.markdown", "text/plain", "text/markdown"),
    ("data.json", "", "application/json"),
    ("rows.jsonl", "", "application/jsonl"),
    ("no-extension", "text/markdown; charset=utf-8", "text/markdown"),
    ("no-extension", "text/x-markdown", "text/markdown"),
    ("no-extension", "application/x-ndjson", "application/jsonl"),
    ("no-extension", " Text/Plain ", "text/plain"),
])
def test_media_type_from_extension_or_declared_type(filename: str, content_type: str, media: str) -> None:
    assert detect_media_type(filename, content_type) == media


@pytest.mark.parametrize("filename,content_type,shown", [
    ("slides.pdf", "application/pdf", "'application/pdf' (.pdf)"),
    ("image.png", "", "(.png)"),
    ("blob", "application/octet-stream", "'application/octet-stream'"),
    ("blob", "", "unknown"),
    ("weird.pdf", "text/plain", "'text/plain' (.pdf)"),  # an unknown extension is not rescued by the declared type
])
def test_other_types_are_refused_naming_the_type(filename: str, content_type: str, shown: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        detect_media_type(filename, content_type)
    e = info.value
    assert (e.field, e.reason) == ("file", "UNSUPPORTED_FILE_TYPE")
    assert e.message.startswith(f"file: unsupported file type {shown}; only text-like files are accepted: ")
    assert ".jsonl, .log, .markdown, .md, .text, .txt" in e.message


def test_purposes() -> None:
    for p in PURPOSES:
        assert check_purpose(p) == p
    for bad in ("", "Assistants", "fine_tune", "answers"):
        with pytest.raises(InvalidArgument) as info:
            check_purpose(bad)
        assert (info.value.field, info.value.reason) == ("purpose", "INVALID_PURPOSE")
        assert info.value.message == (f"purpose must be one of assistants, user_data, batch, fine-tune, vision, "
                                      f"evals, got {bad!r}")


def test_text_is_decoded_as_utf8() -> None:
    assert decode_text("héllo wörld\n".encode(), "text/plain") == "héllo wörld\n"
    assert decode_text(b'{"a": [1, 2]}', "application/json") == '{"a": [1, 2]}'
    assert decode_text(b'{"a": 1}\n\n{"b": 2}\n', "application/jsonl") == '{"a": 1}\n\n{"b": 2}\n'
    assert decode_text(b"{not json but markdown", "text/markdown") == "{not json but markdown"


@pytest.mark.parametrize("content,media,reason,message", [
    (b"", "text/plain", "EMPTY_FILE", "file: the file is empty"),
    (b" \n\t ", "text/plain", "EMPTY_FILE", "file: the file holds only whitespace"),
    (b"abc\x00def", "text/plain", "BINARY_CONTENT", "file: the content is binary (NUL bytes), not text"),
    (b"ok \xff\xfe", "text/plain", "BINARY_CONTENT", "file: the content is not UTF-8 text (invalid byte at offset 3)"),
    (b'{"a": ', "application/json", "INVALID_JSON", "file: not valid JSON: "),
    (b'{"a": 1}\n{broken\n', "application/jsonl", "INVALID_JSON", "file: not valid JSON: "),
])
def test_unreadable_content_is_refused(content: bytes, media: str, reason: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        decode_text(content, media)
    assert (info.value.field, info.value.reason) == ("file", reason)
    assert info.value.message.startswith(message), info.value.message
