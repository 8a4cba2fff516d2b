"""Adapter-aware routing on a real two-worker hf mesh with the KV router: workers report their adapters to the
router, which sends adapter requests only to holders; an adapter's prompt and the same prompt on the base model
are two chains in the router's index; with ``--lora-load-on-demand`` a request naming a known adapter that no
worker holds (lost behind the mesh's back) loads it on a worker first and gets the same text; an adapter unloaded
through the admin plane is not brought back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from embedmesh.router.v1 import router_pb2, router_pb2_grpc
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import MODEL
from tests.support.lora import save_smol_adapter
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

# Long enough for a few full 16-position routing blocks.
TEXT = ("The history of the city begins with a small settlement on the river, where traders met to exchange "
        "grain, salt and wool long before the first walls were built around the market square")


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-root")
    save_smol_adapter(root / "route-lora", seed=1)
    return root


@pytest.fixture(scope="module")
def rmesh(lora_root: Path) -> Iterator[Mesh]:
    m = start_mesh(workers=2, env={"EMBEDMESH_LORA_ROOT": str(lora_root)},
                   extra_args=["--lora-load-on-demand", "--embed-worker-port", "0", "--vector-store-port", "0"])
    yield m
    m.stop()


@pytest.fixture(scope="module")
def rclient(rmesh: Mesh) -> Any:
    return openai.OpenAI(base_url=f"{rmesh.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def _router(mesh: Mesh) -> Any:
    return router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(mesh.extra["router"]))


def _worker(mesh: Mesh, port: int) -> Any:
    return worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def _holders(mesh: Mesh, name: str) -> list[int]:
    return [p for p in mesh.worker_ports
            if name in {a.name for a in _worker(mesh, p).ListLoraAdapters(worker_pb2.ListLoraAdaptersRequest(),
                                                                            timeout=10).adapters}]


def _completed(mesh: Mesh) -> dict[int, int]:
    return {p: _worker(mesh, p).GetStats(worker_pb2.GetStatsRequest(), timeout=10).completed_requests
            for p in mesh.worker_ports}


def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_router_keeps_adapter_chains_apart_and_routes_to_holders(rmesh: Mesh, rclient: Any, lora_root: Path) -> None:
    holder_port = rmesh.worker_ports[1]
    holder_id = _worker(rmesh, holder_port).GetInfo(worker_pb2.GetInfoRequest(), timeout=10).worker_id
    r = httpx.post(f"{rmesh.base_url}/v1/load_lora_adapter", timeout=300,
                   json={"lora_name": "route-lora", "lora_path": "route-lora", "workers": [holder_id]})
    assert r.status_code == 200, r.text
    router = _router(rmesh)

    def adapters_seen() -> dict[str, list[str]]:
        return {w.registration.worker_id: list(w.load.lora_adapters)
                for w in router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers}

    _until(lambda: adapters_seen().get(holder_id) == ["route-lora"])
    assert sorted(v for k, v in adapters_seen().items() if k != holder_id) == [[]]

    nodes0 = router.GetIndexStats(router_pb2.GetIndexStatsRequest(), timeout=10).nodes
    before = _completed(rmesh)
    first = rclient.completions.create(model="route-lora", prompt=TEXT, max_tokens=4, temperature=0)
    blocks = first.usage.prompt_tokens // 16
    assert blocks >= 2
    nodes1 = router.GetIndexStats(router_pb2.GetIndexStatsRequest(), timeout=10).nodes
    assert nodes1 - nodes0 == blocks
    again = rclient.completions.create(model="route-lora", prompt=TEXT, max_tokens=4, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert router.GetIndexStats(router_pb2.GetIndexStatsRequest(), timeout=10).nodes == nodes1, \
        "the repeated adapter prompt reuses its own chain"
    base = rclient.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0)
    assert base.choices[0].text != first.choices[0].text
    assert router.GetIndexStats(router_pb2.GetIndexStatsRequest(), timeout=10).nodes == nodes1 + blocks, \
        "the base model's prompt is a second chain, never credited with the adapter's blocks"
    after = _completed(rmesh)
    others = [p for p in rmesh.worker_ports if p != holder_port]
    assert after[holder_port] - before[holder_port] >= 2
    assert sum(after[p] - before[p] for p in others) <= 1  # at most the base request


def test_a_lost_adapter_is_loaded_on_demand_and_an_unloaded_one_is_not(rmesh: Mesh, rclient: Any) -> None:
    if not _holders(rmesh, "route-lora"):
        r = httpx.post(f"{rmesh.base_url}/v1/load_lora_adapter", timeout=300,
                       json={"lora_name": "route-lora", "lora_path": "route-lora"})
        assert r.status_code == 200, r.text
    expected = rclient.completions.create(model="route-lora", prompt=TEXT, max_tokens=4, temperature=0)
    # The adapter disappears behind the mesh's back (as when its worker restarts without it).
    for port in _holders(rmesh, "route-lora"):
        assert _worker(rmesh, port).UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(name="route-lora"),
                                                      timeout=60).unloaded
    assert _holders(rmesh, "route-lora") == []
    got = rclient.completions.create(model="route-lora", prompt=TEXT, max_tokens=4, temperature=0)
    assert got.choices[0].text == expected.choices[0].text
    assert len(_holders(rmesh, "route-lora")) == 1, "loaded on demand on one worker"
    assert "route-lora" in {m.id for m in rclient.models.list().data}

    r = httpx.post(f"{rmesh.base_url}/v1/unload_lora_adapter", json={"lora_name": "route-lora"}, timeout=120)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.BadRequestError) as e:
        rclient.completions.create(model="route-lora", prompt=TEXT, max_tokens=2)
    assert e.value.body["param"] == "model"
    assert _holders(rmesh, "route-lora") == []
