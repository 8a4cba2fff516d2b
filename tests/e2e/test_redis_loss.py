"""Redis loss in a running mesh (REDIS_URL set): Redis SIGKILLed under load fails no request, L2 is used again
once Redis is back, and Redis full at maxmemory (noeviction: every write refused with OOM) fails no request either.

The preprocessor's L1 is kept small so requests really go to L2: the payloads cycled here do not all fit, so a
repeat is an L1 miss that L2 answers (a hit) while Redis is up. L2 activity is read from the cache's Stats."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import redis

from embedmesh.cache.v1 import cache_pb2, cache_pb2_grpc
from tests.e2e.conftest import HIDDEN, MODEL
from tests.support.mesh import Mesh, start_mesh
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.e2e

ROWS = 24
PAYLOADS = 12
"""Distinct prompt_embeds payloads cycled by the load: 12 x 24 x 576 x 4 bytes = 648 KiB of validated rows."""
L1_BYTES = 256 << 10
"""Preprocessor L1: holds about 4 of them, so the rest come from L2 (or are decoded again when L2 is away)."""


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.close()


@pytest.fixture(scope="module")
def mesh(redis_server: RedisServer) -> Iterator[Mesh]:
    m = start_mesh(workers=1, env={"REDIS_URL": redis_server.url, "EMBEDMESH_CACHE_CAPACITY_BYTES": str(L1_BYTES),
                                   "EMBEDMESH_TRACE_CONSOLE": "0"})
    yield m
    assert m.stop() == 0, m.log_tail()


def _payload(i: int) -> str:
    import torch

    rows = torch.from_numpy(np.random.default_rng(100 + i).standard_normal((ROWS, HIDDEN), dtype=np.float32) * 0.02)
    buf = io.BytesIO()
    torch.save(rows, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def payloads() -> list[str]:
    return [_payload(i) for i in range(PAYLOADS)]


def l2(mesh: Mesh) -> cache_pb2.TierStats:
    with grpc.insecure_channel(mesh.preprocessor) as ch:
        r = cache_pb2_grpc.EncoderCacheServiceStub(ch).Stats(cache_pb2.StatsRequest(), timeout=10)
    (tier,) = [t for t in r.tiers if t.tier == "l2"]
    return tier


class Load:
    """Threads cycling through the payloads (completions), uploads-then-use and embeddings; every response is
    recorded, and each payload's greedy text is checked against the one it gave before the test began."""

    def __init__(self, mesh: Mesh, payloads: list[str], expected: dict[int, str]) -> None:
        self.mesh, self.payloads, self.expected = mesh, payloads, expected
        self.ok = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(k,), daemon=True) for k in range(2)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def record(self, what: str, r: httpx.Response, check: Any = None) -> None:
        with self.lock:
            if r.status_code != 200:
                self.failures.append(f"{what}: {r.status_code} {r.text[:300]}")
            elif check is not None and not check(r.json()):
                self.failures.append(f"{what}: wrong result {r.text[:300]}")
            else:
                self.ok += 1

    def run(self, k: int) -> None:
        url = self.mesh.base_url
        with httpx.Client(timeout=120) as h:
            n = k
            while not self.stop.is_set():
                i = n % len(self.payloads)
                r = h.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "", "max_tokens": 3,
                                                          "temperature": 0, "prompt_embeds": self.payloads[i]})
                self.record(f"completion {i}", r, lambda j, i=i: j["choices"][0]["text"] == self.expected[i])
                if n % 5 == 0:
                    up = h.post(f"{url}/v1/prompt_embeds", json={"data": self.payloads[i]})
                    self.record("upload", up)
                    if up.status_code == 200:
                        r = h.post(f"{url}/v1/completions", json={
                            "model": MODEL, "prompt": "", "max_tokens": 3, "temperature": 0,
                            "prompt_embeds": {"id": up.json()["id"]}})
                        self.record(f"by id {i}", r, lambda j, i=i: j["choices"][0]["text"] == self.expected[i])
                if n % 7 == 0:
                    r = h.post(f"{url}/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": f"load {n % 9}"})
                    self.record("embeddings", r)
                n += 2

    def wait_for(self, count: int) -> None:
        """Block until ``count`` more requests have completed (any outcome)."""
        with self.lock:
            target = self.ok + len(self.failures) + count
        for _ in range(6000):
            with self.lock:
                if self.ok + len(self.failures) >= target:
                    return
            if not any(t.is_alive() for t in self.threads):
                raise AssertionError(f"load threads died; failures: {self.failures[:3]}")
            self.stop.wait(0.05)
        raise AssertionError(f"load made no progress; failures: {self.failures[:3]}")


@pytest.fixture(scope="module")
def expected(mesh: Mesh, payloads: list[str]) -> dict[int, str]:
    out = {}
    with httpx.Client(timeout=120) as h:
        for _ in range(2):  # twice: the second round is served from L2 for the payloads L1 evicted
            for i, p in enumerate(payloads):
                r = h.post(f"{mesh.base_url}/v1/completions", json={"model": MODEL, "prompt": "", "max_tokens": 3,
                                                                     "temperature": 0, "prompt_embeds": p})
                assert r.status_code == 200, r.text
                assert out.setdefault(i, r.json()["choices"][0]["text"]) == r.json()["choices"][0]["text"]
    return out


def test_l2_serves_what_l1_evicted(mesh: Mesh, expected: dict[int, str]) -> None:
    s = l2(mesh)
    assert s.available and s.hits >= PAYLOADS // 2, s


def test_redis_killed_under_load_then_restarted(mesh: Mesh, redis_server: RedisServer, payloads: list[str],
                                                 expected: dict[int, str]) -> None:
    with Load(mesh, payloads, expected) as load:
        load.wait_for(10)
        assert redis_server.proc is not None
        redis_server.proc.kill()  # SIGKILL: connections reset, no goodbye
        redis_server.proc.wait()
        redis_server.proc = None
        load.wait_for(3 * PAYLOADS)  # every payload at least once with Redis gone
        down = l2(mesh)
        assert not down.available and down.unavailable > 0, down
        assert not load.failures, load.failures[:5]

        redis_server.start()  # empty: no persistence
        before = down.hits
        for _ in range(200):  # L2 written again, then L1-evicted payloads come back from it as hits
            load.wait_for(PAYLOADS)
            up = l2(mesh)
            if up.available and up.hits > before:
                break
        assert up.available and up.hits > before, up
        assert redis.Redis.from_url(redis_server.url).dbsize() > 0, "the mesh writes to L2 again"
    assert not load.failures, load.failures[:5]
    assert load.ok > 0


def test_redis_full_at_maxmemory(mesh: Mesh, redis_server: RedisServer, payloads: list[str],
                                 expected: dict[int, str]) -> None:
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", "1mb")
    before = l2(mesh)
    with Load(mesh, payloads, expected) as load:
        load.wait_for(4 * PAYLOADS)
    after = l2(mesh)
    assert not load.failures, load.failures[:5]
    assert after.rejected > before.rejected, "Redis refused writes (OOM) during the run"
    assert after.available, "a full Redis is not an outage"
    r.config_set("maxmemory", "256mb")
    r.config_set("maxmemory-policy", "allkeys-lru")
