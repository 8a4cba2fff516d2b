"""``python -m <process> --help`` of every process whose config is a ``Settings`` dataclass lists each field's flag
with its help text and its variable (run as an operator would, in a subprocess)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PROCESSES = [
    ("embedmesh.gateway.main", "embedmesh.gateway.config", "GatewayConfig"),
    ("embedmesh.services.preprocessor.main", "embedmesh.services.preprocessor.config", "PreprocessorConfig"),
    ("embedmesh.services.router.main", "embedmesh.services.router.config", "RouterConfig"),
    ("embedmesh.services.vector_store.main", "embedmesh.services.vector_store.config", "VectorStoreConfig"),
]


def _squash(text: str) -> str:
    return "".join(text.split())  # argparse re-wraps help text (at spaces and hyphens)


@pytest.mark.parametrize(("main", "module", "name"), PROCESSES, ids=[p[0].rsplit(".", 2)[-2] for p in PROCESSES])
def test_help_lists_every_field_with_its_help_and_variable(main: str, module: str, name: str) -> None:
    cls = getattr(importlib.import_module(module), name)
    run = subprocess.run([sys.executable, "-m", main, "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = _squash(run.stdout)
    for o in cls.options():
        assert o.help, f"{name}.{o.field} has no docstring"
        for flag in o.flags:
            assert f"{flag}" in run.stdout, f"{flag} ({o.field}) missing from {main} --help"
        assert _squash(f"{o.help.rstrip('.')}. [env: {o.env}") in out, f"{o.field}'s help missing from {main} --help"
