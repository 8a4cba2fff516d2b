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
