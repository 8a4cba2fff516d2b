"""Hostile input against the surfaces of InferenceService.GenerateInline and the image encode stage, over real gRPC and
REST on an echo mesh with an image encode service (``--image-encoders 1``) and an 8 MiB message cap: every broken
request is INVALID_ARGUMENT naming the field and the rule (never UNKNOWN/INTERNAL, never a hang); a gzip-compressed
request is refused without being inflated; a message past the cap is RESOURCE_EXHAUSTED by gRPC before any handler;
a 1 x 16384 PNG strip is encoded without the multi-GiB resize its aspect ratio used to cost; and the mesh serves on
after all of it."""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from PIL import Image

from embedmesh.core.errors import from_rpc_error
from embedmesh.core.server import channel_options
from embedmesh.imageencoder.v1 import imageencoder_pb2, imageencoder_pb2_grpc
from embedmesh.inference.v1 import inference_pb2 as ip
from embedmesh.inference.v1 import inference_pb2_grpc
from embedmesh.tensor.v1 import tensor_pb2 as tp
from tests.support.mesh import Mesh, free_port, start_mesh
from tests.support.procmem import hwm_mib

pytestmark = pytest.mark.e2e
pytest.importorskip("efficientnet_lite_pytorch")

H = 576  # the echo engine's hidden size
FP32 = tp.DATA_TYPE_FP32
CAP = 8 << 20


