"""The gateway sends a request under the pieces threshold as one ``InferenceService.GenerateInline`` message (a unary
request; a whole answer read as a unary call) and a big payload as a ``Generate`` pieces stream, with the bypasses on
and off; the preprocessor's answers and refusals come back the same through either."""

from __future__ import annotations

import httpx
import pytest

from embedmesh.core import fastpath
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.transport import thresholds
from tests.unit.gateway.conftest import MODEL
from tests.unit.gateway.test_pieces_body import _PiecesHarness, b64, pgw, rows, saved  # noqa: F401 - pgw: fixture


@pytest.mark.parametrize("fast, unary_max", [(True, thresholds.UNARY_ANSWER_MAX), (True, 0), (False, 0)])
def test_small_requests_go_inline_and_big_ones_as_pieces(pgw: _PiecesHarness, fast: bool,  # noqa: F811
                                                         unary_max: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastpath, "enabled", lambda: fast)
    monkeypatch.setattr(thresholds, "UNARY_ANSWER_MAX", unary_max)  # 0: whole answers read as streaming calls too
    fake = pgw.fake
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    for path, payload, shape in (("completions", body, "Complete"), ("chat/completions", chat, "Chat")):
        for stream in (False, True):
            before = fake.inline_calls
            r = httpx.post(f"{pgw.url}/v1/{path}", json={**payload, "stream": stream}, timeout=30)
            assert r.status_code == 200, r.text
            assert "Hel" in r.text
            assert fake.inline_calls == before + 1
            assert fake.requests[-1][0] == ("Stream" if stream else "") + shape
    small = {**body, "prompt": "", "prompt_embeds": b64(saved(rows(100, 128)))}  # 50 KiB: under the threshold
    before = fake.inline_calls
    assert httpx.post(f"{pgw.url}/v1/completions", json=small, timeout=30).status_code == 200
    assert fake.inline_calls == before + 1 and fake.requests[-1][0] == "Complete"
    big = {**body, "prompt": "", "prompt_embeds": b64(saved(rows(2500, 128)))}
    assert httpx.post(f"{pgw.url}/v1/completions", json=big, timeout=30).status_code == 200
    assert fake.inline_calls == before + 1 and fake.requests[-1][0] == "CompleteChunks"


@pytest.mark.parametrize("stream", [False, True])
def test_a_refusal_of_an_inline_call_is_the_preprocessors(pgw: _PiecesHarness, stream: bool) -> None:  # noqa: F811
    pgw.fake.script.error = InvalidArgument("sampling.temperature: must be in [0, 2]", field="temperature",
                                            reason="OUT_OF_RANGE")
    try:
        r = httpx.post(f"{pgw.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": stream},
                       timeout=30)
    finally:
        pgw.fake.script.error = None
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "temperature"
