"""Fuzzing the gateway's request parsing: hypothesis-generated bodies for /v1/completions, /v1/chat/completions,
/v1/embeddings and /v1/files never get a 5xx.

The gateway runs for real (uvicorn, the real app) against a stub preprocessor that applies the mesh's own rules to
what the gateway sends (``sampling_from_proto``, the prompt-embeds decoder and validation, the int64/uint32 proto
fields), so a value the gateway lets through but the next hop cannot take shows up as a 5xx here too. Bodies start
from a valid request and replace fields with hostile values (ints past 2**64, NaN, deep nesting, wrong types,
hostile tensors: 71 dimensions, shapes past 2**64, huge strides), or are arbitrary JSON or bytes.
``make fuzz`` runs the same properties with many more examples (``EMBEDMESH_FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors
from embedmesh.core.embeds import ModelSpec
from embedmesh.core.errors import InvalidArgument, NotFound
from embedmesh.core.sampling import sampling_from_proto
from embedmesh.inference.v1 import inference_pb2
from embedmesh.tensor.v1 import tensor_pb2
from tests.support.fuzz import fuzz_settings
from tests.unit.core.test_embeds import decode_prompt_embeds
from tests.unit.gateway.conftest import MODEL, STOP, FakeInference, Harness, delta, usage_event

HIDDEN = 8
SPEC = ModelSpec(hidden_size=HIDDEN, max_context_tokens=64, dtype=tensor_pb2.DATA_TYPE_FP32)
MAX_N = 4


class StubPreprocessor(FakeInference):
    """Answers like the preprocessor, after the checks the preprocessor makes on what the gateway built."""

    def _check_embeds(self, pe: inference_pb2.PromptEmbeds, field: str) -> None:
        kind = pe.WhichOneof("source")
        if kind == "cache_id":
            raise NotFound(f"{field}: no uploaded tensor with id {pe.cache_id!r}", field=field)
        if kind == "encoded":
            decode_prompt_embeds(encoded=pe.encoded.data, spec=SPEC, field=field, max_tokens=1, max_bytes=1 << 20)
        elif kind == "tensor":
            arr, dtype = tensors.to_numpy(pe.tensor, field=field)
            decode_prompt_embeds(array=arr, dtype=dtype, spec=SPEC, field=field, max_tokens=1, max_bytes=1 << 20)

    def _check(self, params: Any, prompts: int) -> int:
        sampling_from_proto(params.sampling)
        n = params.n if params.HasField("n") else 1
        if not 1 <= n <= MAX_N:
            raise InvalidArgument(f"n must be in [1, {MAX_N}]", field="n", reason="OUT_OF_RANGE")
        if not prompts:
            raise InvalidArgument("prompt: give a prompt or prompt_embeds", field="prompt", reason="REQUIRED")
        return n

    def _completion(self, request: Any) -> int:
        p = request.params
        for i, pe in enumerate(p.prompt_embeds):
            self._check_embeds(pe, f"prompt_embeds[{i}]")
        if p.HasField("prefix"):
            self._check_embeds(p.prefix, "prompt_embeds_prefix")
        return self._check(p, len(p.prompts) + len(p.prompt_token_ids) + len(p.prompt_embeds))

    def _chat(self, request: Any) -> int:
        p = request.params
        for i, m in enumerate(p.messages):
            for j, part in enumerate(m.parts):
                if part.HasField("prompt_embeds"):
                    self._check_embeds(part.prompt_embeds, f"messages[{i}].content[{j}]")
        return self._check(p, len(p.messages))

    def _reply(self, n: int) -> list[inference_pb2.Choice]:
        return [inference_pb2.Choice(index=i, text="ok", finish_reason=STOP) for i in range(n)]

    async def complete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self._completion(request)
        return inference_pb2.CompleteResponse(id="cmpl-fuzz", model=MODEL, choices=self._reply(n),
                                              usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=1,
                                                                     total_tokens=2))

    async def stream_complete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self._completion(request)
        for i in range(n):
            yield delta(i, "ok", STOP)
        yield usage_event(1, n)

    async def chat(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self._chat(request)
        return inference_pb2.ChatResponse(id="chatcmpl-fuzz", model=MODEL, choices=self._reply(n),
                                          usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=1,
                                                                 total_tokens=2))

    async def stream_chat(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = self._chat(request)
        for i in range(n):
            yield inference_pb2.StreamChatResponse(id="chatcmpl-fuzz", model=MODEL, index=i, text="ok",
                                                   finish_reason=STOP)

    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        if not request.inputs:
            raise InvalidArgument("input must not be empty", field="input", reason="REQUIRED")
        dims = request.dimensions if request.HasField("dimensions") else 8
        if not 1 <= dims <= 8:
            raise InvalidArgument("dimensions must be in [1, 8]", field="dimensions", reason="OUT_OF_RANGE")
        vectors = np.ones((len(request.inputs), dims), dtype=np.float32)
        return inference_pb2.EmbedResponse(model=request.model, embeddings=tensors.from_numpy(vectors),
                                           usage=common_pb2.Usage(prompt_tokens=1, total_tokens=1))


class StubHarness(Harness):
    """The conftest's gateway-on-uvicorn harness, with the stub above as its preprocessor."""

    async def _start(self) -> None:
        self.fake = StubPreprocessor()
        await super()._start()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    h = StubHarness()
    try:
        with httpx.Client(base_url=h.url, timeout=30) as client:
            yield client
    finally:
        h.close()