@pytest.fixture(scope="module")
def hmesh() -> Iterator[Mesh]:
    port = free_port()
    m = start_mesh(engine="echo", env={"EMBEDMESH_TRACE_CONSOLE": "0", "EMBEDMESH_MAX_MESSAGE_BYTES": str(CAP)},
                   extra_args=["--image-encoders", "1", "--image-encoder-port", str(port)])
    try:
        m.extra["model"] = httpx.get(f"{m.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        m.extra["encoder"] = f"127.0.0.1:{port}"
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def stub(hmesh: Mesh) -> Iterator[Any]:
    with grpc.insecure_channel(hmesh.preprocessor, options=channel_options()) as ch:
        yield inference_pb2_grpc.InferenceServiceStub(ch)


def _t(shape: list[int], data: bytes = b"", dtype: int = FP32) -> tp.Tensor:
    return tp.Tensor(dtype=dtype, shape=shape, data=data)


def _rows(n: int, width: int = H) -> bytes:
    return np.ones((n, width), np.float32).tobytes()


def _completion(model: str, *, tensor: tp.Tensor | None = None, prompt: str = "", max_tokens: int = 4,
                **sampling: Any) -> ip.GenerateInlineRequest:
    p = ip.CompletionParams(model=model)
    if tensor is not None:
        p.prompt_embeds.add(tensor=tensor)
    if prompt:
        p.prompts.append(prompt)
    p.sampling.max_tokens = max_tokens
    for k, v in sampling.items():
        setattr(p.sampling, k, v)
    return ip.GenerateInlineRequest(request=ip.GenerateHeader(completion=p))


def _chat(model: str, *parts: ip.ChatContentPart, messages: int = 1) -> ip.GenerateInlineRequest:
    p = ip.ChatParams(model=model, messages=[ip.ChatMessage(role="user", parts=list(parts))] * messages)
    p.sampling.max_tokens = 4
    return ip.GenerateInlineRequest(request=ip.GenerateHeader(chat=p))


def _nan() -> bytes:
    a = np.ones((3, H), np.float32)
    a[2, 5] = np.nan
    return a.tobytes()


CASES: dict[str, tuple[Any, str, str]] = {
    # name: (request maker taking the model name, field, reason)
    "chat without messages": (lambda m: _chat(m, messages=0), "messages", "EMPTY"),
    "data shorter than shape": (lambda m: _completion(m, tensor=_t([3, H], _rows(2))), "prompt_embeds.data",
                                "DATA_SIZE_MISMATCH"),
    "data longer than shape": (lambda m: _completion(m, tensor=_t([3, H], _rows(4))), "prompt_embeds.data",
                               "DATA_SIZE_MISMATCH"),
    "a 2**40 dimension": (lambda m: _completion(m, tensor=_t([2**40, H], _rows(1))), "prompt_embeds.shape",
                          "INVALID_SHAPE"),
    "dimensions whose product overflows": (lambda m: _completion(m, tensor=_t([2**62, 2**62], _rows(1))),
                                           "prompt_embeds.shape", "INVALID_SHAPE"),
    "a negative dimension": (lambda m: _completion(m, tensor=_t([-3, H], _rows(3))), "prompt_embeds.shape",
                             "INVALID_SHAPE"),
    "zero rows": (lambda m: _completion(m, tensor=_t([0, H])), "prompt_embeds", "EMPTY_EMBEDS"),
    "a header tensor of 2**40 rows without data": (lambda m: _completion(m, tensor=_t([2**40, H])),
                                                   "prompt_embeds.data", "PIECES_NEED_GENERATE"),
    "an unknown dtype": (lambda m: _completion(m, tensor=_t([3, H], _rows(3), 999)), "prompt_embeds.dtype",
                         "UNSUPPORTED_DTYPE"),
    "the wrong hidden size": (lambda m: _completion(m, tensor=_t([3, 100], _rows(3, 100))), "prompt_embeds",
                              "HIDDEN_SIZE_MISMATCH"),
    "a NaN row": (lambda m: _completion(m, tensor=_t([3, H], _nan())), "prompt_embeds", "NON_FINITE"),
    "an unknown model": (lambda m: _completion("no-such-model", prompt="hi"), "model", "MODEL_NOT_FOUND"),
    "max_tokens 2**32 - 1": (lambda m: _completion(m, prompt="hi", max_tokens=2**32 - 1), "prompt",
                             "CONTEXT_OVERFLOW"),
    "max_tokens 0": (lambda m: _completion(m, prompt="hi", max_tokens=0), "max_tokens", "OUT_OF_RANGE"),
    "a negative temperature": (lambda m: _completion(m, prompt="hi", temperature=-1.0), "temperature",
                               "OUT_OF_RANGE"),
    "a NaN temperature": (lambda m: _completion(m, prompt="hi", temperature=float("nan")), "temperature",
                          "OUT_OF_RANGE"),
    "an image that is not base64": (
        lambda m: _chat(m, ip.ChatContentPart(image=ip.ImageInput(url="data:image/png;base64,@@@@"))),
        "messages[0].content[0].image_url", "BAD_BASE64"),
    "an image whose header claims 100000 x 100000": (
        lambda m: _chat(m, ip.ChatContentPart(image=ip.ImageInput(data=_png_header(100000, 100000)))),
        "messages[0].content[0].image.data", "TOO_MANY_PIXELS"),
}


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` and whose data is one empty row (a decompression bomb's
    header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 4)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stream", [False, True])
def test_a_hostile_generate_inline_is_invalid_argument_naming_the_field(hmesh: Mesh, stub: Any, case: str,
                                                                          stream: bool) -> None:
    make, field, reason = CASES[case]
    request = make(hmesh.extra["model"])
    request.request.stream = stream
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateInline(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    e = from_rpc_error(info.value)
    assert (e.field, e.reason) == (field, reason), info.value.details()


def _serves(stub: Any, model: str) -> None:
    events = list(stub.GenerateInline(_completion(model, prompt="hi", max_tokens=3), timeout=30))
    assert events[0].completion.choices[0].text == "xxx"


def test_a_gzip_request_is_refused_uninflated_and_one_past_the_cap_before_any_handler(hmesh: Mesh,
                                                                                       stub: Any) -> None:
    model = hmesh.extra["model"]
    n = (CAP - (1 << 20)) // (4 * H)
    zeros = _completion(model, tensor=_t([n, H], bytes(n * 4 * H)))
    with pytest.raises(grpc.RpcError) as info:  # ~7 MiB of zeros, a few KiB on the wire
        list(stub.GenerateInline(zeros, timeout=30, compression=grpc.Compression.Gzip))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, info.value.details()
    assert "gzip" in info.value.details()
    big = _completion(model, tensor=_t([CAP // (4 * H) + 1, H], _rows(CAP // (4 * H) + 1)))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateInline(big, timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    _serves(stub, model)


def test_a_20000_character_model_name_is_invalid_argument_naming_the_model(hmesh: Mesh, stub: Any) -> None:
    name = "m" * 20000
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateInline(_completion(name, prompt="hi"), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert from_rpc_error(info.value).field == "model"
    r = httpx.post(f"{hmesh.base_url}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2},
                   timeout=30)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == "model", r.text[:300]
    r = httpx.post(f"{hmesh.base_url}/v1/chat/completions", timeout=30,
                   json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text[:300]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateInline(_chat(name, ip.ChatContentPart(text="hi")), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert from_rpc_error(info.value).field == "model"


def test_a_20000_character_role_is_invalid_argument_naming_the_role(hmesh: Mesh, stub: Any) -> None:
    """The error quotes the role: cut to its head and length, so the trailers fit gRPC's metadata limit."""
    request = _chat(hmesh.extra["model"], ip.ChatContentPart(text="hi"))
    request.request.chat.messages[0].role = "r" * 20000
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateInline(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert from_rpc_error(info.value).field == "messages[0].role"
    assert "(20000 chars)" in info.value.details() and len(info.value.details()) < 1100


def test_too_many_messages_and_images_are_invalid_argument_naming_them(hmesh: Mesh, stub: Any) -> None:
    model = hmesh.extra["model"]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateInline(_chat(model, ip.ChatContentPart(text=""), messages=100_000), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert (from_rpc_error(info.value).field, from_rpc_error(info.value).reason) == ("messages", "TOO_MANY")
    part = _png_part(2, 2)
    r = httpx.post(f"{hmesh.base_url}/v1/chat/completions", timeout=60,
                   json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [part] * 300}]})
    assert r.status_code == 400, r.text[:300]
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("messages[0].content[16]", "too_many_images")
    _serves(stub, model)


ENCODE_CASES: dict[str, tuple[tp.Tensor, str, str]] = {
    "float32 pixels": (_t([8, 8, 3], bytes(8 * 8 * 3 * 4)), "pixels.dtype", "UNSUPPORTED_DTYPE"),
    "four channels": (_t([8, 8, 4], bytes(256), tp.DATA_TYPE_UINT8), "pixels.shape", "BAD_SHAPE"),
    "a 100000 x 1 image": (_t([100000, 1, 3], bytes(300000), tp.DATA_TYPE_UINT8), "pixels.shape", "BAD_SHAPE"),
    "2**40 sides without data": (_t([2**40, 2**40, 3], b"", tp.DATA_TYPE_UINT8), "pixels.shape", "BAD_SHAPE"),
    "negative sides": (_t([-8, -8, 3], b"", tp.DATA_TYPE_UINT8), "pixels.shape", "BAD_SHAPE"),
    "data shorter than shape": (_t([8, 8, 3], bytes(100), tp.DATA_TYPE_UINT8), "pixels.data",
                                "DATA_SIZE_MISMATCH"),
}


def test_hostile_pixels_are_invalid_argument_naming_the_field(hmesh: Mesh) -> None:
    with grpc.insecure_channel(hmesh.extra["encoder"], options=channel_options()) as ch:
        encoder = imageencoder_pb2_grpc.ImageEncoderServiceStub(ch)
        for case, (pixels, field, reason) in ENCODE_CASES.items():
            with pytest.raises(grpc.RpcError) as info:
                encoder.Encode(imageencoder_pb2.EncodeRequest(model=hmesh.extra["model"], pixels=pixels), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, info.value.details())
            e = from_rpc_error(info.value)
            assert (e.field, e.reason) == (field, reason), (case, info.value.details())


def _png_part(width: int, height: int) -> dict[str, Any]:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), "white").save(buf, "PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue())
                                               .decode()}}


def test_a_1_by_16384_strip_is_encoded_without_a_giant_resize(hmesh: Mesh) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{hmesh.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    pid = int(re.search(rb"image-encoder-0\s+\S+\s+\(pid (\d+)\)", Path(hmesh.log_path).read_bytes()).group(1))

    def ask(*parts: dict[str, Any]) -> Any:
        return client.chat.completions.create(model=hmesh.extra["model"], max_tokens=2, messages=[
            {"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}])

    assert ask(_png_part(2, 2)).choices[0].message.content == "xx"  # the encoder loaded (its weights counted)
    before = hwm_mib(pid)
    for width, height in ((16384, 1), (1, 16384)):
        assert ask(_png_part(width, height)).choices[0].message.content == "xx"
    # The shorter-side-to-256 resize of a strip was 256 x 4194304 RGB pixels (3 GiB) before its 224 x 224 crop.
    assert hwm_mib(pid) - before < 512, (before, hwm_mib(pid))


def _nested_schema(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + "{}" + "}" * depth


def test_a_deeply_nested_json_schema_is_a_400_over_rest(hmesh: Mesh) -> None:
    schema = _nested_schema(150)
    model = json.dumps(hmesh.extra["model"])
    hi = '"messages": [{"role": "user", "content": "hi"}]'
    for path, body, param in (
        ("/v1/chat/completions", f'{{"model": {model}, {hi}, "response_format": {{"type": "json_schema", '
                                 f'"json_schema": {{"name": "x", "schema": {schema}}}}}}}', "response_format"),
        ("/v1/chat/completions", f'{{"model": {model}, {hi}, "tools": [{{"type": "function", "function": '
                                 f'{{"name": "f", "parameters": {schema}}}}}]}}', "tools"),
        ("/v1/responses", f'{{"model": {model}, "input": "hi", "text": {{"format": {{"type": "json_schema", '
                          f'"name": "x", "schema": {schema}}}}}}}', "text"),
    ):
        r = httpx.post(f"{hmesh.base_url}{path}", content=body, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        assert (r.json()["error"]["param"] or "").startswith(param), (path, r.text[:300])


def test_deeply_nested_json_text_over_grpc_is_invalid_argument(hmesh: Mesh, stub: Any) -> None:
    model = hmesh.extra["model"]
    structured = _completion(model, prompt="hi")
    structured.request.completion.sampling.structured.json_schema = _nested_schema(3000)
    user = ip.ChatMessage(role="user", parts=[ip.ChatContentPart(text="hi")])
    tools = ip.ChatParams(model=model, messages=[user], tools=[ip.Tool(name="f", parameters_json=_nested_schema(3000))])
    call = ip.ChatParams(model=model, messages=[ip.ChatMessage(role="assistant", tool_calls=[
        ip.ToolCall(id="call_1", name="f", arguments="[" * 3000 + "]" * 3000)]), user])
    for request in (structured, ip.GenerateInlineRequest(request=ip.GenerateHeader(chat=tools))):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.GenerateInline(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    # A past call's arguments are text the client sent back: past the depth bound they are shown as that text.
    answer = list(stub.GenerateInline(ip.GenerateInlineRequest(request=ip.GenerateHeader(chat=call)), timeout=30))
    assert answer and answer[-1].WhichOneof("event") == "chat", answer[-1]


KEY = "sk-hostile-0123456789"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": KEY, "tenant": "hostile"}]}))
    m = start_mesh(engine="echo", env={"EMBEDMESH_API_KEYS_FILE": str(keys), "EMBEDMESH_TRACE_CONSOLE": "0"})
    yield m
    m.stop()


def test_without_a_key_a_gzip_or_big_request_is_refused_unread(keyed: Mesh) -> None:
    pid = int(re.search(rb"preprocessor\s+\S+\s+\(pid (\d+)\)", Path(keyed.log_path).read_bytes()).group(1))
    with grpc.insecure_channel(keyed.preprocessor, options=channel_options()) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        n = (32 << 20) // (4 * H)
        big = _completion("any", tensor=_t([n, H], bytes(n * 4 * H)))  # 32 MiB of zeros
        before = hwm_mib(pid)
        for compression, code in ((grpc.Compression.Gzip, grpc.StatusCode.UNIMPLEMENTED),
                                  (None, grpc.StatusCode.UNAUTHENTICATED)):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.GenerateInline(big, timeout=30, compression=compression))
            assert info.value.code() == code, info.value.details()
        assert hwm_mib(pid) - before < 24, (before, hwm_mib(pid))  # neither was inflated nor held whole
        names = [m.id for m in stub.ListModels(ip.ListModelsRequest(), timeout=30,
                                               metadata=[("authorization", f"Bearer {KEY}")]).models]
        assert names
