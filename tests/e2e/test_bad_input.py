"""Every bad completions input is a 400 with OpenAI error JSON naming the field, and the mesh keeps serving."""

from __future__ import annotations

import base64
import io
import os
import zipfile
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import CONTEXT, HIDDEN, MODEL, b64_of
from tests.support import generate as gen

pytestmark = pytest.mark.e2e

MARKER = "/tmp/embedmesh-pickle-executed"


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {MARKER}",))


def _torch() -> Any:
    import torch

    return torch


def _saved(obj: Any) -> str:
    buf = io.BytesIO()
    _torch().save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _good(rows: int = 4) -> Any:
    return _torch().randn(rows, HIDDEN)


def _not_torch_zip() -> str:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("hello.txt", "not a tensor")
    return base64.b64encode(buf.getvalue()).decode()


# (case id, body overrides, expected param, words the message must contain)
CASES: list[tuple[str, Callable[[], dict[str, Any]], str, list[str]]] = [
    ("invalid base64", lambda: {"prompt_embeds": "not base64 at all!!"}, "prompt_embeds", ["base64"]),
    ("bytes that are not a tensor", lambda: {"prompt_embeds": base64.b64encode(b"hello world" * 10).decode()},
     "prompt_embeds", []),
    ("zip that is not a torch file", lambda: {"prompt_embeds": _not_torch_zip()}, "prompt_embeds", []),
    ("pickle of a non-tensor that would run code", lambda: {"prompt_embeds": _saved(_Evil())}, "prompt_embeds", []),
    ("pickled dict of tensors", lambda: {"prompt_embeds": _saved({"a": _good()})}, "prompt_embeds", []),
    ("sparse tensor", lambda: {"prompt_embeds": _saved(_good().to_sparse())}, "prompt_embeds", ["sparse"]),
    ("1-D tensor", lambda: {"prompt_embeds": b64_of(_torch().randn(HIDDEN))}, "prompt_embeds", ["1"]),
    ("4-D tensor", lambda: {"prompt_embeds": b64_of(_torch().randn(1, 1, 4, HIDDEN))}, "prompt_embeds", []),
    ("batch of two (2, N, H)", lambda: {"prompt_embeds": b64_of(_torch().randn(2, 4, HIDDEN))}, "prompt_embeds", []),
    ("wrong hidden size", lambda: {"prompt_embeds": b64_of(_torch().randn(4, 100))}, "prompt_embeds",
     [str(HIDDEN), "100"]),
    ("int64 dtype", lambda: {"prompt_embeds": b64_of(_torch().ones(4, HIDDEN, dtype=_torch().int64))},
     "prompt_embeds", ["int64"]),
    ("bool dtype", lambda: {"prompt_embeds": b64_of(_torch().ones(4, HIDDEN, dtype=_torch().bool))},
     "prompt_embeds", ["bool"]),
    ("NaN values", lambda: {"prompt_embeds": b64_of(_good().index_fill_(0, _torch().tensor([1]), float("nan")))},
     "prompt_embeds", ["NaN"]),
    ("Inf values", lambda: {"prompt_embeds": b64_of(_good().index_fill_(0, _torch().tensor([2]), float("inf")))},
     "prompt_embeds", ["Inf"]),
    ("zero rows", lambda: {"prompt_embeds": b64_of(_torch().zeros(0, HIDDEN))}, "prompt_embeds", []),
    ("more rows than the context", lambda: {"prompt_embeds": b64_of(_torch().zeros(CONTEXT - 2, HIDDEN,
                                                                                   dtype=_torch().float16))},
     "prompt_embeds", [str(CONTEXT)]),
    ("decoded size over the cap", lambda: {"prompt_embeds": b64_of(_torch().zeros(8000, HIDDEN))},
     "prompt_embeds", ["MiB"]),
    ("unknown model", lambda: {"model": "no-such-model", "prompt": "hi"}, "model", ["no-such-model"]),
    ("neither prompt nor prompt_embeds", lambda: {"prompt": None}, "prompt", []),
    ("echo with embeddings", lambda: {"prompt_embeds": b64_of(_good()), "echo": True}, "echo", []),
    ("suffix with embeddings", lambda: {"prompt_embeds": b64_of(_good()), "suffix": "x"}, "suffix", []),
    ("prompt_logprobs with embeddings", lambda: {"prompt_embeds": b64_of(_good()), "prompt_logprobs": 1},
     "prompt_logprobs", []),
    ("max_tokens not a number", lambda: {"prompt": "hi", "max_tokens": "many"}, "max_tokens", []),
    ("negative max_tokens", lambda: {"prompt": "hi", "max_tokens": -1}, "max_tokens", []),
    ("n of zero", lambda: {"prompt": "hi", "n": 0}, "n", []),
    ("negative temperature", lambda: {"prompt": "hi", "temperature": -0.5}, "temperature", []),
    ("top_p of zero", lambda: {"prompt": "hi", "top_p": 0}, "top_p", []),
    ("token id outside the vocabulary", lambda: {"prompt": [1, 2, 10_000_000]}, "prompt", []),
]


