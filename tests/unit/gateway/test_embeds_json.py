"""gateway/embeds_json.py: ``loads`` reads a big body's long base64 strings where prompt_embeds are read straight
from the body bytes, giving exactly what ``orjson.loads`` + b64decode give, and gives up (None) on any doubt; through
the gateway, a request answers the same with and without this fast path (a malformed body gets the same error)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pybase64
import pytest

from embedmesh.gateway import embeds_json
from embedmesh.gateway.embeds_json import Base64Text, chat_slots, completion_slots
from embedmesh.gateway.translate import chat_params, completion_params
from tests.unit.gateway.conftest import MODEL, Harness
from tests.unit.gateway.test_wire_body import BIG, CHAT_BODIES, COMPLETION_BODIES, SMALL, b64

# --- embeds_json.loads --------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """``Base64Text`` back to the base64 text it was read from."""
    if isinstance(value, Base64Text):
        return b64(value.decoded)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@pytest.fixture
def short_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Strings of 30+ bytes count as long (these bodies' short base64 too)."""
    monkeypatch.setattr(embeds_json, "MIN_STRING_BYTES", 30)


@pytest.mark.parametrize("body", COMPLETION_BODIES)
@pytest.mark.usefixtures("short_strings")
def test_loads_completion_bodies(body: dict[str, Any]) -> None:
    raw = orjson.dumps(body) + b" " * embeds_json.MIN_BODY_BYTES  # big enough; a long string elsewhere: no
    got = embeds_json.loads(raw, completion_slots)
    assert got is not None
    assert _plain(got) == orjson.loads(raw)
    assert completion_params(got) == completion_params(orjson.loads(raw))


@pytest.mark.parametrize("body", CHAT_BODIES)
@pytest.mark.usefixtures("short_strings")
def test_loads_chat_bodies(body: dict[str, Any]) -> None:
    raw = orjson.dumps(body) + b" " * embeds_json.MIN_BODY_BYTES
    got = embeds_json.loads(raw, chat_slots)
    assert got is not None
    assert _plain(got) == orjson.loads(raw)
    assert chat_params(got) == chat_params(orjson.loads(raw))


def test_loads_decodes_only_what_it_found() -> None:
    text = b64(BIG)
    raw = orjson.dumps({"model": MODEL, "prompt": "", "prompt_embeds": [text, b64(SMALL)]}) \
        + b"\n" * embeds_json.MIN_BODY_BYTES
    got = embeds_json.loads(raw, completion_slots)
    assert got is not None
    first, second = got["prompt_embeds"]
    assert type(first) is Base64Text and first.decoded == pybase64.b64decode(text)
    assert type(second) is str and second == b64(SMALL), "a short string is parsed as usual"


BIG_TEXT = "QUJD" * 100_000


@pytest.mark.parametrize("raw", [
    orjson.dumps({"model": MODEL, "prompt_embeds": b64(SMALL)}),  # a small body
    orjson.dumps({"model": MODEL, "prompt": BIG_TEXT, "prompt_embeds": b64(SMALL)}),  # a long string elsewhere
    orjson.dumps({"model": MODEL, BIG_TEXT: 1}),  # as a key
    orjson.dumps({"model": MODEL, "prompt_embeds": BIG_TEXT[:-1] + "é"}),  # not base64
    orjson.dumps({"model": MODEL, "prompt_embeds": BIG_TEXT[:-2] + "\n"}),  # an escape
    orjson.dumps({"model": MODEL, "prompt_embeds": BIG_TEXT[:-1]}),  # bad padding
    orjson.dumps({"model": MODEL, "prompt_embeds": BIG_TEXT + "=="}),
    orjson.dumps([BIG_TEXT]),  # not an object
    orjson.dumps({"model": MODEL, "prompt_embeds": BIG_TEXT})[:-1],  # truncated JSON
    orjson.dumps({"model": MODEL, "prompt_embeds": BIG_TEXT}) + b",",  # trailing garbage
    b'{"model": "m", "prompt_embeds": "' + BIG_TEXT.encode() + b'", "prompt_embeds": "'
    + BIG_TEXT.encode() + b'"}',  # a key twice
    b'{"model": "m", "prompt_embeds": ["\\"' + BIG_TEXT.encode() + b'"]}',  # after an escaped quote
    b'{"model": "m", "prompt_embeds": "' + BIG_TEXT.encode() + b'"' + BIG_TEXT.encode() + b'"}',
])
def test_loads_gives_up(raw: bytes) -> None:
    assert embeds_json.loads(raw, completion_slots) is None