def assert_no_5xx(r: httpx.Response, *, allow_501: bool = False) -> None:
    """Under 500 (501 "not configured" where the route needs a service this gateway lacks), errors in OpenAI's
    shape, and no server error inside a stream either."""
    if allow_501 and r.status_code == 501:
        assert r.json()["error"]["code"] == "not_implemented"
        return
    assert r.status_code < 500, r.text[:2000]
    if r.status_code >= 400 and r.status_code != 499:
        err = r.json()["error"]
        assert err["message"] and err["type"]
    assert "\"type\":\"server_error\"" not in r.text, r.text[:2000]  # an SSE error event after a 200


# --- hostile values ----------------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _payloads() -> list[str]:
    """Base64 tensors: one that decodes to valid rows, and the hostile classes of issue 15."""
    import torch

    from tests.unit.core.test_tensor_codec import _safetensors_raw, forged_tensor, saved

    return [
        _b64(saved(torch.randn(3, HIDDEN))),
        _b64(saved(torch.randn(3, 2 * HIDDEN)[:, ::2])),  # a strided view: decodes to its values
        _b64(saved(torch.zeros([1] * 71))),
        _b64(forged_tensor((2**32, 2**32, 2), (2**33, 2, 1), numel=4, data=b"\0" * 16)),
        _b64(forged_tensor((0, 2**64), (2**64, 1), numel=0, data=b"")),
        _b64(forged_tensor((1, HIDDEN), (2**70, 1), numel=HIDDEN)),
        _b64(forged_tensor((2, HIDDEN), (2**40, 1), numel=2 * HIDDEN)),
        _b64(_safetensors_raw({"x": {"dtype": "F32", "shape": [2**31, 2**31, 2**31], "data_offsets": [0, 8]}},
                              b"\0" * 8)),
        _b64(_safetensors_raw({"x": {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [0, 0]}}, b"")),
        "not base64!",
    ]


PAYLOADS = _payloads()
BIG = [2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63), -(2**63) - 1, -(2**70), 10**30]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(BIG),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), c, max_size=4)),
                           max_leaves=10)
small_ints = st.one_of(st.integers(-3, 40), st.sampled_from(BIG))
numbers = st.one_of(small_ints, st.floats(0, 2), st.floats(allow_nan=False),
                    st.sampled_from([1e-40, 1e300, -0.0, float("nan"), float("inf")]))
payload = st.sampled_from(PAYLOADS)


DEEP = '"__deep__"'
"""Placeholder replaced by JSON nested 200 or 5000 levels deep (json.dumps itself would recurse too deep)."""

SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": small_ints, "temperature": numbers, "top_p": numbers, "top_k": small_ints, "n": small_ints,
    "seed": st.one_of(small_ints, st.integers(-(2**63), 2**63 - 1)), "stream": st.booleans(),
    "stream_options": st.one_of(st.just({"include_usage": True}), json_values),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20)), "ignore_eos": st.booleans(),
}
# Parameters this server refuses unless neutral: drawn less often, since a refusal there ends the parsing.
RARE: dict[str, st.SearchStrategy[Any]] = {
    "logprobs": json_values, "frequency_penalty": numbers, "presence_penalty": numbers, "logit_bias": json_values,
    "user": json_values, "echo": json_values, "suffix": json_values, "best_of": small_ints,
    "prompt_logprobs": json_values, "top_logprobs": json_values, "tools": json_values,
    "response_format": st.one_of(st.just({"type": "text"}), json_values), "modalities": json_values,
}
COMPLETIONS = {
    **SAMPLING,
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=5), max_size=3),
                        st.lists(small_ints, max_size=4), st.lists(st.lists(small_ints, max_size=3), max_size=3)),
    "prompt_embeds": st.one_of(payload, payload, st.lists(payload, max_size=3), st.just({"id": "emb-nope"})),
    "prompt_embeds_prefix": st.one_of(payload, st.just({"id": 7})),
}
part = st.one_of(st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=10)),
                 st.builds(lambda d: {"type": "prompt_embeds", "data": d}, payload),
                 st.just({"type": "prompt_embeds", "id": "emb-x"}), st.just({"type": "image_url"}),
                 json_values)
