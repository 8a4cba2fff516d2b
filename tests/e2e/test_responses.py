"""The Responses API (/v1/responses) through a real mesh and the official openai SDK: create (string and item
inputs, instructions, streaming), retrieve, input_items, delete, previous_response_id, background + cancel, tenants,
bad input. On an echo mesh (answers "x" per token, so usage tells exactly which prompt the worker got: each
Responses request is compared with the chat completion it means); the few checks where meaning matters (prompt
embeddings equal to their text, a follow-up turn, a function-tool round trip) on the real SmolLM2 mesh."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import HIDDEN, MODEL, b64_of
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

KA, KB = "sk-responses-alpha-0123456789", "sk-responses-beta-0123456789"


@pytest.fixture(scope="module")
def emesh() -> Iterator[Mesh]:
    db = os.path.join(tempfile.mkdtemp(prefix="embedmesh-responses-"), "responses.sqlite3")
    m = start_mesh(engine="echo", env={"EMBEDMESH_TRACE_CONSOLE": "0", "EMBEDMESH_API_KEYS": f"{KA}=alpha,{KB}=beta",
                                       "EMBEDMESH_GATEWAY_RESPONSES_DB": db,
                                       # tensors of 8 KiB and more go as pieces (Generate rows), as big ones do
                                       "EMBEDMESH_GATEWAY_PIECES_MIN_BYTES": "8192"})
    m.extra["model"] = httpx.get(f"{m.base_url}/v1/models", headers={"authorization": f"Bearer {KA}"},
                                 timeout=30).json()["data"][0]["id"]
    yield m
    m.stop()


def _client(m: Mesh, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{m.base_url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture
def alpha(emesh: Mesh) -> openai.OpenAI:
    return _client(emesh, KA)


@pytest.fixture
def beta(emesh: Mesh) -> openai.OpenAI:
    return _client(emesh, KB)


def _chat_prompt_tokens(c: openai.OpenAI, model: str, messages: list[dict[str, Any]]) -> int:
    return c.chat.completions.create(model=model, messages=messages, max_tokens=1).usage.prompt_tokens


def test_create_retrieve_input_items_delete(alpha: openai.OpenAI, emesh: Mesh) -> None:
    model = emesh.extra["model"]
    r = alpha.responses.create(model=model, input="Hello there", max_output_tokens=5, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == "xxxxx"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    # echo stops on the token limit: OpenAI's "incomplete" with its reason
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    assert r.usage.input_tokens == _chat_prompt_tokens(alpha, model, [{"role": "user", "content": "Hello there"}])
    assert r.usage.total_tokens == r.usage.input_tokens + 5
    again = alpha.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == "xxxxx" and again.usage.total_tokens == r.usage.total_tokens
    items = alpha.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hello there")]
    deleted = alpha.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        alpha.responses.delete(r.id)


def test_instructions_and_message_items_are_the_chat_they_mean(alpha: openai.OpenAI, emesh: Mesh) -> None:
    model = emesh.extra["model"]
    items = [{"role": "developer", "content": "Be terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"type": "message", "role": "user", "content": "And another?"}]
    r = alpha.responses.create(model=model, instructions="You are a painter.", input=items, max_output_tokens=3)
    chat = [{"role": "system", "content": "You are a painter."}, {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And another?"}]
    assert r.usage.input_tokens == _chat_prompt_tokens(alpha, model, chat)
    assert r.instructions == "You are a painter."
    # the instructions are not an input item
    listed = alpha.responses.input_items.list(r.id, order="asc")
    assert [i.role for i in listed.data] == ["developer", "user", "assistant", "user"]


def test_previous_response_id_continues_the_stored_conversation(alpha: openai.OpenAI, emesh: Mesh) -> None:
    model = emesh.extra["model"]
    one = alpha.responses.create(model=model, input="My name is Ada.", max_output_tokens=4)
    two = alpha.responses.create(model=model, input="What is my name?", previous_response_id=one.id,
                                 max_output_tokens=2)
    history = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "xxxx"},
               {"role": "user", "content": "What is my name?"}]
    assert two.previous_response_id == one.id
    assert two.usage.input_tokens == _chat_prompt_tokens(alpha, model, history)
    three = alpha.responses.create(model=model, input="Bye.", previous_response_id=two.id, max_output_tokens=1)
    history += [{"role": "assistant", "content": "xx"}, {"role": "user", "content": "Bye."}]
    assert three.usage.input_tokens == _chat_prompt_tokens(alpha, model, history)
    # turn 2's own input items only
    assert [i.content[0].text for i in alpha.responses.input_items.list(two.id).data] == ["What is my name?"]


def test_function_call_items_as_input(alpha: openai.OpenAI, emesh: Mesh) -> None:
    model = emesh.extra["model"]
    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear"}'}]
    r = alpha.responses.create(model=model, input=items, tools=[tool], max_output_tokens=2)
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
    expected = alpha.chat.completions.create(model=model, messages=chat, max_tokens=1,
                                             tools=[{"type": "function", "function": {
                                                 k: v for k, v in tool.items() if k != "type"}}])
    assert r.usage.input_tokens == expected.usage.prompt_tokens
    assert r.tools[0].name == "get_weather"


def test_stream_event_sequence(alpha: openai.OpenAI, emesh: Mesh) -> None:
    model = emesh.extra["model"]
    events = list(alpha.responses.create(model=model, input="Count.", max_output_tokens=4, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")  # the mesh may send several tokens in one delta
    assert 1 <= deltas <= 4
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "xxxx"
    final = events[-1].response
    assert final.output_text == "xxxx" and final.usage.output_tokens == 4
    # a streamed response is stored like any other
    assert alpha.responses.retrieve(final.id).output_text == "xxxx"
    with alpha.responses.stream(model=model, input="Again.", max_output_tokens=3) as stream:
        seen = list(stream)
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == "xxx"
    assert seen[-1].type == "response.incomplete" and seen[-1].response.output_text == "xxx"


def test_store_false_is_not_stored(alpha: openai.OpenAI, emesh: Mesh) -> None:
    r = alpha.responses.create(model=emesh.extra["model"], input="Hi", max_output_tokens=1, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        alpha.responses.create(model=emesh.extra["model"], input="Hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def test_another_tenants_response_is_the_same_404(alpha: openai.OpenAI, beta: openai.OpenAI, emesh: Mesh) -> None:
    model = emesh.extra["model"]
    r = alpha.responses.create(model=model, input="secret", max_output_tokens=1)
    unknown = "resp_" + "0" * 48
    for call in (lambda rid: beta.responses.retrieve(rid), lambda rid: beta.responses.delete(rid),
                 lambda rid: beta.responses.input_items.list(rid), lambda rid: beta.responses.cancel(rid)):
        with pytest.raises(openai.NotFoundError) as theirs:
            call(r.id)
        with pytest.raises(openai.NotFoundError) as none:
            call(unknown)
        assert theirs.value.body["code"] == none.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        beta.responses.create(model=model, input="hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    assert alpha.responses.retrieve(r.id).output_text == "x"  # still there for its tenant


def test_input_items_pages(alpha: openai.OpenAI, emesh: Mesh) -> None:
    items = [{"role": "user", "content": f"item {i}"} for i in range(5)]
    r = alpha.responses.create(model=emesh.extra["model"], input=items, max_output_tokens=1)
    first = alpha.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in first.data] == ["item 0", "item 1"] and first.has_more
    rest = alpha.responses.input_items.list(r.id, limit=10, order="asc", after=first.last_id)
    assert [i.content[0].text for i in rest.data] == ["item 2", "item 3", "item 4"] and not rest.has_more
    desc = alpha.responses.input_items.list(r.id)
    assert [i.content[0].text for i in desc.data] == [f"item {i}" for i in range(4, -1, -1)]
    everything = [i.content[0].text for i in alpha.responses.input_items.list(r.id, limit=2, order="asc")]
    assert everything == [f"item {i}" for i in range(5)]  # the SDK's auto-paging follows last_id


def test_background_then_cancel(alpha: openai.OpenAI, emesh: Mesh) -> None:
    model = emesh.extra["model"]
    done = alpha.responses.create(model=model, input="Hi", max_output_tokens=2, background=True)
    assert done.status in ("queued", "in_progress", "incomplete")
    for _ in range(200):
        got = alpha.responses.retrieve(done.id)
        if got.status not in ("queued", "in_progress"):
            break
    assert got.status == "incomplete" and got.output_text == "xx"
    with pytest.raises(openai.BadRequestError):
        alpha.responses.cancel(done.id)  # finished: nothing to cancel
    long = alpha.responses.create(model=model, input="Go on", max_output_tokens=900_000, background=True)
    cancelled = alpha.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert alpha.responses.retrieve(long.id).status == "cancelled"
    assert alpha.responses.cancel(long.id).status == "cancelled"  # idempotent
    with pytest.raises(openai.BadRequestError) as e:
        alpha.responses.create(model=model, input="Hi", previous_response_id=long.id)
    assert e.value.body["param"] == "previous_response_id"


_EMBEDS_PART = {"type": "input_prompt_embeds", "data": "%%%"}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": ["hi", {"role": "user", "content": [_EMBEDS_PART]}]}, "input[0]"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [_EMBEDS_PART]}]},
     "input[1].content[0].data"),
    ({"input": [{"role": "user", "content": [{"type": "input_prompt_embeds"}]}]}, "input[0].content[0].data"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "top_p": 7}, "top_p"),
    ({"input": "hi", "seed": "x"}, "seed"),
    ({"input": "hi", "instructions": 3}, "instructions"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "description": "no name"}]}, "tools[0].name"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": "hi", "store": False, "background": True}, "background"),
    ({"input": "hi", "made_up": 1}, "made_up"),
    ({"input": "hi", "previous_response_id": ""}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_prompt_embeds", "data": None}]}]},
     "input[0].content[0].data"),
])
def test_bad_input_is_a_400_naming_the_field(emesh: Mesh, body: dict[str, Any], param: str) -> None:
    body = {"model": emesh.extra["model"], **body}
    r = httpx.post(f"{emesh.base_url}/v1/responses", json=body, headers={"authorization": f"Bearer {KA}"},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_tensor_the_preprocessor_refuses_names_the_input_part(alpha: openai.OpenAI, emesh: Mesh) -> None:
    import torch

    bad = {"type": "input_prompt_embeds", "data": b64_of(torch.randn(3, 7))}  # wrong hidden size
    with pytest.raises(openai.BadRequestError) as e:
        alpha.responses.create(model=emesh.extra["model"], max_output_tokens=1,
                               input=[{"role": "user", "content": [{"type": "input_text", "text": "a"}, bad]}])
    assert e.value.body["param"].startswith("input[0].content[1]")
    good = {"type": "input_prompt_embeds", "data": b64_of(torch.zeros(4, HIDDEN))}
    r = alpha.responses.create(model=emesh.extra["model"], max_output_tokens=1,
                               input=[{"role": "user", "content": [{"type": "input_text", "text": "a"}, good]}])
    assert r.output_text == "x"


def test_an_input_image_is_the_chat_image_part_it_means(alpha: openai.OpenAI, emesh: Mesh) -> None:
    import base64
    from importlib import metadata

    png = metadata.distribution("scikit-image").locate_file("skimage/data/coffee.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    model = emesh.extra["model"]
    r = alpha.responses.create(model=model, max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]}])
    assert r.output_text == "xx"
    chat = _chat_prompt_tokens(alpha, model, [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])
    text_only = _chat_prompt_tokens(alpha, model, [{"role": "user", "content": "What is this?"}])
    assert r.usage.input_tokens == chat > text_only  # the image's rows reached the worker, as chat's do
    with pytest.raises(openai.BadRequestError) as e:  # a truncated picture: refused naming the Responses part
        alpha.responses.create(model=model, max_output_tokens=1, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(png[:5000]).decode()}]}])
    assert e.value.body["param"] == "input[0].content[0].image_url"


# --- the real model: where meaning matters ------------------------------------------------------------------------
QUESTION = "What is the capital of France?"


def test_embeddings_part_answers_like_its_text(client: Any, embeds_of: Any) -> None:
    by_text = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Answer briefly."}, {"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=8, temperature=0)
    by_embeds = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Answer briefly."},
        {"type": "input_prompt_embeds", "data": b64_of(embeds_of(QUESTION))}]}], max_output_tokens=8, temperature=0)
    assert by_text.output_text
    assert by_embeds.output_text == by_text.output_text
    assert by_embeds.usage.input_tokens == by_text.usage.input_tokens


def test_second_turn_answers_as_the_whole_chat_would(client: Any) -> None:
    one = client.responses.create(model=MODEL, input="My favourite city is Lyon.", max_output_tokens=8,
                                  temperature=0)
    two = client.responses.create(model=MODEL, input="Which city did I name?", previous_response_id=one.id,
                                  max_output_tokens=8, temperature=0)
    whole = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "My favourite city is Lyon."}, {"role": "assistant", "content": one.output_text},
        {"role": "user", "content": "Which city did I name?"}])
    assert two.output_text == whole.choices[0].message.content
    assert two.usage.input_tokens == whole.usage.prompt_tokens
    with client.responses.stream(model=MODEL, input="Which city did I name?", previous_response_id=one.id,
                                 max_output_tokens=40, temperature=0) as stream:
        streamed = stream.get_final_response()  # the SDK's helper: needs response.completed (the model stopped)
    assert streamed.output_text.startswith(two.output_text)


WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


def test_function_tool_round_trip(client: Any) -> None:
    import jsonschema

    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                    temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    final = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                    max_output_tokens=20, temperature=0, input=[
                                        {"type": "function_call_output", "call_id": calls[0].call_id,
                                         "output": json.dumps({"temperature_c": 21, "sky": "clear"})}])
    assert final.output[0].type == "message" and final.output_text


def test_an_uploaded_tensor_by_id_is_the_same_prompt_as_its_data(alpha: openai.OpenAI, emesh: Mesh) -> None:
    import torch

    model = emesh.extra["model"]
    data = b64_of(torch.ones(6, HIDDEN) * 0.01)
    up = httpx.post(f"{emesh.base_url}/v1/prompt_embeds", json={"data": data},
                    headers={"authorization": f"Bearer {KA}"}, timeout=30)
    assert up.status_code == 200, up.text

    def ask(part: dict[str, Any], key: openai.OpenAI) -> Any:
        return key.responses.create(model=model, max_output_tokens=1, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Look:"}, part]}])

    by_data = ask({"type": "input_prompt_embeds", "data": data}, alpha)
    by_id = ask({"type": "input_prompt_embeds", "id": up.json()["id"]}, alpha)
    assert by_id.usage.input_tokens == by_data.usage.input_tokens
    assert by_data.usage.input_tokens == ask({"type": "input_text", "text": "x"}, alpha).usage.input_tokens + 5
    # a follow-up turn re-sends the stored tensor by id: same prompt as the whole history by data
    two = alpha.responses.create(model=model, max_output_tokens=1, input="More?", previous_response_id=by_id.id)
    whole = alpha.responses.create(model=model, max_output_tokens=1, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                     {"type": "input_prompt_embeds", "data": data}]},
        {"role": "assistant", "content": "x"}, {"role": "user", "content": "More?"}])
    assert two.usage.input_tokens == whole.usage.input_tokens
    beta = _client(emesh, KB)
    with pytest.raises(openai.NotFoundError) as e:  # another tenant's upload
        ask({"type": "input_prompt_embeds", "id": up.json()["id"]}, beta)
    assert e.value.body["param"].startswith("input[0].content[1]")


def test_a_big_tensor_part_and_its_follow_up(alpha: openai.OpenAI, emesh: Mesh) -> None:
    """A body over 1 MiB: its base64 is read already decoded (embeds_json), sent as pieces, and stored as base64
    again for the next turn."""
    import torch

    model = emesh.extra["model"]
    data = b64_of(torch.full((600, HIDDEN), 0.02))
    part = {"type": "input_prompt_embeds", "data": data}
    one = alpha.responses.create(model=model, max_output_tokens=2, input=[{"role": "user", "content": [part]}])
    small = alpha.responses.create(model=model, max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_prompt_embeds", "data": b64_of(torch.full((1, HIDDEN), 0.02))}]}])
    assert one.usage.input_tokens == small.usage.input_tokens + 599
    two = alpha.responses.create(model=model, max_output_tokens=1, input="Again", previous_response_id=one.id)
    whole = alpha.responses.create(model=model, max_output_tokens=1, store=False, input=[
        {"role": "user", "content": [part]}, {"role": "assistant", "content": "xx"},
        {"role": "user", "content": "Again"}])
    assert two.usage.input_tokens == whole.usage.input_tokens
    listed = alpha.responses.input_items.list(one.id).data[0]
    assert listed.content[0].data == data  # the stored item is the base64 it was sent as