# --- through the gateway: the same answer with and without the fast path -------------------------------------------


def _post(gw: Harness, path: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=20)


def _embeds(data: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": "", "prompt_embeds": data})


def _chat_part(part: dict[str, Any]) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": [part]}]})


CASES: list[tuple[str, bytes, bool]] = [
    # (path, body, whether embeds_json.loads reads it)
    *[("/v1/completions", orjson.dumps(b), True) for b in COMPLETION_BODIES[1:4]],
    *[("/v1/completions", orjson.dumps({**b, "stream": True}), True) for b in COMPLETION_BODIES[2:4]],
    *[("/v1/chat/completions", orjson.dumps(b), True) for b in CHAT_BODIES[1:]],
    *[("/v1/chat/completions", orjson.dumps({**b, "stream": True}), True) for b in CHAT_BODIES[1:]],
    ("/v1/completions", _embeds([b64(SMALL), "QUJD" * 8 + "%"]), False),
    ("/v1/completions", _embeds("QUJD" * 9 + "Q"), False),
    ("/v1/completions", _embeds("QUJD" * 9)[:-2], False),
    ("/v1/completions", orjson.dumps({"model": MODEL, "prompt": "QUJD" * 9, "max_tokens": 2}), False),
    ("/v1/completions", orjson.dumps({"model": MODEL, "prompt": "", "prompt_embeds": b64(SMALL), "bogus": 1}), True),
    ("/v1/completions", orjson.dumps({"model": 3, "prompt": "", "prompt_embeds": b64(SMALL)}), True),
    ("/v1/completions", orjson.dumps(["QUJD" * 9]), False),
    ("/v1/chat/completions", _chat_part({"type": "prompt_embeds", "data": "QUJD" * 9 + "!"}), False),
    ("/v1/chat/completions", _chat_part({"type": "image", "data": "QUJD" * 9}), True),
]


def _answer(gw: Harness, path: str, content: bytes) -> tuple[int, Any, list[Any]]:
    """Status, body (without ``created``) and what reached the fake preprocessor."""
    gw.fake.reset()
    r = _post(gw, path, content)
    sent = [(m, req) for m, req in gw.fake.requests]
    if r.status_code != 200:
        return r.status_code, r.content, sent
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [orjson.loads(e[len("data: "):]) if e != "data: [DONE]" else e for e in r.text.split("\n\n") if e]
        return 200, [{k: v for k, v in e.items() if k != "created"} if isinstance(e, dict) else e
                     for e in events], sent
    return 200, {k: v for k, v in r.json().items() if k != "created"}, sent


@pytest.mark.parametrize(("path", "content", "fast"), CASES)
def test_same_answer_with_and_without_fast_path(gw: Harness, monkeypatch: pytest.MonkeyPatch, path: str,
                                                content: bytes, fast: bool) -> None:
    usual = _answer(gw, path, content)
    monkeypatch.setattr(embeds_json, "MIN_BODY_BYTES", 0)
    monkeypatch.setattr(embeds_json, "MIN_STRING_BYTES", 30)
    read: list[bool] = []
    loads = embeds_json.loads

    def spy(raw: bytes, slots: Any) -> Any:
        body = loads(raw, slots)
        read.append(body is not None)
        return body

    monkeypatch.setattr(embeds_json, "loads", spy)
    assert _answer(gw, path, content) == usual
    assert read == [fast]
