"""The worker's gRPC adapter (``worker/servicer.py``): admission past a full batch and its queue, token texts only
when log-probabilities are asked, Embed's conversion and refusals, the optional admin calls refused for engines
without them, LoRA paths resolved under the root before the engine sees them, and GetStats field for field."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedmesh.core import tensors
from embedmesh.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from embedmesh.services.worker.engines.base import EngineStats, FinishReason, GenerationDelta, TokenLogprob
from embedmesh.services.worker.engines.echo.engine import EchoEngine
from embedmesh.services.worker.servicer import WorkerServicer
from embedmesh.worker.v1 import worker_pb2


class _Engine(EchoEngine):
    """Echo with embeddings, LoRA, sleep and KV clearing recorded, and settable stats."""

    def __init__(self) -> None:
        super().__init__("m", hidden_size=4)
        self.calls: list[tuple[Any, ...]] = []
        self.fixed: EngineStats | None = None

    def stats(self) -> EngineStats:
        return self.fixed if self.fixed is not None else super().stats()

    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"

    async def embed(self, inputs: list[str | list[int]], dimensions: int | None = None) -> tuple[np.ndarray, list[int]]:
        self.calls.append(("embed", inputs, dimensions))
        return np.arange(2 * len(inputs), dtype=np.float32).reshape(len(inputs), 2), [3] * len(inputs)

    async def load_lora(self, name: str, path: str) -> bool:
        self.calls.append(("load", name, path))
        return True

    async def unload_lora(self, name: str) -> bool:
        self.calls.append(("unload", name))
        return name == "a"

    async def list_loras(self) -> dict[str, str]:
        return {"b": "/p/b", "a": "/p/a"}

    async def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    async def wake_up(self) -> None:
        self.calls.append(("wake",))

    async def clear_kv_blocks(self) -> bool:
        return True


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _generate(servicer: WorkerServicer, **sampling: Any) -> list[worker_pb2.GenerateResponse]:
    req = worker_pb2.GenerateRequest(request_id="r", segments=[worker_pb2.PromptSegment(
        token_ids=worker_pb2.TokenIds(ids=[1, 2]))])
    req.sampling.max_tokens = 2
    for k, v in sampling.items():
        setattr(req.sampling, k, v)

    async def go() -> list[worker_pb2.GenerateResponse]:
        return [r async for r in servicer.generate(req)]

    return _run(go())


def test_generate_streams_the_engines_deltas_with_the_prompt_length_on_the_last() -> None:
    out = _generate(WorkerServicer(_Engine(), "w"))
    text = "".join(r.text for r in out)
    assert text == "xx" and out[-1].prompt_tokens == 2 and out[-1].completion_tokens == 2
    assert all(not r.logprobs for r in out)


def test_a_full_batch_and_queue_refuse_at_once() -> None:
    engine = _Engine()
    servicer = WorkerServicer(engine, "w", max_queue=3)
    engine.fixed = EngineStats(active_requests=256 + 3)  # echo's max_batch_size is 256
    with pytest.raises(ResourceExhausted) as e:
        _generate(servicer)
    assert e.value.reason == "WORKER_BUSY" and e.value.retry_after_seconds == 1.0
    assert "259 sequences running or queued" in e.value.message
    engine.fixed = EngineStats(active_requests=258)
    assert _generate(servicer)[-1].completion_tokens == 2


def test_abort_get_info_and_get_stats() -> None:
    engine = _Engine()
    servicer = WorkerServicer(engine, "w-7")
    assert _run(servicer.Abort(worker_pb2.AbortRequest(request_id="nope"), None)).aborted is False  # type: ignore[arg-type]
    info = _run(servicer.GetInfo(worker_pb2.GetInfoRequest(), None))  # type: ignore[arg-type]
    assert (info.model, info.engine, info.hidden_size, info.worker_id) == ("m", "echo", 4, "w-7")
    engine.fixed = EngineStats(1, 2, 3, 4, 5, 6, True)
    s = _run(servicer.GetStats(worker_pb2.GetStatsRequest(), None))  # type: ignore[arg-type]
    assert (s.active_requests, s.queued_requests, s.completed_requests, s.aborted_requests, s.generated_tokens,
            s.max_batch_seen, s.sleeping) == (1, 2, 3, 4, 5, 6, True)


def test_embed_passes_text_and_ids_in_order_with_dimensions() -> None:
    engine = _Engine()
    servicer = WorkerServicer(engine, "w")
    req = worker_pb2.EmbedRequest(inputs=[worker_pb2.EmbedInput(text="hi"),
                                          worker_pb2.EmbedInput(token_ids=worker_pb2.TokenIds(ids=[5, 6]))],
                                  dimensions=2)
    resp = _run(servicer.Embed(req, None))  # type: ignore[arg-type]
    assert engine.calls == [("embed", ["hi", [5, 6]], 2)]
    vectors, _ = tensors.to_numpy(resp.embeddings)
    assert np.array_equal(vectors, np.arange(4, dtype=np.float32).reshape(2, 2))
    assert list(resp.input_tokens) == [3, 3] and resp.prompt_tokens == 6
    _run(servicer.Embed(worker_pb2.EmbedRequest(inputs=[worker_pb2.EmbedInput(text="a")]), None))  # type: ignore[arg-type]
    assert engine.calls[-1] == ("embed", ["a"], None)


def test_embed_refusals() -> None:
    with pytest.raises(InvalidArgument) as e:
        _run(WorkerServicer(_Engine(), "w").Embed(worker_pb2.EmbedRequest(), None))  # type: ignore[arg-type]
    assert (e.value.field, e.value.reason, e.value.message) == ("input", "EMPTY",
                                                                "input: at least one input is required")
    with pytest.raises(FailedPrecondition) as f:
        _run(WorkerServicer(EchoEngine("gen"), "w").Embed(
            worker_pb2.EmbedRequest(inputs=[worker_pb2.EmbedInput(text="a")]), None))  # type: ignore[arg-type]
    assert (f.value.field, f.value.reason, f.value.message) == ("model", "WRONG_TASK",
                                                                "model: gen does not produce embeddings")


@pytest.mark.parametrize(("method", "request_", "what"), [
    ("LoadLoraAdapter", worker_pb2.LoadLoraAdapterRequest(name="a", path="a"), "LoRA"),
    ("UnloadLoraAdapter", worker_pb2.UnloadLoraAdapterRequest(name="a"), "LoRA"),
    ("ListLoraAdapters", worker_pb2.ListLoraAdaptersRequest(), "LoRA"),
    ("Sleep", worker_pb2.SleepRequest(level=1), "sleep"),
    ("WakeUp", worker_pb2.WakeUpRequest(), "wake up"),
    ("ClearKvBlocks", worker_pb2.ClearKvBlocksRequest(), "clearing KV blocks"),
])
def test_admin_calls_an_engine_lacks_are_failed_preconditions(method: str, request_: Any, what: str,
                                                              tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    servicer = WorkerServicer(EchoEngine(), "w", lora_root=tmp_path)
    with pytest.raises(FailedPrecondition) as e:
        _run(getattr(servicer, method)(request_, None))
    assert e.value.reason == "UNSUPPORTED_BY_ENGINE"
    assert e.value.message == f"{what} is not supported by the echo engine"


def test_admin_calls_reach_the_engine(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    engine = _Engine()
    s = WorkerServicer(engine, "w", lora_root=tmp_path)
    assert _run(s.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(name="x", path="a"), None)).loaded
    assert engine.calls[-1] == ("load", "x", str((tmp_path / "a").resolve()))
    assert _run(s.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(name="a"), None)).unloaded
    assert not _run(s.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(name="z"), None)).unloaded
    listed = _run(s.ListLoraAdapters(worker_pb2.ListLoraAdaptersRequest(), None)).adapters
    assert [(a.name, a.path) for a in listed] == [("a", "/p/a"), ("b", "/p/b")]
    _run(s.Sleep(worker_pb2.SleepRequest(level=2), None))
    _run(s.WakeUp(worker_pb2.WakeUpRequest(), None))
    assert engine.calls[-2:] == [("sleep", 2), ("wake",)]
    assert _run(s.ClearKvBlocks(worker_pb2.ClearKvBlocksRequest(), None)).cleared


@pytest.mark.parametrize(("request_", "field", "reason"), [
    (worker_pb2.LoadLoraAdapterRequest(path="a"), "name", "REQUIRED"),
    (worker_pb2.LoadLoraAdapterRequest(name="x"), "path", "REQUIRED"),
    (worker_pb2.LoadLoraAdapterRequest(name="x", path="../out"), "path", "PATH_OUTSIDE_ROOT"),
    (worker_pb2.LoadLoraAdapterRequest(name="x", path="missing"), "path", "NOT_A_FOLDER"),
])
def test_lora_loads_are_checked_before_the_engine(request_: Any, field: str, reason: str, tmp_path: Path) -> None:
    engine = _Engine()
    with pytest.raises(InvalidArgument) as e:
        _run(WorkerServicer(engine, "w", lora_root=tmp_path).LoadLoraAdapter(request_, None))
    assert (e.value.field, e.value.reason) == (field, reason) and engine.calls == []


class _Refusing(_Engine):
    """Refuses every adapter naming the folder it was given, as the hf and vLLM engines do."""

    async def load_lora(self, name: str, path: str) -> bool:
        raise InvalidArgument(f"path: no adapter_config.json in {path!r}", field="path", reason="NOT_AN_ADAPTER")

    async def list_loras(self) -> dict[str, str]:
        return {"a": str(self.root / "team" / "a")}

    root: Path


def test_admin_answers_name_adapter_folders_relative_to_the_lora_root(tmp_path: Path) -> None:
    """An admin call never learns where the worker's files lie on its host: only paths under the root, relative."""
    (tmp_path / "team" / "a").mkdir(parents=True)
    engine = _Refusing()
    engine.root = tmp_path.resolve()
    s = WorkerServicer(engine, "w", lora_root=tmp_path)
    with pytest.raises(InvalidArgument) as e:
        _run(s.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(name="x", path="team/a"), None))
    assert e.value.message == "path: no adapter_config.json in 'team/a'" and str(e.value) == e.value.message
    assert str(tmp_path.resolve()) not in str(e.value)
    listed = _run(s.ListLoraAdapters(worker_pb2.ListLoraAdaptersRequest(), None)).adapters
    assert [(a.name, a.path) for a in listed] == [("a", "team/a")]
    with pytest.raises(InvalidArgument) as outside:
        _run(s.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(name="x", path="/etc"), None))
    assert outside.value.reason == "PATH_OUTSIDE_ROOT" and str(tmp_path.resolve()) not in outside.value.message


