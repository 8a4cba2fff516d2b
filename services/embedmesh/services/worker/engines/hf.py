"""The embedded default engine: a transformers causal LM on the CPU with continuous batching.

One engine thread owns the model. Between decode steps it admits waiting sequences: they are prefilled together
(left-padded ``inputs_embeds``), and their KV cache is merged into the running batch's cache, so a new request
never waits for the whole batch to finish. Finished or aborted rows leave the batch at once.

Every prompt is prefilled from embeddings: token ids go through the model's own embedding layer first. So a
prompt given as ``embed_tokens(ids)`` and the same prompt given as ids run the identical computation, and greedy
decoding gives the same text.

Batch invariants (kept by ``_merge`` and ``_drop``):
- ``cache`` layers hold (B, heads, T, head_dim); row i of every layer, ``mask[i]`` and ``rows[i]`` are one sequence.
- ``mask[i, t] == 1`` where position t holds a real token of row i; padding is on the left.
- Every row has exactly one sampled token not yet fed to the model (``rows[i].pending``).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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
from embedmesh.services.worker.engines.detok import IncrementalDetokenizer

__all__ = ["HFEngine", "HFEngineConfig"]

log = get_logger(__name__)


@dataclass(frozen=True)
class HFEngineConfig:
    model_path: Path
    """Local Hugging Face folder (config.json, safetensors, tokenizer.json)."""
    served_name: str
    """Name clients pass as ``model``."""
    max_batch_size: int = 8
    """Most sequences decoded together."""
    threads: int = 2
    """torch intra-op threads."""
    dtype: str = "float32"
    """Compute dtype: float32 (exact on CPU), bfloat16 or float16."""


@dataclass(eq=False)
class _Seq:
    request: GenerationRequest
    out: asyncio.Queue[GenerationDelta | BaseException]
    loop: asyncio.AbstractEventLoop
    detok: IncrementalDetokenizer
    generator: Any = None
    generated: list[int] = field(default_factory=list)
    pending: int = -1
    position: int = 0
    aborted: bool = False
    done: bool = False

    def emit(self, item: GenerationDelta | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class HFEngine(Engine):
    """transformers on the CPU; see the module docstring for the batching scheme."""

    def __init__(self, config: HFEngineConfig) -> None:
        self.config = config
        self._inbox: queue.Queue[_Seq | None] = queue.Queue()
        self._by_id: dict[str, _Seq] = {}
        self._stats = EngineStats()
        self._thread: threading.Thread | None = None
        self._info: ModelInfo | None = None
        self._failed: BaseException | None = None

    # --- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(self.config.threads)
        t0 = time.monotonic()
        dtype = getattr(torch, self.config.dtype)
        cfg = AutoConfig.from_pretrained(self.config.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.config.model_path, dtype=dtype).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model_path)
        self.embed = self.model.get_input_embeddings()
        self.torch = torch
        self.dtype = dtype
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else cfg.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        self._info = ModelInfo(
            model=self.config.served_name,
            engine="hf",
            hidden_size=int(cfg.hidden_size),
            max_context_tokens=int(getattr(cfg, "max_position_embeddings", 2048)),
            dtype=self.config.dtype,
            vocab_size=int(self.embed.weight.shape[0]),
            max_batch_size=self.config.max_batch_size,
        )
        seconds = round(time.monotonic() - t0, 2)
        log.info("model loaded", extra={"path": str(self.config.model_path), "seconds": seconds})

    def info(self) -> ModelInfo:
        if self._info is None:
            raise Unavailable("model is still loading")
        return self._info

    def stats(self) -> EngineStats:
        s = self._stats
        s.queued_requests = self._inbox.qsize()
        s.active_requests = len(self._by_id)
        return s

    async def check_health(self) -> None:
        if self._failed is not None:
            raise Unavailable(f"engine thread failed: {self._failed!r}")

    async def shutdown(self) -> None:
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    # --- request side (event loop) ---------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        info = self.info()
        if request.prompt_len == 0:
            raise InvalidArgument("prompt is empty", field="prompt", reason="EMPTY_PROMPT")
        for seg in request.segments:
            if isinstance(seg, TokenSegment) and any(t < 0 or t >= info.vocab_size for t in seg.ids):
                raise InvalidArgument(
                    f"prompt token ids must be in [0, {info.vocab_size})", field="prompt", reason="TOKEN_OUT_OF_RANGE"
                )
            if isinstance(seg, EmbedsSegment) and (seg.rows.ndim != 2 or seg.rows.shape[1] != info.hidden_size):
                raise InvalidArgument(
                    f"prompt_embeds must be (rows, {info.hidden_size})", field="prompt_embeds", reason="BAD_SHAPE"
                )
        if request.prompt_len + request.sampling.max_tokens > info.max_context_tokens:
            raise InvalidArgument(
                f"prompt ({request.prompt_len}) + max_tokens ({request.sampling.max_tokens}) exceeds the context "
                f"of {info.max_context_tokens}",
                field="max_tokens",
                reason="CONTEXT_OVERFLOW",
            )
        if request.request_id in self._by_id:
            raise InvalidArgument(f"request id {request.request_id!r} is already running", field="request_id")
        seq = _Seq(
            request=request,
            out=asyncio.Queue(),
            loop=asyncio.get_running_loop(),
            detok=IncrementalDetokenizer(self.tokenizer, request.sampling.stop),
        )
        self._by_id[request.request_id] = seq
        self._inbox.put(seq)
        try:
            while True:
                item = await seq.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Reached on normal end, on error, and when the caller stops iterating (client gone).
            if not seq.done:
                seq.aborted = True
            self._by_id.pop(request.request_id, None)

    async def abort(self, request_id: str) -> bool:
        seq = self._by_id.get(request_id)
        if seq is None or seq.done:
            return False
        seq.aborted = True
        return True

    # --- engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        torch = self.torch
        rows: list[_Seq] = []
        cache: Any = None
        mask: Any = None
        try:
            with torch.inference_mode():
                while True:
                    incoming = self._take(block=not rows, room=self.config.max_batch_size - len(rows))
                    if incoming is None:
                        return
                    live = [s for s in incoming if not self._abort_if_needed(s)]
                    if live:
                        cache, mask, rows = self._admit(live, cache, mask, rows)
                    if rows:
                        cache, mask, rows = self._drop_finished(cache, mask, rows)
                    if rows:
                        self._stats.max_batch_seen = max(self._stats.max_batch_seen, len(rows))
                        cache, mask = self._decode_step(cache, mask, rows)
                        cache, mask, rows = self._drop_finished(cache, mask, rows)
        except BaseException as e:  # noqa: BLE001 - surface to every waiting request, then stop
            self._failed = e
            log.exception("engine thread failed")
            for s in rows:
                s.emit(Unavailable("engine failed; the worker must be restarted"))

    def _take(self, block: bool, room: int) -> list[_Seq] | None:
        out: list[_Seq] = []
        if room <= 0:
            return out
        try:
            first = self._inbox.get(block=block, timeout=None)
        except queue.Empty:
            return out
        if first is None:
            return None
        out.append(first)
        while len(out) < room:
            try:
                nxt = self._inbox.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._inbox.put(None)
                break
            out.append(nxt)
        return out

    def _abort_if_needed(self, s: _Seq) -> bool:
        if s.aborted and not s.done:
            s.done = True
            self._stats.aborted_requests += 1
            s.emit(GenerationDelta("", (), len(s.generated), FinishReason.ABORT))
            return True
        return s.done

    def _prompt_embeds(self, s: _Seq) -> Any:
        torch = self.torch
        parts = []
        for seg in s.request.segments:
            if isinstance(seg, TokenSegment):
                ids = torch.tensor(seg.ids, dtype=torch.long)
                parts.append(self.embed(ids))
            else:
                rows = seg.rows
                if rows.dtype == np.uint16:  # bf16 bits
                    t = torch.from_numpy(rows.astype(np.int16, copy=True)).view(torch.bfloat16)
                else:
                    t = torch.from_numpy(np.array(rows, copy=True))
                parts.append(t.to(self.dtype))
        return torch.cat(parts, dim=0)

    def _admit(self, new: list[_Seq], cache: Any, mask: Any, rows: list[_Seq]) -> tuple[Any, Any, list[_Seq]]:
        """Prefill ``new`` together and merge them into the running batch."""
        torch = self.torch
        from transformers import DynamicCache

        embeds = [self._prompt_embeds(s) for s in new]
        length = max(e.shape[0] for e in embeds)
        hidden = embeds[0].shape[1]
        batch = torch.zeros(len(new), length, hidden, dtype=self.dtype)
        new_mask = torch.zeros(len(new), length, dtype=torch.long)
        for i, e in enumerate(embeds):
            batch[i, length - e.shape[0]:] = e
            new_mask[i, length - e.shape[0]:] = 1
        positions = (new_mask.cumsum(-1) - 1).clamp(min=0)
        new_cache = DynamicCache()
        out = self.model(
            inputs_embeds=batch, attention_mask=new_mask, position_ids=positions, past_key_values=new_cache,
            use_cache=True, logits_to_keep=1,
        )
        logits = out.logits[:, -1, :].float()
        for i, s in enumerate(new):
            s.position = embeds[i].shape[0]
            if s.request.sampling.seed is not None:
                s.generator = torch.Generator().manual_seed(int(s.request.sampling.seed))
            else:
                s.generator = torch.Generator()
                s.generator.seed()
            self._accept(s, self._sample(logits[i], s))
        if cache is None or not rows:
            return new_cache, new_mask, list(new)
        return self._merge(cache, mask, new_cache, new_mask), self._cat_mask(mask, new_mask), rows + list(new)

    def _cat_mask(self, a: Any, b: Any) -> Any:
        torch = self.torch
        t = max(a.shape[1], b.shape[1])
        pad = lambda m: torch.nn.functional.pad(m, (t - m.shape[1], 0))  # noqa: E731
        return torch.cat([pad(a), pad(b)], dim=0)

    def _merge(self, cache: Any, mask: Any, new_cache: Any, new_mask: Any) -> Any:
        torch = self.torch
        t = max(mask.shape[1], new_mask.shape[1])
        for old_layer, new_layer in zip(cache.layers, new_cache.layers, strict=True):
            for name in ("keys", "values"):
                a, b = getattr(old_layer, name), getattr(new_layer, name)
                a = torch.nn.functional.pad(a, (0, 0, t - a.shape[2], 0))
                b = torch.nn.functional.pad(b, (0, 0, t - b.shape[2], 0))
                setattr(old_layer, name, torch.cat([a, b], dim=0))
        return cache

    def _decode_step(self, cache: Any, mask: Any, rows: list[_Seq]) -> tuple[Any, Any]:
        torch = self.torch
        ids = torch.tensor([[s.pending] for s in rows], dtype=torch.long)
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
        positions = torch.tensor([[s.position] for s in rows], dtype=torch.long)
        out = self.model(
            inputs_embeds=self.embed(ids), attention_mask=mask, position_ids=positions, past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1, :].float()
        for i, s in enumerate(rows):
            s.position += 1
            if s.done or s.aborted:
                continue
            self._accept(s, self._sample(logits[i], s))
        return cache, mask

    def _drop_finished(self, cache: Any, mask: Any, rows: list[_Seq]) -> tuple[Any, Any, list[_Seq]]:
        torch = self.torch
        for s in rows:
            self._abort_if_needed(s)
        keep = [i for i, s in enumerate(rows) if not s.done]
        if len(keep) == len(rows):
            return cache, mask, rows
        if not keep:
            return None, None, []
        idx = torch.tensor(keep, dtype=torch.long)
        mask = mask[idx]
        # Columns that are padding in every remaining row are dead weight: trim them.
        first = int((mask.sum(0) > 0).nonzero()[0])
        mask = mask[:, first:]
        for layer in cache.layers:
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]
        return cache, mask, [rows[i] for i in keep]

    def _sample(self, logits: Any, s: _Seq) -> int:
        torch = self.torch
        p = s.request.sampling
        if p.temperature == 0.0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = sorted_probs.cumsum(-1)
            cut = cumulative - sorted_probs > p.top_p
            sorted_probs = sorted_probs.masked_fill(cut, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=s.generator))

    def _accept(self, s: _Seq, token: int) -> None:
        """Record a sampled token, stream its text, finish the sequence if a stop rule fires."""
        p = s.request.sampling
        s.generated.append(token)
        s.pending = token
        self._stats.generated_tokens += 1
        finish: FinishReason | None = None
        if token in self.eos_ids and not p.ignore_eos:
            finish = FinishReason.STOP
            text, stopped = s.detok.finish()
        else:
            text, stopped = s.detok.add(token)
            if stopped:
                finish = FinishReason.STOP
            elif len(s.generated) >= p.max_tokens or s.position + 1 >= self.info().max_context_tokens:
                finish = FinishReason.LENGTH
            if finish is FinishReason.LENGTH:
                more, _ = s.detok.finish()
                text += more
        if finish is not None:
            s.done = True
            self._stats.completed_requests += 1
        if text or finish is not None:
            ids = tuple(s.generated[s.detok.emitted_tokens:])
            s.detok.emitted_tokens = len(s.generated)
            s.emit(GenerationDelta(text, ids, len(s.generated), finish))
