"""``python -m <process> --help`` of every process documented by ``scripts/config_table.py`` lists each field's flag
with its help text and its variable (run as an operator would, in a subprocess)."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROCESSES = [(main, module, name) for _, main, module, name in _script().CONFIGS]


def _squash(text: str) -> str:
    return "".join(text.split())  # argparse re-wraps help text (at spaces and hyphens)


@pytest.mark.parametrize(("main", "module", "name"), PROCESSES, ids=[p[2] for p in PROCESSES])
def test_help_lists_every_field_with_its_help_and_variable(main: str, module: str, name: str) -> None:
    cls = getattr(importlib.import_module(module), name)
    run = subprocess.run([sys.executable, "-m", main, "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = _squash(run.stdout)
    for o in cls.options():
        assert o.help, f"{name}.{o.field} has no docstring"
        for flag in o.flags:
            assert f"{flag}" in run.stdout, f"{flag} ({o.field}) missing from {main} --help"
        assert _squash(o.help) in out, f"{o.field}'s help missing from {main} --help"
        assert _squash(f"[env: {o.env}") in out, f"{o.env} missing from {main} --help"
