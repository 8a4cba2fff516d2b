"""The vllm engine adapter without vLLM: prompts handed over as tensors (tokens, embeddings, mixed, bf16 bits),
the requests the KV event translator is told about, streaming and finish mapping, abort when the consumer goes
away, readiness waits, and the stat logger's figures. A fake stands in for ``AsyncLLM`` (the real engine is
exercised in tests/e2e_vllm)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from embedmesh.core.block_hash import ROOT, block_hashes  # noqa: E402
from embedmesh.core.errors import FailedPrecondition, Unavailable  # noqa: E402
from embedmesh.services.worker.engines.base import (  # noqa: E402
    EmbedsSegment,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
    TokenSegment,
)
from embedmesh.services.worker.engines.vllm.engine import VLLMConfig, VLLMEngine  # noqa: E402
from embedmesh.services.worker.engines.vllm.kv_events import KvEventTranslator, Stored  # noqa: E402
from embedmesh.services.worker.engines.vllm.metrics import MetricsRecorder  # noqa: E402
from embedmesh.services.worker.engines.vllm.resume import ResumedText  # noqa: E402
from tests.unit.services.worker.engines.vllm.test_metrics import _PC, _Sched  # noqa: E402

HIDDEN = 8


@dataclass
class _Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class _Output:
    outputs: list[_Completion]
    finished: bool = False


@dataclass
class FakeAsyncLLM:
    """Streams the scripted deltas; records prompts and aborts."""

    script: list[_Output] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    gate: asyncio.Event | None = None

    async def generate(self, prompt: Any, sampling: Any, request_id: str, lora_request: Any = None
                       ) -> AsyncIterator[_Output]:
        self.prompts.append(prompt)
        for out in self.script:
            if self.gate is not None:
                await self.gate.wait()
            yield out

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def engine(dtype: str = "float32", kv: bool = False, **kw: Any) -> tuple[VLLMEngine, FakeAsyncLLM]:
    e = VLLMEngine(VLLMConfig(Path("/nonexistent"), "m", dtype=dtype, **kw))
    fake = FakeAsyncLLM()
    e._engine = fake
    e._info = ModelInfo(model="m", engine="vllm", hidden_size=HIDDEN, max_context_tokens=64, dtype=dtype,
                        vocab_size=32, max_batch_size=4)
    e._embed_table = torch.arange(32 * HIDDEN, dtype=getattr(torch, dtype)).reshape(32, HIDDEN)
    e._sampling = lambda request: None  # type: ignore[method-assign]
    e._ready.set()
    if kv:
        e._kv = KvEventTranslator(4, lambda evs: None)
    return e, fake


def req(*segments: Any, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest("r1", list(segments), SamplingParams(max_tokens=max_tokens))


def test_token_prompts_go_as_token_ids_and_are_tracked() -> None:
    e, _ = engine(kv=True)
    r = req(TokenSegment((1, 2)), TokenSegment((3, 4, 5)))
    assert e._prompt(r) == {"prompt_token_ids": [1, 2, 3, 4, 5]}
    assert e._kv is not None and e._kv._requests["r1"].sent_tokens == [1, 2, 3, 4, 5]


def test_embeddings_and_mixed_prompts_go_as_one_tensor() -> None:
    e, _ = engine(kv=True)
    rows = np.random.default_rng(0).standard_normal((3, HIDDEN)).astype(np.float32)
    prompt = e._prompt(req(TokenSegment((2, 5)), EmbedsSegment(rows)))["prompt_embeds"]
    assert prompt.dtype == torch.float32 and tuple(prompt.shape) == (5, HIDDEN)
    assert torch.equal(prompt[:2], e._embed_table[torch.tensor([2, 5])])
    assert np.array_equal(prompt[2:].numpy(), rows)
    sent = e._kv._requests["r1"].sent_rows  # type: ignore[union-attr]
    assert sent is not None and hashlib.sha256(sent.tobytes()).digest() == hashlib.sha256(
        prompt.numpy().tobytes()).digest()


def test_bf16_rows_arrive_as_bf16_tensors_with_their_bits() -> None:
    e, _ = engine(dtype="bfloat16", kv=True)
    values = torch.tensor([[1.5] * HIDDEN, [-2.0] * HIDDEN], dtype=torch.bfloat16)
    bits = values.view(torch.int16).numpy().view(np.uint16)
    prompt = e._prompt(req(EmbedsSegment(bits)))["prompt_embeds"]
    assert prompt.dtype == torch.bfloat16 and torch.equal(prompt, values)
    sent = e._kv._requests["r1"].sent_rows  # type: ignore[union-attr]
    assert sent is not None and sent.tobytes() == bits.tobytes()


def test_stream_maps_finish_reasons_and_counts() -> None:
    e, fake = engine(kv=True)
    fake.script = [_Output([_Completion("Hel", [1])]), _Output([_Completion("lo", [2, 3], "length")], True)]

    async def run() -> list[Any]:
        return [d async for d in e.generate(req(TokenSegment((1, 2, 3, 4))))]

    deltas = asyncio.run(run())
    assert [d.text for d in deltas] == ["Hel", "lo"] and deltas[-1].finish_reason is FinishReason.LENGTH
    assert deltas[-1].completion_tokens == 3 and fake.aborted == []
    s = e.stats()
    assert s.completed_requests == 1 and s.generated_tokens == 3 and s.active_requests == 0
    assert e._kv is not None and e._kv._requests["r1"].finished_at is not None


def test_closing_the_stream_aborts_in_vllm() -> None:
    e, fake = engine()
    fake.script = [_Output([_Completion("a", [1])]), _Output([_Completion("b", [2])])]

    async def run() -> None:
        gen = e.generate(req(TokenSegment((1,))))
        await gen.__anext__()
        await gen.aclose()  # the gRPC call was cancelled

    asyncio.run(run())
    assert fake.aborted == ["r1"] and e.stats().aborted_requests == 1


def test_requests_wait_for_readiness_and_fail_clearly_when_it_does_not_come() -> None:
    e, fake = engine(ready_timeout_seconds=0.05)
    e._ready.clear()
    fake.script = [_Output([_Completion("x", [1], "stop")], True)]

    async def run() -> Any:
        with pytest.raises(Unavailable):
            await e.generate(req(TokenSegment((1,)))).__anext__()
        e.config = VLLMConfig(Path("/nonexistent"), "m", ready_timeout_seconds=5)
        asyncio.get_running_loop().call_later(0.05, e._ready.set)  # the engine finishes loading meanwhile
        return await e.generate(req(TokenSegment((1,)))).__anext__()

    assert asyncio.run(run()).finish_reason is FinishReason.STOP


def test_clear_kv_blocks_tells_the_router_at_once() -> None:
    e, fake = engine(kv=True)
    got: list[Any] = []
    e.on_kv_events(got.append)
    e._kv = KvEventTranslator(4, e._publish_kv)

    async def reset_prefix_cache() -> bool:
        return True

    fake.reset_prefix_cache = reset_prefix_cache  # type: ignore[attr-defined]
    assert asyncio.run(e.clear_kv_blocks())
    assert [type(x).__name__ for batch in got for x in batch] == ["Cleared"]


def test_kv_listeners_get_events_and_a_failing_one_does_not_stop_the_others() -> None:
    e, _ = engine()
    got: list[Any] = []

    def broken(_: Any) -> None:
        raise RuntimeError("boom")

    e.on_kv_events(broken)
    e.on_kv_events(got.append)
    e._publish_kv([Stored(ROOT, (1,))])
    assert got == [[Stored(ROOT, (1,))]]
    assert e.kv_snapshot() == [] and e.kv_event_counters() == {}
    assert block_hashes([(1, 2, 3, 4)], 4)  # the mesh's hashing is importable beside the engine


def test_the_engine_reads_its_figures_from_the_metrics_recorder() -> None:
    m = MetricsRecorder()
    m.record(_Sched(1, 0, 0.5, _PC(100, 0), num_skipped_waiting_reqs=2), None)
    s = m.latest
    e, _ = engine()
    e._metrics = m
    assert e.stats().queued_requests == 2 and e.engine_metrics() is s


def _platform(monkeypatch: pytest.MonkeyPatch, sleep_mode: bool) -> None:
    """A stand-in for ``vllm.platforms`` whose platform has (GPU) or lacks (this CPU) vLLM's sleep mode."""
    import sys
    import types

    class Platform:
        device_type = "cuda" if sleep_mode else "cpu"

        @staticmethod
        def is_sleep_mode_available() -> bool:
            return sleep_mode

    mod = types.ModuleType("vllm.platforms")
    mod.current_platform = Platform()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.platforms", mod)


