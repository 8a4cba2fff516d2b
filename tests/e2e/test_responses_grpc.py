"""The Responses API over gRPC (``embedmesh.responses.v1.ResponsesService`` on the gateway's ``--grpc-port``)
through a real echo mesh: the same stored state as REST (a response made over REST read, continued, listed and
deleted over gRPC, and the other way round, with the official openai SDK on the REST side), streamed events in the
documented order, background + cancel, tenant isolation (another tenant's id is NOT_FOUND with the words of an
unknown id), and bad input named as INVALID_ARGUMENT. The echo engine answers "x" per token, so usage says which
prompt the worker got."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import pytest
from google.protobuf import json_format, struct_pb2

from embedmesh.responses.v1 import responses_pb2 as pb
from embedmesh.responses.v1 import responses_pb2_grpc as pb_grpc
from tests.e2e.test_grpc_api import grpcurl
from tests.support.mesh import Mesh, free_port, start_mesh

pytestmark = pytest.mark.e2e

KA, KB = "sk-responses-grpc-alpha-0123456789", "sk-responses-grpc-beta-0123456789"


@pytest.fixture(scope="module")
def gmesh() -> Iterator[Mesh]:
    db = os.path.join(tempfile.mkdtemp(prefix="embedmesh-responses-grpc-"), "responses.sqlite3")
    port = free_port()
    m = start_mesh(engine="echo", env={"EMBEDMESH_TRACE_CONSOLE": "0", "EMBEDMESH_API_KEYS": f"{KA}=alpha,{KB}=beta",
                                       "EMBEDMESH_GATEWAY_RESPONSES_DB": db,
                                       "EMBEDMESH_GATEWAY_GRPC_PORT": str(port)})
    m.extra["model"] = httpx.get(f"{m.base_url}/v1/models", headers={"authorization": f"Bearer {KA}"},
                                 timeout=30).json()["data"][0]["id"]
    m.extra["grpc"] = f"127.0.0.1:{port}"
    yield m
    m.stop()


@pytest.fixture(scope="module")
def stub(gmesh: Mesh) -> Iterator[pb_grpc.ResponsesServiceStub]:
    with grpc.insecure_channel(str(gmesh.extra["grpc"])) as channel:
        yield pb_grpc.ResponsesServiceStub(channel)


@pytest.fixture
def alpha(gmesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gmesh.base_url}/v1", api_key=KA, max_retries=0, timeout=60)


def _key(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def _body(obj: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(obj)
    return s


def _create(stub: pb_grpc.ResponsesServiceStub, key: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of one CreateResponse call, as JSON: the response object, or the streamed events."""
    out = []
    for msg in stub.CreateResponse(pb.CreateResponseRequest(body=_body(body)), metadata=_key(key), timeout=60):
        which = msg.WhichOneof("result")
        out.append({"kind": which, **json_format.MessageToDict(getattr(msg, which))})
    return out


