"""gateway/lora.py: vLLM's LoRA and sleep-mode admin routes, each through a bare app with a scripted stub — the gRPC
request each sends, the answer it gives, a bad body's 400 (before any call) and a refusal of the service mapped."""

from __future__ import annotations

from typing import Any

import pytest

from embedmesh.core.errors import NotFound, PermissionDenied
from embedmesh.gateway import lora
from embedmesh.inference.v1 import inference_pb2 as ipb
from tests.unit.gateway.conftest import FakeStub, bare_gateway, route_client, rpc_error


def client(**answers: Any) -> tuple[Any, FakeStub]:
    gw = bare_gateway()
    gw.stub = FakeStub(**answers)
    return route_client(lora.routes(gw)), gw.stub


def test_load_sends_name_path_and_workers_and_answers_vllms_text() -> None:
    http, stub = client(LoadLoraAdapter=ipb.LoadLoraAdapterResponse(workers=["w1"], loaded=True))
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/loras/sql", "workers": ["w1"],
                                                 "load_inplace": True})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    assert r.headers["content-type"].startswith("text/plain")
    assert stub.calls == [("LoadLoraAdapter", ipb.LoadLoraAdapterRequest(lora_name="sql", lora_path="/loras/sql",
                                                                         workers=["w1"]), 600.0)]


def test_unload_sends_the_name_and_answers_vllms_text() -> None:
    http, stub = client(UnloadLoraAdapter=ipb.UnloadLoraAdapterResponse(workers=["w1"]))
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql", "lora_int_id": 3})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
    assert stub.calls == [("UnloadLoraAdapter", ipb.UnloadLoraAdapterRequest(lora_name="sql"), 600.0)]


@pytest.mark.parametrize(("path", "body", "param", "message", "code"), [
    ("/v1/load_lora_adapter", {"lora_path": "/p"}, "lora_name", "lora_name: is required (a non-empty string)",
     "missing"),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": ""}, "lora_path",
     "lora_path: is required (a non-empty string)", "invalid_type"),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/p", "workers": [1]}, "workers",
     "workers: must be a list of worker ids (see /health)", "invalid_type"),
    ("/v1/unload_lora_adapter", {"lora_name": "a", "rank": 1}, "rank", "rank: is not a parameter of this route",
     "unknown_parameter"),
])
def test_a_bad_body_is_a_400_and_nothing_is_called(path: str, body: dict[str, Any], param: str, message: str,
                                                   code: str) -> None:
    http, stub = client(LoadLoraAdapter=ipb.LoadLoraAdapterResponse(),
                        UnloadLoraAdapter=ipb.UnloadLoraAdapterResponse())
    r = http.post(path, json=body)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    assert stub.calls == []


def test_a_refusal_of_the_service_is_mapped_with_its_field() -> None:
    http, _ = client(UnloadLoraAdapter=rpc_error(NotFound("lora_name: no adapter 'x' is loaded", field="lora_name",
                                                          reason="LORA_NOT_FOUND")),
                     LoadLoraAdapter=rpc_error(PermissionDenied("an admin key is required")))
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "lora_name: no adapter 'x' is loaded", "type": "not_found_error", "param": "lora_name",
        "code": "lora_not_found"}
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/p"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


@pytest.mark.parametrize("query,level", [("", 1), ("?level=1", 1), ("?level=2", 2)])
def test_sleep_sends_the_level_and_lists_the_workers(query: str, level: int) -> None:
    http, stub = client(SleepWorkers=ipb.SleepWorkersResponse(workers=["w1", "w2"]))
    r = http.post("/sleep" + query)
    assert r.status_code == 200 and r.json() == {"workers": ["w1", "w2"]}
    assert stub.last("SleepWorkers") == ipb.SleepWorkersRequest(level=level)


@pytest.mark.parametrize("level", ["0", "3", "one", ""])
def test_sleep_at_another_level_is_a_400_naming_level(level: str) -> None:
    http, stub = client(SleepWorkers=ipb.SleepWorkersResponse())
    r = http.post(f"/sleep?level={level}")
    assert r.status_code == 400 and r.json()["error"] == {"message": "level: must be 1 or 2",
                                                         "type": "invalid_request_error", "param": "level",
                                                         "code": "invalid_value"}
    assert stub.calls == []


def test_wake_up_and_is_sleeping() -> None:
    http, stub = client(WakeUpWorkers=ipb.WakeUpWorkersResponse(workers=["w2"]),
                        IsSleeping=ipb.IsSleepingResponse(is_sleeping=False, sleeping=["w1"]))
    assert http.post("/wake_up").json() == {"workers": ["w2"]}
    assert http.get("/is_sleeping").json() == {"is_sleeping": False, "sleeping_workers": ["w1"]}
    assert [m for m, _, _ in stub.calls] == ["WakeUpWorkers", "IsSleeping"]
    assert http.get("/sleep").status_code == 405
