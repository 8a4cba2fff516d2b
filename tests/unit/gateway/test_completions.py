"""/v1/completions through the real openai SDK and raw httpx against the fake preprocessor: the translated
CompletionParams, OpenAI's response and chunk shapes, and the error table."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import orjson
import pytest

from embedmesh.core.errors import (
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from embedmesh.tensor.v1 import tensor_pb2
from tests.unit.gateway.conftest import LENGTH, MODEL, STOP, Harness, delta, usage_event

EMBEDS_A = b"\x80\x02fake torch.save bytes \x00\xff" * 3
EMBEDS_B = b"safetensors-ish header and data"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def post(gw: Harness, body: Any, **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes | str) else orjson.dumps(body)
    return httpx.post(f"{gw.url}/v1/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=20, **kw)


def sse(text: str) -> list[str]:
    """The data payloads of an SSE body, in order; asserts every event is `data: ...` followed by a blank line."""
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def assert_good_request_still_works(gw: Harness) -> None:
    gw.fake.reset()
    r = post(gw, {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Hello there"


# --- translation ----------------------------------------------------------------------------------------------------


def test_sdk_text_prompt_and_sampling_fields_are_translated(client: Any, gw: Harness) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=7, temperature=0.5, top_p=0.9,
                                    seed=42, stop=["\n", "END"], n=2, user="someone", frequency_penalty=0,
                                    presence_penalty=0.0, extra_body={"top_k": 20, "ignore_eos": True})
    p = gw.fake.last("Complete").params
    assert p.model == MODEL
    assert list(p.prompts) == ["Once upon"]
    assert not p.prompt_token_ids and not p.prompt_embeds
    assert p.n == 2
    s = p.sampling
    assert s.max_tokens == 7 and s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert s.top_k == 20 and s.seed == 42 and list(s.stop) == ["\n", "END"] and s.ignore_eos is True
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL
    assert out.choices[0].text == "Hello there" and out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 2 and out.usage.total_tokens == 7


def test_unset_sampling_fields_stay_unset(client: Any, gw: Harness) -> None:
    client.completions.create(model=MODEL, prompt="x", stop="END")
    p = gw.fake.last("Complete").params
    s = p.sampling
    assert not p.HasField("n")
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert not s.HasField(name), name
    assert list(s.stop) == ["END"] and s.ignore_eos is False


def test_sdk_prompt_embeds_single_and_list(client: Any, gw: Harness) -> None:
    client.completions.create(model=MODEL, prompt="", extra_body={"prompt_embeds": b64(EMBEDS_A)})
    p = gw.fake.last("Complete").params
    assert list(p.prompts) == [], "an empty prompt beside prompt_embeds is dropped"
    assert len(p.prompt_embeds) == 1
    enc = p.prompt_embeds[0].encoded
    assert enc.data == EMBEDS_A and enc.encoding == tensor_pb2.TENSOR_ENCODING_UNSPECIFIED

    client.completions.create(model=MODEL, prompt=["", ""], extra_body={"prompt_embeds": [b64(EMBEDS_A),
                                                                                        b64(EMBEDS_B)]})
    p = gw.fake.last("Complete").params
    assert list(p.prompts) == []
    assert [e.encoded.data for e in p.prompt_embeds] == [EMBEDS_A, EMBEDS_B]


def test_text_beside_prompt_embeds_is_kept(client: Any, gw: Harness) -> None:
    client.completions.create(model=MODEL, prompt="also this", extra_body={"prompt_embeds": b64(EMBEDS_A)})
    p = gw.fake.last("Complete").params
    assert list(p.prompts) == ["also this"] and len(p.prompt_embeds) == 1


@pytest.mark.parametrize("prompt,texts,ids", [
    ("hello", ["hello"], []),
    (["a", "b"], ["a", "b"], []),
    ([1, 2, 3], [], [[1, 2, 3]]),
    ([[1, 2], [3]], [], [[1, 2], [3]]),
    ("", [""], []),  # alone, an empty prompt is passed on: the preprocessor rejects it (one rule, one place)
])
def test_prompt_forms(gw: Harness, prompt: Any, texts: list[str], ids: list[list[int]]) -> None:
    r = post(gw, {"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    p = gw.fake.last("Complete").params
    assert list(p.prompts) == texts
    assert [list(t.ids) for t in p.prompt_token_ids] == ids


# --- response shapes ------------------------------------------------------------------------------------------------


def test_non_stream_shape(gw: Harness) -> None:
    gw.fake.script.choices = [("one", STOP), ("two", LENGTH)]
    r = post(gw, {"model": MODEL, "prompt": "x", "n": 2})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "text": "one", "finish_reason": "stop", "logprobs": None},
        {"index": 1, "text": "two", "finish_reason": "length", "logprobs": None},
    ]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_shape_raw(gw: Harness, include_usage: bool) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": "x", "n": 2, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    r = post(gw, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = sse(r.text)
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    chunks = [orjson.loads(d) for d in data[:-1]]
    assert gw.fake.last("StreamComplete").params.n == 2
    text: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for c in chunks:
        assert c["object"] == "text_completion" and c["id"].startswith("cmpl-") and c["model"] == MODEL
        if include_usage:
            assert "usage" in c
        else:
            assert "usage" not in c
        for ch in c["choices"]:
            assert set(ch) == {"index", "text", "finish_reason", "logprobs"} and ch["logprobs"] is None
            text[ch["index"]] += ch["text"]
            if ch["finish_reason"] is not None:
                finishes[ch["index"]].append(ch["finish_reason"])
    assert text == {0: "Hello", 1: "World"}
    assert finishes == {0: ["stop"], 1: ["length"]}
    if include_usage:
        assert all(c["usage"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    else:
        assert all(c["choices"] for c in chunks)


def test_stream_with_sdk(client: Any, gw: Harness) -> None:
    stream = client.completions.create(model=MODEL, prompt="", stream=True, stream_options={"include_usage": True},
                                       extra_body={"prompt_embeds": b64(EMBEDS_A)})
    chunks = list(stream)
    assert [e.encoded.data for e in gw.fake.last("StreamComplete").params.prompt_embeds] == [EMBEDS_A]
    assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == 0) == "Hello"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 7
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 2


def test_duplicate_finish_reason_from_upstream_is_sent_once(gw: Harness) -> None:
    gw.fake.script.stream = [delta(0, "a"), delta(0, "b", STOP), delta(0, "", STOP), usage_event(1, 2)]
    data = sse(post(gw, {"model": MODEL, "prompt": "x", "stream": True}).text)
    finishes = [ch["finish_reason"] for d in data[:-1] for ch in orjson.loads(d)["choices"] if ch["finish_reason"]]
    assert finishes == ["stop"]


def test_error_after_the_stream_started_is_an_sse_error_event(gw: Harness) -> None:
    gw.fake.script.stream = [delta(0, "partial"), Unavailable("the worker went away", reason="WORKER_LOST")]
    r = post(gw, {"model": MODEL, "prompt": "x", "stream": True})
    assert r.status_code == 200
    data = sse(r.text)
    assert orjson.loads(data[0])["choices"][0]["text"] == "partial"
    err = orjson.loads(data[-2])["error"]
    assert err["message"] == "the worker went away" and err["code"] == "worker_lost"
    assert data[-1] == "[DONE]"
    assert_good_request_still_works(gw)


def test_error_before_the_first_event_is_a_plain_error_response(gw: Harness) -> None:
    gw.fake.script.error = InvalidArgument("prompt_embeds: hidden size 7, the model's is 576", field="prompt_embeds",
                                           reason="EMBEDS_HIDDEN_SIZE")
    r = post(gw, {"model": MODEL, "prompt": "", "stream": True, "prompt_embeds": b64(EMBEDS_A)})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["param"] == "prompt_embeds"


# --- errors ---------------------------------------------------------------------------------------------------------

EMBEDS = {"prompt": "", "prompt_embeds": b64(EMBEDS_A)}

# (case id, body fields over {"model": MODEL, "prompt": "hi"}, expected param, a word the message must hold)
BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("invalid base64", {"prompt_embeds": "not base64 at all!!"}, "prompt_embeds", "base64"),
    ("invalid base64 padding", {"prompt_embeds": "QUJD"[:3]}, "prompt_embeds", "base64"),
    ("invalid base64 in a list", {"prompt_embeds": [b64(EMBEDS_A), "%%%"]}, "prompt_embeds[1]", "base64"),
    ("prompt_embeds not a string", {"prompt_embeds": 12}, "prompt_embeds", "base64"),
    ("prompt_embeds empty list alone", {"prompt": None, "prompt_embeds": []}, "prompt_embeds", "list"),
    ("echo not a bool", {"echo": "yes"}, "echo", "boolean"),
    ("suffix with embeddings", {**EMBEDS, "suffix": "tail"}, "suffix", "not supported"),
    ("logprobs above 20", {"logprobs": 21}, "logprobs", "[0, 20]"),
    ("logprobs a bool", {"logprobs": True}, "logprobs", "[0, 20]"),
    ("prompt_logprobs negative", {"prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
    ("best_of above 1", {"best_of": 3}, "best_of", "not supported"),
    ("frequency_penalty above 2", {"frequency_penalty": 2.5}, "frequency_penalty", "[-2, 2]"),
    ("presence_penalty a string", {"presence_penalty": "x"}, "presence_penalty", "[-2, 2]"),
    ("repetition_penalty zero", {"repetition_penalty": 0}, "repetition_penalty", "(0, 2]"),
    ("logit_bias key not an id", {"logit_bias": {"abc": 1}}, "logit_bias", "token id"),
    ("logit_bias value out of range", {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("logit_bias not an object", {"logit_bias": [1, 2]}, "logit_bias", "object"),
    ("max_tokens 0 without echo", {"max_tokens": 0}, "max_tokens", ">= 1"),
    ("unknown field", {"temprature": 0.5}, "temprature", "not a parameter"),
    ("response_format unknown type", {"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ("json_schema without schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ("invalid JSON schema", {"response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema", "valid JSON schema"),
    ("two constraints", {"guided_regex": "a+", "structured_outputs": {"choice": ["a"]}}, "guided_regex",
     "combined"),
    ("structured_outputs unknown kind", {"structured_outputs": {"xml": "x"}}, "structured_outputs.xml", "json"),
    ("empty choice", {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ("max_tokens not a number", {"max_tokens": "abc"}, "max_tokens", "integer"),
    ("max_tokens negative", {"max_tokens": -1}, "max_tokens", "integer"),
    ("max_tokens a float", {"max_tokens": 2.5}, "max_tokens", "integer"),
    ("max_tokens past uint32", {"max_tokens": 2**40}, "max_tokens", "integer"),
    ("n of zero", {"n": 0}, "n", "integer"),
    ("n a bool", {"n": True}, "n", "integer"),
    ("temperature below 0", {"temperature": -0.1}, "temperature", ">= 0"),
    ("temperature a string", {"temperature": "hot"}, "temperature", "number"),
    ("top_p of zero", {"top_p": 0}, "top_p", "(0, 1]"),
    ("top_p above one", {"top_p": 1.5}, "top_p", "(0, 1]"),
    ("top_k a string", {"top_k": "5"}, "top_k", "integer"),
    ("seed a string", {"seed": "x"}, "seed", "integer"),
    ("stop a number", {"stop": 5}, "stop", "string"),
    ("stop a list with a number", {"stop": ["a", 1]}, "stop", "string"),
    ("ignore_eos a string", {"ignore_eos": "yes"}, "ignore_eos", "boolean"),
    ("stream a string", {"stream": "yes"}, "stream", "boolean"),
    ("stream_options not an object", {"stream": True, "stream_options": True}, "stream_options", "include_usage"),
    ("prompt a number", {"prompt": 5}, "prompt", "string"),
    ("prompt mixed types", {"prompt": ["a", 1]}, "prompt", "token"),
    ("token id past int32", {"prompt": [1, 2**40]}, "prompt", "token ids"),
    ("model missing", {"model": None}, "model", "required"),
    ("model a number", {"model": 3}, "model", "required"),
]


@pytest.mark.parametrize("name,fields,param,word", BAD, ids=[c[0] for c in BAD])
def test_bad_requests_are_400_naming_the_param(gw: Harness, name: str, fields: dict[str, Any], param: str,
                                               word: str) -> None:
    body = {k: v for k, v in {"model": MODEL, "prompt": "hi", **fields}.items() if v is not None}
    r = post(gw, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert word in err["message"], err["message"]
    assert gw.fake.requests == [], "a request the gateway rejects never reaches the preprocessor"
    assert_good_request_still_works(gw)


def test_sdk_surfaces_param_of_a_gateway_400(client: Any) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="", extra_body={"prompt_embeds": "***"})
    assert info.value.status_code == 400 and info.value.param == "prompt_embeds"


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'"a string"', b"\xff\xfe"],
                         ids=["broken", "empty", "array", "string", "not utf-8"])
def test_body_that_is_not_a_json_object_is_400(gw: Harness, body: bytes) -> None:
    r = post(gw, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["code"] == "invalid_json"
    assert_good_request_still_works(gw)


def test_neither_prompt_nor_prompt_embeds_is_the_preprocessors_400(gw: Harness) -> None:
    """The gateway passes an empty request on; the preprocessor's INVALID_ARGUMENT names the field."""
    gw.fake.script.error = InvalidArgument("either prompt or prompt_embeds is required", field="prompt",
                                           reason="MISSING_PROMPT")
    r = post(gw, {"model": MODEL})
    assert r.status_code == 400
    p = gw.fake.last("Complete").params
    assert not p.prompts and not p.prompt_token_ids and not p.prompt_embeds
    assert r.json()["error"] == {"message": "either prompt or prompt_embeds is required",
                                 "type": "invalid_request_error", "param": "prompt", "code": "missing_prompt"}


