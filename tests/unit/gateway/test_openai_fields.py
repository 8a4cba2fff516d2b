"""The OpenAI fields of issue #20 at the REST edge: each JSON field lands in the right proto field, and log-
probabilities and tool calls come back in OpenAI's shapes (whole and streamed), from a fake InferenceService."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.gateway.translate import CHAT_FIELDS, COMPLETION_FIELDS, IGNORED_FIELDS
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


def chunks_of(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]


def stream_msg(text: str, lps: list[Any], finish: int = 0, prompt_lps: list[Any] = ()) -> Any:
    return inference_pb2.StreamCompleteResponse(id="cmpl-fake", model=MODEL, index=0, text=text,
                                                finish_reason=finish, logprobs=lps, prompt_logprobs=prompt_lps)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

# (case id, fields over CHAT, expected param, a word the message must hold)
CHAT_BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("top_logprobs without logprobs", {"top_logprobs": 3}, "top_logprobs", "logprobs: true"),
    ("top_logprobs with logprobs false", {"logprobs": False, "top_logprobs": 3}, "top_logprobs", "logprobs: true"),
    ("top_logprobs above 20", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("logprobs an integer", {"logprobs": 5}, "logprobs", "boolean"),
    ("tool without a name", {"tools": [{"type": "function", "function": {"description": "d"}}]},
     "tools[0].function.name", "required"),
    ("tool name with a space", {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools[0].function.name", "letters"),
    ("tool name past 64", {"tools": [{"type": "function", "function": {"name": "f" * 65}}]},
     "tools[0].function.name", "1-64"),
    ("tool twice", {"tools": [TOOL, TOOL]}, "tools[1].function.name", "twice"),
    ("tool of another type", {"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
    ("tool without function", {"tools": [{"type": "function"}]}, "tools[0].function", "required"),
    ("tool parameters not a schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "potato"}}}}}]},
     "tools[0].function.parameters", "valid JSON schema"),
    ("tool strict a string", {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools[0].function.strict", "boolean"),
    ("tools not a list", {"tools": {"name": "f"}}, "tools", "list"),
    ("tool_choice naming an unknown function", {"tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, "tool_choice", "get_time"),
    ("tool_choice required without tools", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("tool_choice auto without tools", {"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ("tool_choice an unknown mode", {"tools": [TOOL], "tool_choice": "always"}, "tool_choice", "required"),
    ("tool message without tool_call_id", {"messages": [{"role": "user", "content": "hi"},
                                                       {"role": "tool", "content": "42"}]},
     "messages[1].tool_call_id", "required"),
    ("tool_calls on a user message", {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
     "messages[0].tool_calls", "assistant"),
    ("tool call without a function name", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name", "required"),
    ("tool call arguments not a string", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}]},
     "messages[0].tool_calls[0].function.arguments", "string"),
    ("unknown field", {"reasoning_effrot": "low"}, "reasoning_effrot", "not a parameter"),
    ("two constraints", {"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
     "guided_json", "combined"),
    ("two keys of structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", "exactly one"),
    ("guided_json not a schema", {"guided_json": {"type": "potato"}}, "guided_json", "valid JSON schema"),
    ("logit_bias key not an integer", {"logit_bias": {"hello": 5}}, "logit_bias", "token id"),
    ("logit_bias value below -100", {"logit_bias": {"5": -100.5}}, "logit_bias", "[-100, 100]"),
    ("min_tokens negative", {"min_tokens": -1}, "min_tokens", ">= 0"),
    ("functions (legacy)", {"functions": [{"name": "f"}]}, "functions", "use tools"),
    ("store true", {"store": True}, "store", "not supported"),
    ("min_p other than 0", {"min_p": 0.05}, "min_p", "not supported"),
    ("audio output", {"audio": {"voice": "alloy"}}, "audio", "text only"),
]


@pytest.mark.parametrize("name,fields,param,word", CHAT_BAD, ids=[c[0] for c in CHAT_BAD])
def test_bad_chat_fields_are_400_naming_the_param(gw: Harness, name: str, fields: dict[str, Any], param: str,
                                                  word: str) -> None:
    r = post(gw, "/v1/chat/completions", {**CHAT, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert word in err["message"], err["message"]
    assert gw.fake.requests == [], "a request the gateway refuses never reaches the preprocessor"


COMPLETION_BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("logprobs negative", {"logprobs": -1}, "logprobs", "[0, 20]"),
    ("store true", {"store": True}, "store", "not supported"),
    ("min_p other than 0", {"min_p": 0.1}, "min_p", "not supported"),
    ("tools on completions", {"tools": [TOOL]}, "tools", "not a parameter"),
    ("guided_choice of a number", {"guided_choice": [1, 2]}, "guided_choice", "strings"),
    ("guided_regex empty", {"guided_regex": ""}, "guided_regex", "non-empty"),
    ("structured json_object false", {"structured_outputs": {"json_object": "yes"}},
     "structured_outputs.json_object", "true"),
    ("response_format json_schema as text not JSON", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": "{not json"}}}, "response_format.json_schema.schema", "JSON schema"),
]


@pytest.mark.parametrize("name,fields,param,word", COMPLETION_BAD, ids=[c[0] for c in COMPLETION_BAD])
def test_bad_completion_fields_are_400_naming_the_param(gw: Harness, name: str, fields: dict[str, Any], param: str,
                                                        word: str) -> None:
    r = post(gw, "/v1/completions", {"model": MODEL, "prompt": "hi", **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err
    assert gw.fake.requests == []


IGNORED_VALUES = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                  "parallel_tool_calls": False, "min_p": 0}


@pytest.mark.parametrize("path,body,method", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}, "Complete"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 3}, "Chat"),
], ids=["completions", "chat"])
def test_accepted_and_ignored_fields_change_nothing_sent(gw: Harness, path: str, body: dict[str, Any],
                                                         method: str) -> None:
    assert set(IGNORED_VALUES) >= IGNORED_FIELDS
    assert post(gw, path, body).status_code == 200
    plain = gw.fake.last(method).params
    r = post(gw, path, {**body, **IGNORED_VALUES})
    assert r.status_code == 200, r.text
    assert gw.fake.last(method).params == plain


def test_empty_prompt_embeds_beside_a_text_prompt_means_none(gw: Harness) -> None:
    r = post(gw, "/v1/completions", {"model": MODEL, "prompt": "hi", "prompt_embeds": []})
    assert r.status_code == 200, r.text
    p = gw.fake.last("Complete").params
    assert list(p.prompts) == ["hi"] and len(p.prompt_embeds) == 0


def test_response_format_text_and_tool_choice_none_set_nothing(gw: Harness) -> None:
    r = post(gw, "/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}, "tool_choice": "none",
                                          "logprobs": True})
    assert r.status_code == 200, r.text
    p = gw.fake.last("Chat").params
    assert not p.sampling.HasField("structured") and p.tool_choice.mode == "none" and len(p.tools) == 0
    assert p.sampling.HasField("logprobs") and p.sampling.logprobs == 0


def test_structured_outputs_json_as_text_and_guided_json_reach_the_proto(gw: Harness) -> None:
    schema = {"type": "array", "items": {"type": "string"}}
    post(gw, "/v1/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {"json": json.dumps(schema)}})
    assert json.loads(gw.fake.last("Complete").params.sampling.structured.json_schema) == schema
    post(gw, "/v1/completions", {"model": MODEL, "prompt": "x", "guided_json": schema})
    assert json.loads(gw.fake.last("Complete").params.sampling.structured.json_schema) == schema
    post(gw, "/v1/completions", {"model": MODEL, "prompt": "x", "guided_grammar": 'root ::= "a"'})
    assert gw.fake.last("Complete").params.sampling.structured.grammar == 'root ::= "a"'
    post(gw, "/v1/completions", {"model": MODEL, "prompt": [5, 6], "prompt_logprobs": 3, "max_tokens": 0,
                                 "echo": True})
    s = gw.fake.last("Complete").params.sampling
    assert s.prompt_logprobs == 3 and not s.HasField("logprobs")


def test_vllm_prompt_logprobs_shape(gw: Harness) -> None:
    gw.fake.script.choice_protos = [inference_pb2.Choice(
        index=0, text="", finish_reason=common_pb2.FINISH_REASON_LENGTH,
        prompt_logprobs=[lp(5, "A", None), lp(6, "B", -2.0, [(7, "C", -0.5)])])]
    r = post(gw, "/v1/completions", {"model": MODEL, "prompt": [5, 6], "prompt_logprobs": 1, "max_tokens": 0,
                                     "echo": True})
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None
    assert choice["prompt_logprobs"] == [None, {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "C"},
                                                "6": {"logprob": -2.0, "rank": None, "decoded_token": "B"}}]


def test_plain_responses_carry_null_logprobs(gw: Harness) -> None:
    r = post(gw, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert r.json()["choices"][0]["logprobs"] is None and "prompt_logprobs" not in r.json()["choices"][0]
    r = post(gw, "/v1/chat/completions", CHAT)
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "Hello there"}


def test_streamed_echo_puts_the_prompt_logprobs_in_the_first_chunk(gw: Harness) -> None:
    # float32 on the wire: values exact in binary
    gw.fake.script.stream = [
        stream_msg("Hi", [], prompt_lps=[lp(1, "H", None), lp(2, "i", -1.5, [(9, "o", -0.25)])]),
        stream_msg("!", [lp(3, "!", -0.375, [(3, "!", -0.375)])]),
        stream_msg(" x", [lp(4, " x", -0.75, [(4, " x", -0.75)])], STOP), usage_event(2, 2)]
    r = post(gw, "/v1/completions", {"model": MODEL, "prompt": "Hi", "echo": True, "logprobs": 1, "stream": True})
    got = [ch["logprobs"] for c in chunks_of(r) for ch in c["choices"] if ch["logprobs"]]
    assert got == [
        {"tokens": ["H", "i"], "token_logprobs": [None, -1.5], "top_logprobs": [None, {"o": -0.25}],
         "text_offset": [0, 1]},
        {"tokens": ["!"], "token_logprobs": [-0.375], "top_logprobs": [{"!": -0.375}], "text_offset": [2]},
        {"tokens": [" x"], "token_logprobs": [-0.75], "top_logprobs": [{" x": -0.75}], "text_offset": [3]}]
    assert "".join(ch["text"] for c in chunks_of(r) for ch in c["choices"]) == "Hi! x"


def test_streamed_chat_logprobs_come_with_their_chunk(gw: Harness) -> None:
    gw.fake.script.stream = [
        stream_msg("Hel", [lp(1, "Hel", -0.125, [(1, "Hel", -0.125), (2, "Hi", -2.5)])]),
        stream_msg("lo", [lp(3, "lo", -0.25, [(3, "lo", -0.25), (4, "p", -3.0)])], STOP), usage_event(2, 2)]
    r = post(gw, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 1, "stream": True})
    chunks = [ch for c in chunks_of(r) for ch in c["choices"]]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""} and chunks[0]["logprobs"] is None
    assert [ch["delta"].get("content") for ch in chunks[1:]] == ["Hel", "lo"]
    assert [ch["logprobs"] for ch in chunks[1:]] == [
        {"content": [{"token": "Hel", "logprob": -0.125, "bytes": list(b"Hel"),
                      "top_logprobs": [{"token": "Hel", "logprob": -0.125, "bytes": list(b"Hel")}]}]},
        {"content": [{"token": "lo", "logprob": -0.25, "bytes": list(b"lo"),
                      "top_logprobs": [{"token": "lo", "logprob": -0.25, "bytes": list(b"lo")}]}]}]
    assert [ch["finish_reason"] for ch in chunks] == [None, None, "stop"]


def test_tool_calls_with_text_keep_the_text_and_list_every_call(gw: Harness) -> None:
    gw.fake.script.choice_protos = [inference_pb2.Choice(
        index=0, text="Let me check.", finish_reason=STOP,
        tool_calls=[inference_pb2.ToolCall(id="call_1", name="a", arguments="{}"),
                    inference_pb2.ToolCall(id="call_2", name="b", arguments='{"y": 2}')])]
    r = post(gw, "/v1/chat/completions", {**CHAT, "tools": [
        {"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] \
        == [("call_1", "a", "{}"), ("call_2", "b", '{"y": 2}')]
    p = gw.fake.last("Chat").params
    assert [(t.name, t.parameters_json) for t in p.tools] == [("a", ""), ("b", "")]


DOC = Path(__file__).resolve().parents[3] / "docs" / "openai-fields.md"


def test_every_accepted_field_is_in_the_docs_table() -> None:
    text = DOC.read_text()
    documented = set(re.findall(r"`([a-z_]+)`", text))
    assert (COMPLETION_FIELDS | CHAT_FIELDS) - documented == set()
    ignored = text.split("## Accepted and ignored", 1)[1].split("\n## ", 1)[0]
    assert IGNORED_FIELDS - set(re.findall(r"`([a-z_]+)`", ignored)) == set()
