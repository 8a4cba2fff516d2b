"""Fixtures of the images' smoke tests (``make test-images``; ``make test`` runs them after building the default set).

The images are the ones ``make images`` builds (``scripts/images.sh``), tagged with pyproject.toml's version. One that
is missing is a failure where ``EMBEDMESH_REQUIRE_IMAGES`` names its kind (``1``: the default set, services and
worker-hf; else a list of kinds), otherwise a skip that says how to build it. Every container and network a test
makes is removed when it ends, also when it fails. Clients reach containers only through ports published on
127.0.0.1; containers reach each other on a podman network of their own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"
KINDS = ("services", "worker-hf", "worker-vllm", "worker-sglang")
DEFAULT_SET = ("services", "worker-hf")
USER_ID = 10001
"""The unprivileged user every image runs as (deploy/docker/, the manifests' runAsUser)."""


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run podman with this repository's containers.conf (runc, rlimits this VM accepts) unless one is set."""
    env = {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF") or str(CONTAINERS_CONF)}
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False)


def required_kinds() -> set[str]:
    """The kinds whose absence fails the tests (``EMBEDMESH_REQUIRE_IMAGES``)."""
    value = os.environ.get("EMBEDMESH_REQUIRE_IMAGES", "").strip()
    if value in ("", "0"):
        return set()
    if value == "1":
        return set(DEFAULT_SET)
    kinds = set(re.split(r"[\s,]+", value))
    unknown = kinds - set(KINDS)
    if unknown:
        raise pytest.UsageError(f"EMBEDMESH_REQUIRE_IMAGES names unknown images {sorted(unknown)}; kinds: {KINDS}")
    return kinds


def image_ref(kind: str) -> str:
    return f"embedmesh/{kind}:{VERSION}"


def image(kind: str) -> str:
    """The reference of a built image, or a skip/failure saying what is missing and how to build it."""
    ref = image_ref(kind)
    if shutil.which("podman") is None:
        missing = "podman is not installed (make image-sysdeps)"
    elif podman("image", "exists", ref).returncode != 0:
        missing = f"image {ref} is not built (make images, or scripts/images.sh {kind})"
    else:
        return ref
    if kind in required_kinds():
        pytest.fail(f"{missing}; EMBEDMESH_REQUIRE_IMAGES requires it")
    pytest.skip(missing)


class Containers:
    """Containers and networks of one test (or module), all removed by ``close``."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:8]
        self.names: list[str] = []
        self.networks: list[str] = []

    def network(self, internal: bool = False) -> str:
        """A podman network of this test's own; ``internal``: no route out of it (and no published ports)."""
        name = f"embedmesh-test-{self.tag}-{len(self.networks)}"
        self.networks.append(name)
        r = podman("network", "create", *(["--internal"] if internal else []), name)
        assert r.returncode == 0, r.stderr
        return name

    def start(self, image: str, *args: str, alias: str = "", networks: tuple[str, ...] = (),
              publish: tuple[int, ...] = (), env: dict[str, str] | None = None, entrypoint: str | None = None,
              volumes: tuple[tuple[str, str], ...] = (), shm_size: str = "") -> str:
        """``podman run -d``; ``alias`` is the name other containers on ``networks`` dial; each port of
        ``publish`` is published on 127.0.0.1 at a free host port (``host_port``); ``volumes`` are (host folder,
        container path) pairs mounted read-only."""
        name = f"embedmesh-test-{self.tag}-{alias or 'c'}-{len(self.names)}"
        self.names.append(name)  # before the run: a half-created container is removed too
        cmd = ["run", "-d", "--pull=never", "--name", name]
        for net in networks:
            cmd += ["--network", net]
        if networks and alias:
            cmd += ["--network-alias", alias]
        for port in publish:
            cmd += ["-p", f"127.0.0.1::{port}"]
        for key, value in (env or {}).items():
            cmd += ["-e", f"{key}={value}"]
        if entrypoint is not None:
            cmd += ["--entrypoint", entrypoint]
        for host, path in volumes:
            cmd += ["-v", f"{host}:{path}:ro"]
        if shm_size:
            cmd += ["--shm-size", shm_size]
        r = podman(*cmd, image, *args)
        assert r.returncode == 0, f"podman run {image} failed: {r.stderr}"
        return name

    def host_port(self, name: str, port: int) -> int:
        r = podman("port", name, f"{port}/tcp")
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        host, _, found = r.stdout.strip().splitlines()[0].rpartition(":")
        assert host == "127.0.0.1", f"published on {host}, not loopback"
        return int(found)

    def logs(self, name: str) -> str:
        r = podman("logs", name)
        return r.stdout + r.stderr

    def running(self, name: str) -> bool:
        r = podman("inspect", "--format", "{{.State.Running}}", name)
        return r.stdout.strip() == "true"

    def pid1_uid(self, name: str) -> int:
        """The real uid of the container's main process, read from its /proc."""
        r = podman("exec", name, "cat", "/proc/1/status")
        assert r.returncode == 0, r.stderr
        line = next(x for x in r.stdout.splitlines() if x.startswith("Uid:"))
        return int(line.split()[1])

    def close(self) -> None:
        for name in reversed(self.names):
            podman("rm", "--force", "--time", "0", name)
        for net in self.networks:
            podman("network", "rm", "--force", net)


@pytest.fixture
def containers() -> Iterator[Containers]:
    c = Containers()
    try:
        yield c
    finally:
        c.close()


def wait_grpc_serving(address: str, service: str, timeout: float, alive: object = None) -> None:
    """Poll grpc.health.v1 Check until ``service`` is SERVING; ``alive`` (a callable) stops the wait early with a
    failure when the container has exited."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    last = "no answer"
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            except grpc.RpcError as e:
                last = e.code().name
            if callable(alive) and not alive():
                pytest.fail(f"the container exited before {service} served (last: {last})")
            time.sleep(0.5)
    pytest.fail(f"{service} at {address} not SERVING after {timeout}s (last: {last})")


def run_to_exit(ref: str, *args: str, timeout: float = 120,
                entrypoint: str | None = None) -> subprocess.CompletedProcess[str]:
    """``podman run --rm`` in the foreground with no network but its loopback, removed by name if it outlives
    ``timeout`` (it should have exited)."""
    name = f"embedmesh-test-{uuid.uuid4().hex[:8]}-once"
    cmd = ["run", "--rm", "--pull=never", "--network", "none", "--name", name,
           *(["--entrypoint", entrypoint] if entrypoint else []), ref]
    try:
        return podman(*cmd, *args, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{ref} {' '.join(args)} was still running after {timeout}s; it should have refused to start")
    finally:
        podman("rm", "--force", "--time", "0", name)


@pytest.fixture(scope="session")
def smollm() -> Any:
    """(model, tokenizer) of the default model on the host, the reference the containers' answers are held to."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from embedmesh.models import ensure_default_model

    path = ensure_default_model()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
