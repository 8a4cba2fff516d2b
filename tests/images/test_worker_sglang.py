"""The worker-sglang image (sglang==0.5.23 on CPUs, as scripts/sglang_venv.sh): it runs as its unprivileged user,
serves the baked-in all-MiniLM-L6-v2 with ``--model default`` and no download, and its vectors equal transformers'
CLS-pooled outputs on the host (SGLang pools BERT models with [CLS]; tests/e2e_sglang pins that)."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest

from embedmesh.core import tensors
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.images.conftest import USER_ID, Containers, image, podman, run_to_exit, wait_grpc_serving

WORKER = "embedmesh.worker.v1.WorkerService"
TEXTS = ["The cat sits on the mat.", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def worker_sglang() -> str:
    return image("worker-sglang")


def test_the_image_runs_as_its_unprivileged_user_with_sglang(worker_sglang: str) -> None:
    assert podman("image", "inspect", "--format", "{{.Config.User}}", worker_sglang).stdout.strip() == str(USER_ID)
    check = ("import os; from sglang.srt.entrypoints.engine import Engine; import importlib.metadata as md; "
             "print(os.getuid(), md.version('sglang'))")
    r = run_to_exit(worker_sglang, "-c", check, entrypoint="python3", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == [str(USER_ID), "0.5.23"]


def _cls_pooled(texts: list[str]) -> np.ndarray:
    import torch
    from transformers import AutoModel, AutoTokenizer

    from embedmesh.models.minilm import minilm_dir

    model = AutoModel.from_pretrained(minilm_dir(), dtype=torch.float32).eval()
    batch = AutoTokenizer.from_pretrained(minilm_dir())(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        v = model(**batch).last_hidden_state[:, 0]
    return torch.nn.functional.normalize(v, dim=1).numpy()


def test_it_serves_the_baked_in_embedding_model(worker_sglang: str, containers: Containers) -> None:
    name = containers.start(worker_sglang, "--host", "0.0.0.0", "--port", "50091", "--engine", "sglang",
                            "--model", "default", alias="sglang", publish=(50091,), shm_size="1g")
    address = f"127.0.0.1:{containers.host_port(name, 50091)}"
    wait_grpc_serving(address, WORKER, 400, alive=lambda: containers.running(name))
    assert containers.pid1_uid(name) == USER_ID
    req = worker_pb2.EmbedRequest(inputs=[worker_pb2.EmbedInput(text=t) for t in TEXTS])
    with grpc.insecure_channel(address) as ch:
        got: Any = tensors.to_numpy(worker_pb2_grpc.WorkerServiceStub(ch).Embed(req, timeout=120).embeddings)[0]
    np.testing.assert_allclose(got, _cls_pooled(TEXTS), atol=1e-5)
