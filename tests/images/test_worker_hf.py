"""The worker-hf image (the hf and hf-embed engines, CPU torch, the default models baked in): it runs as its
unprivileged user, loads the baked-in model without any download and answers grpc.health.v1 through a published
port, and a model that is not there stops it with one line."""

from __future__ import annotations

import pytest

from tests.images.conftest import USER_ID, Containers, image, podman, run_to_exit, wait_grpc_serving

WORKER = "embedmesh.worker.v1.WorkerService"


@pytest.fixture(scope="module")
def worker_hf() -> str:
    return image("worker-hf")


def test_the_image_runs_as_its_unprivileged_user_with_the_model_baked_in(worker_hf: str) -> None:
    r = podman("image", "inspect", "--format", "{{.Config.User}}", worker_hf)
    assert r.stdout.strip() == str(USER_ID)
    check = ("import os, torch; from embedmesh.models.convert import default_model_dir; "
             "d = default_model_dir(); print(os.getuid(), torch.__version__, (d / '.complete').exists(), "
             "os.access(d, os.W_OK))")
    r = run_to_exit(worker_hf, "-c", check, entrypoint="python3")
    assert r.returncode == 0, r.stderr
    uid, torch_version, converted, _ = r.stdout.split()
    assert uid == str(USER_ID)
    assert torch_version.endswith("+cpu"), "the CPU build of torch, not PyPI's CUDA build"
    assert converted == "True", "the default model is converted at build time, not at start-up"


@pytest.mark.parametrize(("engine", "port"), [("hf", 50061), ("hf-embed", 50091)])
def test_each_engine_serves_the_baked_in_model(worker_hf: str, containers: Containers, engine: str,
                                               port: int) -> None:
    name = containers.start(worker_hf, "--host", "0.0.0.0", "--port", str(port), "--engine", engine,
                            alias=engine, publish=(port,))
    host_port = containers.host_port(name, port)
    wait_grpc_serving(f"127.0.0.1:{host_port}", WORKER, 180, alive=lambda: containers.running(name))
    assert containers.pid1_uid(name) == USER_ID
    assert "converting" not in containers.logs(name), "the model was converted again at start-up"


def test_a_model_volume_not_mounted_stops_the_worker_with_one_line(worker_hf: str) -> None:
    # The gpu overlay's workers load /models/...; without the volume the worker says so once and exits.
    r = run_to_exit(worker_hf, "--host", "0.0.0.0", "--engine", "hf", "--model", "/models/llm", timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "embedmesh-worker: error: model '/models/llm': no config.json in that folder")
