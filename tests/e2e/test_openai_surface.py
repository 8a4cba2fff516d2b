"""The OpenAI surface evaluation harnesses and real clients use, through the real mesh with the official openai SDK:
log-probabilities (checked against transformers computing them itself), echo scoring, penalties and logit_bias,
structured outputs (JSON schema, choice, regex), tool calling, unknown fields."""

from __future__ import annotations

import json
import random
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.conftest import MODEL, b64_of
from tests.support import generate as gen

pytestmark = pytest.mark.e2e

TEXT = "The capital of France is"


def _log_softmax_rows(model: Any, ids: list[int]) -> Any:
    """log_softmax of the logits at every position of ``ids``: row t predicts token t+1."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _greedy_reference(model: Any, ids: list[int], steps: int) -> tuple[list[int], list[Any]]:
    """Greedy continuation with transformers: the tokens and the log-softmax row each was picked from."""
    import torch

    out, rows = [], []
    cur = list(ids)
    for _ in range(steps):
        row = _log_softmax_rows(model, cur)[-1]
        t = int(torch.argmax(row))
        out.append(t)
        rows.append(row)
        cur.append(t)
    return out, rows


def test_completion_logprobs_equal_transformers(client: Any, hf_model: Any) -> None:
    model, tok = hf_model
    ids = tok(TEXT).input_ids
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=5, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    expected, rows = _greedy_reference(model, ids, 5)
    assert r.choices[0].text == tok.decode(expected)
    assert lp.tokens == [tok.decode([t]) for t in expected]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for i, t in enumerate(expected):
        assert lp.token_logprobs[i] == pytest.approx(float(rows[i][t]), abs=1e-4)
        top = rows[i].topk(5)
        want = {tok.decode([int(j)]): float(v) for v, j in zip(top.values, top.indices, strict=True)}
        got = lp.top_logprobs[i]
        assert 5 <= len(got) <= 6
        for token, value in want.items():
            assert got[token] == pytest.approx(value, abs=1e-4)
    # text_offset: where each token starts in the returned text.
    assert lp.text_offset[0] == 0
    for i in range(1, 5):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])


def test_prompt_embeds_give_the_same_logprobs_as_text(client: Any, embeds_of: Any) -> None:
    by_text = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, logprobs=2)
    by_embeds = client.completions.create(model=MODEL, prompt="", max_tokens=4, temperature=0, logprobs=2,
                                          extra_body={"prompt_embeds": b64_of(embeds_of(TEXT))})
    a, b = by_text.choices[0].logprobs, by_embeds.choices[0].logprobs
    assert a.tokens == b.tokens
    for x, y in zip(a.token_logprobs, b.token_logprobs, strict=True):
        assert x == pytest.approx(y, abs=1e-4)


def test_echo_scores_a_continuation_like_transformers(client: Any, hf_model: Any) -> None:
    """What loglikelihood scoring does: echo + max_tokens 0 + logprobs; the sum over the continuation's tokens."""
    model, tok = hf_model
    context, continuation = "The capital of France is", " Paris"
    ids = tok(context + continuation).input_ids
    n_ctx = len(tok(context).input_ids)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == tok.decode(ids)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None
    rows = _log_softmax_rows(model, ids)
    want = sum(float(rows[t - 1][ids[t]]) for t in range(n_ctx, len(ids)))
    got = sum(lp.token_logprobs[n_ctx:])
    assert got == pytest.approx(want, abs=1e-3)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)


def test_echo_with_text_prepends_the_prompt(client: Any) -> None:
    plain = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == TEXT + plain.choices[0].text


def test_echo_with_embeddings_is_a_clear_400(client: Any, embeds_of: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="", max_tokens=2, echo=True,
                                  extra_body={"prompt_embeds": b64_of(embeds_of(TEXT))})
    assert e.value.body["param"] == "echo"


def test_chat_logprobs_shape_and_values(client: Any, hf_model: Any) -> None:
    model, tok = hf_model
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    expected, rows = _greedy_reference(model, ids, 4)
    for i, entry in enumerate(content):
        assert entry.token == tok.decode([expected[i]])
        assert entry.logprob == pytest.approx(float(rows[i][expected[i]]), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(float(rows[i].max()), abs=1e-4)


def test_streamed_logprobs_match_the_whole_answer(client: Any) -> None:
    whole = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0, logprobs=0)
    tokens, values = [], []
    for chunk in client.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0, logprobs=0,
                                           stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == whole.choices[0].logprobs.tokens
    assert values == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)


