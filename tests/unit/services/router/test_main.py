"""router.main: ``build`` wires one config into the registry, the policy's weights and its seeded generator;
``sweep_forever`` drops silent workers and counts them; the module serves and prints its address."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from embedmesh.services.router.config import RouterConfig
from embedmesh.services.router.main import build, sweep_forever
from embedmesh.services.router.metrics import DROPS, WORKERS
from embedmesh.services.router.registry import WorkerState
from embedmesh.services.router.scoring import Weights
from embedmesh.services.router.servicer import RouterServicer


def test_build_wires_the_config_into_registry_and_policy() -> None:
    cfg = RouterConfig(port=0, prefill_weight=2.0, decode_weight=0.5, temperature=0.25, stale_seconds=7.0,
                       approx_ttl_seconds=30.0, approx_max_blocks=123, seed=42)
    servicer = build(cfg)
    assert isinstance(servicer, RouterServicer)
    registry = servicer.registry
    assert registry.stale_seconds == 7.0
    assert (registry.approx.ttl_seconds, registry.approx.max_blocks) == (30.0, 123)
    assert registry.approx.index is registry.index
    assert servicer.router.weights == Weights(2.0, 0.5, 0.25)


def test_the_seed_makes_tie_breaking_repeatable() -> None:
    def picks(seed: int) -> list[str]:
        servicer = build(RouterConfig(port=0, seed=seed))
        for wid in ("a", "b", "c", "d"):
            servicer.registry.register(WorkerState(wid, f"{wid}:1", "m", 4, "test", True))
        out = []
        for _ in range(12):
            out.append(servicer.router.route("m", [], 4, 4).worker_id)
            for w in servicer.registry.workers.values():
                w.routed_since_load = 0  # keep every worker tied
        return out

    assert picks(7) == picks(7)
    assert len(set(picks(7))) > 1  # ties are broken at random, not always the first
    assert any(picks(s) != picks(7) for s in (1, 2, 3))


async def test_sweep_forever_drops_silent_workers_and_counts_them() -> None:
    servicer = build(RouterConfig(port=0, stale_seconds=0.05, seed=0))
    registry = servicer.registry
    silent = registry.register(WorkerState("silent", "s:1", "m", 4, "test", True))
    registry.index.stored("silent", 0, [1, 2])
    before = DROPS.labels("silent")._value.get()
    silent.last_seen = time.monotonic() - 10
    task = asyncio.create_task(sweep_forever(registry, 0.01))
    try:
        for _ in range(200):
            await asyncio.sleep(0.01)
            if "silent" not in registry.workers:
                break
        live = registry.register(WorkerState("live", "l:1", "m", 4, "test", True))
        for _ in range(5):
            await asyncio.sleep(0.01)
            live.last_seen = time.monotonic()
    finally:
        task.cancel()
    assert "silent" not in registry.workers and registry.index.blocks_of("silent") == 0
    assert "live" in registry.workers
    assert DROPS.labels("silent")._value.get() == before + 1
    assert WORKERS._value.get() == 1  # the gauges are refreshed on each sweep


def test_main_prints_its_address() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "embedmesh.services.router.main", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("router listening on 127.0.0.1:") and int(line.rsplit(":", 1)[1]) > 0
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_help_lists_the_router_flags() -> None:
    r = subprocess.run([sys.executable, "-m", "embedmesh.services.router.main", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    for flag in ("--port", "--prefill-weight", "--decode-weight", "--stale-seconds", "--approx-ttl"):
        assert flag in r.stdout, flag
