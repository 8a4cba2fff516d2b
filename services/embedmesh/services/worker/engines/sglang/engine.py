"""The ``sglang`` engine: an adapter over SGLang's offline ``Engine`` (sglang==0.5.23, in its own venv built by
``scripts/sglang_venv.sh``; the worker runs there with the source tree on PYTHONPATH).

Two tasks, one per worker:
- ``embed`` (runs on this CPU): ``is_embedding=True``, ``device="cpu"``, ``disable_radix_cache=True`` (with the
  radix cache on, a repeated input is served from cached prefix states and comes back as a wrong vector), a bounded
  ``max_total_tokens`` (SGLang otherwise sizes its KV pool from free memory). Inputs are tokenized and checked here
  with the shared rules of ``engines/embed_inputs.py`` (errors and token counts match the hf worker) and sent as
  ``input_ids`` (so SGLang runs without a tokenizer, ``skip_tokenizer_init``, and answers without the detokenizer
  hop); SGLang's scheduler batches concurrent requests itself and sleeps while idle (``sleep_on_idle``: by default it
  busy-polls a whole core, which on a small CPU host starves the mesh and its own OpenMP threads). Note: SGLang
  pools BERT models with the [CLS] token and L2-normalises (``sglang/srt/models/bert.py``), whereas
  all-MiniLM-L6-v2 was trained with mean pooling: its vectors are close to, but not equal to, the hf worker's (the
  sglang e2e test measures the cosine).
- ``generate`` (GPU deployments; not runnable on this CPU): requests become ``GenerateReqInput`` objects — token-only
  prompts as ``input_ids``, prompts with embeddings as ``input_embeds`` for the whole prompt (token segments are
  looked up in the model's input embedding table, so mixed prompts work) — streamed with
  ``incremental_streaming_output=True`` and converted to ``GenerationDelta``. Tested at that boundary only (the
  request objects built and a scripted tokenizer manager), see tests/unit/services/worker/engines/sglang/test_engine.py.
- LoRA (``generate``, with ``--enable-lora``): SGLang is started with ``enable_lora`` (and a maximum rank, the
  adapters per batch, every supported target module), adapters load and unload at run time through its tokenizer
  manager (``LoadLoRAAdapterReqInput`` / ``UnloadLoRAAdapterReqInput``; SGLang's unload waits for the requests
  using the adapter), and a request names its adapter as ``lora_path`` (SGLang resolves a loaded adapter's name).
  SGLang batches requests of different adapters together (``max_loras_per_batch``).

Spawn guard: SGLang starts its scheduler and detokenizer with multiprocessing's ``spawn`` method, which re-imports
the parent's ``__main__``; the worker's ``main.py`` keeps its start-up under ``if __name__ == "__main__"``, and any
script that builds this engine must do the same.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.core.sampling import SamplingParams
from embedmesh.core.tensors import BF16_STORAGE, bf16_to_f32
from embedmesh.services.worker.engines.base import (
    EmbedsSegment,
    Engine,
    EngineStats,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    Segment,
    TokenLogprob,
    TokenSegment,
    load_once,
)
from embedmesh.services.worker.engines.embed_inputs import InputEncoder, check_dimensions, read_pooling_spec, shorten

__all__ = [
    "SGLangConfig",
    "SGLangEngine",
    "engine_kwargs",
    "sampling_to_sglang",
    "prompt_fields",
    "generate_request",
    "delta_from_output",
]

log = get_logger(__name__)

TASKS = ("embed", "generate")


@dataclass(frozen=True)
class SGLangConfig:
    model_path: Path
    """Local Hugging Face folder (a sentence-transformers folder for embeddings)."""
    served_name: str
    """Name clients pass as ``model``."""
    task: str = "embed"
    """"embed" (CPU or GPU) or "generate" (GPU only)."""
    device: str = "cpu"
    """SGLang device: "cpu" here, "cuda" on GPU hosts."""
    dtype: str = "float32"
    """Model dtype inside SGLang ("float32" keeps MiniLM's vectors comparable with the hf worker's)."""
    max_total_tokens: int = 8192
    """Size of SGLang's token pool; bounded, or SGLang sizes it from free memory."""
    max_running_requests: int = 64
    """Most sequences SGLang runs at once."""
    supports_dimensions: bool = False
    """Allow shortened vectors (Matryoshka-trained models only)."""
    log_level: str = "error"
    """SGLang's own log level."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More ``ServerArgs`` fields, passed through as given (e.g. ``tp_size`` on GPU hosts)."""
    enable_lora: bool = False
    """Generation: allow LoRA adapters (LoadLoraAdapter, ``--lora-modules``)."""
    max_lora_rank: int = 64
    """Largest adapter rank SGLang reserves room for."""
    max_loras_per_batch: int = 4
    """Adapters in one running batch (SGLang's own limit; the base model counts as one)."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.max_total_tokens < 16:
            raise ValueError("max_total_tokens must be >= 16")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.enable_lora and self.task != "generate":
            raise ValueError("enable_lora needs task 'generate'")
        if self.max_lora_rank < 1 or self.max_loras_per_batch < 1:
            raise ValueError("max_lora_rank and max_loras_per_batch must be >= 1")


def engine_kwargs(config: SGLangConfig, context_length: int | None) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine`` (its ``ServerArgs``)."""
    kw: dict[str, Any] = {
        "model_path": str(config.model_path),
        "tokenizer_path": str(config.model_path),
        "served_model_name": config.served_name,
        "device": config.device,
        "dtype": config.dtype,
        "max_total_tokens": config.max_total_tokens,
        "max_running_requests": config.max_running_requests,
        # Embeddings: a cached prefix gives a wrong vector for a repeated input. Generation with input_embeds
        # has no token ids to key a prefix on either.
        "disable_radix_cache": True,
        "log_level": config.log_level,
        "random_seed": 0,
    }
    if context_length:
        kw["context_length"] = context_length
    if config.task == "embed":
        kw["is_embedding"] = True
        # Idle, SGLang's scheduler polls its sockets in a busy loop: a whole core, all the time. On a small CPU host
        # that core is taken from the mesh's other processes and from any other engine's OpenMP threads (an idle
        # engine beside a working one cut the working one's rate ~3.5x on 2 cores). sleep_on_idle blocks it in zmq
        # poll instead; the request itself wakes it.
        kw["sleep_on_idle"] = True
        # Inputs reach SGLang as checked token ids (see ``SGLangEngine.embed``), so it needs no tokenizer, and its
        # scheduler then sends results straight back to us instead of through the detokenizer process.
        kw["skip_tokenizer_init"] = True
    else:
        kw["incremental_streaming_output"] = True  # each streamed chunk carries only its new tokens
    if config.enable_lora:
        kw.update(enable_lora=True, max_lora_rank=config.max_lora_rank,
                  max_loras_per_batch=config.max_loras_per_batch, lora_target_modules=["all"])
    kw.update(config.extra)
    return kw


