"""Request models at the REST edge: msgspec vs pydantic v2 vs the hand parser they replaced (issue #17).

Two bodies, each taken the way the gateway takes it (``Gateway.read_json``: ``embeds_json.loads`` for a big body,
else ``orjson.loads``), then checked and turned into the gRPC message:

* ``chat``: a typical chat request (system + user message, max_tokens, temperature, top_p, stop, seed, stream);
* ``completion 1 MiB``: a completion whose ``prompt_embeds`` is a 1 MiB base64 string (the fast path decodes it
  while parsing).

Rows (median microseconds per request over ``--rounds`` rounds of ``--n`` requests):

* ``hand parser``: today's ``translate.py`` before the models (read from git, ``--baseline``), parse + checks +
  protobuf;
* ``msgspec models``: this tree's ``translate.py`` (``requests.py`` models), parse + checks + protobuf;
* ``msgspec check only`` / ``pydantic check only``: only ``requests.parse`` vs ``model_validate`` of pydantic
  models with the same fields, types and ranges (strict, no custom validators: a lower bound for pydantic, which
  would also need the wording hooks). The protobuf step after either is the same code.

    .venv/bin/python bench/bench_request_models.py
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "7ea8987"
"""The last commit with the hand parser (translate.py before requests.py)."""

CHAT = {"model": "m", "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                   {"role": "user", "content": "Hello there, how are you today? Tell me a story."}],
        "max_tokens": 128, "temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"], "seed": 1, "stream": True}


def completion_1mib() -> dict[str, Any]:
    data = base64.b64encode(os.urandom(3 * (1 << 20) // 4)).decode()  # 1 MiB of base64
    return {"model": "m", "prompt": "", "prompt_embeds": data, "max_tokens": 16, "temperature": 0}


def load_baseline(commit: str) -> Any:
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:gateway/embedmesh/gateway/translate.py"],
                          check=True, capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix="_translate.py", delete=False) as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("hand_translate", f.name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    os.unlink(f.name)
    return module


def pydantic_models() -> tuple[type, type]:
    """pydantic v2 models with the fields, types and ranges of ``requests.ChatRequest``/``CompletionRequest``."""
    from pydantic import BaseModel, ConfigDict, Field

    from embedmesh.core import sampling as s

    u32 = 2**32 - 1
    Int = Annotated[int, Field(ge=-1, le=u32)]  # noqa: N806 - type aliases
    Num = Annotated[float, Field(allow_inf_nan=False)]  # noqa: N806

    class Base(BaseModel):
        model_config = ConfigDict(strict=True, extra="forbid")
        model: Annotated[str, Field(min_length=1)]
        store: Any = None
        min_p: Any = None
        n: Annotated[int, Field(ge=1, le=u32)] | None = None
        stream: bool | None = None
        stream_options: dict[str, bool] | None = None
        temperature: Annotated[float, Field(ge=s.TEMPERATURE_MIN, le=s.TEMPERATURE_MAX)] | None = None
        top_p: Annotated[float, Field(gt=0, le=s.TOP_P_MAX)] | None = None
        top_k: Int | None = None
        seed: Annotated[int, Field(ge=s.SEED_MIN, le=s.SEED_MAX)] | None = None
        stop: str | Annotated[list[str], Field(max_length=s.MAX_STOP)] | None = None
        ignore_eos: bool | None = None
        presence_penalty: Annotated[float, Field(ge=s.PENALTY_MIN, le=s.PENALTY_MAX)] | None = None
        frequency_penalty: Annotated[float, Field(ge=s.PENALTY_MIN, le=s.PENALTY_MAX)] | None = None
        repetition_penalty: Annotated[float, Field(gt=0, le=s.REPETITION_PENALTY_MAX)] | None = None
        min_tokens: Annotated[int, Field(ge=0, le=u32)] | None = None
        logit_bias: dict[str, Num] | None = None
        response_format: Any = None
        structured_outputs: Any = None
        guided_json: Any = None
        guided_regex: Any = None
        guided_choice: Any = None
        guided_grammar: Any = None
        user: Any = None
        metadata: Any = None
        service_tier: Any = None
        parallel_tool_calls: Any = None

    class Completion(Base):
        suffix: Any = None
        best_of: Any = None
        max_tokens: Annotated[int, Field(ge=0, le=u32)] | None = None
        echo: bool | None = None
        logprobs: Annotated[int, Field(ge=0, le=s.MAX_LOGPROBS)] | None = None
        prompt_logprobs: Annotated[int, Field(ge=0, le=s.MAX_LOGPROBS)] | None = None
        prompt_embeds: Any = None
        prompt_embeds_prefix: Any = None
        prompt: Any = None

    class TextPart(BaseModel):
        model_config = ConfigDict(strict=True)
        type: Literal["text"]
        text: str

    class EmbedsPart(BaseModel):
        model_config = ConfigDict(strict=True)
        type: Literal["prompt_embeds"]
        id: Any = None
        data: Any = None

    class Message(BaseModel):
        model_config = ConfigDict(strict=True)
        role: str
        name: str | None = None
        tool_calls: Any = None
        tool_call_id: Any = None
        content: str | list[Annotated[TextPart | EmbedsPart, Field(discriminator="type")]] | None = None

    class Function(BaseModel):
        model_config = ConfigDict(strict=True)
        name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
        description: str = ""
        parameters: Any = None
        strict: bool | None = None

    class Tool(BaseModel):
        model_config = ConfigDict(strict=True)
        type: Literal["function"] = "function"
        function: Function

    class Chat(Base):
        functions: Any = None
        function_call: Any = None
        audio: Any = None
        modalities: Any = None
        prediction: Any = None
        web_search_options: Any = None
        max_completion_tokens: Annotated[int, Field(ge=1, le=u32)] | None = None
        max_tokens: Any = None
        logprobs: bool | None = None
        top_logprobs: Annotated[int, Field(ge=0, le=s.MAX_LOGPROBS)] | None = None
        tools: list[Tool] | None = None
        tool_choice: Any = None
        messages: Annotated[list[Message], Field(min_length=1)]

    return Chat, Completion


def median_us(fn: Callable[[], Any], n: int, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="requests per round (chat; the 1 MiB case uses n/20)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--baseline", default=BASELINE, help="git commit whose translate.py is the hand parser")
    args = ap.parse_args()

    from embedmesh.gateway import embeds_json, requests, translate

    hand = load_baseline(args.baseline)
    p_chat, p_completion = pydantic_models()
    cases = [("chat", orjson.dumps(CHAT), embeds_json.chat_slots, hand.chat_params, translate.chat_params,
              requests.ChatRequest, p_chat, args.n),
             ("completion 1 MiB", orjson.dumps(completion_1mib()), embeds_json.completion_slots,
              hand.completion_params, translate.completion_params, requests.CompletionRequest, p_completion,
              max(1, args.n // 20))]
    rows: list[tuple[str, str, float]] = []
    for name, raw, slots, hand_fn, new_fn, model, p_model, n in cases:

        def read(raw: bytes = raw, slots: Any = slots) -> Any:  # Gateway.read_json's parse
            body = embeds_json.loads(raw, slots)
            return body if body is not None else orjson.loads(raw)

        def hand_path(read: Any = read, fn: Any = hand_fn) -> Any:
            return fn(read(), [])

        def new_path(read: Any = read, fn: Any = new_fn) -> Any:
            return fn(read(), [])

        # The same proto either way (the models replace the checks, not the message).
        assert hand_path().SerializeToString(deterministic=True) == new_path().SerializeToString(deterministic=True)
        rows.append((name, "JSON parse only (read_json)", median_us(read, n, args.rounds)))
        rows.append((name, "hand parser (before): parse+check+proto", median_us(hand_path, n, args.rounds)))
        rows.append((name, "msgspec models (now): parse+check+proto", median_us(new_path, n, args.rounds)))
        rows.append((name, "msgspec: requests.parse only", median_us(
            lambda read=read, model=model: requests.parse(model, read()), n, args.rounds)))
        rows.append((name, "pydantic v2: model_validate only", median_us(
            lambda read=read, p_model=p_model: p_model.model_validate(read()), n, args.rounds)))

    import msgspec
    import pydantic

    print(f"python {sys.version.split()[0]}, msgspec {msgspec.__version__}, pydantic {pydantic.VERSION}; "
          f"median of {args.rounds} rounds; check-only rows include the JSON parse")
    print(f"{'case':<18} {'path':<44} {'us/request':>10}")
    for case, path, us in rows:
        print(f"{case:<18} {path:<44} {us:>10.1f}")


if __name__ == "__main__":
    main()
