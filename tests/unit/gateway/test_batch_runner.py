"""The runner on a real SQLite store with a scripted ``call``: prefix order, bounded concurrency, interactive traffic
first, OpenAI's output lines, a stop and a new runner that runs only what was not recorded, cancel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from prometheus_client import REGISTRY

from embedmesh.gateway.batch_runner import BatchRunner
from embedmesh.gateway.batch_store import BatchStore


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[BatchStore]:
    s = BatchStore(str(tmp_path / "b.sqlite3"))
    yield s
    s.close()


class Engine:
    """The handlers' stand-in: answers each body after ``delay``, refuses bodies with "bad"."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.seen: list[str] = []
        self.auth: set[str] = set()
        self.running = 0
        self.peak = 0

    async def __call__(self, url: str, body: bytes, authorization: str) -> tuple[int, bytes]:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            prompt = orjson.loads(body)["prompt"]
            self.seen.append(prompt)
            self.auth.add(authorization)
            await asyncio.sleep(self.delay)
            if "bad" in prompt:
                return 400, orjson.dumps({"error": {"message": "prompt: bad", "code": "invalid_value"}})
            return 200, orjson.dumps({"id": f"cmpl-{prompt}", "choices": [{"text": prompt}]})
        finally:
            self.running -= 1


async def _batch(store: BatchStore, prompts: list[str], order: list[int] | None = None) -> str:
    f = await store.add_file("t", "batch", "in.jsonl", b"-")
    lines = [(f"id-{i}", "/v1/completions", orjson.dumps({"prompt": p}), (order or list(range(len(prompts))))[i])
             for i, p in enumerate(prompts)]
    return str((await store.create_batch("t", "/v1/completions", f["id"], "24h", None, "sealed", lines, {}))["id"])


def _runner(store: BatchStore, engine: Engine, **kw: object) -> BatchRunner:
    return BatchRunner(store, engine, owner="me", unseal=lambda s: f"Bearer {s}", poll_s=0.05, **kw)  # type: ignore[arg-type]