def test_asleep_worker_refuses_generation_clearly_until_woken(monkeypatch: pytest.MonkeyPatch) -> None:
    _platform(monkeypatch, sleep_mode=True)
    off, _ = engine()
    with pytest.raises(FailedPrecondition, match="--enable-sleep-mode"):  # on a GPU, sleep needs the engine flag
        asyncio.run(off.sleep(1))
    e, fake = engine(enable_sleep_mode=True)
    fake.script = [_Output([_Completion("x", [1], "stop")], True)]
    calls: list[Any] = []

    async def sleep(level: int) -> None:
        calls.append(("sleep", level))

    async def wake_up() -> None:
        calls.append("wake")

    fake.sleep = sleep  # type: ignore[attr-defined]
    fake.wake_up = wake_up  # type: ignore[attr-defined]

    async def run() -> Any:
        await e.sleep(2)
        with pytest.raises(Unavailable) as info:
            await e.generate(req(TokenSegment((1,)))).__anext__()
        assert info.value.reason == "WORKER_ASLEEP" and "WakeUp" in str(info.value)
        await e.wake_up()
        await e.wake_up()  # waking an awake worker is a no-op, not a second call into vLLM
        return await e.generate(req(TokenSegment((1,)))).__anext__()

    assert asyncio.run(run()).finish_reason is FinishReason.STOP
    assert calls == [("sleep", 2), "wake"] and fake.prompts  # the request after WakeUp reached the engine


