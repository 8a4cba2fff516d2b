"""core.grpc_runtime: every service entry point sets gRPC's settings before anything imports grpc (gRPC reads them
only then), and an operator's own setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from embedmesh.core import grpc_runtime

ENTRY_POINTS = ["embedmesh.services.preprocessor.main", "embedmesh.services.router.main",
                "embedmesh.services.worker.main", "embedmesh.services.encoder_cache.main",
                "embedmesh.services.vector_store.main", "embedmesh.gateway.main"]


def test_apply_sets_the_default_only_when_unset() -> None:
    env: dict[str, str] = {}
    assert grpc_runtime.apply(env) is True
    assert env["GRPC_EXPERIMENTS"] == "-event_engine_client,-event_engine_listener"
    mine = {"GRPC_EXPERIMENTS": ""}  # an operator asking for gRPC's own defaults
    assert grpc_runtime.apply(mine) is False
    assert mine == {"GRPC_EXPERIMENTS": ""}


def _imports(module: str, env: dict[str, str]) -> tuple[list[str], str]:
    """The modules ``import module`` loaded, in the order they finished (``-X importtime``), and the
    GRPC_EXPERIMENTS that process ended up with."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c",
                          f"import os, {module}; print(repr(os.environ.get('GRPC_EXPERIMENTS')))"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    names = [line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    return names, out.stdout.strip()


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_sets_it_before_grpc_is_imported(module: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    names, value = _imports(module, env)
    assert value == repr(grpc_runtime.GRPC_EXPERIMENTS)
    assert "grpc" in names, "the entry point no longer imports grpc: this test checks nothing"
    assert names.index("embedmesh.core.grpc_runtime") < names.index("grpc"), (
        f"{module} imports grpc before embedmesh.core.grpc_runtime: gRPC would start with its own defaults")


def test_an_operators_setting_is_kept() -> None:
    env = {**os.environ, "GRPC_EXPERIMENTS": "-event_engine_client"}
    _, value = _imports("embedmesh.services.preprocessor.main", env)
    assert value == repr("-event_engine_client")
