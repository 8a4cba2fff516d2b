"""The services image (gateway, preprocessor, router, encoder cache, vector store) as built by ``make images``: it
runs as its unprivileged user, a service in it answers grpc.health.v1 through a published port, and a service missing
a required setting refuses to start with one line saying which, instead of serving or crash-looping silently."""

from __future__ import annotations

import pytest

from tests.images.conftest import USER_ID, Containers, image, podman, run_to_exit, wait_grpc_serving


@pytest.fixture(scope="module")
def services() -> str:
    return image("services")


def test_the_image_runs_as_its_unprivileged_user(services: str) -> None:
    r = podman("image", "inspect", "--format", "{{.Config.User}}", services)
    assert r.stdout.strip() == str(USER_ID)
    r = run_to_exit(services, "python3", "-c", "import os, pwd; print(os.getuid(), pwd.getpwuid(os.getuid()).pw_name)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(USER_ID), "embedmesh"]


def test_no_torch_and_no_compiler_in_the_image(services: str) -> None:
    r = run_to_exit(services, "python3", "-c",
                    "import importlib.util, shutil; print(importlib.util.find_spec('torch'), shutil.which('g++'))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "None"]


def test_the_router_answers_health_as_the_unprivileged_user(services: str, containers: Containers) -> None:
    name = containers.start(services, "python3", "-m", "embedmesh.services.router.main", "--host", "0.0.0.0",
                            "--port", "50081", alias="router", publish=(50081,))
    port = containers.host_port(name, 50081)
    wait_grpc_serving(f"127.0.0.1:{port}", "embedmesh.router.v1.RouterService", 60,
                      alive=lambda: containers.running(name))
    assert containers.pid1_uid(name) == USER_ID


def test_the_vector_store_without_its_database_refuses_to_start_with_one_line(services: str) -> None:
    # The manifests give it EMBEDMESH_VECTOR_STORE_POSTGRES_DSN from a Secret; without it, it must not serve.
    r = run_to_exit(services, "python3", "-m", "embedmesh.services.vector_store.main", "--host", "0.0.0.0",
                    "--backend", "pgvector", timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "embedmesh-vector-store: error: the pgvector backend needs postgres_dsn"


def test_half_a_tls_setting_refuses_to_start_with_one_line(services: str) -> None:
    # The mTLS overlay sets the three paths together; one alone (a Secret not mounted) is refused, not ignored.
    r = run_to_exit(services, "python3", "-m", "embedmesh.services.router.main", "--host", "0.0.0.0",
                    "--tls-cert", "/etc/embedmesh/tls/tls.crt", timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "embedmesh-router: error: --tls-cert, --tls-key and --tls-ca go together: set all three or none")
