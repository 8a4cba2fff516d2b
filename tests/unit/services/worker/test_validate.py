"""Every Generate is checked by the worker itself, whoever sent it: the bad-input table through the real
WorkerServicer (echo engine: no model, so only the worker's own checks stand between a request and the engine),
then the worker still answers."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from embedmesh.core.errors import InvalidArgument
from embedmesh.core.tensors import f32_to_bf16, from_numpy
from embedmesh.services.worker.engines.echo.engine import EchoEngine
from embedmesh.services.worker.servicer import WorkerServicer
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2

HIDDEN = 576
VOCAB = 49152
CONTEXT = 1 << 20


def make(segments: list[Any] | None = None, request_id: str = "r1", **sampling: Any) -> worker_pb2.GenerateRequest:
    req = worker_pb2.GenerateRequest(request_id=request_id)
    for seg in [worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=[1, 2, 3]))] if segments is None \
            else segments:
        req.segments.append(seg)
    sampling.setdefault("max_tokens", 2)
    for k, v in sampling.items():
        if k == "stop":
            req.sampling.stop.extend(v)
        else:
            setattr(req.sampling, k, v)
    return req


def rows(arr: np.ndarray, dtype: int | None = None) -> worker_pb2.PromptSegment:
    return worker_pb2.PromptSegment(embeds=from_numpy(arr, dtype))


def ids(*values: int) -> worker_pb2.PromptSegment:
    return worker_pb2.PromptSegment(token_ids=worker_pb2.TokenIds(ids=list(values)))


def good_rows(n: int = 3) -> np.ndarray:
    return np.full((n, HIDDEN), 0.25, np.float32)


def with_value(value: float, dtype: Any = np.float32) -> np.ndarray:
    a = good_rows().astype(dtype)
    a[1, 7] = value
    return a


async def generate(servicer: WorkerServicer, request: worker_pb2.GenerateRequest) -> list[Any]:
    return [r async for r in servicer.generate(request)]


@pytest.fixture
def engine() -> EchoEngine:
    return EchoEngine("echo", hidden_size=HIDDEN)


@pytest.fixture
def servicer(engine: EchoEngine) -> WorkerServicer:
    return WorkerServicer(engine, "w-test")


BAD = [
    # (case, request, field, reason)
    ("nan row", make([rows(with_value(np.nan))]), "prompt_embeds", "NON_FINITE"),
    ("inf row", make([rows(with_value(np.inf))]), "prompt_embeds", "NON_FINITE"),
    ("-inf fp16 row", make([rows(with_value(-np.inf, np.float16))]), "prompt_embeds", "NON_FINITE"),
    ("nan bf16 bits", make([rows(f32_to_bf16(with_value(np.nan)), tensor_pb2.DATA_TYPE_BF16)]), "prompt_embeds",
     "NON_FINITE"),
    ("fp64 overflowing the fp32 model", make([rows(with_value(1e300, np.float64))]), "prompt_embeds", "NON_FINITE"),
    ("nan after good ids", make([ids(1, 2), rows(with_value(np.nan))]), "prompt_embeds", "NON_FINITE"),
    ("1-D rows", make([rows(np.zeros(HIDDEN, np.float32))]), "prompt_embeds", "BAD_RANK"),
    ("4-D rows", make([rows(np.zeros((1, 1, 2, HIDDEN), np.float32))]), "prompt_embeds", "BAD_RANK"),
    ("wrong hidden size", make([rows(np.zeros((2, 100), np.float32))]), "prompt_embeds", "HIDDEN_SIZE_MISMATCH"),
    ("zero rows", make([rows(np.zeros((0, HIDDEN), np.float32))]), "prompt_embeds", "EMPTY_EMBEDS"),
    ("int32 rows", make([rows(np.ones((2, HIDDEN), np.int32))]), "prompt_embeds", "UNSUPPORTED_DTYPE"),
    ("token id = vocab", make([ids(1, VOCAB)]), "prompt", "TOKEN_OUT_OF_RANGE"),
    ("negative token id", make([ids(-1)]), "prompt", "TOKEN_OUT_OF_RANGE"),
    ("no segments", make([]), "prompt", "EMPTY_PROMPT"),
    ("empty token list", make([ids()]), "prompt", "EMPTY_PROMPT"),
    ("empty segment", make([worker_pb2.PromptSegment()]), "segments[0]", "EMPTY_SEGMENT"),
    ("no request id", make(request_id=""), "request_id", "REQUIRED"),
    ("temperature NaN", make(temperature=float("nan")), "temperature", "OUT_OF_RANGE"),
    ("temperature negative", make(temperature=-1.0), "temperature", "OUT_OF_RANGE"),
    ("temperature 1e3", make(temperature=1e3), "temperature", "OUT_OF_RANGE"),
    ("top_p 0", make(top_p=0.0), "top_p", "OUT_OF_RANGE"),
    ("top_p inf", make(top_p=float("inf")), "top_p", "OUT_OF_RANGE"),
    ("max_tokens 0", make(max_tokens=0), "max_tokens", "OUT_OF_RANGE"),
    ("too many stop strings", make(stop=["x"] * 17), "stop", "TOO_MANY_STOP"),
    ("context overflow by ids", make(max_tokens=CONTEXT), "max_tokens", "CONTEXT_OVERFLOW"),
    ("context overflow by rows", make([rows(good_rows())], max_tokens=CONTEXT - 1), "prompt_embeds",
     "CONTEXT_OVERFLOW"),
]


@pytest.mark.parametrize("case,request_,field,reason", BAD, ids=[b[0] for b in BAD])
async def test_bad_generate_requests_are_refused_by_the_worker(
    servicer: WorkerServicer, engine: EchoEngine, case: str, request_: worker_pb2.GenerateRequest, field: str,
    reason: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        await generate(servicer, request_)
    assert (info.value.field, info.value.reason) == (field, reason), case
    assert field in str(info.value)
    assert engine.stats().generated_tokens == 0, "a refused request reached the engine"
    # The worker answers the next request as usual.
    out = await generate(servicer, make(request_id="after"))
    assert "".join(r.text for r in out) == "xx"  # the echo engine's two deltas (merged when both were waiting)
    assert [t for r in out for t in r.token_ids] == [87, 87]


async def test_valid_rows_of_every_float_dtype_are_cast_to_the_model_dtype(
    servicer: WorkerServicer, engine: EchoEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[np.ndarray] = []
    original = engine.generate

    def spy(request: Any) -> Any:
        seen.extend(s.rows for s in request.segments if hasattr(s, "rows"))
        return original(request)

    monkeypatch.setattr(engine, "generate", spy)
    base = good_rows()
    for arr, dtype in [(base, None), (base.astype(np.float16), None), (base.astype(np.float64), None),
                       (f32_to_bf16(base), tensor_pb2.DATA_TYPE_BF16)]:
        out = await generate(servicer, make([ids(5), rows(arr, dtype)], request_id=f"ok-{len(seen)}"))
        assert out[-1].prompt_tokens == 4
    assert [a.dtype for a in seen] == [np.dtype(np.float32)] * 4
    assert all(np.array_equal(a, base) for a in seen)


async def test_tiny_temperature_is_accepted(servicer: WorkerServicer) -> None:
    out = await generate(servicer, make(temperature=1e-40, request_id="tiny"))
    assert out[-1].completion_tokens == 2


async def test_an_embedding_model_refuses_generate_before_any_other_rule(engine: EchoEngine) -> None:
    engine._info = dataclasses.replace(engine.info(), task="embed")
    with pytest.raises(InvalidArgument) as info:
        await generate(WorkerServicer(engine, "w"), make([rows(np.zeros((2, 100), np.float32))]))
    assert (info.value.field, info.value.reason) == ("model", "WRONG_TASK")
