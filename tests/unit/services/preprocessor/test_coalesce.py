"""Responses that queue up while the reader is slow go out merged per choice, in order, errors in place."""

from __future__ import annotations

from embedmesh.common.v1 import common_pb2
from embedmesh.services.preprocessor.pipeline import Delta, _coalesce
from embedmesh.worker.v1 import worker_pb2

LENGTH = common_pb2.FINISH_REASON_LENGTH


def _r(text: str, ids: list[int], finish: int = 0, tokens: int = 0, lp: float | None = None,
       plp: bool = False) -> worker_pb2.GenerateResponse:
    r = worker_pb2.GenerateResponse(text=text, token_ids=ids, finish_reason=finish, completion_tokens=tokens)
    if lp is not None:
        r.logprobs.add(token_id=ids[0], logprob=lp)
    if plp:
        r.prompt_logprobs.add(token_id=1)
    return r


def test_consecutive_deltas_of_one_choice_merge() -> None:
    err = RuntimeError("boom")
    out = _coalesce([(0, _r("a", [1], lp=-0.1, plp=True)), (0, _r("b", [2], lp=-0.2)), (1, _r("x", [9])),
                     (0, _r("c", [3], LENGTH, 3, lp=-0.3)), (0, _r("late", [4])), err, (1, _r("y", [8], LENGTH, 2))])
    assert len(out) == 6
    d0, n0 = out[0]  # type: ignore[misc]
    assert isinstance(d0, Delta) and (d0.index, d0.text, d0.token_ids) == (0, "ab", (1, 2)) and n0 == 0
    assert [lp.token_id for lp in d0.logprobs] == [1, 2] and len(d0.prompt_logprobs) == 1
    assert out[1][0].text == "x"  # type: ignore[index]
    d2, n2 = out[2]  # type: ignore[misc]
    assert (d2.text, d2.finish_reason, n2) == ("c", LENGTH, 3)
    # A delta after a finished one is never merged into it.
    assert out[3][0].text == "late"  # type: ignore[index]
    assert out[4] is err
    assert out[5][0].text == "y" and out[5][1] == 2  # type: ignore[index]


def test_a_finished_choice_absorbs_its_queued_tokens() -> None:
    out = _coalesce([(2, _r("p", [5])), (2, _r("q", [6])), (2, _r("", [], LENGTH, 2))])
    assert len(out) == 1
    d, n = out[0]  # type: ignore[misc]
    assert (d.index, d.text, d.token_ids, d.finish_reason, n) == (2, "pq", (5, 6), LENGTH, 2)
