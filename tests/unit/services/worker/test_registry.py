"""The engine registry: the one place engines are named, built and given a venv."""

from __future__ import annotations

import pytest

from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines import registry
from embedmesh.services.worker.engines.echo.engine import EchoEngine


def test_every_engine_is_registered_once_with_what_the_launcher_needs() -> None:
    assert registry.names() == ("hf", "hf-embed", "vllm", "sglang", "echo")
    assert registry.venv_of("vllm") == "--vllm-venv" and registry.venv_of("sglang") == "--sglang-venv"
    assert registry.venv_of("hf") is None and registry.venv_of("echo") is None
    assert registry.spec("hf-embed").tasks == ("embed",)


def test_build_engine_builds_the_configured_engine() -> None:
    engine = registry.build_engine(WorkerConfig(engine="echo", served_name="e", hidden_size=8))
    assert isinstance(engine, EchoEngine)


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(registry.UnknownEngine, match="unknown engine 'x'; known engines: hf, hf-embed, vllm"):
        registry.spec("x")


def test_a_name_cannot_be_registered_twice() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.spec("echo"))


def test_vllm_gets_sleep_mode_and_lora_from_the_worker_flags() -> None:
    from embedmesh.services.worker.engines.vllm.engine import VLLMEngine

    config = WorkerConfig.from_args(["--engine", "vllm", "--enable-sleep-mode", "--enable-lora"])
    engine = registry.build_engine(config)
    assert isinstance(engine, VLLMEngine)
    assert engine.config.enable_sleep_mode and engine.config.enable_lora
    assert not registry.build_engine(WorkerConfig.from_args(["--engine", "vllm"])).config.enable_sleep_mode
