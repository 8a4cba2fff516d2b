"""The ``embedmesh.models`` package (``models/__init__.py``): its names come from ``convert`` on first use, not at
import (so ``python -m embedmesh.models.convert`` does not import the module twice)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import embedmesh.models
from embedmesh.models import convert


def test_importing_the_package_does_not_import_the_converter() -> None:
    code = ("import sys, embedmesh.models as m; assert 'embedmesh.models.convert' not in sys.modules; "
            "m.DEFAULT_MODEL; assert 'embedmesh.models.convert' in sys.modules")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("name", embedmesh.models.__all__)
def test_every_exported_name_is_the_converters(name: str) -> None:
    assert getattr(embedmesh.models, name) is getattr(convert, name)


def test_other_names_are_attribute_errors_naming_them() -> None:
    with pytest.raises(AttributeError, match="^convert_everything$"):
        embedmesh.models.convert_everything  # noqa: B018
