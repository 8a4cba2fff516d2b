"""Should the preprocessor's output types (``Delta``/``Choice`` log-probabilities) be plain dataclasses?

Measures, in process, the cost per generated token of the preprocessor's streamed path as it is (a worker
``GenerateResponse`` of one token parsed from its bytes -> ``Delta`` -> ``Choice`` -> ``StreamCompleteResponse``
serialized, log-probabilities passed through as protobuf) against the extra cost of converting each worker
``TokenLogprob`` to a dataclass and back to protobuf on the way. Median of many runs; the ratio is what decides.

    .venv/bin/python bench/bench_logprob_domain.py [--top 5] [--runs 31] [--loops 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from embedmesh.common.v1 import common_pb2
from embedmesh.inference.v1 import inference_pb2
from embedmesh.services.preprocessor.pipeline import Delta, _coalesce
from embedmesh.services.preprocessor.service import Choice
from embedmesh.services.preprocessor.servicer import _choice_fields
from embedmesh.worker.v1 import worker_pb2


@dataclass(frozen=True, slots=True)
class Top:
    token_id: int
    token: str
    logprob: float
    bytes: bytes


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    token: str
    logprob: float | None
    bytes: bytes
    top: tuple[Top, ...]


def to_dataclass(lp: common_pb2.TokenLogprob) -> Logprob:
    return Logprob(lp.token_id, lp.token, lp.logprob if lp.HasField("logprob") else None, lp.bytes,
                   tuple(Top(t.token_id, t.token, t.logprob, t.bytes) for t in lp.top))


def to_proto(lp: Logprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, token=lp.token, logprob=lp.logprob, bytes=lp.bytes,
        top=[common_pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob, bytes=t.bytes)
             for t in lp.top])


def worker_bytes(top: int, with_logprobs: bool) -> bytes:
    resp = worker_pb2.GenerateResponse(text=" word", token_ids=[1234], completion_tokens=7)
    if with_logprobs:
        resp.logprobs.append(common_pb2.TokenLogprob(
            token_id=1234, token=" word", logprob=-0.25, bytes=b" word",
            top=[common_pb2.TopLogprob(token_id=1234 + i, token=f" w{i}", logprob=-0.25 - i, bytes=f" w{i}".encode())
                 for i in range(top)]))
    return resp.SerializeToString()


def per_token(data: bytes) -> None:
    """The preprocessor's own work for one streamed token (gRPC's C core and the event loop not counted)."""
    resp = worker_pb2.GenerateResponse.FromString(data)
    delta: Delta = _coalesce([(0, resp)])[0][0]  # type: ignore[index]
    choice = Choice(delta.index, delta.text, delta.token_ids, delta.finish_reason, delta.logprobs,
                    delta.prompt_logprobs)
    out = inference_pb2.StreamCompleteResponse(id="cmpl-1", model="m", **_choice_fields(choice))
    inference_pb2.GenerateResponse(completion_chunk=out).SerializeToString()


def convert(data: bytes) -> None:
    """The extra work a dataclass domain type adds per token: worker proto -> dataclass -> proto."""
    resp = worker_pb2.GenerateResponse.FromString(data)
    [to_proto(lp) for lp in [to_dataclass(p) for p in resp.logprobs]]


def parse_only(data: bytes) -> None:
    worker_pb2.GenerateResponse.FromString(data)


def median_us(fn, data: bytes, runs: int, loops: int) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(loops):
            fn(data)
        samples.append((time.perf_counter() - t) / loops * 1e6)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--runs", type=int, default=31)
    ap.add_argument("--loops", type=int, default=2000)
    a = ap.parse_args()
    plain, with_lp = worker_bytes(a.top, False), worker_bytes(a.top, True)
    base_plain = median_us(per_token, plain, a.runs, a.loops)
    base_lp = median_us(per_token, with_lp, a.runs, a.loops)
    extra = median_us(convert, with_lp, a.runs, a.loops) - median_us(parse_only, with_lp, a.runs, a.loops)
    print(f"per-token path, no logprobs:              {base_plain:7.2f} us")
    print(f"per-token path, logprobs (top={a.top}) passed: {base_lp:7.2f} us")
    print(f"proto -> dataclass -> proto, per token:   {extra:7.2f} us  "
          f"= {extra / base_lp * 100:.1f} % of the logprobs path")


if __name__ == "__main__":
    main()
