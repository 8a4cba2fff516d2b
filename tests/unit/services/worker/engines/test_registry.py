"""The engine registry: the one place engines are named, built and given a venv; adding an engine is one folder
(engine, options, factory) plus one registry line, and nothing else in the worker names an engine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import embedmesh.services.worker.engines as engines_pkg
from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines import registry
from embedmesh.services.worker.engines.echo import EchoOptions
from embedmesh.services.worker.engines.echo.engine import EchoEngine

ROOT = Path(__file__).resolve().parents[5]
ENGINES_DIR = Path(engines_pkg.__file__).parent


def test_every_engine_is_registered_once_with_what_the_launcher_needs() -> None:
    assert registry.names() == ("hf", "hf-embed", "vllm", "sglang", "echo", "mocker")
    assert registry.venv_of("vllm") == "--vllm-venv" and registry.venv_of("sglang") == "--sglang-venv"
    assert registry.venv_of("hf") is None and registry.venv_of("echo") is None
    assert registry.spec("hf-embed").tasks == ("embed",)


@pytest.mark.parametrize("name", registry.names())
def test_every_engine_lives_in_its_own_folder(name: str) -> None:
    # engines/<name>/ holds the engine, its options (config.py) and the factory the registry line points at.
    folder = ENGINES_DIR / name.replace("-", "_")
    assert (folder / "__init__.py").is_file() and (folder / "engine.py").is_file() and (folder / "config.py").is_file()
    spec = registry.spec(name)
    assert spec.build.__module__ == f"embedmesh.services.worker.engines.{folder.name}"
    assert spec.options is not None and spec.options.__module__ == f"{spec.build.__module__}.config"


def test_no_engine_module_is_left_outside_a_folder() -> None:
    shared = {"__init__.py", "base.py", "registry.py", "options.py", "embed_inputs.py"}
    assert {p.name for p in ENGINES_DIR.glob("*.py")} == shared


def test_build_engine_builds_the_configured_engine() -> None:
    engine = registry.build_engine(WorkerConfig(engine="echo", served_name="e", with_options=EchoOptions(8)))
    assert isinstance(engine, EchoEngine) and engine.info().hidden_size == 8 and engine.info().model == "e"


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(registry.UnknownEngine, match="unknown engine 'x'; known engines: hf, hf-embed, vllm"):
        registry.spec("x")


def test_a_name_cannot_be_registered_twice() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.spec("echo"))


def _worker(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, "-m", "embedmesh.services.worker.main", *argv], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


def test_the_worker_refuses_an_unknown_engine_listing_the_known_ones() -> None:
    run = _worker("--engine", "nope")
    assert run.returncode == 2, run.stderr
    assert "unknown engine 'nope'; known engines: hf, hf-embed, vllm, sglang, echo" in run.stderr
    assert "Traceback" not in run.stderr


def test_the_workers_help_names_every_engine_and_its_options() -> None:
    run = _worker("--help")
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())
    for name in registry.names():
        assert f"{name}: {registry.spec(name).summary}" in text
    for flag in ("--max-model-len", "--no-kv-events", "--sglang-task", "--hidden-size", "--threads"):
        assert flag in text


def test_engines_without_the_optional_capabilities_decline_them() -> None:
    engine = registry.build_engine(WorkerConfig(engine="echo"))
    assert engine.kv_event_source() is None and engine.kv_usage() == 0.0 and engine.metrics_collector("w") is None


# --- adding an engine: one folder + one registry line -------------------------------------------------------

TOY = '''
from __future__ import annotations

from dataclasses import dataclass

from embedmesh.core.config import option
from embedmesh.services.worker.engines import options
from embedmesh.services.worker.engines.echo.engine import EchoEngine


@dataclass(frozen=True)
class ToyOptions(options.EngineOptions):
    toy_width: int = option(4, aliases=("EMBEDMESH_TOY_WIDTH",))
    """Width the toy engine claims."""
    threads: int = options.threads()

    def validate(self) -> None:
        if self.toy_width < 1:
            raise ValueError("toy_width must be >= 1")


class ToyEngine(EchoEngine):
    def __init__(self, name: str, opts: ToyOptions) -> None:
        super().__init__(name, hidden_size=opts.toy_width)
        self.opts = opts


def build(config):
    return ToyEngine(config.served_name or "toy", config.options_as(ToyOptions))
'''


@pytest.fixture
def toy_registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    folder = tmp_path / "toy_engine_pkg"
    folder.mkdir()
    (folder / "__init__.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    toy = importlib.import_module("toy_engine_pkg")
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register(registry.EngineSpec("toy", toy.build, "a throwaway engine", options=toy.ToyOptions))
    yield toy
    sys.modules.pop("toy_engine_pkg", None)


def test_a_new_engine_is_built_with_its_own_options_from_flags(toy_registered: object,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    toy: object = toy_registered
    config = WorkerConfig.from_args(["--engine", "toy", "--toy-width", "12", "--threads", "3"])
    engine = registry.build_engine(config)
    assert isinstance(engine, toy.ToyEngine)  # type: ignore[attr-defined]
    assert engine.opts == toy.ToyOptions(toy_width=12, threads=3)  # type: ignore[attr-defined]
    assert engine.info().hidden_size == 12 and engine.info().model == "toy"
    monkeypatch.setenv("EMBEDMESH_TOY_WIDTH", "7")
    assert registry.build_engine(WorkerConfig.from_args(["--engine", "toy"])).info().hidden_size == 7
    # Its flags are in --help, and a bad value is refused like any other (exit 2 naming it).
    assert "--toy-width" in WorkerConfig.parser().format_help()
    with pytest.raises(SystemExit) as exit_:
        WorkerConfig.from_args(["--engine", "toy", "--toy-width", "0"])
    assert exit_.value.code == 2 and "toy_width must be >= 1" in capsys.readouterr().err
    # ...and the known engines listed for a misspelt name include it.
    with pytest.raises(registry.UnknownEngine, match="known engines: hf, hf-embed, vllm, sglang, echo, mocker, toy"):
        WorkerConfig(engine="tyo")