def _code(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_rest_response_read_continued_and_deleted_over_grpc(stub: pb_grpc.ResponsesServiceStub,
                                                            alpha: openai.OpenAI, gmesh: Mesh) -> None:
    model = gmesh.extra["model"]
    first = alpha.responses.create(model=model, input="Hello over REST", max_output_tokens=3)
    got = stub.RetrieveResponse(pb.RetrieveResponseRequest(response_id=first.id), metadata=_key(KA), timeout=30)
    seen = json_format.MessageToDict(got.response)
    assert seen["id"] == first.id and seen["status"] == first.status
    assert seen["output"][0]["content"][0]["text"] == first.output_text == "xxx"
    assert seen["usage"]["input_tokens"] == first.usage.input_tokens
    items = stub.ListInputItems(pb.ListInputItemsRequest(response_id=first.id), metadata=_key(KA), timeout=30)
    assert [json_format.MessageToDict(i)["content"][0]["text"] for i in items.data] == ["Hello over REST"]
    assert items.first_id == items.last_id == json_format.MessageToDict(items.data[0])["id"] and not items.has_more

    # the follow-up turn over gRPC continues the REST one: the worker gets the whole conversation, as chat sends it
    [turn2] = _create(stub, KA, {"model": model, "input": "And again", "previous_response_id": first.id,
                                 "max_output_tokens": 2})
    assert turn2["kind"] == "response" and turn2["previous_response_id"] == first.id
    whole = [{"role": "user", "content": "Hello over REST"}, {"role": "assistant", "content": "xxx"},
             {"role": "user", "content": "And again"}]
    chat = alpha.chat.completions.create(model=model, messages=whole, max_tokens=1)
    assert turn2["usage"]["input_tokens"] == chat.usage.prompt_tokens
    # ... and REST reads what gRPC stored
    again = alpha.responses.retrieve(turn2["id"])
    assert again.output_text == "xx" and again.usage.input_tokens == chat.usage.prompt_tokens

    deleted = stub.DeleteResponse(pb.DeleteResponseRequest(response_id=first.id), metadata=_key(KA), timeout=30)
    assert deleted.id == first.id and deleted.deleted
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(first.id)
    err = _code(lambda: stub.DeleteResponse(pb.DeleteResponseRequest(response_id=first.id), metadata=_key(KA)))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_stream_events_in_order_and_stored_for_rest(stub: pb_grpc.ResponsesServiceStub,
                                                         alpha: openai.OpenAI, gmesh: Mesh) -> None:
    model = gmesh.extra["model"]
    events = _create(stub, KA, {"model": model, "input": "Stream it", "max_output_tokens": 4, "stream": True})
    assert {e["kind"] for e in events} == {"event"}
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [int(e["sequence_number"]) for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "xxxx"
    rid = events[0]["response"]["id"]
    stored = alpha.responses.retrieve(rid)
    assert stored.output_text == "xxxx" and stored.status == "incomplete"
    # the REST stream of the same request has the same event types
    rest = [e.type for e in alpha.responses.create(model=model, input="Stream it", max_output_tokens=4,
                                                    stream=True)]
    assert rest == types


def test_grpc_background_then_cancel(stub: pb_grpc.ResponsesServiceStub, alpha: openai.OpenAI,
                                     gmesh: Mesh) -> None:
    model = gmesh.extra["model"]
    [queued] = _create(stub, KA, {"model": model, "input": "Go on", "max_output_tokens": 900_000,
                                  "background": True})
    assert queued["status"] in ("queued", "in_progress")
    got = stub.CancelResponse(pb.CancelResponseRequest(response_id=queued["id"]), metadata=_key(KA), timeout=30)
    assert json_format.MessageToDict(got.response)["status"] == "cancelled"
    assert alpha.responses.retrieve(queued["id"]).status == "cancelled"
    done = alpha.responses.create(model=model, input="Hi", max_output_tokens=1)  # not a background one
    err = _code(lambda: stub.CancelResponse(pb.CancelResponseRequest(response_id=done.id), metadata=_key(KA)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "background" in err.details()


def test_another_tenants_id_is_not_found_as_an_unknown_one(stub: pb_grpc.ResponsesServiceStub,
                                                            alpha: openai.OpenAI, gmesh: Mesh) -> None:
    mine = alpha.responses.create(model=gmesh.extra["model"], input="Mine", max_output_tokens=1)
    unknown = "resp_" + "0" * 48
    calls = [lambda rid: stub.RetrieveResponse(pb.RetrieveResponseRequest(response_id=rid), metadata=_key(KB)),
             lambda rid: stub.DeleteResponse(pb.DeleteResponseRequest(response_id=rid), metadata=_key(KB)),
             lambda rid: stub.ListInputItems(pb.ListInputItemsRequest(response_id=rid), metadata=_key(KB)),
             lambda rid: stub.CancelResponse(pb.CancelResponseRequest(response_id=rid), metadata=_key(KB))]
    for call in calls:
        theirs, none = _code(lambda c=call: c(mine.id)), _code(lambda c=call: c(unknown))
        assert theirs.code() == none.code() == grpc.StatusCode.NOT_FOUND
        assert theirs.details() == none.details().replace(unknown, mine.id)
    err = _code(lambda: _create(stub, KB, {"model": gmesh.extra["model"], "input": "Theirs",
                                           "previous_response_id": mine.id}))
    assert err.code() == grpc.StatusCode.NOT_FOUND and err.details().startswith("previous_response_id")
    assert alpha.responses.retrieve(mine.id).output_text == "x"  # still there for its own tenant
    err = _code(lambda: stub.RetrieveResponse(pb.RetrieveResponseRequest(response_id=mine.id)))  # no key
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(("body", "field"), [
    ({"input": "hi"}, "model"),
    ({"model": "M"}, "input"),
    ({"model": "M", "input": "hi", "max_output_tokens": -3}, "max_output_tokens"),
    ({"model": "M", "input": "hi", "temperature": -1}, "temperature"),
    ({"model": "M", "input": [{"type": "message", "role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text"),
])
def test_bad_create_is_invalid_argument_naming_the_field(stub: pb_grpc.ResponsesServiceStub, gmesh: Mesh,
                                                         body: dict[str, Any], field: str) -> None:
    body = {k: (gmesh.extra["model"] if v == "M" else v) for k, v in body.items()}
    err = _code(lambda: _create(stub, KA, body))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field), err.details()


def test_bad_ids_and_paging_are_invalid_argument(stub: pb_grpc.ResponsesServiceStub, alpha: openai.OpenAI,
                                                 gmesh: Mesh) -> None:
    r = alpha.responses.create(model=gmesh.extra["model"], input="Page me", max_output_tokens=1)
    for request, field in [(pb.ListInputItemsRequest(response_id=r.id, limit=101), "limit"),
                           (pb.ListInputItemsRequest(response_id=r.id, order="sideways"), "order"),
                           (pb.ListInputItemsRequest(response_id=r.id, after="msg_nope"), "after"),
                           (pb.ListInputItemsRequest(response_id=""), "response_id"),
                           (pb.ListInputItemsRequest(response_id="x" * 300), "response_id")]:
        err = _code(lambda q=request: stub.ListInputItems(q, metadata=_key(KA), timeout=30))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field), err.details()
    err = _code(lambda: stub.RetrieveResponse(pb.RetrieveResponseRequest(response_id="a/b?c"), metadata=_key(KA)))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_grpcurl_recipe_of_the_docs(gmesh: Mesh, alpha: openai.OpenAI) -> None:
    """docs/api.md's grpcurl lines, with the real grpcurl binary and reflection (no .proto files)."""
    addr = str(gmesh.extra["grpc"])
    anonymous = subprocess.run([grpcurl(), "-plaintext", addr, "list"], capture_output=True, text=True, timeout=30)
    assert anonymous.returncode != 0 and "Unauthenticated" in anonymous.stderr  # reflection wants the key
    listed = subprocess.run([grpcurl(), "-plaintext", "-H", f"authorization: Bearer {KA}", addr, "list"],
                            capture_output=True, text=True, timeout=30)
    assert "embedmesh.responses.v1.ResponsesService" in listed.stdout.split(), listed.stderr
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as ch:  # health stays open to probes (which carry no key, nor use reflection)
        probe = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert probe.status == health_pb2.HealthCheckResponse.SERVING
    body = {"body": {"model": gmesh.extra["model"], "input": "Hello from grpcurl", "max_output_tokens": 2}}
    made = subprocess.run([grpcurl(), "-plaintext", "-H", f"authorization: Bearer {KA}", "-d", json.dumps(body), addr,
                           "embedmesh.responses.v1.ResponsesService/CreateResponse"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    rid = json.loads(made.stdout)["response"]["id"]
    assert alpha.responses.retrieve(rid).output_text == "xx"
    got = subprocess.run([grpcurl(), "-plaintext", "-H", f"authorization: Bearer {KB}", "-d",
                          json.dumps({"responseId": rid}), addr,
                          "embedmesh.responses.v1.ResponsesService/RetrieveResponse"],
                         capture_output=True, text=True, timeout=30)
    assert got.returncode != 0 and "NotFound" in got.stderr
