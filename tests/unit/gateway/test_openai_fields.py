"""The OpenAI fields of issue #20 at the REST edge: each JSON field lands in the right proto field, and log-
probabilities and tool calls come back in OpenAI's shapes (whole and streamed), from a fake InferenceService."""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson

from embedmesh.common.v1 import common_pb2
from embedmesh.inference.v1 import inference_pb2
from tests.unit.gateway.conftest import MODEL, STOP, Harness, usage_event


def post(gw: Harness, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", content=orjson.dumps(body), headers={"content-type": "application/json"},
                      timeout=20)


def lp(token_id: int, token: str, value: float | None, top: list[tuple[int, str, float]] = ()) -> Any:
    out = common_pb2.TokenLogprob(token_id=token_id, token=token, bytes=token.encode())
    if value is not None:
        out.logprob = value
    for t, text, v in top:
        out.top.append(common_pb2.TopLogprob(token_id=t, token=text, logprob=v, bytes=text.encode()))
    return out


def test_completion_fields_reach_the_proto(gw: Harness) -> None:
    r = post(gw, "/v1/completions", {
        "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 0, "echo": True, "logprobs": 4, "presence_penalty": 0.5,
        "frequency_penalty": -0.25, "repetition_penalty": 1.1, "logit_bias": {"7": -100, "9": 2.5}, "min_tokens": 2,
        "guided_regex": "[a-z]+", "user": "ignored"})
    assert r.status_code == 200, r.text
    p = gw.fake.last("Complete").params
    s = p.sampling
    assert p.echo and s.max_tokens == 0 and s.HasField("max_tokens") and s.logprobs == 4
    assert (s.presence_penalty, s.frequency_penalty, s.min_tokens) == (0.5, -0.25, 2)
    assert abs(s.repetition_penalty - 1.1) < 1e-6
    assert dict(s.logit_bias) == {7: -100.0, 9: 2.5}
    assert s.structured.regex == "[a-z]+"


def test_response_format_and_structured_outputs_reach_the_proto(gw: Harness) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    post(gw, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": schema}}})
    assert json.loads(gw.fake.last("Chat").params.sampling.structured.json_schema) == schema
    post(gw, "/v1/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert list(gw.fake.last("Complete").params.sampling.structured.choice.values) == ["a", "b"]
    post(gw, "/v1/completions", {"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}})
    assert gw.fake.last("Complete").params.sampling.structured.json_object


def test_chat_tools_and_history_reach_the_proto(gw: Harness) -> None:
    tool = {"type": "function", "function": {"name": "f", "description": "d",
                                             "parameters": {"type": "object", "properties": {}}}}
    r = post(gw, "/v1/chat/completions", {
        "model": MODEL, "logprobs": True, "top_logprobs": 2, "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": None,
                      "tool_calls": [{"id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "42"}]})
    assert r.status_code == 200, r.text
    p = gw.fake.last("Chat").params
    assert p.sampling.logprobs == 2
    assert [(t.name, t.description, json.loads(t.parameters_json)) for t in p.tools] == [
        ("f", "d", {"type": "object", "properties": {}})]
    assert p.tool_choice.function == "f"
    assert p.messages[1].tool_calls[0].name == "f" and p.messages[2].tool_call_id == "call_1"


def test_completion_logprobs_with_echo_in_openai_shape(gw: Harness) -> None:
    gw.fake.script.choice_protos = [inference_pb2.Choice(
        index=0, text="AB C", finish_reason=STOP,
        prompt_logprobs=[lp(1, "A", None), lp(2, "B", -1.0, [(2, "B", -1.0)])],
        logprobs=[lp(3, " C", -0.5, [(3, " C", -0.5), (4, " D", -1.5)])])]
    r = post(gw, "/v1/completions", {"model": MODEL, "prompt": "AB", "echo": True, "logprobs": 1})
    got = r.json()["choices"][0]["logprobs"]
    assert got == {"tokens": ["A", "B", " C"], "token_logprobs": [None, -1.0, -0.5],
                   "top_logprobs": [None, {"B": -1.0}, {" C": -0.5, " D": -1.5}], "text_offset": [0, 1, 2]}


def test_chat_logprobs_and_tool_calls_in_openai_shape(gw: Harness) -> None:
    gw.fake.script.choice_protos = [inference_pb2.Choice(
        index=0, text="", finish_reason=STOP,
        logprobs=[lp(3, "{", -0.5, [(3, "{", -0.5), (4, "x", -1.5), (5, "y", -2.0)])],
        tool_calls=[inference_pb2.ToolCall(id="call_a", name="f", arguments='{"x": 1}')])]
    r = post(gw, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                          "logprobs": True, "top_logprobs": 2})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    entry = choice["logprobs"]["content"][0]
    assert entry["token"] == "{" and entry["logprob"] == -0.5 and entry["bytes"] == [123]
    assert [t["token"] for t in entry["top_logprobs"]] == ["{", "x"]  # trimmed to top_logprobs


def test_streamed_logprobs_continue_text_offsets_and_tool_calls_come_as_one_delta(gw: Harness) -> None:
    def msg(text: str, lps: list[Any], finish: int = 0, calls: list[Any] = ()) -> Any:
        return inference_pb2.StreamCompleteResponse(id="cmpl-fake", model=MODEL, index=0, text=text,
                                                    finish_reason=finish, logprobs=lps, tool_calls=calls)

    gw.fake.script.stream = [msg("ab", [lp(1, "a", -0.1), lp(2, "b", -0.2)]), msg("c", [lp(3, "c", -0.3)], STOP),
                             usage_event(1, 3)]
    r = post(gw, "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 0, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    offsets = [o for c in chunks for ch in c["choices"] if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2]
    gw.fake.script.stream = [msg("", [], STOP, [inference_pb2.ToolCall(id="call_b", name="f", arguments="{}")]),
                             usage_event(1, 3)]
    r = post(gw, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                          "stream": True, "tools": [{"type": "function", "function": {"name": "f"}}]})
    chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    calls = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls", [])]
    assert calls == [{"index": 0, "id": "call_b", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["tool_calls"]


def test_unknown_fields_are_refused_on_embeddings_too(gw: Harness) -> None:
    r = post(gw, "/v1/embeddings", {"model": MODEL, "input": "hi", "normalize": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "normalize"
    assert r.json()["error"]["code"] == "unknown_parameter"