@pytest.mark.parametrize("name,body,param,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_400_naming_the_field(
    mesh: Any, name: str, body: Callable[[], dict[str, Any]], param: str, words: list[str]
) -> None:
    if os.path.exists(MARKER):
        os.remove(MARKER)
    payload: dict[str, Any] = {"model": MODEL, "prompt": "", "max_tokens": 16}
    payload.update(body())
    payload = {k: v for k, v in payload.items() if v is not None}
    r = httpx.post(f"{mesh.base_url}/v1/completions", json=payload, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["message"]
    for w in words:
        assert w in err["message"], err["message"]
    assert not os.path.exists(MARKER), "a pickle in prompt_embeds executed code"
    # The mesh keeps serving after every bad request.
    ok = httpx.post(f"{mesh.base_url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                    timeout=60)
    assert ok.status_code == 200, ok.text


def test_openai_sdk_surfaces_the_param(client: Any) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="", extra_body={"prompt_embeds": b64_of(_torch().randn(3, 7))})
    assert info.value.status_code == 400
    assert info.value.param == "prompt_embeds"


# --- hostile inputs (issue 15): each used to be a 500/INTERNAL ----------------------------------------------------
# Tensors are forged with the codec tests' real pickler, so each differs from a genuine torch.save file in exactly
# the claim under test (shape, strides); after each case the mesh must still answer a normal request.

INT64_MAX = 2**63 - 1


def _forged(size: tuple[int, ...], stride: tuple[int, ...], numel: int) -> bytes:
    from tests.unit.core.test_tensor_codec import forged_tensor

    return forged_tensor(size, stride, numel=numel, data=bytes(4 * numel))


def _safetensors(shape: list[int]) -> bytes:
    from tests.unit.core.test_tensor_codec import _safetensors_raw

    return _safetensors_raw({"x": {"dtype": "F32", "shape": shape, "data_offsets": [0, 8]}}, b"\0" * 8)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# (case id, serialized tensor, reason the codec gives)
HOSTILE_TENSORS: list[tuple[str, Callable[[], bytes], str]] = [
    ("71-dim tensor", lambda: base64.b64decode(_saved(_torch().zeros([1] * 71))), "bad_rank"),
    ("shape product past 2**64", lambda: _forged((2**32, 2**32, 2), (2**33, 2, 1), 4), "invalid_shape"),
    ("dims under 2**31, product past 2**64", lambda: _forged((2**31,) * 3, (2**62, 2**31, 1), 4), "too_large"),
    ("shape mixing 0 and 2**64", lambda: _forged((0, 2**64), (2**64, 1), 0), "invalid_shape"),
    ("hand-edited huge stride", lambda: _forged((2, HIDDEN), (2**40, 1), 2 * HIDDEN), "bad_strides"),
    ("stride past int64", lambda: _forged((1, HIDDEN), (2**70, 1), HIDDEN), "bad_strides"),
    ("safetensors shape past 2**64", lambda: _safetensors([2**31, 2**31, 2**31]), "too_large"),
    ("safetensors mixing 0 and 2**64", lambda: _safetensors([0, 2**64]), "invalid_shape"),
]


def _mesh_answers(mesh: Any) -> None:
    ok = httpx.post(f"{mesh.base_url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                    timeout=60)
    assert ok.status_code == 200, ok.text


def _assert_400(r: httpx.Response, param_prefix: str, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] is not None and err["param"].startswith(param_prefix), err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("name,data,code", HOSTILE_TENSORS, ids=[c[0] for c in HOSTILE_TENSORS])
def test_hostile_tensors_over_rest_are_400s(mesh: Any, name: str, data: Callable[[], bytes], code: str) -> None:
    encoded = _b64(data())
    r = httpx.post(f"{mesh.base_url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "", "max_tokens": 4, "prompt_embeds": encoded})
    _assert_400(r, "prompt_embeds", code)
    r = httpx.post(f"{mesh.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe:"}, {"type": "prompt_embeds", "data": encoded}]}]})
    _assert_400(r, "messages[0].content[1]", code)
    r = httpx.post(f"{mesh.base_url}/v1/prompt_embeds", json={"data": encoded}, timeout=60)  # EncoderCache.Put
    assert 400 <= r.status_code < 500 and r.status_code != 404, r.text
    _mesh_answers(mesh)