@pytest.mark.parametrize("level", [0, 3])
def test_sleep_levels_are_one_or_two(level: int) -> None:
    engine = _Engine()
    with pytest.raises(InvalidArgument) as e:
        _run(WorkerServicer(engine, "w").Sleep(worker_pb2.SleepRequest(level=level), None))  # type: ignore[arg-type]
    assert (e.value.field, e.value.reason, e.value.message) == ("level", "OUT_OF_RANGE", "level must be 1 or 2")
    assert engine.calls == []


def test_the_default_lora_root_is_under_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBEDMESH_CACHE", str(tmp_path))
    assert WorkerServicer(EchoEngine(), "w").lora_root == tmp_path / "lora-adapters"


class _Scored(_Engine):
    async def generate(self, request: Any) -> Any:  # type: ignore[override]
        yield GenerationDelta("x", (87,), 1, FinishReason.LENGTH, logprobs=(TokenLogprob(87, -0.5, ((3, -1.0),)),))


def test_token_texts_are_filled_in_only_when_log_probabilities_are_asked() -> None:
    (plain,) = _generate(WorkerServicer(_Scored(), "w"))
    assert plain.logprobs[0].token == "" and plain.logprobs[0].top[0].token == ""
    (scored,) = _generate(WorkerServicer(_Scored(), "w"), logprobs=1)
    assert (scored.logprobs[0].token, scored.logprobs[0].top[0].token) == ("<87>", "<3>")
    (prompt,) = _generate(WorkerServicer(_Scored(), "w"), prompt_logprobs=0)
    assert prompt.logprobs[0].token == "<87>"
