"""``POST /v1/completions``: its body's model and the checks only it has (prompts, prompt embeddings)."""

from __future__ import annotations

from typing import Any

from embedmesh.gateway.requests.fields import (
    UNKNOWN,
    Bool,
    LogitBias,
    Logprobs,
    MaxTokens,
    MinP,
    MinTokens,
    Model_,
    N,
    Penalty,
    RepetitionPenalty,
    Seed,
    Stop,
    Store,
    Stream,
    Suffix,
    Temperature,
    TopK,
    TopP,
    check_max_tokens,
    embeds_source,
    is_int,
    sampling_checks,
    token_ids,
    unsupported,
)
from embedmesh.gateway.requests.model import Model, Refusal

_COMPLETION_UNSUPPORTED = {
    "best_of": unsupported("best_of", lambda v: v not in (None, 1), "is not supported by this server: only 1 is "
                                                                     "accepted (use n)"),
}


def _check_prompt_embeds(obj: Any) -> None:
    """-> a list of sources (decoded bytes, or the message naming an upload), or None."""
    embeds = obj.prompt_embeds
    if embeds == [] and obj.prompt not in (None, "", []):
        embeds = None  # vLLM: an empty list beside a text prompt means no embeddings
    if embeds is None:
        obj.prompt_embeds = None
        return
    items = [embeds] if isinstance(embeds, str | dict) else embeds
    if not isinstance(items, list) or not items:
        raise Refusal("prompt_embeds", "must be a base64 string or a non-empty list of them", "invalid_type")
    single = not isinstance(embeds, list) or len(items) == 1
    obj.prompt_embeds = [embeds_source(item, "prompt_embeds" if single else f"prompt_embeds[{i}]")
                         for i, item in enumerate(items)]


def _check_prefix(obj: Any) -> None:
    if obj.prompt_embeds_prefix is not None:
        obj.prompt_embeds_prefix = embeds_source(obj.prompt_embeds_prefix, "prompt_embeds_prefix")


_PROMPT_SHAPES = "must be a string, a list of strings, a list of token ids or a list of token-id lists"
_IDS = "token ids must be integers in [0, vocabulary size)"


def _check_prompt(obj: Any) -> None:
    """-> (texts, token-id lists). ``prompt=""`` (or only empty strings) beside prompt_embeds is dropped: the openai
    SDK requires a prompt."""
    prompt = obj.prompt
    if prompt is None:
        return
    texts: list[str] = []
    ids: list[list[int]] = []
    if isinstance(prompt, str):
        if prompt or not obj.prompt_embeds:
            texts.append(prompt)
    elif isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            if any(prompt) or not obj.prompt_embeds:
                texts = prompt
        elif all(is_int(p) for p in prompt):
            ids.append(token_ids(prompt, "prompt", _IDS))
        elif all(isinstance(p, list) and all(is_int(t) for t in p) for p in prompt):
            ids = [token_ids(p, "prompt" if len(prompt) == 1 else f"prompt[{i}]", _IDS) for i, p in enumerate(prompt)]
        else:
            raise Refusal("prompt", _PROMPT_SHAPES, "invalid_type")
    else:
        raise Refusal("prompt", _PROMPT_SHAPES, "invalid_type")
    obj.prompt = (texts, ids)


class CompletionRequest(Model, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/completions``. After ``parse``: ``structured_outputs`` is the one output constraint (kind, value)
    or None, ``logit_bias`` {token id: bias}, ``prompt_embeds`` a list of sources or None, ``prompt`` (texts,
    token-id lists)."""

    unknown = UNKNOWN
    model: Model_
    store: Store | None = None
    min_p: MinP | None = None
    suffix: Suffix | None = None
    best_of: Any = None
    n: N | None = None
    stream: Bool | None = None
    stream_options: Stream | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    ignore_eos: Bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MinTokens | None = None
    logit_bias: LogitBias | None = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    echo: Bool | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    prompt_embeds: Any = None
    prompt_embeds_prefix: Any = None
    prompt: Any = None
    user: Any = None
    metadata: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None

    checks = {**_COMPLETION_UNSUPPORTED, "max_tokens": check_max_tokens, **sampling_checks(),
              "prompt_embeds": _check_prompt_embeds, "prompt_embeds_prefix": _check_prefix, "prompt": _check_prompt}
    always = frozenset({"guided_grammar"})

