"""The worker's bootstrap (``worker/main.py``): it names no engine, ``--lora-modules`` adapters load before the
worker serves, a bad one stopping the worker with the reason, and a model that is not there stops it with one line."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from embedmesh.services.worker import main as worker_main
from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines.echo.engine import EchoEngine


def test_the_worker_bootstrap_names_no_engine() -> None:
    # Capabilities (KV events, KV usage, engine metrics) come from the engine's hooks, not engine branches.
    source = Path(worker_main.__file__).read_text()
    assert not [n for n in ("vllm", "VLLM", "sglang", "SGLang", "HFEngine", "Echo") if n in source]


class _LoraEcho(EchoEngine):
    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[tuple[str, str]] = []

    async def load_lora(self, name: str, path: str) -> bool:
        self.loaded.append((name, path))
        return True


def _config(*modules: str) -> WorkerConfig:
    return WorkerConfig.from_args(["--engine", "echo", "--lora-modules", *modules])


def test_lora_modules_load_in_order_from_under_the_root(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    engine = _LoraEcho()
    asyncio.run(worker_main._load_lora_modules(engine, _config("first=a", f"second={tmp_path / 'b'}"), tmp_path))
    assert engine.loaded == [("first", str((tmp_path / "a").resolve())), ("second", str((tmp_path / "b").resolve()))]


def test_a_path_outside_the_root_stops_the_worker_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        asyncio.run(worker_main._load_lora_modules(_LoraEcho(), _config("x=../elsewhere"), tmp_path))
    assert str(e.value).startswith("--lora-modules x=../elsewhere: --lora-modules: '..' is not allowed")


def test_an_engine_without_lora_stops_the_worker(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    with pytest.raises(SystemExit, match="--lora-modules: the echo engine does not load LoRA adapters"):
        asyncio.run(worker_main._load_lora_modules(EchoEngine(), _config("a=a"), tmp_path))


def test_no_lora_modules_loads_nothing(tmp_path: Path) -> None:
    engine = _LoraEcho()
    asyncio.run(worker_main._load_lora_modules(engine, WorkerConfig(engine="echo"), tmp_path))
    assert engine.loaded == []


def test_a_missing_model_stops_the_worker_with_one_line_and_status_2(tmp_path: Path) -> None:
    # What a container whose model volume is not mounted prints, again at every restart: the reason, no traceback.
    missing = tmp_path / "models" / "llm"
    r = subprocess.run([sys.executable, "-m", "embedmesh.services.worker.main", "--engine", "hf", "--port", "0",
                        "--model", str(missing)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"embedmesh-worker: error: model '{missing}': no config.json in that folder"), r.stderr
