"""Resuming on vLLM without vLLM: what is refused (naming the field) and what is allowed, the sampling fields a
resumed request changes, and the resumed text: the resumed tokens' released text is not sent again, their held-back
text comes first, a stop string across the cut ends the sequence at the token completing it. A small detokenizer
with vLLM's contract (``update`` / ``get_next_output_text`` / ``output_token_ids``; hold back ``len(longest stop) - 1``
characters, stop strings searched in new text) stands in for vLLM's (the real one runs in tests/e2e_vllm)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from embedmesh.core.errors import FailedPrecondition
from embedmesh.core.sampling import SamplingParams, Structured
from embedmesh.services.worker.engines.base import EmbedsSegment, FinishReason, GenerationRequest, TokenSegment
from embedmesh.services.worker.engines.vllm.resume import (
    ResumedText,
    check_resumable,
    detokenizer_request,
    refusal,
    resumed_detokenizer,
    sampling_overrides,
)

WORDS = {1: "The", 2: " cat", 3: " sat", 4: " on", 5: " the", 6: " mat", 7: "."}


class CharDetok:
    """One word per id; vLLM's hold-back and stop rules (first stop string in the new text; excluded from it)."""

    def __init__(self, stop: list[str] | None, min_tokens: int = 0) -> None:
        self.stop, self.min_tokens = stop or [], min_tokens
        self.buffer = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    def update(self, ids: list[int], stop_terminated: bool) -> str | None:
        for i, t in enumerate(ids):
            before = len(self.text)
            self.token_ids.append(t)
            if stop_terminated and i == len(ids) - 1:
                return None
            self.text += WORDS[t]
            if len(self.token_ids) <= self.min_tokens:
                continue
            for s in self.stop:
                at = self.text.find(s, max(before - len(s) + 1, 0))
                if at >= 0:
                    self.text = self.text[:at]
                    return s  # the ids after the completing one are never appended
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        end = len(self.text) - (0 if finished else self.buffer)
        out = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out


def request(resumed: tuple[int, ...] = (1, 2), segments: list[Any] | None = None, **sampling: Any) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerationRequest("r", segments or [TokenSegment((9, 9))], SamplingParams(**sampling), resumed=resumed)


ROWS = EmbedsSegment(np.zeros((2, 4), np.float32))


@pytest.mark.parametrize(("field", "sampling", "segments"), [
    ("seed", {"temperature": 0.7, "seed": 3}, None),
    ("presence_penalty", {"presence_penalty": 0.5}, None),
    ("frequency_penalty", {"frequency_penalty": -0.5}, None),
    ("repetition_penalty", {"repetition_penalty": 1.2}, [ROWS]),
    ("repetition_penalty", {"repetition_penalty": 1.2}, [TokenSegment((1,)), ROWS]),
    ("structured_outputs", {"structured": Structured("regex", "[a-z]+")}, None),
])
def test_what_vllm_cannot_continue_exactly_is_refused_naming_the_field(field: str, sampling: dict[str, Any],
                                                                        segments: list[Any] | None) -> None:
    r = request(segments=segments, **sampling)
    assert refusal(r) is not None and refusal(r)[0] == field  # type: ignore[index]
    with pytest.raises(FailedPrecondition) as e:
        check_resumable(r)
    assert e.value.reason == "RESUME_UNSUPPORTED" and e.value.field == field and f"{field}:" in str(e.value)


@pytest.mark.parametrize("sampling", [
    {}, {"seed": 3}, {"temperature": 0.7, "seed": 3, "top_k": 1}, {"temperature": 0.7},
    {"repetition_penalty": 1.2}, {"logit_bias": ((5, 2.0),)}, {"logprobs": 2}, {"min_tokens": 4},
    {"stop": ("x",)},
])
def test_what_continues_exactly_is_allowed(sampling: dict[str, Any]) -> None:
    """Greedy (a seed without randomness is no state), unseeded sampling (nothing to equal), a repetition penalty
    after token ids (vLLM counts prompt and output ids alike), per-step settings."""
    r = request(**sampling)
    assert refusal(r) is None
    check_resumable(r)


def test_resumed_requests_reduce_min_tokens_and_leave_stop_strings_and_text_to_the_engine() -> None:
    assert sampling_overrides(request(resumed=(), min_tokens=5, stop=("x",))) == {}
    assert sampling_overrides(request(resumed=(1, 2), min_tokens=5, stop=("x",))) == {
        "min_tokens": 3, "stop": None, "detokenize": False}
    assert sampling_overrides(request(resumed=(1, 2, 3), min_tokens=2))["min_tokens"] == 0


def test_the_detokenizer_is_built_for_the_request_as_the_first_worker_ran_it() -> None:
    r = request(resumed=(1, 2), stop=("a", "bc"), min_tokens=3)
    seen: list[Any] = []

    def build(tokenizer: Any, req: Any) -> CharDetok:
        seen.append((tokenizer, req))
        return CharDetok(req.sampling_params.stop, req.sampling_params.min_tokens)

    text = resumed_detokenizer("tok", r, [9, 9], None, build=build)
    tokenizer, req = seen[0]
    assert tokenizer == "tok" and req.prompt_token_ids == [9, 9] and req.prompt_embeds is None
    assert req.sampling_params.stop == ["a", "bc"] and req.sampling_params.min_tokens == 3
    assert not req.sampling_params.include_stop_str_in_output and req.sampling_params.skip_special_tokens
    assert isinstance(text, ResumedText) and text.step((3,), None)[1] == (3,)
    assert detokenizer_request(request(), None, "rows").prompt_token_ids is None


def _whole(stop: list[str] | None, ids: list[int]) -> str:
    d = CharDetok(stop)
    d.update(ids, False)
    return d.get_next_output_text(True, True)


@pytest.mark.parametrize("cut", [1, 2, 3, 4])
def test_held_back_text_comes_first_and_a_stop_string_across_the_cut_ends_the_sequence(cut: int) -> None:
    """The undisturbed run stops at " the"; whatever the cut, before + after is its text, with no repeat."""
    ids, stop = [1, 2, 3, 4, 5, 6], [" on the"]
    first = CharDetok(stop)  # the lost worker, streaming one token a step
    before = ""
    for t in ids[:cut]:
        first.update([t], False)
        before += first.get_next_output_text(False, True)
    text = ResumedText(CharDetok(stop), ids[:cut])
    assert not text.stopped_early
    after, kept, finish = "", [], None
    for t in ids[cut:]:
        chunk, got, finish = text.step((t,), None)
        after += chunk
        kept += got
        if finish is not None:
            break
    assert finish is FinishReason.STOP and kept == ids[cut:5]  # ends at the token completing the stop string
    assert before + after == _whole(stop, ids) == "The cat sat"


def test_an_end_of_sequence_token_is_kept_but_not_detokenized_and_the_rest_is_released() -> None:
    text = ResumedText(CharDetok(["zzzz"]), [1, 2])  # the client got "The " ("cat" held: 3 characters)
    assert text.step((3,), None) == ("cat ", (3,), None)
    # vLLM stopped on its end-of-sequence token (here id 7): kept as an id, not as text; the held text released
    assert text.step((7,), FinishReason.STOP) == ("sat", (7,), FinishReason.STOP)


def test_resumed_tokens_already_ending_in_a_stop_string_end_at_once() -> None:
    text = ResumedText(CharDetok([" sat"]), [1, 2, 3])
    assert text.stopped_early and text.held() == "cat"  # the client got "The "; the stop string is cut off
