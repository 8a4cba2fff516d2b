"""The Python client sends small generations (raw tensors under 1 MiB) as one ``GenerateInline`` message and big ones
as a ``Generate`` pieces stream, sync and async, streamed or whole: counted by the preprocessor's own
``embedmesh_rpc_requests_total`` per method."""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Any

import numpy as np
import pytest
from embedmesh_client import AsyncClient, Client, EmbedmeshClientError

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e

TEXT = "The capital of France is"


def calls(mesh: Any) -> dict[tuple[str, str], float]:
    """The preprocessor's finished calls by (method, code), for its two generation methods."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{mesh.extra['metrics_base'] + 1}/metrics", timeout=10).read()
    out: dict[tuple[str, str], float] = {}
    for line in text.decode().splitlines():
        if line.startswith("embedmesh_rpc_requests_total{") and 'service="preprocessor"' in line:
            labels = dict(p.split("=", 1) for p in line[line.index("{") + 1:line.index("}")].split(","))
            key = (labels["method"].strip('"'), labels["code"].strip('"'))
            if key[0] in ("Generate", "GenerateInline"):
                out[key] = float(line.rsplit(" ", 1)[1])
    return out


def grew(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float], method: str,
         code: str = "OK") -> float:
    return after.get((method, code), 0.0) - before.get((method, code), 0.0)


def test_small_generations_are_one_inline_call_and_big_ones_a_pieces_stream(mesh: Any, embeds_of: Any) -> None:
    emb = embeds_of(TEXT).numpy()
    chat = [{"role": "user", "content": [{"type": "prompt_embeds", "tensor": emb}]}]
    with Client(mesh.preprocessor, timeout=120) as pc:
        before = calls(mesh)
        whole = pc.complete(MODEL, embeds=emb, max_tokens=6, temperature=0).choices[0].text
        streamed = "".join(e.text for e in pc.stream_complete(MODEL, embeds=emb, max_tokens=6, temperature=0))
        by_chat = pc.chat(MODEL, chat, max_tokens=4, temperature=0).choices[0].text
        chat_streamed = "".join(e.text for e in pc.stream_chat(MODEL, chat, max_tokens=4, temperature=0))
        with pytest.raises(EmbedmeshClientError) as info:  # a refusal through the unary read is typed as ever
            pc.complete(MODEL, embeds=np.zeros((3, 7), np.float32))
        after = calls(mesh)
        assert whole and whole == streamed and by_chat == chat_streamed
        assert (info.value.field, info.value.reason) == ("prompt_embeds", "HIDDEN_SIZE_MISMATCH")
        assert grew(before, after, "GenerateInline") == 4
        assert grew(before, after, "GenerateInline", "INVALID_ARGUMENT") == 1
        assert grew(before, after, "Generate") == 0
        big = np.random.default_rng(1).standard_normal((1200, 576), dtype=np.float32) * 0.05  # 2.8 MB
        pc.complete(MODEL, embeds=big, max_tokens=2, temperature=0)
        again = calls(mesh)
        assert grew(after, again, "Generate") == 1 and grew(after, again, "GenerateInline") == 0

    async def go() -> tuple[str, str]:
        async with AsyncClient(mesh.preprocessor) as c:
            w = await c.complete(MODEL, embeds=emb, max_tokens=6, temperature=0)
            parts = [e.text async for e in c.stream_chat(MODEL, chat, max_tokens=4, temperature=0)]
            with pytest.raises(EmbedmeshClientError) as err:
                await c.complete(MODEL, embeds=np.zeros((3, 7), np.float32))
            assert err.value.reason == "HIDDEN_SIZE_MISMATCH"
            return w.choices[0].text, "".join(parts)

    a_whole, a_chat = asyncio.run(go())
    end = calls(mesh)
    assert (a_whole, a_chat) == (whole, by_chat)
    assert grew(again, end, "GenerateInline") == 2 and grew(again, end, "GenerateInline", "INVALID_ARGUMENT") == 1
    assert grew(again, end, "Generate") == 0
