"""The gateway's own bounds on a body's lists (``body_bounds.py``), through a real gateway over HTTP with the openai
SDK: one item past a bound is a 400 ``invalid_request_error`` naming the field (``param``) with the rule, and the
refusal comes before any item is converted — the request models' ``parse`` is never entered (a counting spy on
each route's ``parse``; a bounded body that is let through does enter it) and nothing reaches the preprocessor."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import openai
import orjson
import pytest

from embedmesh.gateway import GatewayConfig, embeddings, responses, translate
from embedmesh.gateway.body_bounds import MAX_EMBED_INPUTS, MAX_PARTS, MAX_PROMPTS, MAX_TOOLS
from embedmesh.gateway.embeds_json import MIN_BODY_BYTES
from tests.unit.gateway.conftest import MODEL, Harness


class Spy:
    """Counts the calls of one module's ``parse`` (the conversion of a body into its typed model)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
        self.calls = 0
        real = module.parse

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "parse", counted)


@pytest.fixture(scope="module")
def wide(harness: Harness, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A gateway with the default bounds and body limit (1 GiB), before the fake preprocessor."""
    return harness.run(harness._serve(GatewayConfig(
        port=0, preprocessor=harness.grpc.address,
        responses_db=str(tmp_path_factory.mktemp("wide") / "responses.sqlite3"))))


@pytest.fixture(scope="module")
def small(harness: Harness, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A gateway with ``max_messages=3``."""
    return harness.run(harness._serve(GatewayConfig(
        port=0, preprocessor=harness.grpc.address, max_messages=3,
        responses_db=str(tmp_path_factory.mktemp("small") / "responses.sqlite3"))))


@pytest.fixture
def client(gw: Harness, wide: str) -> openai.OpenAI:
    return sdk(wide)


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def refused(call: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.status_code == 400 and e.value.type == "invalid_request_error"
    return e.value


def user(n: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"}] * n


def test_100000_messages_are_refused_before_any_is_converted(gw: Harness, client: openai.OpenAI,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch, translate)
    body = orjson.dumps({"model": MODEL, "messages": user(100_000)})
    r = httpx.post(f"{client.base_url}chat/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages" and error["code"] == "too_many"
    assert "at most 2048 messages" in error["message"] and "100000" in error["message"]
    err = refused(lambda: client.chat.completions.create(model=MODEL, messages=user(2049)))
    assert err.param == "messages" and err.code == "too_many" and "at most 2048 messages" in err.message
    assert spy.calls == 0 and gw.fake.requests == []
    # 2048 (the default bound) are converted and sent
    client.chat.completions.create(model=MODEL, messages=user(2048))
    assert spy.calls == 1 and len(gw.fake.last("Chat").params.messages) == 2048


def test_max_messages_is_the_configured_bound(gw: Harness, small: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch, translate)
    err = refused(lambda: sdk(small).chat.completions.create(model=MODEL, messages=user(4)))
    assert err.param == "messages" and "at most 3 messages" in err.message and spy.calls == 0
    sdk(small).chat.completions.create(model=MODEL, messages=user(3))
    assert spy.calls == 1 and len(gw.fake.last("Chat").params.messages) == 3


def test_a_big_body_is_bounded_before_its_base64_is_looked_for(gw: Harness, client: openai.OpenAI,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Over ``embeds_json.MIN_BODY_BYTES`` with a long base64 part the body takes the fast reader, which walks the
    messages for their base64 slots: the count comes first there too."""
    from embedmesh.gateway import completions

    walked = Spy(monkeypatch, translate)
    slots = {"calls": 0}
    real = completions.chat_slots

    def counted(body: Any) -> Any:
        slots["calls"] += 1
        return real(body)

    monkeypatch.setattr(completions, "chat_slots", counted)
    data = base64.b64encode(b"\0" * MIN_BODY_BYTES).decode()
    messages = [{"role": "user", "content": [{"type": "prompt_embeds", "data": data}]}] + user(3000)
    err = refused(lambda: client.chat.completions.create(model=MODEL, messages=messages))
    assert err.param == "messages" and err.code == "too_many"
    assert slots["calls"] == 0 and walked.calls == 0 and gw.fake.requests == []


def test_content_parts_in_all(gw: Harness, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch, translate)
    half = [{"type": "text", "text": "a"}] * (MAX_PARTS // 2)
    err = refused(lambda: client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": half}, {"role": "user", "content": "plain"},
        {"role": "user", "content": half + [{"type": "text", "text": "b"}]}]))
    assert err.param == "messages[2].content" and f"at most {MAX_PARTS} content parts" in err.message
    assert spy.calls == 0 and gw.fake.requests == []


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("tools", [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
               for i in range(MAX_TOOLS + 1)], f"at most {MAX_TOOLS} tools"),
    ("stop", ["x"] * 100_000, "at most 16 stop strings"),
    ("logit_bias", {str(i): 1 for i in range(100_000)}, "at most 300 token ids"),
])
def test_chat_lists(gw: Harness, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch, field: str, value: Any,
                    rule: str) -> None:
    spy = Spy(monkeypatch, translate)
    err = refused(lambda: client.chat.completions.create(model=MODEL, messages=user(1), **{field: value}))
    assert err.param == field and err.code == "too_many" and rule in err.message
    assert spy.calls == 0 and gw.fake.requests == []


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("prompt", ["p"] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS} prompts"),
    ("prompt", [[1, 2]] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS} prompts"),
    ("stop", ["x"] * 17, "at most 16 stop strings"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "at most 300 token ids"),
])
def test_completion_lists(gw: Harness, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch, field: str,
                          value: Any, rule: str) -> None:
    spy = Spy(monkeypatch, translate)
    kwargs = {"prompt": "hi", field: value}
    err = refused(lambda: client.completions.create(model=MODEL, **kwargs))
    assert err.param == field and err.code == "too_many" and rule in err.message
    assert spy.calls == 0 and gw.fake.requests == []


def test_completion_prompt_embeds_list(gw: Harness, wide: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch, translate)
    r = httpx.post(f"{wide}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "", "prompt_embeds": ["AAAA"] * (MAX_PROMPTS + 1)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_embeds" and error["code"] == "too_many"
    assert spy.calls == 0 and gw.fake.requests == []


def test_one_long_token_id_prompt_is_one_prompt(gw: Harness, client: openai.OpenAI) -> None:
    """A list of token ids is one prompt, not MAX_PROMPTS of them: it goes on (its length is the context's rule)."""
    client.completions.create(model=MODEL, prompt=list(range(MAX_PROMPTS + 10)))
    assert list(gw.fake.last("Complete").params.prompt_token_ids[0].ids) == list(range(MAX_PROMPTS + 10))


def test_embedding_inputs(gw: Harness, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch, embeddings)
    for value in (["a"] * (MAX_EMBED_INPUTS + 1), [[1]] * (MAX_EMBED_INPUTS + 1)):
        err = refused(lambda v=value: client.embeddings.create(model=MODEL, input=v))
        assert err.param == "input" and err.code == "too_many" and f"at most {MAX_EMBED_INPUTS} inputs" in err.message
    assert spy.calls == 0 and gw.fake.requests == []


def test_responses_input_items(gw: Harness, small: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch, responses)
    items = [{"role": "user", "content": "hi"}] * 4
    err = refused(lambda: sdk(small).responses.create(model=MODEL, input=items))
    assert err.param == "input" and err.code == "too_many" and "at most 3 input items" in err.message
    assert spy.calls == 0 and gw.fake.requests == []
    sdk(small).responses.create(model=MODEL, input=items[:3], store=False)
    assert spy.calls == 1 and len(gw.fake.last("Chat").params.messages) == 3


def test_responses_conversation_is_bounded_with_its_history(gw: Harness, small: str) -> None:
    """Each turn is within the bound; the stored conversation and the new input together are not."""
    first = sdk(small).responses.create(model=MODEL, input=[{"role": "user", "content": "hi"}] * 2)
    err = refused(lambda: sdk(small).responses.create(model=MODEL, input="again", previous_response_id=first.id))
    assert err.param == "input" and err.code == "too_many" and "at most 3" in err.message
    assert len(gw.fake.requests) == 1


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("metadata", {f"k{i}": "v" for i in range(17)}, "at most 16 keys"),
    ("metadata", {"k": "v" * 513}, "values at most 512"),
    ("metadata", {"k" * 65: "v"}, "keys are at most 64 characters"),
    ("include", ["message.output_text.logprobs"] * 17, "at most 16 names"),
    ("tools", [{"type": "function", "name": f"f{i}"} for i in range(MAX_TOOLS + 1)], f"at most {MAX_TOOLS} tools"),
    ("stop", ["x"] * 17, "at most 16 stop strings"),
])
def test_responses_lists(gw: Harness, small: str, monkeypatch: pytest.MonkeyPatch, field: str, value: Any,
                         rule: str) -> None:
    spy = Spy(monkeypatch, responses)
    r = httpx.post(f"{small}/v1/responses", timeout=60, json={"model": MODEL, "input": "hi", field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] in ("too_many", "too_long") and rule in error["message"]
    assert spy.calls == 0 and gw.fake.requests == []


@pytest.fixture(scope="module")
def vs_url(harness: Harness) -> str:
    """A gateway serving the vector store routes, its vector store unreachable: a body let through gets 503."""
    return harness.run(harness._serve(GatewayConfig(port=0, preprocessor=harness.grpc.address,
                                                    vector_store="127.0.0.1:1")))


@pytest.mark.parametrize(("path", "body", "param", "rule"), [
    ("/v1/vector_stores", {"file_ids": ["file-x"] * 501}, "file_ids", "at most 500 file ids"),
    ("/v1/vector_stores", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 keys"),
    ("/v1/vector_stores/vs_1/file_batches", {"files": [{"file_id": "f"}] * 501}, "files", "at most 500 files"),
    ("/v1/vector_stores/vs_1/file_batches", {"file_ids": ["f"], "attributes": {f"k{i}": 1 for i in range(17)}},
     "attributes", "at most 16 keys"),
    ("/v1/vector_stores/vs_1/search", {"query": ["q"] * 17}, "query", "at most 16 queries"),
    ("/v1/vector_stores/vs_1/files", {"file_id": "f", "attributes": {f"k{i}": 1 for i in range(100_000)}},
     "attributes", "at most 16 keys"),
])
def test_vector_store_lists(gw: Harness, vs_url: str, monkeypatch: pytest.MonkeyPatch, path: str,
                            body: dict[str, Any], param: str, rule: str) -> None:
    from embedmesh.gateway import vector_stores

    spy = Spy(monkeypatch, vector_stores)
    r = httpx.post(f"{vs_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "too_many" and rule in error["message"]
    assert spy.calls == 0


def test_a_file_batchs_own_attributes_are_counted_before_they_are_read(gw: Harness, vs_url: str) -> None:
    r = httpx.post(f"{vs_url}/v1/vector_stores/vs_1/file_batches", timeout=60,
                   json={"files": [{"file_id": "f", "attributes": {f"k{i}": 1 for i in range(17)}}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "files[0].attributes" and error["code"] == "too_many"
    # within every bound: on to the (unreachable) vector store
    r = httpx.post(f"{vs_url}/v1/vector_stores/vs_1/search", json={"query": ["q"] * 16}, timeout=60)
    assert r.status_code == 503, r.text