GRPC_ERRORS = [
    (InvalidArgument("prompt_embeds: NaN at row 2", field="prompt_embeds", reason="EMBEDS_NAN"), 400,
     "invalid_request_error", "prompt_embeds", "embeds_nan", "prompt_embeds: NaN at row 2"),
    (FailedPrecondition("model is sleeping", field="model", reason="MODEL_SLEEPING"), 400,
     "invalid_request_error", "model", "model_sleeping", "model is sleeping"),
    (NotFound("model 'x' is not served", field="model", reason="MODEL_NOT_FOUND"), 404, "not_found_error", "model",
     "model_not_found", "model 'x' is not served"),
    (ResourceExhausted("queue full"), 429, "rate_limit_error", None, "resource_exhausted", "queue full"),
    (Unavailable("no worker is ready"), 503, "service_unavailable", None, "unavailable", "no worker is ready"),
    (InternalError("KeyError: 'secret' at /srv/app.py:12"), 500, "server_error", None, "internal",
     "internal server error"),
    (InternalError("internal error (incident 0123456789ab); see the service log"), 500, "server_error", None,
     "internal", "internal error (incident 0123456789ab); see the service log"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
@pytest.mark.parametrize("error,status,kind,param,code,message", GRPC_ERRORS,
                         ids=[type(e[0]).__name__ + str(i) for i, e in enumerate(GRPC_ERRORS)])
def test_grpc_status_maps_to_http_and_openai_error(gw: Harness, stream: bool, error: Exception, status: int,
                                                   kind: str, param: str | None, code: str, message: str) -> None:
    gw.fake.script.error = error  # type: ignore[assignment]
    r = post(gw, {"model": MODEL, "prompt": "hi", "stream": stream})
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"message": message, "type": kind, "param": param, "code": code}}
    assert_good_request_still_works(gw)


def test_preprocessor_unreachable_is_503_without_internals(gw: Harness) -> None:
    r = httpx.post(f"{gw.dead_url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=20)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and err["code"] == "unavailable"
    assert "127.0.0.1" not in err["message"] and "ipv4" not in err["message"]


def test_body_over_the_limit_is_413(gw: Harness) -> None:
    from tests.unit.gateway.conftest import MAX_BODY_BYTES

    big = orjson.dumps({"model": MODEL, "prompt": "", "prompt_embeds": "A" * (MAX_BODY_BYTES + 8)})
    r = post(gw, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks() -> Any:  # no content-length: the limit holds while reading
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    r = httpx.post(f"{gw.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=20)
    assert r.status_code == 413
    assert gw.fake.requests == []
    assert_good_request_still_works(gw)
