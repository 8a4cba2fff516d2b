"""The TypeScript client (clients/typescript, @grpc/grpc-js, loaded from the same protos/) sends a prompt-embeddings
tensor as raw bytes and streams the completion; its text equals the Python client's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from embedmesh_client import Client

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "clients" / "typescript" / "dist" / "complete.js"


def test_typescript_client_streams_the_same_text(mesh: Any, embeds_of: Any, tmp_path: Path) -> None:
    assert SCRIPT.exists(), "build the TypeScript client first: make ts-client"
    emb = embeds_of("The capital of France is").numpy().astype("<f4")
    path = tmp_path / "prompt.f32"
    path.write_bytes(emb.tobytes())
    before = (_chunked_calls(mesh, "GenerateInline"), _chunked_calls(mesh))
    r = subprocess.run(["node", str(SCRIPT), mesh.preprocessor, MODEL, str(path), str(emb.shape[0]),
                        str(emb.shape[1]), "10"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # a small tensor: one GenerateInline message, no Generate stream
    assert (_chunked_calls(mesh, "GenerateInline"), _chunked_calls(mesh)) == (before[0] + 1, before[1])
    out = json.loads(r.stdout)
    with Client(mesh.preprocessor) as c:
        expected = c.complete(MODEL, embeds=emb, max_tokens=10, temperature=0)
    assert out["text"] == expected.choices[0].text and out["text"]
    assert out["deltas"] >= 2, "the completion was not streamed"
    assert out["usage"]["promptTokens"] == emb.shape[0]
    assert out["usage"]["totalTokens"] == expected.usage.total_tokens


def test_typescript_client_reports_the_status(mesh: Any, tmp_path: Path) -> None:
    path = tmp_path / "bad.f32"
    path.write_bytes(np.zeros((2, 7), "<f4").tobytes())
    r = subprocess.run(["node", str(SCRIPT), mesh.preprocessor, MODEL, str(path), "2", "7"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    err = json.loads(r.stderr.strip().splitlines()[-1])
    assert err["code"] == 3 and "hidden size" in err["details"]


def _chunked_calls(mesh: Any, method: str = "Generate") -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{mesh.extra['metrics_base'] + 1}/metrics", timeout=10).read()
    prefix = f'embedmesh_rpc_requests_total{{code="OK",method="{method}",service="preprocessor"}} '
    return sum(float(line[len(prefix):]) for line in text.decode().splitlines() if line.startswith(prefix))


def test_a_big_tensor_goes_in_pieces_and_gives_the_same_text(mesh: Any, tmp_path: Path) -> None:
    # 1200 x 576 float32 = 2.8 MB, past the client's 1 MiB threshold: sent as Generate rows after the header
    big = (np.random.default_rng(2).standard_normal((1200, 576)) * 0.05).astype("<f4")
    path = tmp_path / "big.f32"
    path.write_bytes(big.tobytes())
    before = _chunked_calls(mesh)
    r = subprocess.run(["node", str(SCRIPT), mesh.preprocessor, MODEL, str(path), "1200", "576", "5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert _chunked_calls(mesh) == before + 1
    out = json.loads(r.stdout)
    with Client(mesh.preprocessor) as c:
        expected = c.complete(MODEL, embeds=big, max_tokens=5, temperature=0)
    assert out["text"] == expected.choices[0].text
    assert out["usage"]["promptTokens"] == 1200
