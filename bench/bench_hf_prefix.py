"""The hf engine's prefix cache, measured in process on the real default model: requests that share a long prefix
(``--prefix`` tokens) and each end with their own question, ``max_tokens: 1`` (so the time to the first token is the
prefill), run with the cache on and off alternately on one engine (the cache's capacity set to 0 for the off runs:
same weights, same threads), medians of ``--trials`` each.

Also, in the same run: a cold request with the cache on (nothing cached: the full prefill plus storing its blocks)
against the same request with it off — what the cache costs when it misses — and the greedy text of an 8-token
completion of a shared-prefix prompt with the cache warm against off (must be equal).

Last line: ``hf_prefix: ttft_on_over_off=X cold_on_over_off=Y prefix_tokens=N same_text=B``.

    python bench/bench_hf_prefix.py [--prefix 1500] [--trials 7] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedmesh.core.sampling import SamplingParams  # noqa: E402
from embedmesh.services.worker.engines.base import GenerationRequest, TokenSegment  # noqa: E402

WORDS = ("river bridge market harbour castle tower garden street valley mountain forest village school library "
         "station museum theatre church square palace").split()
QUESTIONS = ["What is the oldest building?", "Which river runs through it?", "How many bridges are there?",
             "Who founded the market?", "When was the tower built?", "Where is the harbour?",
             "Why is the square famous?", "Which garden is largest?", "What does the museum hold?",
             "How old is the library?", "Who lives in the palace?", "Where does the street lead?"]
_ids = iter(range(10**9))


def _prefix(tokenizer: Any, n: int) -> tuple[int, ...]:
    import random

    rnd = random.Random(7)
    text = " ".join(rnd.choice(WORDS) for _ in range(n))
    return tuple(tokenizer(text).input_ids[:n])


async def _ttft(engine: Any, ids: tuple[int, ...], n: int = 1) -> tuple[float, tuple[int, ...]]:
    req = GenerationRequest(f"b{next(_ids)}", [TokenSegment(ids)], SamplingParams(max_tokens=n, temperature=0.0))
    t0 = time.perf_counter()
    first = None
    out: list[int] = []
    async for d in engine.generate(req):
        if first is None:
            first = time.perf_counter() - t0
        out.extend(d.token_ids)
    while engine.progress().busy:  # the step that stores blocks after the last token is over
        await asyncio.sleep(0.005)
    return first or 0.0, tuple(out)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=0, help="shared prefix tokens (default 1500, --quick 1000)")
    ap.add_argument("--trials", type=int, default=0, help="requests per mode (default 7, --quick 3)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a small shared machine a second thread mostly waits for a "
                         "core, which slows small passes like a cached prompt's suffix tenfold)")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    prefix_len = a.prefix or (1000 if a.quick else 1500)
    trials = a.trials or (3 if a.quick else 7)

    from embedmesh.models import ensure_default_model
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    engine = HFEngine(HFEngineConfig(ensure_default_model(), "smol", max_batch_size=4, threads=a.threads, block_size=16,
                                     prefix_cache_blocks=512))
    await engine.start()
    cache = engine.prefix_cache
    try:
        prefix = _prefix(engine.tokenizer, prefix_len)
        prompts = [prefix + tuple(engine.tokenizer(" " + q).input_ids) for q in QUESTIONS]
        await _ttft(engine, prompts[-1][:64])  # warm up the model
        # A miss with the cache on (full prefill + storing) against off, alternating, fresh cache each time.
        cold_on, cold_off = [], []
        for i in range(trials):
            cache.capacity = 512
            await engine.clear_kv_blocks()
            cold_on.append((await _ttft(engine, prompts[i % len(prompts)]))[0])
            cache.capacity = 0
            cold_off.append((await _ttft(engine, prompts[i % len(prompts)]))[0])
        # Hits: the shared prefix cached, a new question each time.
        cache.capacity = 512
        await engine.clear_kv_blocks()
        await _ttft(engine, prefix)
        on, off = [], []
        for i in range(trials):
            prompt = prompts[i % len(prompts)]
            cache.capacity = 0
            off.append((await _ttft(engine, prompt))[0])
            cache.capacity = 512
            await engine.clear_kv_blocks()
            await _ttft(engine, prefix)  # only the prefix is cached, never this question
            on.append((await _ttft(engine, prompt))[0])
        cache.capacity = 0
        _, text_off = await _ttft(engine, prompts[0], 8)
        cache.capacity = 512
        await engine.clear_kv_blocks()
        await _ttft(engine, prefix)
        _, text_on = await _ttft(engine, prompts[0], 8)
        hit = cache.counters["hit_tokens"]
    finally:
        await engine.shutdown()

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1000:.0f}"

    print(f"hf prefix cache, SmolLM2-135M float32 in process, {a.threads} torch thread(s), block 16, a "
          f"{len(prefix)}-token shared prefix + a {len(prompts[0]) - len(prefix)}-token question, max_tokens 1, "
          f"{trials} requests per mode, alternating")
    print()
    print("| mode | TTFT median ms | positions prefilled |")
    print("|---|---|---|")
    print(f"| cache off | {ms(off)} | {len(prompts[0])} |")
    print(f"| cache on, prefix cached | {ms(on)} | {len(prompts[0]) - len(prefix) // 16 * 16} |")
    print(f"| cache off, cold | {ms(cold_off)} | {len(prompts[0])} |")
    print(f"| cache on, cold (prefill + store) | {ms(cold_on)} | {len(prompts[0])} |")
    print()
    ratio = statistics.median(on) / statistics.median(off)
    cold = statistics.median(cold_on) / statistics.median(cold_off)
    same = text_on == text_off
    print(f"positions found in the cache over the run: {hit}; 8-token greedy text on == off: {same}")
    print(f"hf_prefix: ttft_on_over_off={ratio:.2f} cold_on_over_off={cold:.2f} prefix_tokens={len(prefix)} "
          f"same_text={same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
