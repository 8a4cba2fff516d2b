"""Adapter paths resolve inside the LoRA root or are refused naming the field, symlinks and '..' included."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.services.worker.lora_paths import resolve_adapter_path


def test_folders_under_the_root_resolve(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert resolve_adapter_path(str(tmp_path / "a" / "b"), tmp_path) == (tmp_path / "a" / "b").resolve()
    assert resolve_adapter_path("a/b", tmp_path) == (tmp_path / "a" / "b").resolve()
    (tmp_path / "inner-link").symlink_to(tmp_path / "a")
    assert resolve_adapter_path("inner-link", tmp_path) == (tmp_path / "a").resolve()


@pytest.mark.parametrize("make,reason", [
    (lambda r: "/etc", "PATH_OUTSIDE_ROOT"),
    (lambda r: f"{r}/a/../../etc", "PATH_OUTSIDE_ROOT"),
    (lambda r: "../x", "PATH_OUTSIDE_ROOT"),
    (lambda r: "escape", "PATH_OUTSIDE_ROOT"),
    (lambda r: f"{r}/missing", "NOT_A_FOLDER"),
    (lambda r: f"{r}/file", "NOT_A_FOLDER"),
    (lambda r: "", "REQUIRED"),
    (lambda r: "a\x00b", "INVALID_PATH"),
])
def test_anything_else_is_refused_naming_the_field(tmp_path: Path, make: object, reason: str) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "escape").symlink_to("/etc")
    with pytest.raises(InvalidArgument) as info:
        resolve_adapter_path(make(str(tmp_path)), tmp_path, field="lora_path")  # type: ignore[operator]
    assert info.value.field == "lora_path" and info.value.reason == reason