message = st.one_of(
    st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["user", "system", "assistant"]),
              st.one_of(st.text(max_size=10), st.lists(part, max_size=3), st.none())),
    json_values)
CHAT = {
    **SAMPLING,
    "messages": st.one_of(st.lists(message, min_size=1, max_size=3), st.lists(message, min_size=1, max_size=3),
                          json_values),
    "max_completion_tokens": small_ints,
}
EMBEDDINGS: dict[str, st.SearchStrategy[Any]] = {
    "input": st.one_of(st.text(max_size=10), st.lists(st.text(max_size=5), max_size=3),
                       st.lists(small_ints, max_size=4), st.lists(st.lists(small_ints, max_size=3), max_size=3),
                       json_values),
    "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), json_values),
    "dimensions": small_ints, "user": json_values,
}
ROUTES = {
    "/v1/completions": ({"model": MODEL, "prompt": "hi", "max_tokens": 2}, COMPLETIONS),
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, CHAT),
    "/v1/embeddings": ({"model": MODEL, "input": "hi"}, EMBEDDINGS),
}


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    """A request body: mostly a valid one with some fields replaced, sometimes anything at all."""
    base, fields = ROUTES[path]
    shape = draw(st.integers(0, 19))
    if shape == 0:
        return draw(st.binary(max_size=64))
    if shape == 1:
        return json.dumps(draw(json_values)).encode()
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(st.one_of(fields[name], fields[name], fields[name], json_values))
    if path != "/v1/embeddings" and draw(st.integers(0, 5)) == 0:
        name = draw(st.sampled_from(sorted(RARE)))
        body[name] = draw(RARE[name])
    if shape == 2:
        body["model"] = draw(json_values)
    if shape == 3:
        body[draw(st.sampled_from(sorted(fields)))] = "__deep__"
    if shape == 4:
        body[draw(st.text(max_size=6))] = draw(json_values)
    text = json.dumps(body)  # NaN/Infinity and lone surrogates stay in: the gateway must refuse them
    if shape == 3:
        levels = draw(st.sampled_from([200, 5000]))
        text = text.replace(DEEP, "[" * levels + '"x"' + "]" * levels, 1)
    return text.encode()


def _post(http: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", list(ROUTES))
def test_fuzz_json_bodies_never_get_a_5xx(http: httpx.Client, path: str) -> None:
    @fuzz_settings(120)
    @given(body=bodies(path))
    def run(body: bytes) -> None:
        assert_no_5xx(_post(http, path, body))

    run()


# --- the cases of issue 15 that reach the parsing, pinned (the fuzz above finds them too, by chance) -------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 2**64}, "n"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**70}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e300}, "temperature"),
    ("/v1/completions", {"prompt": [1, 2**40]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2**64},
     "max_completion_tokens"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 2**70}, "dimensions"),
    ("/v1/embeddings", {"input": [[1, 2**40]]}, "input"),
], ids=["max_tokens 2**70", "n 2**64", "seed 2**63", "top_k 2**70", "temperature 1e300", "token id 2**40",
        "max_completion_tokens 2**64", "dimensions 2**70", "embedding token id 2**40"])
def test_numbers_past_the_proto_fields_are_400s_naming_the_field(http: httpx.Client, path: str,
                                                                 body: dict[str, Any], param: str) -> None:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("index", range(len(PAYLOADS)))
def test_hostile_tensors_in_both_rest_forms_are_400s_naming_the_field(http: httpx.Client, index: int) -> None:
    data = PAYLOADS[index]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "", "prompt_embeds": data})
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "prompt_embeds", "data": data}]}]})
    if index < 2:  # the genuine tensor and the strided view decode
        assert r.status_code == 200 and chat.status_code == 200, (r.text, chat.text)
        return
    assert r.status_code == 400 and chat.status_code == 400, (r.text, chat.text)
    assert r.json()["error"]["param"] in ("prompt_embeds", "prompt_embeds[0]")
    assert chat.json()["error"]["param"] in ("messages[0].content[1]", "messages[0].content[1].data")