def test_a_strided_view_is_not_hostile(mesh: Any) -> None:
    # torch.save of a view stores the whole storage and the view's strides; it decodes to the view's values.
    view = _torch().randn(3, 2 * HIDDEN)[:, ::2]
    assert not view.is_contiguous()
    r = httpx.post(f"{mesh.base_url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "", "max_tokens": 2, "prompt_embeds": _saved(view)})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3


def _grpc_complete(mesh: Any, params: Any) -> Any:
    import grpc

    from embedmesh.core.server import channel_options
    from embedmesh.inference.v1 import inference_pb2_grpc

    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        return gen.complete(inference_pb2_grpc.InferenceServiceStub(ch), params,
                                                                    timeout=60)


def _grpc_error(call: Callable[[], Any]) -> Any:
    import grpc

    from embedmesh.core.errors import from_rpc_error

    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    return from_rpc_error(info.value)


RAW_SHAPES = [([1] * 71, 4, "BAD_RANK"), ([2**32, 2**32, 2], 0, "INVALID_SHAPE"),
              ([0, INT64_MAX], 0, "INVALID_SHAPE"), ([-1, HIDDEN], 0, "INVALID_SHAPE")]


@pytest.mark.parametrize("shape,nbytes,reason", RAW_SHAPES, ids=["71 dims", "past 2**64", "0 and int64 max",
                                                                 "negative"])
def test_hostile_raw_tensors_over_grpc_are_invalid_argument(mesh: Any, shape: list[int], nbytes: int,
                                                            reason: str) -> None:
    from embedmesh.cache.v1 import cache_pb2
    from embedmesh.inference.v1 import inference_pb2
    from embedmesh.tensor.v1 import tensor_pb2

    tensor = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=shape, data=bytes(nbytes))
    params = inference_pb2.CompletionParams(model=MODEL, prompt_embeds=[inference_pb2.PromptEmbeds(tensor=tensor)])
    err = _grpc_error(lambda: _grpc_complete(mesh, params))
    assert err.field.startswith("prompt_embeds") and err.reason == reason, err
    header = cache_pb2.PutHeader(dtype=tensor_pb2.DATA_TYPE_FP32, shape=shape)
    err = _grpc_error(lambda: _grpc_put(mesh, header, bytes(nbytes)))
    assert err.field and (err.field.startswith("chunk") or err.field.startswith("header")), err
    _mesh_answers(mesh)


def _grpc_put(mesh: Any, header: Any, data: bytes) -> Any:
    import grpc

    from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
    from embedmesh.core.server import channel_options

    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        return cache_pb2_grpc.EncoderCacheServiceStub(ch).Put(
            iter([cache_pb2.PutRequest(header=header), cache_pb2.PutRequest(chunk=data)]), timeout=60)


