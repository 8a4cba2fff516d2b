"""The Python client (clients/python) against the real mesh: raw tensors from numpy and torch, streaming, chat,
embeddings, chunked upload-once, typed errors, async."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from embedmesh_client import AsyncClient, Client, EmbedmeshClientError, from_tensor, to_tensor

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e

TEXT = "The capital of France is"


@pytest.fixture
def pc(mesh: Any) -> Any:
    with Client(mesh.preprocessor, timeout=120) as c:
        yield c


def test_numpy_and_torch_tensors_give_the_text_prompt_answer(pc: Client, client: Any, embeds_of: Any) -> None:
    expected = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0).choices[0].text
    emb = embeds_of(TEXT)
    by_numpy = pc.complete(MODEL, embeds=emb.numpy(), max_tokens=8, temperature=0)
    by_torch = pc.complete(MODEL, embeds=emb.requires_grad_(False), max_tokens=8, temperature=0)
    assert by_numpy.choices[0].text == by_torch.choices[0].text == expected
    streamed = "".join(e.text for e in pc.stream_complete(MODEL, embeds=emb.numpy(), max_tokens=8, temperature=0))
    assert streamed == expected


def test_bf16_and_fp16_tensors_are_accepted(pc: Client, embeds_of: Any) -> None:
    import torch

    emb = embeds_of(TEXT)
    msg = to_tensor(emb.to(torch.bfloat16))
    assert np.array_equal(from_tensor(msg), emb.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    for t in (emb.to(torch.bfloat16), emb.to(torch.float16)):
        r = pc.complete(MODEL, embeds=t, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens == emb.shape[0] and r.choices[0].text


def test_chunked_upload_then_use_by_id(pc: Client, embeds_of: Any) -> None:
    big = np.random.default_rng(0).standard_normal((6000, 576), dtype=np.float32)  # 13.8 MB, in 1 MiB chunks
    key = pc.upload_embeds(big)
    assert key.startswith("emb-") and pc.upload_embeds(big) != key  # ids are random, never content hashes
    emb = embeds_of(TEXT).numpy()
    key2 = pc.upload_embeds(emb)
    a = pc.complete(MODEL, embeds=key2, max_tokens=6, temperature=0)
    b = pc.complete(MODEL, embeds=emb, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text


def test_chat_and_embeddings(pc: Client, embeds_of: Any) -> None:
    q = "What is the capital of France?"
    by_text = pc.chat(MODEL, [{"role": "user", "content": q}], max_tokens=6, temperature=0)
    by_tensor = pc.chat(MODEL, [{"role": "user", "content": [{"type": "prompt_embeds", "tensor": embeds_of(q)}]}],
                        max_tokens=6, temperature=0)
    assert by_text.choices[0].text == by_tensor.choices[0].text
    vectors = pc.embed("all-MiniLM-L6-v2", ["hello", "world"])
    assert vectors.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert {m.id for m in pc.list_models()} >= {MODEL, "all-MiniLM-L6-v2"}


def test_errors_are_typed_with_field_and_reason(pc: Client) -> None:
    with pytest.raises(EmbedmeshClientError) as info:
        pc.complete(MODEL, embeds=np.zeros((3, 7), np.float32))
    assert info.value.field == "prompt_embeds" and info.value.reason == "HIDDEN_SIZE_MISMATCH"
    with pytest.raises(EmbedmeshClientError) as info:
        pc.complete(MODEL, embeds="emb-unknown")
    assert info.value.code.name == "NOT_FOUND"


def test_async_client(mesh: Any, embeds_of: Any) -> None:
    async def go() -> tuple[str, str]:
        async with AsyncClient(mesh.preprocessor) as c:
            whole = await c.complete(MODEL, embeds=embeds_of(TEXT).numpy(), max_tokens=6, temperature=0)
            parts = [e.text async for e in c.stream_complete(MODEL, prompt=TEXT, max_tokens=6, temperature=0)]
            return whole.choices[0].text, "".join(parts)

    whole, streamed = asyncio.run(go())
    assert whole == streamed


def test_big_tensors_go_in_pieces_past_any_message_size_limit(mesh: Any, pc: Client) -> None:
    # 1200 x 576 float32 = 2.8 MB: over the 1 MiB threshold, so the client sends it as Generate rows in 1 MiB pieces,
    # and a client whose messages may not exceed 1.5 MiB still gets the answer one big message gives.
    big = np.random.default_rng(1).standard_normal((1200, 576), dtype=np.float32) * 0.05
    expected = pc.complete(MODEL, embeds=big, max_tokens=5, temperature=0)
    with Client(mesh.preprocessor, timeout=120, max_message_bytes=3 << 19) as small:
        got = small.complete(MODEL, embeds=[big, big[:7]], prefix=big[:3], max_tokens=5, temperature=0)
        assert got.usage.prompt_tokens == 1200 + 7 + 2 * 3
        alone = small.complete(MODEL, embeds=big, max_tokens=5, temperature=0)
        streamed = "".join(e.text for e in small.stream_complete(MODEL, embeds=big, max_tokens=5, temperature=0))
        chat = [{"role": "user", "content": [{"type": "prompt_embeds", "tensor": big}]}]
        assert small.chat(MODEL, chat, max_tokens=3, temperature=0).choices[0].text == \
            "".join(e.text for e in small.stream_chat(MODEL, chat, max_tokens=3, temperature=0)) == \
            pc.chat(MODEL, chat, max_tokens=3, temperature=0).choices[0].text
        with pytest.raises(EmbedmeshClientError) as info:  # the NaN is found by the mesh, named as always
            bad = big.copy()
            bad[1000, 3] = np.nan
            small.complete(MODEL, embeds=bad, max_tokens=5)
    assert alone.choices[0].text == streamed == expected.choices[0].text
    assert (info.value.field, info.value.reason) == ("prompt_embeds", "NON_FINITE")

    async def go() -> tuple[str, str]:
        async with AsyncClient(mesh.preprocessor, max_message_bytes=3 << 19) as c:
            whole = await c.complete(MODEL, embeds=big, max_tokens=5, temperature=0)
            parts = [e.text async for e in c.stream_complete(MODEL, embeds=big, max_tokens=5, temperature=0)]
            chat = [{"role": "user", "content": [{"type": "prompt_embeds", "tensor": big}]}]
            one = (await c.chat(MODEL, chat, max_tokens=3, temperature=0)).choices[0].text
            assert one == "".join([e.text async for e in c.stream_chat(MODEL, chat, max_tokens=3, temperature=0)])
            return whole.choices[0].text, "".join(parts)

    assert asyncio.run(go()) == (expected.choices[0].text, expected.choices[0].text)
