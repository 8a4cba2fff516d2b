"""A REST completion with one big torch.save ``prompt_embeds`` payload (8 MiB of values or more) goes from the gateway
to the preprocessor as a Generate pieces stream and on to the worker as it arrives (``gateway/pieces_body.py``), on
a real echo mesh driven by the openai SDK and httpx: answered as before, streamed or not; every rule on the values
refused under the same name and code as the one-message path gives (NaN/Inf in the last row, a wrong hidden size,
over the byte cap) with nothing generated; a payload whose values are not stored as a wire tensor's (a transposed
view, float64) still goes as one message and is served."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch

from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.generate_calls import generate_calls, grew
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

ROWS, HIDDEN = 4000, 576  # 9.2 MB of float32: past the gateway's 8 MiB pieces threshold
CAP = 24 << 20


@pytest.fixture(scope="module")
def emesh() -> Iterator[Mesh]:
    m = start_mesh(engine="echo", extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"],
                   env={"EMBEDMESH_MAX_EMBEDS_BYTES": str(CAP), "EMBEDMESH_TRACE_CONSOLE": "0"})
    yield m
    m.stop()


def b64(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def rows(n: int = ROWS, hidden: int = HIDDEN, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, hidden)).astype(np.float32))


def calls(mesh: Mesh) -> dict[tuple[str, str, str], float]:
    """The preprocessor's Generate calls by (task, stream, transport)."""
    return generate_calls(mesh.extra["metrics_base"] + 1)


def completed(mesh: Mesh) -> int:
    with grpc.insecure_channel(mesh.workers[0]) as ch:
        return int(worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=10)
                   .completed_requests)


def post(mesh: Mesh, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{mesh.base_url}/v1/completions", json={"model": "echo", "prompt": "", **body}, timeout=120)



def test_a_big_payload_goes_as_pieces_and_is_answered_as_before(emesh: Mesh) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{emesh.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    before = calls(emesh)
    got = client.completions.create(model="echo", prompt="", max_tokens=3, extra_body={"prompt_embeds": b64(rows())})
    assert got.choices[0].text == "xxx" and got.usage.prompt_tokens == ROWS
    chunks = list(client.completions.create(model="echo", prompt="", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"prompt_embeds": b64(rows(seed=1))}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "xxx"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == ROWS
    after = calls(emesh)
    assert grew(before, after, "completion", False, "pieces") == 1
    assert grew(before, after, "completion", True, "pieces") == 1
    assert grew(before, after, "completion", False, "message") == 0
    assert grew(before, after, "completion", True, "message") == 0


def test_small_payloads_and_other_layouts_still_go_as_one_message(emesh: Mesh) -> None:
    before = calls(emesh)
    small = post(emesh, {"prompt_embeds": b64(rows(100)), "max_tokens": 2})
    transposed = post(emesh, {"prompt_embeds": b64(rows(HIDDEN, ROWS).t()), "max_tokens": 2})
    wide = post(emesh, {"prompt_embeds": b64(rows(2200).to(torch.float64)), "max_tokens": 2})  # 10 MB of float64
    assert [r.status_code for r in (small, transposed, wide)] == [200] * 3, (transposed.text, wide.text)
    assert transposed.json()["usage"]["prompt_tokens"] == ROWS and wide.json()["usage"]["prompt_tokens"] == 2200
    after = calls(emesh)
    assert grew(before, after, "completion", False, "message") == 3
    assert grew(before, after, "completion", False, "pieces") == 0


def test_a_big_payload_for_an_unknown_model_is_refused_as_a_small_one(emesh: Mesh) -> None:
    big = post(emesh, {"model": "no-such-model", "prompt_embeds": b64(rows()), "max_tokens": 2})
    small = post(emesh, {"model": "no-such-model", "prompt_embeds": b64(rows(10)), "max_tokens": 2})
    assert big.status_code == small.status_code != 200, (big.text, small.text)
    assert big.json()["error"] == small.json()["error"] and big.json()["error"]["param"] == "model"


def test_a_bfloat16_payload_goes_as_pieces_and_is_cast_like_one_message(emesh: Mesh) -> None:
    before = calls(emesh)
    r = post(emesh, {"prompt_embeds": b64(rows(8000).to(torch.bfloat16)), "max_tokens": 2})  # 9.2 MB of bf16
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 8000
    assert grew(before, calls(emesh), "completion", False, "pieces") == 1


@pytest.mark.parametrize("case", ["nan in the last value", "inf in the first", "hidden size", "over the cap"])
def test_a_broken_big_payload_is_refused_as_the_one_message_path_refuses_it(emesh: Mesh, case: str) -> None:
    t = rows()
    want = {"nan in the last value": "non_finite", "inf in the first": "non_finite",
            "hidden size": "hidden_size_mismatch", "over the cap": "too_large"}[case]
    if case == "nan in the last value":
        t[-1, -1] = float("nan")
    elif case == "inf in the first":
        t[0, 0] = float("inf")
    elif case == "hidden size":
        t = rows(ROWS, 640)
    else:
        t = rows(11000)  # 25.3 MB over the 24 MiB cap
    done = completed(emesh)
    big = post(emesh, {"prompt_embeds": b64(t), "max_tokens": 2})
    streamed = post(emesh, {"prompt_embeds": b64(t), "max_tokens": 2, "stream": True})
    for r in (big, streamed):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt_embeds" and err["code"] == want, err
        assert err["message"].startswith("prompt_embeds: ")
    if case == "over the cap":
        assert "EMBEDMESH_MAX_EMBEDS_BYTES" in big.json()["error"]["message"]
    # the same words as for a payload small enough to go as one message
    if case != "over the cap":
        small = t[:100] if case != "hidden size" else rows(100, 640)
        if case == "nan in the last value":
            small[-1, -1] = float("nan")
        one = post(emesh, {"prompt_embeds": b64(small), "max_tokens": 2})
        assert one.status_code == 400 and one.json()["error"] == big.json()["error"]
    assert completed(emesh) == done  # nothing generated


def chat(mesh: Mesh, *payloads: torch.Tensor, stream: bool = False) -> httpx.Response:
    content = [{"type": "prompt_embeds", "data": b64(p)} for p in payloads]
    return httpx.post(f"{mesh.base_url}/v1/chat/completions", timeout=120, json={
        "model": "echo", "max_tokens": 2, "stream": stream,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "look:"}, *content]}]})


