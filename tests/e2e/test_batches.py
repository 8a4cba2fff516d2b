"""The Batch API through a real mesh (echo engine, API keys of two tenants) with the official ``openai`` SDK:
files.create(purpose="batch") -> batches.create -> poll -> files.content; a bad line fails alone with the route's
own 400; cancel; another tenant's batch and files are 404; a file that is not JSONL is a 400 naming the line; a
gateway killed mid-batch and started again on the same database runs only the lines it had not recorded (counted
by the preprocessor's per-tenant OK requests)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.mesh import Mesh, free_port, start_mesh

pytestmark = pytest.mark.e2e

KEY_A, KEY_B, KEY_R = "batch-tenant-a-key", "batch-tenant-b-key", "batch-restart-key"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    d = tmp_path_factory.mktemp("batches")
    keys = d / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": KEY_A, "tenant": "ta"}, {"key": KEY_B, "tenant": "tb"},
                                         {"key": KEY_R, "tenant": "tr"}]}))
    m = start_mesh(engine="echo", env={"EMBEDMESH_API_KEYS_FILE": str(keys), "EMBEDMESH_TRACE_CONSOLE": "0",
                                       "EMBEDMESH_GATEWAY_BATCH_DB": str(d / "batches.sqlite3")})
    m.extra["keys"] = str(keys)
    m.extra["dir"] = str(d)
    yield m
    m.stop()


def sdk(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60)


def model(mesh: Mesh) -> str:
    return str(sdk(mesh.base_url, KEY_A).models.list().data[0].id)


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return ("\n".join(json.dumps(x) for x in lines) + "\n").encode()


def completion(cid: str, body: dict[str, Any], url: str = "/v1/completions") -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def wait(client: openai.OpenAI, bid: str, statuses: tuple[str, ...] = ("completed", "failed", "cancelled"),
         timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(bid)
        if b.status in statuses:
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {bid} still {b.status}: {b.request_counts}")


def lines_of(client: openai.OpenAI, fid: str | None) -> dict[str, dict[str, Any]]:
    if fid is None:
        return {}
    out = [json.loads(x) for x in client.files.content(fid).content.decode().splitlines()]
    return {x["custom_id"]: x for x in out}


def embeds_b64(rows: int) -> str:
    import torch

    buf = io.BytesIO()
    torch.save(torch.randn(rows, 576), buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_a_batch_runs_through_the_same_routes_and_its_output_downloads(mesh: Mesh) -> None:
    c = sdk(mesh.base_url, KEY_A)
    m = model(mesh)
    up = c.post("/prompt_embeds", body={"data": embeds_b64(7)}, cast_to=object)
    lines = [completion("text", {"model": m, "prompt": "Say hi", "max_tokens": 3}),
             completion("inline", {"model": m, "prompt_embeds": embeds_b64(5), "max_tokens": 2}),
             completion("by-id", {"model": m, "prompt_embeds": {"id": up["id"]}, "max_tokens": 2}),
             completion("bad", {"model": m, "prompt": "x", "max_tokens": 2, "temperature": -1}),
             completion("streams", {"model": m, "prompt": "x", "max_tokens": 2, "stream": True})]
    f = c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(jsonl(lines))
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                         metadata={"job": "e2e"})
    assert b.status == "validating" and b.metadata == {"job": "e2e"} and b.request_counts.total == 5
    done = wait(c, b.id)
    assert done.status == "completed" and done.completed_at and done.in_progress_at
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 2)
    out, err = lines_of(c, done.output_file_id), lines_of(c, done.error_file_id)
    assert sorted(out) == ["by-id", "inline", "text"] and sorted(err) == ["bad", "streams"]
    # the interactive route answers the same body the same way (echo: "x" per token; embeds rows = prompt tokens)
    direct = c.completions.create(model=m, prompt="Say hi", max_tokens=3)
    text = out["text"]["response"]
    assert text["status_code"] == 200 and text["body"]["choices"][0]["text"] == direct.choices[0].text
    assert text["body"]["usage"] == direct.usage.model_dump(exclude_none=True) | text["body"]["usage"]
    assert out["inline"]["response"]["body"]["usage"]["prompt_tokens"] == 5
    assert out["by-id"]["response"]["body"]["usage"]["prompt_tokens"] == 7
    bad = err["bad"]
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["param"] == "temperature"
    assert err["streams"]["response"]["body"]["error"]["param"] == "stream"
    assert b.id in [x.id for x in c.batches.list(limit=100).data]


def test_a_chat_batch_with_a_shared_prefix(mesh: Mesh) -> None:
    c = sdk(mesh.base_url, KEY_A)
    m = model(mesh)
    system = {"role": "system", "content": "You answer briefly. " * 20}
    lines = [completion(f"q{i}", {"model": m, "max_tokens": 2,
                                  "messages": [system, {"role": "user", "content": f"Question {i}"}]},
                        "/v1/chat/completions") for i in range(12)]
    f = c.files.create(file=("chat.jsonl", jsonl(lines)), purpose="batch")
    done = wait(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                    completion_window="24h").id)
    out = lines_of(c, done.output_file_id)
    assert sorted(out) == sorted(f"q{i}" for i in range(12))
    assert {o["response"]["body"]["object"] for o in out.values()} == {"chat.completion"}


def test_a_file_that_is_not_jsonl_is_a_400_naming_the_line(mesh: Mesh) -> None:
    c = sdk(mesh.base_url, KEY_A)
    good = json.dumps(completion("a", {"model": "m", "prompt": "x"}))
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", f"{good}\nthis is not json\n".encode()), purpose="batch")
    assert e.value.body["param"] == "file" and e.value.body["message"].startswith("line 2: ")  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="line 2: custom_id 'a' is already"):
        c.files.create(file=("x.jsonl", f"{good}\n{good}\n".encode()), purpose="batch")


def test_another_tenants_batch_and_files_are_404(mesh: Mesh) -> None:
    a, b = sdk(mesh.base_url, KEY_A), sdk(mesh.base_url, KEY_B)
    f = a.files.create(file=("in.jsonl", jsonl([completion("a", {"model": model(mesh), "prompt": "x",
                                                                  "max_tokens": 1})])), purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    for call in (lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                 lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [x.id for x in b.batches.list().data]
    wait(a, batch.id)


def test_cancel_stops_a_batch_and_keeps_what_was_done(mesh: Mesh) -> None:
    c = sdk(mesh.base_url, KEY_A)
    m = model(mesh)
    n = 3000
    f = c.files.create(file=("big.jsonl", jsonl([completion(f"c{i}", {"model": m, "prompt": f"p{i}",
                                                                        "max_tokens": 4}) for i in range(n)])),
                       purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    cancelling = c.batches.cancel(b.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait(c, b.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert done.request_counts.completed < n
    assert len(lines_of(c, done.output_file_id)) == done.request_counts.completed
    time.sleep(1.0)
    assert c.batches.retrieve(b.id).request_counts.completed == done.request_counts.completed  # nothing runs on


def _ok_requests(mesh: Mesh, tenant: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{mesh.extra['metrics_base'] + 1}/metrics",  # type: ignore[operator]
                                  timeout=10).read().decode()
    pattern = re.compile(r'^embedmesh_tenant_requests_total\{(?=[^}]*tenant="' + tenant + r'")(?=[^}]*code="OK")'
                         r'[^}]*\} ([0-9.e+]+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


def _gateway(mesh: Mesh, port: int, db: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "EMBEDMESH_API_KEYS_FILE": str(mesh.extra["keys"]), "EMBEDMESH_GATEWAY_BATCH_DB": db,
           "EMBEDMESH_GATEWAY_BATCH_CONCURRENCY": "2", "EMBEDMESH_TRACE_CONSOLE": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "embedmesh.gateway.main", "--port", str(port),
                             "--preprocessor", mesh.preprocessor], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("gateway did not start")


def test_a_gateway_killed_mid_batch_resumes_and_runs_no_finished_line_twice(mesh: Mesh) -> None:
    import sqlite3

    db = str(Path(str(mesh.extra["dir"])) / "restart.sqlite3")
    port = free_port()
    n = 400
    gw = _gateway(mesh, port, db)
    try:
        c = sdk(f"http://127.0.0.1:{port}", KEY_R)
        m = model(mesh)
        f = c.files.create(file=("r.jsonl", jsonl([completion(f"r{i}", {"model": m, "prompt": f"p{i}",
                                                                          "max_tokens": 8}) for i in range(n)])),
                           purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        while c.batches.retrieve(b.id).request_counts.completed < 20:
            time.sleep(0.05)
        os.killpg(gw.pid, signal.SIGKILL)  # no drain, no shutdown: lines in flight die unrecorded
        gw.wait()
        time.sleep(1.0)  # the preprocessor ends the dead gateway's calls (CANCELLED, not OK)
        with sqlite3.connect(db) as conn:
            recorded = conn.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND done = 1",
                                    (b.id,)).fetchone()[0]
        before = _ok_requests(mesh, "tr")
        assert 20 <= recorded < n, recorded
        gw = _gateway(mesh, port, db)  # the same host:port: it takes its lease back at once
        done = wait(c, b.id)
        ran_again = _ok_requests(mesh, "tr") - before
        out = lines_of(c, done.output_file_id)
    finally:
        if gw.poll() is None:
            os.killpg(gw.pid, signal.SIGKILL)
            gw.wait()
    assert done.status == "completed" and done.request_counts.completed == n
    assert ran_again == n - recorded  # every unrecorded line once more, no recorded one again
    assert sorted(out) == sorted(f"r{i}" for i in range(n))


def test_a_responses_batch_runs_through_the_responses_route(mesh: Mesh) -> None:
    c = sdk(mesh.base_url, KEY_A)
    m = model(mesh)
    lines = [completion("r1", {"model": m, "input": "Say hi", "max_output_tokens": 3}, "/v1/responses"),
             completion("r2", {"model": m, "input": "Say hi", "max_output_tokens": -1}, "/v1/responses")]
    f = c.files.create(file=("resp.jsonl", jsonl(lines)), purpose="batch")
    done = wait(c, c.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h").id)
    out, err = lines_of(c, done.output_file_id), lines_of(c, done.error_file_id)
    assert out["r1"]["response"]["body"]["object"] == "response"
    assert out["r1"]["response"]["body"]["status"] in ("completed", "incomplete")
    assert err["r2"]["response"]["status_code"] == 400
    assert err["r2"]["response"]["body"]["error"]["param"] == "max_output_tokens"