def test_sleep_without_sleep_mode_fails_clearly_and_keeps_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    from embedmesh.core.errors import FailedPrecondition

    _platform(monkeypatch, sleep_mode=False)
    e, fake = engine()
    fake.script = [_Output([_Completion("x", [1], "stop")], True)]

    async def run() -> Any:
        with pytest.raises(FailedPrecondition) as info:
            await e.sleep(1)
        assert info.value.reason == "SLEEP_UNSUPPORTED" and "cpu" in str(info.value)
        return await e.generate(req(TokenSegment((1,)))).__anext__()

    assert asyncio.run(run()).finish_reason is FinishReason.STOP


def test_openai_surface_maps_onto_vllm_and_back() -> None:
    from types import SimpleNamespace

    from embedmesh.core.sampling import Structured
    from embedmesh.services.worker.engines.vllm.engine import _logprobs, _prompt_logprobs, _vllm_structured

    assert _vllm_structured(Structured("json_schema", '{"type": "object"}')) == {"json": '{"type": "object"}'}
    assert _vllm_structured(Structured("choice", ("a", "b"))) == {"choice": ["a", "b"]}
    assert _vllm_structured(Structured("json_object")) == {"json_object": True}
    assert _vllm_structured(Structured("grammar", "root ::= 'x'")) == {"grammar": "root ::= 'x'"}

    def lp(value: float, rank: int) -> SimpleNamespace:
        return SimpleNamespace(logprob=value, rank=rank, decoded_token="")

    # vLLM's position dict: the top k by rank plus the sampled token (rank 7 here, outside the top 2).
    sample = [{3: lp(-0.1, 1), 4: lp(-0.2, 2), 9: lp(-3.0, 7)}]
    (entry,) = _logprobs(sample, [9], 2)
    assert entry.token_id == 9 and entry.logprob == -3.0
    assert entry.top == ((3, -0.1), (4, -0.2), (9, -3.0))
    prompt = _prompt_logprobs([None, {5: lp(-1.5, 3), 3: lp(-0.1, 1)}], [2, 5], 1)
    assert prompt[0].logprob is None and prompt[1].logprob == -1.5 and prompt[1].top == ((3, -0.1), (5, -1.5))


def test_a_resumed_stream_follows_its_prompt_as_ids_or_as_embedding_rows() -> None:
    """Ids after ids (vLLM's prefix cache and repetition penalty see them); after rows, the table's own rows."""
    e, _ = engine(kv=True)
    assert e.resumes is True
    r = GenerationRequest("r1", [TokenSegment((1, 2))], SamplingParams(max_tokens=2), resumed=(7, 8))
    assert e._prompt(r) == {"prompt_token_ids": [1, 2, 7, 8]}
    assert e._kv is not None and e._kv._requests["r1"].sent_tokens == [1, 2, 7, 8]
    rows = np.random.default_rng(1).standard_normal((3, HIDDEN)).astype(np.float32)
    r = GenerationRequest("r2", [EmbedsSegment(rows)], SamplingParams(max_tokens=2), resumed=(7, 8))
    prompt = e._prompt(r)["prompt_embeds"]
    assert tuple(prompt.shape) == (5, HIDDEN) and np.array_equal(prompt[:3].numpy(), rows)
    assert torch.equal(prompt[3:], e._embed_table[torch.tensor([7, 8])])


def test_a_resumed_stream_vllm_cannot_continue_exactly_is_refused_before_vllm_sees_it() -> None:
    e, fake = engine()
    r = GenerationRequest("r1", [TokenSegment((1, 2))], SamplingParams(max_tokens=2, temperature=0.5, seed=4),
                          resumed=(7,))

    async def run() -> None:
        async for _ in e.generate(r):
            pass

    with pytest.raises(FailedPrecondition) as err:
        asyncio.run(run())
    assert err.value.reason == "RESUME_UNSUPPORTED" and err.value.field == "seed"
    assert fake.prompts == [] and e.stats().active_requests == 0


def test_a_stop_string_found_in_a_resumed_stream_ends_it_and_aborts_vllm() -> None:
    from tests.unit.services.worker.engines.vllm.test_resume import CharDetok

    e, fake = engine()
    r = GenerationRequest("r1", [TokenSegment((9,))], SamplingParams(max_tokens=6, stop=(" on the",)),
                          resumed=(1, 2, 3))
    e._resumed_text = lambda request, prompt: ResumedText(CharDetok([" on the"]), request.resumed)  # type: ignore
    fake.script = [_Output([_Completion("", [4])]), _Output([_Completion("", [5, 6])]),
                   _Output([_Completion("", [7], "length")], True)]

    async def run() -> list[Any]:
        return [d async for d in e.generate(r)]

    deltas = asyncio.run(run())
    # the client had "The c" (6 characters held for the 7 of the stop string): the rest comes first, the stop
    # string is cut off, the id completing it is the last
    assert "The c" + "".join(d.text for d in deltas) == "The cat sat" and deltas[-1].finish_reason is FinishReason.STOP
    assert [t for d in deltas for t in d.token_ids] == [4, 5] and deltas[-1].completion_tokens == 2
    assert fake.aborted == ["r1"] and e.stats().completed_requests == 1 and e.stats().aborted_requests == 0