def test_a_chat_with_big_payloads_goes_as_pieces_and_is_answered_as_before(emesh: Mesh) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{emesh.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    before = calls(emesh)
    got = client.chat.completions.create(model="echo", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "prompt_embeds", "data": b64(rows(2500))},  # type: ignore[list-item, misc]
        {"type": "prompt_embeds", "data": b64(rows(2000, seed=3))}]}])  # type: ignore[list-item, misc]
    assert got.choices[0].message.content == "xx" and got.usage is not None
    streamed = chat(emesh, rows(4000), stream=True)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    after = calls(emesh)
    assert grew(before, after, "chat", False, "pieces") == 1 and grew(before, after, "chat", True, "pieces") == 1
    assert grew(before, after, "chat", False, "message") == 0 and grew(before, after, "chat", True, "message") == 0
    # the same conversation as one message (small) counts its prompt the same way per row
    small = chat(emesh, rows(10))
    assert small.status_code == 200
    big = chat(emesh, rows(4000))
    assert big.json()["usage"]["prompt_tokens"] - small.json()["usage"]["prompt_tokens"] == 4000 - 10


@pytest.mark.parametrize("case", ["nan", "over the cap"])
def test_a_broken_big_chat_payload_is_refused_as_the_one_message_path_refuses_it(emesh: Mesh, case: str) -> None:
    t = rows(11000) if case == "over the cap" else rows()
    if case == "nan":
        t[2000, 7] = float("nan")
    done = completed(emesh)
    big = chat(emesh, t)
    assert big.status_code == 400, big.text
    err = big.json()["error"]
    assert err["param"] == "messages[0].content[1]" and err["code"] == ("non_finite" if case == "nan" else "too_large")
    if case == "nan":
        small = t[1990:2010].clone()
        one = chat(emesh, small)
        assert one.status_code == 400 and one.json()["error"] == err
    else:
        assert "EMBEDMESH_MAX_EMBEDS_BYTES" in err["message"]
    assert completed(emesh) == done
