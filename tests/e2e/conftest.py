"""Fixtures for the running mesh: one real mesh (hf worker, SmolLM2) for the whole session, the model's own
tokenizer and embedding layer in the test process to build prompt embeddings as a client would."""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.mesh import Mesh, start_mesh

MODEL = "SmolLM2-135M-Instruct"
HIDDEN = 576
CONTEXT = 8192
MAX_EMBEDS_BYTES = 16 * 1024 * 1024


@pytest.fixture(scope="session")
def mesh() -> Iterator[Mesh]:
    # A small embeds cap so the over-cap case in the bad-input table stays cheap to send.
    trace_file = f"/tmp/embedmesh-traces-{os.getpid()}.jsonl"
    if os.path.exists(trace_file):
        os.remove(trace_file)
    m = start_mesh(workers=1, env={"EMBEDMESH_MAX_EMBEDS_BYTES": str(MAX_EMBEDS_BYTES),
                                   "EMBEDMESH_TRACE_FILE": trace_file, "EMBEDMESH_TRACE_CONSOLE": "0"})
    m.extra["trace_file"] = trace_file
    yield m
    code = m.stop()
    assert code == 0, f"launcher did not stop cleanly ({code}):\n{m.log_tail()}"


@pytest.fixture(scope="session")
def hf_model() -> Any:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from embedmesh.models import ensure_default_model

    path = ensure_default_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


@pytest.fixture(scope="session")
def embeds_of(hf_model: Any) -> Any:
    """text -> the embedding-layer output for its token ids, exactly as vLLM's docs tell clients to build it."""
    import torch

    model, tok = hf_model

    def make(text: str) -> torch.Tensor:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            return model.get_input_embeddings()(ids).squeeze(0)

    return make


def b64_of(tensor: Any) -> str:
    import torch

    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
def client(mesh: Mesh) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
