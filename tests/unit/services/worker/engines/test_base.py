"""The engine interface (``engines/base.py``): the optional capabilities decline by default (so the servicer
answers FAILED_PRECONDITION and main.py wires nothing), prompt lengths, and ``load_once``'s single-flight loads."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from embedmesh.services.worker.engines.base import (
    EmbedsSegment,
    Engine,
    EngineStats,
    GenerationRequest,
    ModelInfo,
    TokenSegment,
    load_once,
)

INFO = ModelInfo("m", "bare", 4, 64, "float32", 100, 8)


class _Bare(Engine):
    """Only the abstract methods."""

    async def start(self) -> None:
        return None

    def info(self) -> ModelInfo:
        return INFO

    def generate(self, request: GenerationRequest) -> Any:
        raise AssertionError("not called")

    async def abort(self, request_id: str) -> bool:
        return False

    def stats(self) -> EngineStats:
        return EngineStats()


def test_the_interface_cannot_be_instantiated_without_its_abstract_methods() -> None:
    with pytest.raises(TypeError):
        Engine()  # type: ignore[abstract]


@pytest.mark.parametrize(("method", "args"), [
    ("load_lora", ("a", "/p")), ("unload_lora", ("a",)), ("list_loras", ()), ("sleep", (1,)), ("wake_up", ()),
    ("clear_kv_blocks", ()), ("embed", (["x"],)),
])
def test_optional_calls_are_refused_by_default(method: str, args: tuple[Any, ...]) -> None:
    with pytest.raises(NotImplementedError):
        asyncio.run(getattr(_Bare(), method)(*args))


def test_optional_hooks_decline_by_default() -> None:
    e = _Bare()
    assert e.kv_event_source() is None and e.kv_usage() == 0.0 and e.metrics_collector("w") is None
    assert e.progress() is None and e.fail_all(RuntimeError("x")) == 0
    assert e.lora_names() == [] and e.token_text(5) == ""
    assert asyncio.run(e.ready_info()) is INFO
    assert asyncio.run(e.check_health()) is None and asyncio.run(e.shutdown()) is None


def test_prompt_length_counts_ids_and_rows() -> None:
    req = GenerationRequest("r", [TokenSegment((1, 2, 3)), EmbedsSegment(np.zeros((4, 2), np.float32)),
                                  TokenSegment((9,))])
    assert [len(s) for s in req.segments] == [3, 4, 1] and req.prompt_len == 8
    assert GenerationRequest("r", []).prompt_len == 0 and req.lora_adapter == ""


def test_load_once_runs_one_load_for_concurrent_callers() -> None:
    async def run() -> None:
        loading: dict[str, asyncio.Future[bool]] = {}
        started = asyncio.Event()
        release = asyncio.Event()
        calls = 0

        async def load() -> None:
            nonlocal calls
            calls += 1
            started.set()
            await release.wait()

        first = asyncio.create_task(load_once(loading, "a", load))
        await started.wait()
        second = asyncio.create_task(load_once(loading, "a", load))
        other = asyncio.create_task(load_once(loading, "b", load))
        await asyncio.sleep(0)
        release.set()
        assert await asyncio.gather(first, second, other) == [True, False, True]
        assert calls == 2 and loading == {}
        # Done: the next call loads again (the engine decides whether that is a no-op).
        assert await load_once(loading, "a", load) is True and calls == 3

    asyncio.run(run())


def test_load_once_hands_a_failure_to_every_waiter_and_forgets_it() -> None:
    async def run() -> None:
        loading: dict[str, asyncio.Future[bool]] = {}
        release = asyncio.Event()

        async def bad() -> None:
            await release.wait()
            raise ValueError("broken adapter")

        first = asyncio.create_task(load_once(loading, "a", bad))
        await asyncio.sleep(0)
        second = asyncio.create_task(load_once(loading, "a", bad))
        await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(first, second, return_exceptions=True)
        assert [type(r) for r in results] == [ValueError, ValueError]
        assert all(str(r) == "broken adapter" for r in results) and loading == {}

        async def good() -> None:
            return None

        assert await load_once(loading, "a", good) is True

    asyncio.run(run())