def test_logit_bias_forces_and_forbids_tokens(client: Any, hf_model: Any) -> None:
    _, tok = hf_model
    forced = tok(" banana").input_ids[0]
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == tok.decode([forced] * 3)
    plain = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, temperature=0, logprobs=0)
    first = tok(plain.choices[0].text).input_ids[0]
    banned = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text


def test_frequency_penalty_matches_a_reference_loop(client: Any, hf_model: Any) -> None:
    import torch

    model, tok = hf_model
    prompt = "one one one one one one"
    ids = tok(prompt).input_ids
    counts: dict[int, int] = {}
    cur, out = list(ids), []
    for _ in range(8):
        with torch.no_grad():
            logits = model(torch.tensor([cur])).logits[0, -1].float()
        for t, c in counts.items():
            logits[t] -= 1.5 * c + 0.5
        t = int(torch.argmax(logits))
        out.append(t)
        counts[t] = counts.get(t, 0) + 1
        cur.append(t)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, frequency_penalty=1.5,
                                  presence_penalty=0.5)
    assert r.choices[0].text == tok.decode(out)


def _random_schema(rng: random.Random) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["string", "integer", "boolean", "enum"])
        name = f"{rng.choice(['name', 'size', 'ok', 'color', 'count'])}_{i}"
        if kind == "string":
            props[name] = {"type": "string", "maxLength": rng.randint(1, 8)}
        elif kind == "integer":
            props[name] = {"type": "integer", "minimum": 0, "maximum": rng.randint(1, 999)}
        elif kind == "boolean":
            props[name] = {"type": "boolean"}
        else:
            props[name] = {"enum": rng.sample(["red", "green", "blue", "small", "large"], 2)}
    return {"type": "object", "properties": props, "required": sorted(props),
            "additionalProperties": False}


def test_json_schema_output_parses_and_validates_for_20_random_schemas(client: Any) -> None:
    rng = random.Random(20)
    for i in range(20):
        schema = _random_schema(rng)
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a thing as JSON."}], max_tokens=80,
            temperature=0.8, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_vllm_structured_outputs(client: Any) -> None:
    r = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)
    r = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=5, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="A code:", max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    import re

    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


def test_tool_call_round_trip_streaming(client: Any) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], max_tokens=60, temperature=0, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function:
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert len(calls) == 1
    call = calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    args = json.loads(call["arguments"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature_c": 21, "sky": "clear"})},
    ]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=20,
                                           temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content


def test_required_tool_choice_always_calls(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                       tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls and msg.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logprobs": 21}, "logprobs"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"extra_body": {"made_up_field": 1}}, "made_up_field"),
    ({"extra_body": {"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}},
     "response_format.json_schema.schema"),
])
def test_bad_new_fields_are_400_naming_the_field(client: Any, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, **kwargs)
    assert e.value.body["param"] == param


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_bad_chat_fields_are_400_naming_the_field(client: Any, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       **kwargs)
    assert e.value.body["param"] == param


def test_empty_prompt_embeds_beside_text_means_none(client: Any) -> None:
    plain = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0)
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0,
                                  extra_body={"prompt_embeds": []})
    assert r.choices[0].text == plain.choices[0].text


def test_grpc_clients_get_logprobs_as_messages(mesh: Any, hf_model: Any) -> None:
    model, tok = hf_model
    ids = tok(TEXT).input_ids
    expected, rows = _greedy_reference(model, ids, 3)
    with grpc.insecure_channel(mesh.preprocessor) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        params = inference_pb2.CompletionParams(model=MODEL, prompts=[TEXT])
        params.sampling.max_tokens = 3
        params.sampling.temperature = 0
        params.sampling.logprobs = 2
        resp = gen.complete(stub, params, timeout=120)
    lps = resp.choices[0].logprobs
    assert [lp.token_id for lp in lps] == expected
    for lp, row in zip(lps, rows, strict=True):
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert lp.token == tok.decode([lp.token_id])
        assert [t.token_id for t in lp.top][:2] == [int(i) for i in row.topk(2).indices]
