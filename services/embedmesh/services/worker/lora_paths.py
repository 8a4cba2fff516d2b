"""Where LoRA adapters may be loaded from: only folders under the worker's configured root.

A load request names a path; the worker resolves it (symlinks followed) and refuses anything that does not end up
inside the root — ``..`` segments, absolute paths elsewhere, symlinks pointing out — with INVALID_ARGUMENT naming
the field, before the engine opens a single file. The root is ``--lora-root`` (env EMBEDMESH_LORA_ROOT; default
``$EMBEDMESH_CACHE/lora-adapters``).
"""

from __future__ import annotations

import os
from pathlib import Path

from embedmesh.core.errors import InvalidArgument

__all__ = ["default_lora_root", "relative_to_root", "resolve_adapter_path"]


def default_lora_root() -> Path:
    cache = os.environ.get("EMBEDMESH_CACHE") or str(Path.home() / ".cache" / "embedmesh")
    return Path(cache) / "lora-adapters"


def resolve_adapter_path(path: str, root: Path, field: str = "path") -> Path:
    """The adapter folder ``path`` resolved inside ``root``; InvalidArgument naming ``field`` otherwise."""
    if not path:
        raise InvalidArgument(f"{field} is required", field=field, reason="REQUIRED")
    if "\x00" in path or len(path) > 4096:
        raise InvalidArgument(f"{field}: not a valid path", field=field, reason="INVALID_PATH")
    if ".." in Path(path).parts:
        raise InvalidArgument(f"{field}: '..' is not allowed in adapter paths", field=field,
                              reason="PATH_OUTSIDE_ROOT")
    base = root.resolve()
    candidate = Path(path) if os.path.isabs(path) else base / path
    resolved = candidate.resolve()
    if not resolved.is_relative_to(base):
        raise InvalidArgument(f"{field}: adapters load only from folders under the worker's LoRA root "
                              f"(--lora-root; give a path relative to it); {path!r} is outside it", field=field,
                              reason="PATH_OUTSIDE_ROOT")
    if not resolved.is_dir():
        raise InvalidArgument(f"{field}: {path!r} is not a folder under the LoRA root", field=field,
                              reason="NOT_A_FOLDER")
    return resolved


def relative_to_root(text: str, root: Path) -> str:
    """``text`` with every mention of the root's absolute path made relative to it: what an admin call answers
    names folders as the caller names them, never where the worker's files lie on its host."""
    base = str(root.resolve())
    return text.replace(base + os.sep, "").replace(base, ".")
