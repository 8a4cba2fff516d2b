"""lm-evaluation-harness (PyPI `lm-eval`) scores a local multiple-choice task through the gateway with its
`local-completions` model — loglikelihoods from `echo` + `logprobs` — and every loglikelihood it records equals the
one transformers computes for the same context and continuation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e

TASK = Path(__file__).parent / "lmeval_task"
YAML = """task: embedmesh_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _reference(hf_model: Any, context: str, continuation: str) -> float:
    """log p(continuation | context) with transformers, split into tokens as lm-eval splits them."""
    import torch

    model, tok = hf_model
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    n_ctx = len(tok(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(float(rows[t - 1][whole[t]]) for t in range(n_ctx, len(whole)))


def run_lm_eval(base_url: str, model: str, tmp_path: Path) -> tuple[list[tuple[str, str, float]], float]:
    """Run lm-eval's local-completions model on the shipped task against ``base_url`` (an OpenAI-compatible
    server); return (context, continuation, loglikelihood) of every request, and the accuracy."""
    from embedmesh.models import ensure_default_model

    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(TASK / "mc.jsonl", tmp_path / "mc.jsonl")
    (tmp_path / "embedmesh_mc.yaml").write_text(YAML.format(data=tmp_path / "mc.jsonl"))
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
        f"model={model},base_url={base_url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={ensure_default_model()},tokenized_requests=True,num_concurrent=1,max_retries=1",
        "--tasks", "embedmesh_mc", "--include_path", str(tmp_path), "--batch_size", "1", "--log_samples",
        "--output_path", str(out),
    ]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OPENAI_API_KEY": "unused"}
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    samples = [json.loads(line) for p in out.rglob("samples_embedmesh_mc_*.jsonl") for line in p.open()]
    assert len(samples) == 20
    rows = []
    for s in sorted(samples, key=lambda x: x["doc_id"]):
        args_ = s["arguments"]
        pairs = list(args_.values()) if isinstance(args_, dict) else args_
        for pair, resp in zip(pairs, s["resps"], strict=True):
            context, continuation = (pair["arg_0"], pair["arg_1"]) if isinstance(pair, dict) else pair
            got = resp
            while isinstance(got, list):  # [[loglikelihood, is_greedy]]
                got = got[0]
            rows.append((context, continuation, float(got)))
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    return rows, float(results["results"]["embedmesh_mc"]["acc,none"])


def test_lm_eval_local_completions_scores_like_transformers(mesh: Any, hf_model: Any, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    rows, accuracy = run_lm_eval(mesh.base_url, MODEL, tmp_path)
    assert len(rows) == 60
    for context, continuation, got in rows:
        assert got == pytest.approx(_reference(hf_model, context, continuation), abs=1e-3)
    assert 0.0 <= accuracy <= 1.0
