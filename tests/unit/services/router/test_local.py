"""router.local: the in-process route client answers what the gRPC RouteClient answers — the policy's decision
as a RouteDecision (candidates and costs included), None with a counted fallback when no worker serves the model
or the request is refused, and only adapter holders for an adapter."""

from __future__ import annotations

import random

import pytest
from prometheus_client import REGISTRY

from embedmesh.services.router.local import LocalRouteClient
from embedmesh.services.router.policy import KvRouter
from embedmesh.services.router.registry import Registry, WorkerState
from embedmesh.services.router.scoring import Weights


def _fallbacks(reason: str) -> float:
    return REGISTRY.get_sample_value("embedmesh_router_fallback_total", {"reason": reason}) or 0.0


def _client() -> LocalRouteClient:
    reg = Registry()
    reg.register(WorkerState("a", "a:1", "m", 4, "test", True)).active_requests = 0
    reg.register(WorkerState("b", "b:1", "m", 4, "test", True)).active_requests = 3
    reg.index.stored("b", 0, [1, 2, 3])
    reg.workers["b"].adapters = {"sql"}
    return LocalRouteClient(KvRouter(reg, Weights(prefill=1, decode=0), random.Random(0)), block_size=4)


async def test_the_policys_choice_with_its_candidates() -> None:
    d = await _client().route("m", [1, 2, 3], 12, "r1")
    assert d is not None
    assert (d.worker_id, d.address, d.overlap_blocks, d.adapter_missing) == ("b", "b:1", 3, False)
    assert [(c.worker_id, c.address, c.overlap_blocks, c.active_requests) for c in d.candidates] == [
        ("b", "b:1", 3, 3), ("a", "a:1", 0, 0)]
    assert d.candidates[0].cost < d.candidates[1].cost


async def test_adapters_only_their_holders_else_adapter_missing() -> None:
    c = _client()
    d = await c.route("m", [9], 4, adapter="sql")
    assert d is not None and d.worker_id == "b" and [x.worker_id for x in d.candidates] == ["b"]
    missing = await c.route("m", [9], 4, adapter="nobody-has-it")
    assert missing is not None and missing.adapter_missing


async def test_no_worker_or_a_refusal_is_none_and_counted() -> None:
    c = _client()
    before = _fallbacks("no_worker"), _fallbacks("too_many_hashes")
    assert await c.route("other-model", [1], 4) is None
    assert await c.route("m", [1, 2, 3, 4], 8) is None  # 4 hashes, only 2 full blocks
    assert (_fallbacks("no_worker"), _fallbacks("too_many_hashes")) == (before[0] + 1, before[1] + 1)


def test_block_size_is_checked() -> None:
    with pytest.raises(ValueError, match="block_size"):
        LocalRouteClient(_client().router, 0)