def test_seed_at_int64_max_with_n_2_reaches_the_preprocessor_intact(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "seed": 2**63 - 1, "n": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


# --- /v1/files: multipart --------------------------------------------------------------------------------------


def _multipart(boundary: str, parts: list[tuple[str, str | None, bytes]]) -> bytes:
    out = b""
    for name, filename, data in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


GOOD = _multipart("b0undary", [("purpose", None, b"assistants"), ("file", "a.txt", b"hello")])


@pytest.mark.parametrize(("content_type", "body", "param"), [
    ("multipart/form-data", GOOD, "file"),  # no boundary
    ("multipart/form-data; boundary=", GOOD, "file"),
    ("multipart/form-data; boundary=other", GOOD, "file"),  # parts never start: no file part
    ("multipart/form-data; boundary=b0undary", b"--b0undary\r\nContent-Disposition: form-data\r\n\r\nx\r\n"
                                              b"--b0undary--\r\n", "file"),  # a part without a name
    ("multipart/form-data; boundary=b0undary", _multipart("b0undary", [("file", "a", b"1"), ("file", "b", b"2")]),
     "file"),  # two files
    ("multipart/form-data; boundary=b0undary", _multipart("b0undary", [("purpose", None, b"assistants")]), "file"),
    ("multipart/form-data; boundary=b0undary", _multipart("b0undary", [("file", None, b"not a file part"),
                                                                       ("purpose", None, b"x")]), "file"),
    ("multipart/form-data; boundary=b0undary", _multipart("b0undary", [("file", "a.txt", b"hi")]), "purpose"),
    ("multipart/form-data; boundary=b0undary", b"\x00\xff garbage", "file"),
    ("application/json", b"{}", "file"),
], ids=["no boundary", "empty boundary", "wrong boundary", "part without name", "two files", "no file part",
        "file as a plain field", "no purpose", "garbage", "not multipart"])
def test_malformed_uploads_are_400s_naming_the_field(http: httpx.Client, content_type: str, body: bytes,
                                                     param: str) -> None:
    r = http.post("/v1/files", content=body, headers={"content-type": content_type})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"]


def test_a_well_formed_upload_gets_past_the_parsing(http: httpx.Client) -> None:
    # This gateway has no vector store: reaching the 501 proves the multipart above was accepted.
    r = http.post("/v1/files", content=GOOD, headers={"content-type": "multipart/form-data; boundary=b0undary"})
    assert r.status_code == 501, r.text


@fuzz_settings(100)
@given(content_type=st.one_of(st.sampled_from(["multipart/form-data", "multipart/form-data; boundary=b0undary",
                                               "multipart/form-data; boundary=b0undary; charset=nope",
                                               "multipart/form-data; boundary=\"b0undary\""]),
                              st.text(max_size=40).map(lambda t: "multipart/form-data; " + t)),
       body=st.one_of(st.binary(max_size=200), st.builds(
           lambda parts: _multipart("b0undary", parts),
           st.lists(st.tuples(st.sampled_from(["file", "purpose", "x", ""]),
                              st.one_of(st.none(), st.text(max_size=8)), st.binary(max_size=20)), max_size=4))))
def test_fuzz_multipart_uploads_never_get_a_5xx(http: httpx.Client, content_type: str, body: bytes) -> None:
    try:
        r = http.post("/v1/files", content=body, headers={"content-type": content_type.encode()})
    except httpx.LocalProtocolError:  # httpx refuses to send a header value it cannot encode; nothing to test
        return
    assert_no_5xx(r, allow_501=True)


@pytest.mark.parametrize("levels", [150, 500])  # orjson stops at 1024 containers: 512 levels
def test_a_deeply_nested_search_filter_is_a_400_before_any_call(http: httpx.Client, levels: int) -> None:
    # Checked on the JSON, before the gateway recurses over it or nests protobuf messages (protobuf refuses nesting
    # past 100 levels): a 400 even on this gateway, which has no vector store to call (that would be a 501).
    leaf = '{"type": "eq", "key": "a", "value": 1}'
    flt = '{"type": "and", "filters": [' * levels + leaf + "]}" * levels
    r = http.post("/v1/vector_stores/vs_1/search", content=f'{{"query": "x", "filters": {flt}}}'.encode(),
                  headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "too_deep" and err["param"].startswith("filters.filters[0]"), err


def test_a_filter_type_that_is_not_a_string_is_a_400(http: httpx.Client) -> None:
    r = http.post("/v1/vector_stores/vs_1/search", json={"query": "x", "filters": {"type": ["and"], "filters": []}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "filters.type"