async def _until(store: BatchStore, bid: str, status: str, timeout: float = 10.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        got = await store.batch("t", bid)
        if got is not None and got["status"] == status:
            return got
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch not {status}: {await store.batch('t', bid)}")


async def test_lines_run_in_run_order_with_bounded_concurrency_and_land_in_openais_files(store: BatchStore) -> None:
    engine = Engine(delay=0.01)
    bid = await _batch(store, ["p0", "bad1", "p2", "p3", "p4", "p5"], order=[5, 4, 3, 2, 1, 0])
    runner = _runner(store, engine, concurrency=2, slice_lines=4)
    runner.start()
    try:
        got = await _until(store, bid, "completed")
    finally:
        await runner.stop()
    assert engine.seen == ["p5", "p4", "p3", "p2", "bad1", "p0"] and engine.peak == 2
    assert engine.auth == {"Bearer sealed"}  # the creator's header, unsealed, with every line
    assert got["request_counts"] == {"total": 6, "completed": 5, "failed": 1} and got["in_progress_at"]
    out = [orjson.loads(x) for x in (await store.file_content("t", got["output_file_id"]) or b"").splitlines()]
    assert [o["custom_id"] for o in out] == ["id-0", "id-2", "id-3", "id-4", "id-5"]  # file order
    assert out[0]["response"] == {"status_code": 200, "request_id": "cmpl-p0",
                                  "body": {"id": "cmpl-p0", "choices": [{"text": "p0"}]}}
    assert out[0]["error"] is None and out[0]["id"].startswith("batch_req_")
    err = [orjson.loads(x) for x in (await store.file_content("t", got["error_file_id"]) or b"").splitlines()]
    assert [(e["custom_id"], e["response"]["status_code"], e["error"]) for e in err] == [
        ("id-1", 400, {"code": "invalid_value", "message": "prompt: bad"})]


async def test_no_line_starts_while_interactive_traffic_is_busy(store: BatchStore) -> None:
    engine = Engine()
    busy = [True]
    bid = await _batch(store, ["a", "b"])
    runner = _runner(store, engine, busy=lambda: busy[0])
    runner.start()
    try:
        await _until(store, bid, "in_progress")
        await asyncio.sleep(0.2)
        assert engine.seen == []
        busy[0] = False
        await _until(store, bid, "completed")
    finally:
        await runner.stop()
    assert engine.seen == ["a", "b"]


async def test_after_a_stop_a_new_runner_runs_only_the_lines_not_recorded(store: BatchStore) -> None:
    engine = Engine(delay=0.05)
    prompts = [f"p{i}" for i in range(12)]
    bid = await _batch(store, prompts)
    first = _runner(store, engine, concurrency=2)
    first.start()
    while (await store.batch("t", bid) or {})["request_counts"]["completed"] < 4:
        await asyncio.sleep(0.01)
    await first.stop()  # as a gateway dies: lines in flight are cancelled, not recorded
    done = (await store.batch("t", bid) or {})["request_counts"]["completed"]
    before = len(engine.seen)
    second = _runner(store, engine, concurrency=2)  # the same owner: it takes the lease back at once
    second.start()
    try:
        got = await _until(store, bid, "completed")
    finally:
        await second.stop()
    assert len(engine.seen) - before == 12 - done  # each line not recorded ran once more; no recorded one again
    out = (await store.file_content("t", got["output_file_id"]) or b"").splitlines()
    assert sorted(orjson.loads(x)["custom_id"] for x in out) == sorted(f"id-{i}" for i in range(12))


async def test_a_cancel_stops_the_batch_and_keeps_what_was_done(store: BatchStore) -> None:
    engine = Engine(delay=0.05)
    bid = await _batch(store, [f"p{i}" for i in range(40)])
    runner = _runner(store, engine, concurrency=1)
    runner.start()
    try:
        while (await store.batch("t", bid) or {})["request_counts"]["completed"] < 2:
            await asyncio.sleep(0.01)
        await store.cancel("t", bid)
        runner.wake(cancelled=bid)
        got = await _until(store, bid, "cancelled")
    finally:
        await runner.stop()
    done = got["request_counts"]["completed"]
    assert 2 <= done < 40 and len(engine.seen) <= done + 1
    assert len((await store.file_content("t", got["output_file_id"]) or b"").splitlines()) == done


async def test_a_saturated_mesh_is_not_the_lines_fault_it_runs_again(store: BatchStore) -> None:
    calls: list[int] = []

    async def flaky(url: str, body: bytes, authorization: str) -> tuple[int, bytes]:
        calls.append(1)
        if len(calls) == 1:
            return 503, b'{"error": {"message": "busy", "code": "overloaded"}}'
        return 200, b'{"id": "x"}'

    before = {k: REGISTRY.get_sample_value("embedmesh_gateway_batch_lines_total", {"outcome": k}) or 0
              for k in ("ok", "retried")}
    bid = await _batch(store, ["a"])
    runner = BatchRunner(store, flaky, owner="me", unseal=str, poll_s=0.05)
    runner.start()
    try:
        got = await _until(store, bid, "completed")
    finally:
        await runner.stop()
    assert len(calls) == 2 and got["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    for k in ("ok", "retried"):
        assert REGISTRY.get_sample_value("embedmesh_gateway_batch_lines_total", {"outcome": k}) == before[k] + 1


@pytest.mark.parametrize(("quiet_s", "peak"), [(30.0, 1), (0.0, 3)])
async def test_after_interactive_traffic_lines_trickle_one_at_a_time(store: BatchStore, quiet_s: float,
                                                                     peak: int) -> None:
    engine = Engine(delay=0.05)
    busy = [True]
    bid = await _batch(store, [f"p{i}" for i in range(6)])
    runner = _runner(store, engine, concurrency=3, busy=lambda: busy[0], quiet_s=quiet_s)
    runner.start()
    try:
        await _until(store, bid, "in_progress")
        await asyncio.sleep(0.05)
        busy[0] = False  # interactive traffic just stopped
        await _until(store, bid, "completed")
    finally:
        await runner.stop()
    assert engine.peak == peak


async def test_traffic_seen_while_every_slot_is_taken_still_holds_the_next_line(store: BatchStore) -> None:
    engine = Engine(delay=0.3)
    busy = [False]
    await _batch(store, ["a", "b", "c"])
    runner = _runner(store, engine, concurrency=2, busy=lambda: busy[0], quiet_s=30.0, busy_concurrency=0)
    runner.start()
    try:
        while len(engine.seen) < 2:
            await asyncio.sleep(0.01)
        busy[0] = True  # an interactive request comes and goes while both slots run lines
        await asyncio.sleep(0.05)
        busy[0] = False
        await asyncio.sleep(0.6)  # both lines are done: the third waits for a quiet spell
        assert engine.seen == ["a", "b"]
    finally:
        await runner.stop()


class Clock:
    """Wall-clock time the test moves forward."""

    def __init__(self) -> None:
        self.shift = 0.0

    def __call__(self) -> float:
        return time.time() + self.shift


async def test_a_batch_past_its_24h_window_expires_with_its_unfinished_lines_reported(store: BatchStore) -> None:
    gate = asyncio.Event()  # never set: lines after the first two hang until cancelled

    class Slow(Engine):
        async def __call__(self, url: str, body: bytes, authorization: str) -> tuple[int, bytes]:
            if orjson.loads(body)["prompt"] not in ("p0", "bad1"):
                self.seen.append(orjson.loads(body)["prompt"])
                self.running += 1
                try:
                    await gate.wait()
                finally:
                    self.running -= 1
            return await super().__call__(url, body, authorization)

    engine, clock = Slow(), Clock()
    bid = await _batch(store, ["p0", "bad1", "p2", "p3", "p4"])
    runner = _runner(store, engine, concurrency=3, lease_s=0.3, clock=clock)
    runner.start()
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while (await store.batch("t", bid) or {})["request_counts"]["completed"] + \
                (await store.batch("t", bid) or {})["request_counts"]["failed"] < 2:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        assert (await store.batch("t", bid) or {})["status"] == "in_progress"
        clock.shift = 24 * 3600  # a day later: the window has ended with p2 running and p3, p4 not started
        got = await _until(store, bid, "expired")
    finally:
        await runner.stop()
    assert engine.running == 0  # the running line was cancelled
    assert got["expired_at"] and got["completed_at"] is None
    assert got["request_counts"] == {"total": 5, "completed": 1, "failed": 4}
    out = [orjson.loads(x) for x in (await store.file_content("t", got["output_file_id"]) or b"").splitlines()]
    assert [o["custom_id"] for o in out] == ["id-0"]
    err = [orjson.loads(x) for x in (await store.file_content("t", got["error_file_id"]) or b"").splitlines()]
    assert [(e["custom_id"], (e["error"] or {}).get("code")) for e in err] == [
        ("id-1", "invalid_value"), ("id-2", "batch_expired"), ("id-3", "batch_expired"), ("id-4", "batch_expired")]
    assert all(e["response"] is None for e in err[1:])


async def test_a_batch_claimed_after_its_window_runs_no_line(store: BatchStore) -> None:
    engine, clock = Engine(), Clock()
    clock.shift = 24 * 3600 + 1  # the gateway was down for a day
    bid = await _batch(store, ["a", "b"])
    runner = _runner(store, engine, clock=clock)
    runner.start()
    try:
        got = await _until(store, bid, "expired")
    finally:
        await runner.stop()
    assert engine.seen == [] and got["in_progress_at"] is None and got["output_file_id"] is None
    assert got["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
