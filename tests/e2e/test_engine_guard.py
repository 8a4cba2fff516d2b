"""One request must never stop a worker: a tiny temperature through the public API and NaN rows sent straight to
the worker (no preprocessor in between) each get an answer, and the worker keeps serving afterwards."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedmesh.core.errors import from_rpc_error
from embedmesh.core.server import channel_options
from embedmesh.core.tensors import from_numpy
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import MODEL
from tests.support.worker_generate import worker_generate

pytestmark = pytest.mark.e2e

TEXT = "The capital of France is"


def test_a_tiny_temperature_decodes_greedily_and_the_worker_keeps_serving(mesh: Any, client: Any) -> None:
    greedy = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0).choices[0].text
    tiny = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=1e-40, seed=1)
    assert tiny.choices[0].text == greedy
    assert tiny.usage.completion_tokens == 8
    after = client.completions.create(model=MODEL, prompt="Roses are red,", max_tokens=4, temperature=0)
    assert after.choices[0].text and after.usage.completion_tokens == 4


def _generate(stub: Any, request_id: str, segments: list[Any]) -> list[Any]:
    req = worker_pb2.GenerateRequest(request_id=request_id, segments=segments)
    req.sampling.max_tokens = 4
    req.sampling.temperature = 0.0
    return list(worker_generate(stub, req, timeout=60))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_sent_straight_to_a_worker_are_invalid_and_it_keeps_serving(
    mesh: Any, embeds_of: Any, value: float
) -> None:
    rows = embeds_of(TEXT).numpy().astype(np.float32)
    bad = rows.copy()
    bad[2, 100] = value
    with grpc.insecure_channel(mesh.workers[0], options=channel_options()) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            _generate(stub, f"nan-{value}", [worker_pb2.PromptSegment(embeds=from_numpy(bad))])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        err = from_rpc_error(info.value)
        assert (err.field, err.reason) == ("prompt_embeds", "NON_FINITE")
        assert "NaN or Inf" in str(err)
        # The same worker answers a good request at once.
        by_rows = _generate(stub, f"rows-after-{value}", [worker_pb2.PromptSegment(embeds=from_numpy(rows))])
        assert by_rows[-1].finish_reason and by_rows[-1].prompt_tokens == rows.shape[0]
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_tiny_temperature_sent_straight_to_a_worker_is_greedy(mesh: Any, embeds_of: Any) -> None:
    rows = embeds_of(TEXT).numpy().astype(np.float32)
    seg = worker_pb2.PromptSegment(embeds=from_numpy(rows))
    with grpc.insecure_channel(mesh.workers[0], options=channel_options()) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        greedy = _generate(stub, "greedy", [seg])
        req = worker_pb2.GenerateRequest(request_id="tiny", segments=[seg])
        req.sampling.max_tokens = 4
        req.sampling.temperature = 1e-40
        req.sampling.seed = 7
        tiny = list(worker_generate(stub, req, timeout=60))
    assert "".join(r.text for r in tiny) == "".join(r.text for r in greedy)
    assert tiny[-1].completion_tokens == 4
