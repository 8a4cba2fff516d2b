"""Completions from prompt embeddings and text through the real mesh, with the official openai SDK."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import MODEL, b64_of

pytestmark = pytest.mark.e2e

TEXT = "The capital of France is"


def greedy(client: Any, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 12)
    return client.completions.create(model=MODEL, temperature=0, **kw)


def test_embeds_give_the_same_text_as_the_text_prompt(client: Any, embeds_of: Any, hf_model: Any) -> None:
    emb = embeds_of(TEXT)
    by_text = greedy(client, prompt=TEXT)
    by_embeds = greedy(client, prompt="", extra_body={"prompt_embeds": b64_of(emb)})
    assert by_text.choices[0].text, "the model produced no text"
    assert by_embeds.choices[0].text == by_text.choices[0].text
    assert by_embeds.usage.prompt_tokens == emb.shape[0]
    assert by_embeds.usage.completion_tokens == 12
    assert by_embeds.usage.total_tokens == by_embeds.usage.prompt_tokens + by_embeds.usage.completion_tokens
    # The text path counts the same positions.
    _, tok = hf_model
    assert by_text.usage.prompt_tokens == len(tok(TEXT).input_ids)


def test_reference_generation_matches_transformers(client: Any, hf_model: Any) -> None:
    """The mesh's greedy text equals transformers' own generate() on the same weights (not just self-consistent)."""
    import torch

    model, tok = hf_model
    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    got = greedy(client, prompt=TEXT, max_tokens=8).choices[0].text
    assert got == expected


def test_three_d_tensor_counts_as_two_d(client: Any, embeds_of: Any) -> None:
    emb = embeds_of(TEXT)
    flat = greedy(client, prompt="", extra_body={"prompt_embeds": b64_of(emb)})
    batched = greedy(client, prompt="", extra_body={"prompt_embeds": b64_of(emb.unsqueeze(0))})
    assert batched.choices[0].text == flat.choices[0].text
    assert batched.usage.prompt_tokens == emb.shape[0]


def test_list_of_embeds_and_text_prompt_order(client: Any, embeds_of: Any) -> None:
    a, b = "The capital of France is", "One, two, three,"
    refs = [greedy(client, prompt=p, max_tokens=6) for p in (a, b, "My favourite colour is")]
    ref_a, ref_b, ref_c = (x.choices[0].text for x in refs)
    r = greedy(
        client, prompt="My favourite colour is", max_tokens=6,
        extra_body={"prompt_embeds": [b64_of(embeds_of(a)), b64_of(embeds_of(b))]},
    )
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts == [ref_a, ref_b, ref_c]
    assert r.usage.completion_tokens == sum(x.usage.completion_tokens for x in refs)
    assert r.usage.prompt_tokens == sum(x.usage.prompt_tokens for x in refs)


def test_streaming_matches_non_streaming(client: Any, embeds_of: Any) -> None:
    body = {"prompt_embeds": b64_of(embeds_of(TEXT))}
    whole = greedy(client, prompt="", max_tokens=16, extra_body=body)
    stream = greedy(client, prompt="", max_tokens=16, extra_body=body, stream=True,
                    stream_options={"include_usage": True})
    parts, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.text)
            if c.finish_reason is not None:
                finishes.append(c.finish_reason)
    assert "".join(parts) == whole.choices[0].text
    assert finishes == [whole.choices[0].finish_reason]
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens


def test_stream_raw_sse_ends_with_done_and_no_usage_unless_asked(mesh: Any, embeds_of: Any) -> None:
    import httpx
    import orjson

    payload = {"model": MODEL, "prompt": TEXT, "max_tokens": 5, "temperature": 0, "stream": True, "n": 2}
    with httpx.stream("POST", f"{mesh.base_url}/v1/completions", json=payload, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    finish_by_index: dict[int, list[str]] = {}
    for ch in chunks:
        assert ch["object"] == "text_completion"
        assert ch.get("usage") is None
        for c in ch["choices"]:
            if c["finish_reason"] is not None:
                finish_by_index.setdefault(c["index"], []).append(c["finish_reason"])
    assert finish_by_index == {0: ["length"], 1: ["length"]}


def test_max_tokens_and_finish_reasons(client: Any) -> None:
    r = greedy(client, prompt=TEXT, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_stop_string_ends_generation_before_it(client: Any) -> None:
    full = greedy(client, prompt=TEXT, max_tokens=12).choices[0].text
    assert len(full) > 4
    stop = full.strip()[2:5]
    cut = greedy(client, prompt=TEXT, max_tokens=12, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert full.startswith(cut.text)


def test_seed_makes_sampling_repeatable_and_n_gives_choices(client: Any) -> None:
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, n=3, **kw)
    b = client.completions.create(seed=1234, n=3, **kw)
    ta = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    tb = [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(ta) == 3
    assert ta == tb
    assert len(set(ta)) > 1, "three sampled choices were identical"
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_text_prompt_list_and_token_ids(client: Any, hf_model: Any) -> None:
    _, tok = hf_model
    ids = tok(TEXT).input_ids
    r = greedy(client, prompt=[TEXT, "One, two, three,"], max_tokens=5)
    assert len(r.choices) == 2
    by_ids = greedy(client, prompt=ids, max_tokens=5)
    assert by_ids.choices[0].text == sorted(r.choices, key=lambda c: c.index)[0].text


def test_models_and_health(mesh: Any, client: Any) -> None:
    import httpx

    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "all-MiniLM-L6-v2"}
    assert models[MODEL].model_extra["task"] == "generate"
    assert models["all-MiniLM-L6-v2"].model_extra["task"] == "embed"
    assert httpx.get(f"{mesh.base_url}/health", timeout=10).status_code == 200