# --- generation adapter (GPU) ---------------------------------------------------------------------------------
def sampling_to_sglang(s: SamplingParams) -> dict[str, Any]:
    """Our resolved sampling controls as SGLang's ``sampling_params`` dict."""
    out: dict[str, Any] = {
        "max_new_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,  # -1: all tokens
        "ignore_eos": s.ignore_eos,
    }
    if s.stop:
        out["stop"] = list(s.stop)
    if s.seed is not None:
        out["sampling_seed"] = s.seed
    if s.presence_penalty:
        out["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        out["frequency_penalty"] = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        out["repetition_penalty"] = s.repetition_penalty
    if s.min_tokens:
        out["min_new_tokens"] = s.min_tokens
    if s.logit_bias:
        out["logit_bias"] = {str(t): b for t, b in s.logit_bias}
    st = s.structured
    if st is not None:
        # SGLang's grammar backend (xgrammar by default) takes a JSON schema, a regex or an EBNF grammar.
        if st.kind == "json_schema":
            out["json_schema"] = str(st.value)
        elif st.kind == "json_object":
            out["json_schema"] = '{"type": "object"}'
        elif st.kind == "choice":
            out["regex"] = "(" + "|".join(re.escape(v) for v in st.value) + ")"
        elif st.kind == "regex":
            out["regex"] = str(st.value)
        else:
            out["ebnf"] = str(st.value)
    return out


def logprob_fields(s: SamplingParams) -> dict[str, Any]:
    """``GenerateReqInput`` fields asking SGLang for log-probabilities (of the output, and of the prompt from its
    first token when prompt log-probabilities are wanted)."""
    if s.logprobs is None and s.prompt_logprobs is None:
        return {}
    k = max(s.logprobs or 0, s.prompt_logprobs or 0)
    out: dict[str, Any] = {"return_logprob": True, "top_logprobs_num": k}
    out["logprob_start_len"] = 0 if s.prompt_logprobs is not None else -1
    return out


def _rows_f32(seg: EmbedsSegment) -> np.ndarray:
    rows = seg.rows
    if rows.dtype == BF16_STORAGE:
        return bf16_to_f32(rows)
    return rows.astype(np.float32, copy=False)


def prompt_fields(segments: Sequence[Segment],
                  embed_tokens: Callable[[Sequence[int]], np.ndarray] | None) -> dict[str, Any]:
    """The prompt part of a ``GenerateReqInput``: ``input_ids`` for token-only prompts, else ``input_embeds`` for
    the whole prompt in order (token segments looked up with ``embed_tokens``: ids -> (n, hidden) rows)."""
    if all(isinstance(s, TokenSegment) for s in segments):
        return {"input_ids": [t for s in segments for t in s.ids]}  # type: ignore[union-attr]
    parts: list[np.ndarray] = []
    for s in segments:
        if isinstance(s, EmbedsSegment):
            parts.append(_rows_f32(s))
        else:
            if embed_tokens is None:
                raise InvalidArgument("prompt: this worker cannot mix token ids with embeddings (no embedding "
                                      "table)", field="prompt", reason="MIXED_PROMPT_UNSUPPORTED")
            parts.append(np.asarray(embed_tokens(s.ids), np.float32))
    return {"input_embeds": np.concatenate(parts).tolist()}


def generate_request(request: GenerationRequest,
                     embed_tokens: Callable[[Sequence[int]], np.ndarray] | None) -> Any:
    """Build SGLang's ``GenerateReqInput`` for one sequence (streamed)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    lora = {"lora_path": request.lora_adapter} if request.lora_adapter else {}
    return GenerateReqInput(rid=request.request_id, sampling_params=sampling_to_sglang(request.sampling),
                            stream=True, **logprob_fields(request.sampling),
                            **prompt_fields(request.segments, embed_tokens), **lora)


_FINISH = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP, "abort": FinishReason.ABORT}


def delta_from_output(chunk: dict[str, Any]) -> GenerationDelta:
    """One incremental SGLang output chunk as our delta."""
    meta = chunk.get("meta_info") or {}
    finish = meta.get("finish_reason")
    reason = None
    if isinstance(finish, dict):
        reason = _FINISH.get(str(finish.get("type")), FinishReason.STOP)
    elif finish:
        reason = _FINISH.get(str(finish), FinishReason.STOP)
    ids = tuple(chunk.get("output_ids") or ())
    lps = _sglang_logprobs(meta.get("output_token_logprobs"), meta.get("output_top_logprobs"), len(ids))
    prompt = meta.get("input_token_logprobs")
    prompt_lps = _sglang_logprobs(prompt, meta.get("input_top_logprobs"), len(prompt)) if prompt else None
    return GenerationDelta(text=chunk.get("text") or "", token_ids=ids,
                           completion_tokens=int(meta.get("completion_tokens", 0)), finish_reason=reason,
                           logprobs=lps, prompt_logprobs=prompt_lps)


def _sglang_logprobs(chosen: Any, tops: Any, n: int) -> tuple[TokenLogprob, ...]:
    """SGLang's (logprob, token id, text) triples (the last ``n``: this chunk's) -> TokenLogprob, top k + chosen."""
    if not chosen:
        return ()
    chosen = list(chosen)[-n:] if n else []
    tops = list(tops or [])[-n:] if n else []
    out = []
    for i, (value, token, *_rest) in enumerate(chosen):
        alts = [(int(t), float(v)) for v, t, *_ in (tops[i] if i < len(tops) and tops[i] else [])]
        if value is not None and all(t != token for t, _ in alts):
            alts.append((int(token), float(value)))
        out.append(TokenLogprob(int(token), None if value is None else float(value), tuple(alts)))
    return tuple(out)


class _EmbeddingTable:
    """The model's input embedding matrix, read from its safetensors (for mixed token + embeddings prompts)."""

    _NAMES = ("embed_tokens.weight", "word_embeddings.weight", "wte.weight")

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.matrix: np.ndarray | None = None
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                name = next((k for k in f.keys() if k.endswith(self._NAMES)), None)  # noqa: SIM118
                if name is not None:
                    self.matrix = f.get_tensor(name).float().numpy()
                    return

    def __call__(self, ids: Sequence[int]) -> np.ndarray:
        assert self.matrix is not None
        return self.matrix[np.asarray(ids, np.int64)]