@pytest.mark.parametrize("name,data,code", HOSTILE_TENSORS, ids=[c[0] for c in HOSTILE_TENSORS])
def test_hostile_encoded_tensors_over_grpc_are_invalid_argument(mesh: Any, name: str, data: Callable[[], bytes],
                                                                code: str) -> None:
    from embedmesh.cache.v1 import cache_pb2
    from embedmesh.inference.v1 import inference_pb2
    from embedmesh.tensor.v1 import tensor_pb2

    payload = data()
    params = inference_pb2.CompletionParams(model=MODEL, prompt_embeds=[inference_pb2.PromptEmbeds(
        encoded=tensor_pb2.EncodedTensor(data=payload))])
    err = _grpc_error(lambda: _grpc_complete(mesh, params))
    assert err.field.startswith("prompt_embeds") and err.reason == code.upper(), err
    encoding = (tensor_pb2.TENSOR_ENCODING_SAFETENSORS if payload[:4] != b"PK\x03\x04"
                else tensor_pb2.TENSOR_ENCODING_TORCH_SAVE)
    err = _grpc_error(lambda: _grpc_put(mesh, cache_pb2.PutHeader(encoding=encoding), payload))
    assert err.field == "chunk" and err.reason == code.upper(), err
    _mesh_answers(mesh)


def test_seed_at_int64_max_with_two_choices(mesh: Any) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "seed": INT64_MAX, "n": 2}
    r = httpx.post(f"{mesh.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1]
    again = httpx.post(f"{mesh.base_url}/v1/completions", json=body, timeout=120).json()["choices"]
    assert [c["text"] for c in sorted(again, key=lambda c: c["index"])] == \
        [c["text"] for c in sorted(choices, key=lambda c: c["index"])], "equal seeds must give equal text"
    # The same over gRPC, where the seed is the int64 field itself.
    from embedmesh.inference.v1 import inference_pb2

    params = inference_pb2.CompletionParams(model=MODEL, prompts=["Once upon a time"], n=2)
    params.sampling.max_tokens = 4
    params.sampling.seed = INT64_MAX
    assert len(_grpc_complete(mesh, params).choices) == 2


@pytest.mark.parametrize("field,value", [("max_tokens", 2**70), ("n", 2**64), ("seed", 2**63), ("top_k", 2**70),
                                         ("temperature", 1e300)])
def test_numbers_past_the_proto_fields_are_400s(mesh: Any, field: str, value: Any) -> None:
    r = httpx.post(f"{mesh.base_url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, field: value})
    _assert_400(r, field)
    _mesh_answers(mesh)


def test_a_filter_nested_150_deep_is_a_400(mesh: Any) -> None:
    flt: dict[str, Any] = {"type": "eq", "key": "topic", "value": "food"}
    for _ in range(150):
        flt = {"type": "and", "filters": [flt]}
    created = httpx.post(f"{mesh.base_url}/v1/vector_stores", json={"name": "hostile"}, timeout=60)
    if created.status_code == 501:
        pytest.skip("the mesh runs no vector store")
    assert created.status_code == 200, created.text
    store = created.json()["id"]
    try:
        r = httpx.post(f"{mesh.base_url}/v1/vector_stores/{store}/search", json={"query": "x", "filters": flt},
                       timeout=60)
        err = _assert_400(r, "filters", "too_deep")
        assert "levels deep" in err["message"]
        ok = httpx.post(f"{mesh.base_url}/v1/vector_stores/{store}/search", timeout=60,
                        json={"query": "x", "filters": {"type": "eq", "key": "topic", "value": "food"}})
        assert ok.status_code == 200, ok.text
    finally:
        httpx.delete(f"{mesh.base_url}/v1/vector_stores/{store}", timeout=60)
    _mesh_answers(mesh)


def test_a_multipart_upload_without_a_boundary_is_a_400(mesh: Any) -> None:
    body = (b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nassistants\r\n'
            b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\nhello\r\n--xyz--\r\n')
    r = httpx.post(f"{mesh.base_url}/v1/files", content=body, headers={"content-type": "multipart/form-data"},
                   timeout=60)
    if r.status_code == 501:
        pytest.skip("the mesh runs no vector store")
    err = _assert_400(r, "file", "invalid_multipart")
    assert "boundary" in err["message"]
    _mesh_answers(mesh)
