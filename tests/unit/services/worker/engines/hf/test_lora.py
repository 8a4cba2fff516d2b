"""LoRA adapters on the hf engine (peft): the adapter's greedy text equals transformers + peft computing it
directly, base requests in the same continuous batch are unaffected (mixed-adapter batches), a name loads once
under concurrency, a bad folder leaves nothing loaded, unloading lets running requests finish."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import SamplingParams
from embedmesh.services.worker.engines.base import GenerationRequest, TokenSegment
from tests.support.lora import save_other_base_adapter, save_smol_adapter

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = (504, 3458, 282, 4649, 314)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "smol-lora"
    save_smol_adapter(out)
    return out


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[Any]:
    from embedmesh.models import ensure_default_model
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    e = HFEngine(HFEngineConfig(ensure_default_model(), "smol", max_batch_size=4))
    await e.start()
    yield e
    await e.shutdown()


_ids = iter(range(10**6))


async def run(engine: Any, lora: str = "", n: int = 8) -> list[int]:
    req = GenerationRequest(f"lora{next(_ids)}", [TokenSegment(PROMPT)], SamplingParams(max_tokens=n, temperature=0),
                            lora_adapter=lora)
    return [t async for d in engine.generate(req) for t in d.token_ids]


def reference(adapter: Path | None, n: int = 8) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    from embedmesh.models import ensure_default_model

    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(PROMPT):].tolist()


async def test_adapter_text_equals_peft_and_base_is_unaffected(engine: Any, adapter: Path) -> None:
    base_before = await run(engine)
    loads = await asyncio.gather(*(engine.load_lora("smol-lora", str(adapter)) for _ in range(3)))
    assert sorted(loads) == [False, False, True]  # loaded once
    assert await engine.list_loras() == {"smol-lora": str(adapter)}
    with_adapter, base = await asyncio.gather(run(engine, "smol-lora"), run(engine))
    assert with_adapter == reference(adapter)
    assert base == base_before == reference(None)
    assert with_adapter != base
    # Two adapters and the base model decoded in one batch: each row keeps its own weights.
    await engine.load_lora("smol-lora-b", str(adapter))
    assert engine.stats().max_batch_seen >= 2
    mixed = await asyncio.gather(run(engine, "smol-lora"), run(engine), run(engine, "smol-lora-b"))
    assert mixed == [with_adapter, base, with_adapter]
    await engine.unload_lora("smol-lora-b")


async def test_unknown_adapter_and_bad_folders(engine: Any, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument) as e:
        await run(engine, "nope")
    assert e.value.field == "model"
    with pytest.raises(InvalidArgument) as e:
        await engine.load_lora("empty", str(tmp_path))
    assert e.value.field == "path" and e.value.reason == "NOT_AN_ADAPTER"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "target_modules": ["no_such_layer"],
        "base_model_name_or_path": "x"}))
    with pytest.raises(InvalidArgument) as e:
        await engine.load_lora("bad", str(bad))
    assert e.value.field == "path" and e.value.reason == "ADAPTER_MISMATCH"
    assert "bad" not in await engine.list_loras()


async def test_unload_lets_running_requests_finish(engine: Any, adapter: Path) -> None:
    await engine.load_lora("smol-lora-2", str(adapter))
    running = asyncio.create_task(run(engine, "smol-lora-2", n=24))
    await asyncio.sleep(0.2)
    assert await engine.unload_lora("smol-lora-2") is True
    assert len(await running) == 24
    assert "smol-lora-2" not in await engine.list_loras()
    with pytest.raises(InvalidArgument):
        await run(engine, "smol-lora-2")


async def test_adapters_load_again_after_all_were_unloaded(engine: Any, adapter: Path) -> None:
    for name in list(await engine.list_loras()):
        await engine.unload_lora(name)
    base = await run(engine)
    assert base == reference(None)  # no adapter left: the plain model
    await engine.load_lora("again", str(adapter))
    assert await run(engine, "again") == reference(adapter)
    assert await run(engine) == base


async def test_a_mismatched_first_adapter_leaves_the_plain_model_untouched(adapter: Path, tmp_path: Path) -> None:
    """On a fresh engine (no adapter ever loaded) an adapter made for another base model is refused naming
    ``path``; the base model's tokens are unchanged and a good adapter then loads and matches peft."""
    from embedmesh.models import ensure_default_model
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    save_other_base_adapter(tmp_path / "o")
    e = HFEngine(HFEngineConfig(ensure_default_model(), "smol", max_batch_size=4))
    await e.start()
    try:
        base = await run(e)
        with pytest.raises(InvalidArgument) as info:
            await e.load_lora("other", str(tmp_path / "o"))
        assert info.value.field == "path" and info.value.reason == "ADAPTER_MISMATCH"
        assert await e.list_loras() == {}
        assert await run(e) == base
        assert await e.load_lora("good", str(adapter))
        assert await run(e, "good") == reference(adapter)
        assert await run(e) == base
    finally:
        await e.shutdown()