# --- the engine -----------------------------------------------------------------------------------------------
class SGLangEngine(Engine):
    """A worker engine over ``sglang.Engine`` (started in this process; SGLang spawns its own scheduler)."""

    def __init__(self, config: SGLangConfig) -> None:
        self.config = config
        self._sgl: Any = None
        self._info: ModelInfo | None = None
        self._encoder: InputEncoder | None = None
        self._embed_tokens: Callable[[Sequence[int]], np.ndarray] | None = None
        self._stats = EngineStats()
        self._running: set[str] = set()
        self._loras: dict[str, str] = {}
        self._lora_loading: dict[str, asyncio.Future[bool]] = {}

    async def start(self) -> None:
        folder = self.config.model_path
        cfg = json.loads((folder / "config.json").read_text())
        from transformers import AutoTokenizer

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, folder)
        hidden = int(cfg["hidden_size"])
        vocab = int(cfg["vocab_size"])
        positions = int(cfg.get("max_position_embeddings", 2048))
        if self.config.task == "embed":
            max_tokens = read_pooling_spec(folder, positions).max_tokens
            self._encoder = InputEncoder(tokenizer, self.config.served_name, vocab, max_tokens)
        else:
            max_tokens = positions
        kwargs = engine_kwargs(self.config, max_tokens)
        loop = asyncio.get_running_loop()
        self._sgl = await asyncio.to_thread(_launch, kwargs)
        _attach_without_signal_handlers(self._sgl, loop)
        if self.config.task == "generate":
            self._embed_tokens = await asyncio.to_thread(_EmbeddingTable, folder)
        self._info = ModelInfo(
            self.config.served_name, "sglang", hidden, max_tokens, self.config.dtype, vocab,
            self.config.max_running_requests, task=self.config.task,
            embedding_size=hidden if self.config.task == "embed" else 0,
            supports_dimensions=self.config.supports_dimensions,
        )
        log.info("sglang engine started", extra={"model": str(folder), "task": self.config.task,
                                                 "device": self.config.device})

    def info(self) -> ModelInfo:
        if self._info is None:
            raise Unavailable("model is still loading", reason="LOADING")
        return self._info

    def stats(self) -> EngineStats:
        self._stats.active_requests = len(self._running)
        return self._stats

    async def shutdown(self) -> None:
        if self._sgl is not None:
            sgl, self._sgl = self._sgl, None
            await asyncio.to_thread(sgl.shutdown)

    async def check_health(self) -> None:
        if self._sgl is None:
            raise Unavailable("sglang engine is not running", reason="ENGINE_STOPPED")

    def _manager(self) -> Any:
        if self._sgl is None:
            raise Unavailable("sglang engine is not running", reason="ENGINE_STOPPED")
        return self._sgl.tokenizer_manager

    # --- embeddings ---------------------------------------------------------------------------------------------
    async def embed(self, inputs: list[str | list[int]],
                    dimensions: int | None = None) -> tuple[np.ndarray, list[int]]:
        info = self.info()
        if info.task != "embed" or self._encoder is None:
            raise InvalidArgument(f"model: {info.model} generates text; pick an embedding model", field="model",
                                  reason="WRONG_TASK")
        check_dimensions(dimensions, info)
        ids = self._encoder.encode(inputs)
        from sglang.srt.managers.io_struct import EmbeddingReqInput

        rid = uuid.uuid4().hex
        if len(ids) == 1:  # SGLang's single-request path: no per-input tasks to gather
            obj = EmbeddingReqInput(input_ids=ids[0], rid=rid)
        else:
            obj = EmbeddingReqInput(input_ids=ids, rid=[f"{rid}-{i}" for i in range(len(ids))])
        self._running.add(rid)
        try:
            results = self._manager().generate_request(obj, None)
            out = await results.__anext__()
            async for _ in results:  # nothing more comes (not streamed): let the generator end now rather than have
                pass  # the event loop's async-generator finalizer close it later
        finally:
            self._running.discard(rid)
        rows = out if isinstance(out, list) else [out]
        vectors = np.asarray([r["embedding"] for r in rows], np.float32)
        self._stats.completed_requests += 1
        return shorten(vectors, dimensions), [len(x) for x in ids]

    # --- generation (GPU) ---------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        info = self.info()
        if info.task != "generate":
            raise InvalidArgument(f"model: {info.model} is an embedding model; use /v1/embeddings", field="model",
                                  reason="WRONG_TASK")
        if request.lora_adapter and request.lora_adapter not in self._loras:
            raise InvalidArgument(f"model: the LoRA adapter {request.lora_adapter!r} is not loaded on this worker",
                                  field="model", reason="LORA_NOT_LOADED")
        obj = generate_request(request, self._embed_tokens)
        manager = self._manager()
        self._running.add(request.request_id)
        finished = False
        try:
            async for chunk in manager.generate_request(obj, None):
                delta = delta_from_output(chunk)
                self._stats.generated_tokens += len(delta.token_ids)
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    self._stats.completed_requests += 1
                    return
        finally:
            self._running.discard(request.request_id)
            if not finished:  # the caller went away: stop the sequence in SGLang too
                manager.abort_request(rid=request.request_id)
                self._stats.aborted_requests += 1

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._running:
            return False
        self._manager().abort_request(rid=request_id)
        return True

    # --- LoRA adapters (generation) -----------------------------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> bool:
        if not self.config.enable_lora:
            from embedmesh.core.errors import FailedPrecondition

            raise FailedPrecondition("LoRA is disabled on this worker; start it with --enable-lora (generation "
                                     "workers only)", reason="LORA_DISABLED")
        if name in self._loras:
            return False

        async def load() -> None:
            from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

            out = await self._manager().load_lora_adapter(LoadLoRAAdapterReqInput(lora_name=name, lora_path=path),
                                                          None)
            if not getattr(out, "success", False):
                raise InvalidArgument(f"path: SGLang could not load the adapter: "
                                      f"{getattr(out, 'error_message', '') or 'unknown error'}", field="path",
                                      reason="ADAPTER_INVALID")
            self._loras[name] = path

        return await load_once(self._lora_loading, name, load)

    async def unload_lora(self, name: str) -> bool:
        if name not in self._loras:
            return False
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        self._loras.pop(name)  # new requests naming it are refused from now; SGLang lets running ones finish
        out = await self._manager().unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name), None)
        if not getattr(out, "success", False):
            log.warning("SGLang refused to unload an adapter", extra={
                "adapter": name, "error": getattr(out, "error_message", "")})
        return True

    async def list_loras(self) -> dict[str, str]:
        if not self.config.enable_lora:
            raise NotImplementedError
        return dict(self._loras)

    def lora_names(self) -> list[str]:
        return list(self._loras)


def _launch(kwargs: dict[str, Any]) -> Any:
    """Start SGLang (loads the model, spawns the scheduler); off the event loop so health checks keep answering."""
    import sglang

    return sglang.Engine(**kwargs)


def _attach_without_signal_handlers(sgl: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Start SGLang's response loop on our event loop but keep our SIGTERM/SIGQUIT handlers.

    SGLang's tokenizer manager installs its own SIGTERM handler on the loop that first serves a request (it kills
    the process tree once requests drain), which would bypass the worker's graceful drain. We start that loop now
    and put back whatever handlers the worker had (asyncio keeps them in ``_signal_handlers``).
    """
    handlers = getattr(loop, "_signal_handlers", None)
    saved = {sig: handlers.get(sig) for sig in (signal.SIGTERM, signal.SIGQUIT)} if handlers is not None else {}
    sgl.tokenizer_manager.auto_create_handle_loop()
    for sig, handle in saved.items():
        if handle is not None:
            loop.add_signal_handler(sig, handle._callback, *handle._args)
        else:
            loop.remove_signal_handler(sig)
