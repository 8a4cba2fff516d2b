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

Failure is contained (the engine thread must outlive any request):
- sampling is computed in float32 on max-shifted logits, temperatures below ``GREEDY_BELOW`` are greedy, and a
  distribution that still is not finite falls back to greedy: no temperature or top_p yields NaN probabilities;
- a row whose logits are NaN, +Inf or all -Inf fails alone (NON_FINITE_COMPUTATION); rows never mix in a forward
  pass, so the rest of the batch goes on;
- an exception in a prefill fails only the sequences being prefilled; one in a decode step fails the batch it ran
  and resets the cache; the thread goes on. Only what escapes that (BaseException) stops it, and then every
  waiting and later request fails at once (ENGINE_FAILED) while the worker's watchdog restarts the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedmesh.core.errors import EmbedmeshError, InternalError, InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.services.worker.engines.base import (
    EmbedsSegment,
    Engine,
    EngineProgress,
    EngineStats,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    TokenLogprob,
    TokenSegment,
    load_once,
)
from embedmesh.services.worker.engines.hf import logits as logits_ops
from embedmesh.services.worker.engines.hf.detok import IncrementalDetokenizer
from embedmesh.services.worker.validate import check_generation

__all__ = ["HFEngine", "HFEngineConfig", "GREEDY_BELOW"]

log = get_logger(__name__)

GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (vLLM's convention): dividing logits by them overflows float32."""


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
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """Parallel to ``generated`` when the request asked for log-probabilities."""
    prompt_lp: tuple[TokenLogprob, ...] | None = None
    """Prompt log-probabilities, sent with the first delta."""
    counts: dict[int, int] = field(default_factory=dict)
    """Generated token -> times (frequency/presence penalties)."""
    matcher: Any = None
    """The grammar matcher of a structured-output request (``core/structured.py``)."""

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
        """What stopped the engine thread; set once, by that thread."""
        self._refusal: EmbedmeshError | None = None
        """Set by ``fail_all``: every later request is refused with it."""
        self._steps = 0
        """Units of work done by the engine thread (decoder layers run, loop turns); read by the watchdog."""
        self._active = 0
        """Sequences the engine thread holds (being prefilled or decoded)."""
        self._stopping = False
        self._texts: dict[int, str] = {}
        self._model_lock = threading.Lock()
        """Held by the engine thread for each step and by adapter loads/unloads: the model never changes mid-pass."""
        self._loras: dict[str, str] = {}
        """Loaded LoRA adapters: name -> folder (peft format)."""
        self._lora_loading: dict[str, asyncio.Future[bool]] = {}
        self._unloading: set[str] = set()
        self._peft = False
        self._plain: Any = None
        """Whether ``self.model`` is a peft model (after the first adapter load)."""
        self._structured: Any = None
        """``StructuredCompiler`` for this tokenizer, built on first use (in the engine thread)."""

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
        self._count_layer_progress()
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

    def _count_layer_progress(self) -> None:
        """Count every decoder layer run as progress, so a long prefill is not mistaken for a stall."""
        layers = next((m for m in self.model.modules() if isinstance(m, self.torch.nn.ModuleList)), None)

        def tick(*_: Any) -> None:
            self._steps += 1

        for layer in layers or ():
            layer.register_forward_hook(tick)

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

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

    def progress(self) -> EngineProgress:
        failed = None
        if self._failed is not None:
            failed = f"engine thread failed: {self._failed!r}"
        elif self._thread is not None and not self._thread.is_alive() and not self._stopping:
            failed = "engine thread exited"
        return EngineProgress(steps=self._steps, busy=self._active > 0 or self._inbox.qsize() > 0, failed=failed)

    def fail_all(self, error: Exception) -> int:
        if isinstance(error, EmbedmeshError):
            self._refusal = error
        failed = 0
        for seq in list(self._by_id.values()):
            if not seq.done:
                # ``done`` makes the engine thread skip the sequence if it still holds it.
                seq.done = True
                seq.emit(error)
                failed += 1
        return failed

    def _unavailable(self) -> Unavailable | None:
        """The error a new request gets when the engine can no longer run one, else None."""
        if self._refusal is not None:
            r = self._refusal
            return Unavailable(str(r), field=r.field, reason=r.reason, retry_after_seconds=r.retry_after_seconds)
        if self._failed is not None or (self._thread is not None and not self._thread.is_alive()):
            return Unavailable("the worker's engine has failed and the worker is restarting; retry, another worker "
                               "will take the request", reason="ENGINE_FAILED", retry_after_seconds=1.0)
        return None

    async def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    # --- request side (event loop) ---------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        info = self.info()
        down = self._unavailable()
        if down is not None:
            raise down
        check_generation(request, info)
        adapter = request.lora_adapter
        if adapter and (adapter not in self._loras or adapter in self._unloading):
            raise InvalidArgument(f"model: the LoRA adapter {request.lora_adapter!r} is not loaded on this worker",
                                  field="model", reason="LORA_NOT_LOADED")
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
        down = self._unavailable()
        if down is not None:
            # The thread stopped (or the watchdog tripped) between the check above and the put: nobody may ever
            # take the sequence from the inbox, so fail it here (a second error queued behind it is never read).
            seq.emit(down)
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
        incoming: list[_Seq] | None = []
        try:
            with torch.inference_mode():
                while True:
                    self._active = len(rows)
                    incoming = self._take(block=not rows, room=self.config.max_batch_size - len(rows))
                    if incoming is None:
                        return
                    self._active = len(rows) + len(incoming)
                    live = [s for s in incoming if not self._abort_if_needed(s)]
                    with self._model_lock:
                        if live:
                            cache, mask, rows = self._admit_guarded(live, cache, mask, rows)
                        incoming = []
                        if rows:
                            cache, mask, rows = self._decode_guarded(cache, mask, rows)
                    self._steps += 1
        except BaseException as e:  # noqa: BLE001 - past the per-step guards: surface to every waiting request, stop
            self._failed = e
            log.exception("engine thread failed; the worker must be restarted")
            error = self._unavailable() or Unavailable("the engine failed", reason="ENGINE_FAILED")
            for s in [*rows, *(incoming or [])]:
                s.emit(error)
            # Sequences still in the inbox would wait forever: nobody takes them any more.
            while True:
                try:
                    left = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if left is not None:
                    left.emit(error)

    def _admit_guarded(self, new: list[_Seq], cache: Any, mask: Any,
                       rows: list[_Seq]) -> tuple[Any, Any, list[_Seq]]:
        """Prefill ``new`` and merge it into the running batch. A failed prefill fails only ``new`` (the running
        batch is untouched until the merge); a failed merge fails everything it may have half-changed."""
        try:
            prefilled = self._prefill(new)
        except Exception as e:  # noqa: BLE001 - one batch's failure must not stop the engine
            self._fail_step(new, e, "prefill")
            return cache, mask, rows
        if prefilled is None:
            return cache, mask, rows
        new_cache, new_mask, admitted = prefilled
        if cache is None or not rows:
            return new_cache, new_mask, admitted
        try:
            return self._merge(cache, mask, new_cache, new_mask), self._cat_mask(mask, new_mask), rows + admitted
        except Exception as e:  # noqa: BLE001
            self._fail_step(rows + admitted, e, "merge")
            return None, None, []

    def _decode_guarded(self, cache: Any, mask: Any, rows: list[_Seq]) -> tuple[Any, Any, list[_Seq]]:
        """Drop finished rows, decode one step, drop again; when it raises, the rows it ran fail (its cache may be
        half-updated, so it is dropped with them) and the engine goes on with an empty batch."""
        try:
            cache, mask, rows = self._drop_finished(cache, mask, rows)
            if not rows:
                return None, None, []
            self._stats.max_batch_seen = max(self._stats.max_batch_seen, len(rows))
            cache, mask = self._decode_step(cache, mask, rows)
            return self._drop_finished(cache, mask, rows)
        except Exception as e:  # noqa: BLE001 - one batch's failure must not stop the engine
            self._fail_step(rows, e, "decode")
            return None, None, []

    def _fail_step(self, seqs: list[_Seq], e: Exception, step: str) -> None:
        log.exception("hf %s step failed; failing its %d sequences", step, len(seqs),
                      extra={"request_ids": [s.request.request_id for s in seqs]})
        for s in seqs:
            self._fail(s, e)

    def _fail(self, s: _Seq, e: Exception) -> None:
        """End one sequence with an error (ours as is; anything else without internals)."""
        if s.done:
            return
        s.done = True
        if not isinstance(e, EmbedmeshError):
            e = InternalError("the model failed while generating this request; it was logged on the worker")
        s.emit(e)

    def _non_finite(self, s: _Seq) -> InvalidArgument:
        field = "prompt_embeds" if any(isinstance(g, EmbedsSegment) for g in s.request.segments) else "prompt"
        return InvalidArgument(
            f"{field}: the model's computation went non-finite (NaN or Inf) for this prompt; check the magnitudes "
            "of the input values", field=field, reason="NON_FINITE_COMPUTATION")

    def _sample_rows(self, logits: Any, seqs: list[_Seq]) -> None:
        """Sample and accept one token per live row of ``logits`` (float32, one row per sequence); a row that is
        not finite, or whose sampling raises, fails alone."""
        torch = self.torch
        # max() propagates NaN and keeps +Inf; a row of only -Inf has no token to pick: one reduction finds all.
        bad = (~torch.isfinite(logits.max(dim=-1).values)).tolist()
        for i, s in enumerate(seqs):
            if s.done or s.aborted:
                continue
            if bad[i]:
                log.warning("non-finite logits; failing the request", extra={"request_id": s.request.request_id})
                self._fail(s, self._non_finite(s))
                continue
            try:
                self._step_row(logits[i], s)
            except Exception as e:  # noqa: BLE001 - this row alone
                log.exception("sampling failed", extra={"request_id": s.request.request_id})
                self._fail(s, e)

    def _step_row(self, raw: Any, s: _Seq) -> None:
        """Process one sequence's logits row (penalties, bias, grammar), sample, record its log-probability."""
        p = s.request.sampling
        row = raw
        if logits_ops.needs_processing(p):
            prompt_ids = (t for g in s.request.segments if isinstance(g, TokenSegment) for t in g.ids)
            row = logits_ops.process(raw, p, generated=s.generated, counts=s.counts, prompt_ids=prompt_ids,
                                     eos_ids=self.eos_ids)
        if s.matcher is not None:
            row = row.clone() if row is raw else row
            s.matcher.mask(row)
            if not bool(self.torch.isfinite(row.max())):
                raise InternalError("the structured-output constraint allows no token here")
        token = self._sample(row, s)
        lp = logits_ops.token_logprob(raw, token, p.logprobs) if p.logprobs is not None else None
        if s.matcher is not None and not s.matcher.accept(token):
            raise InternalError("the sampled token breaks the structured-output constraint")
        self._accept(s, token, lp)

    def _adapters(self, rows: list[_Seq]) -> dict[str, Any]:
        """Forward-pass arguments giving each row its own adapter (peft's mixed-adapter batches: one continuous batch
        holds base-model rows and rows of any loaded adapters), or nothing before the first adapter is loaded."""
        if not self._peft or not self.model.peft_config:
            return {}
        return {"adapter_names": [s.request.lora_adapter or "__base__" for s in rows]}

    def _net(self) -> Any:
        """The module a forward pass runs: the peft model while adapters are loaded, else the (base) model."""
        if self._peft and not self.model.peft_config:
            return self._plain  # every adapter unloaded: peft has no active adapter to consult
        return self.model

    # --- LoRA adapters (peft) ----------------------------------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> bool:
        """Load once: concurrent calls for one name share the first call's result. A folder that is not an
        adapter of this model is refused naming ``path``, and nothing of it stays loaded."""
        if name in self._loras:
            return False

        async def load() -> None:
            from pathlib import Path as _Path

            if not (_Path(path) / "adapter_config.json").is_file():
                raise InvalidArgument(f"path: no adapter_config.json in {path!r}: not a peft adapter folder",
                                      field="path", reason="NOT_AN_ADAPTER")
            await asyncio.to_thread(self._load_adapter, name, path)
            self._loras[name] = path

        return await load_once(self._lora_loading, name, load)

    def _load_adapter(self, name: str, path: str) -> None:
        with self._model_lock:
            try:
                if not self._peft:
                    from peft import PeftModel

                    self._plain = self.model  # the transformers model (peft injects its layers into it)
                    self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
                    self._peft = True
                else:
                    self.model.load_adapter(path, adapter_name=name)
                if self.model.active_adapter not in self.model.peft_config:
                    self.model.set_adapter(name)  # the active one was unloaded; peft needs a live one to consult
                self.model.eval()
            except Exception as e:  # noqa: BLE001 - a bad folder is the caller's error; leave nothing behind
                if self._peft and name in getattr(self.model, "peft_config", {}):
                    with contextlib.suppress(Exception):
                        self.model.delete_adapter(name)
                log.warning("LoRA load failed", extra={"adapter": name, "error": str(e)[:300]})
                raise InvalidArgument(f"path: the adapter in {path!r} cannot be loaded on this model "
                                      f"({type(e).__name__}: {str(e)[:200]})", field="path",
                                      reason="ADAPTER_MISMATCH") from None

    async def unload_lora(self, name: str) -> bool:
        """Refuse new requests for ``name`` at once; let running ones finish; then free it."""
        if name not in self._loras or name in self._unloading:
            return False
        self._unloading.add(name)
        try:
            while any(s.request.lora_adapter == name and not s.done for s in self._by_id.values()):
                await asyncio.sleep(0.05)
            await asyncio.to_thread(self._delete_adapter, name)
            self._loras.pop(name, None)
            return True
        finally:
            self._unloading.discard(name)

    def _delete_adapter(self, name: str) -> None:
        with self._model_lock:
            self.model.delete_adapter(name)
            left = list(self.model.peft_config)
            if left and self.model.active_adapter not in left:
                self.model.set_adapter(left[0])

    async def list_loras(self) -> dict[str, str]:
        return {n: p for n, p in self._loras.items() if n not in self._unloading}

    def lora_names(self) -> list[str]:
        return [n for n in self._loras if n not in self._unloading]

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

    def _prefill(self, new: list[_Seq]) -> tuple[Any, Any, list[_Seq]] | None:
        """Prefill ``new`` together and sample each one's first token: (cache, mask, sequences) to merge into the
        running batch, or None when none of them could start. A sequence whose prompt cannot be built fails alone."""
        torch = self.torch
        from transformers import DynamicCache

        embeds, ready = [], []
        for s in new:
            try:
                e = self._prompt_embeds(s)
                seed = s.request.sampling.seed
                s.generator = torch.Generator()
                if seed is not None:
                    s.generator.manual_seed(int(seed))
                else:
                    s.generator.seed()
                if s.request.sampling.structured is not None:
                    s.matcher = self._compiler().matcher(s.request.sampling.structured)
            except Exception as err:  # noqa: BLE001 - this sequence alone
                log.exception("building the prompt failed", extra={"request_id": s.request.request_id})
                self._fail(s, err)
                continue
            embeds.append(e)
            ready.append(s)
        if not ready:
            return None
        length = max(e.shape[0] for e in embeds)
        hidden = embeds[0].shape[1]
        batch = torch.zeros(len(ready), length, hidden, dtype=self.dtype)
        new_mask = torch.zeros(len(ready), length, dtype=torch.long)
        for i, e in enumerate(embeds):
            batch[i, length - e.shape[0]:] = e
            new_mask[i, length - e.shape[0]:] = 1
        positions = (new_mask.cumsum(-1) - 1).clamp(min=0)
        new_cache = DynamicCache()
        scored = [s.request.sampling.prompt_logprobs is not None for s in ready]
        out = self._net()(
            inputs_embeds=batch, attention_mask=new_mask, position_ids=positions, past_key_values=new_cache,
            use_cache=True, logits_to_keep=0 if any(scored) else 1, **self._adapters(ready),
        )
        for i, s in enumerate(ready):
            s.position = embeds[i].shape[0]
            if scored[i]:
                self._score_prompt(s, out.logits[i, length - s.position:], s.position)
        self._sample_rows(out.logits[:, -1, :].float(), ready)
        # Rows that failed stay until ``_drop_finished``: cache rows and sequences stay aligned.
        return new_cache, new_mask, ready

    def _score_prompt(self, s: _Seq, logits: Any, n: int) -> None:
        """Prompt log-probabilities for ``s`` (token-id prompts only: the worker's validation refuses embeddings);
        with ``max_tokens == 0`` the sequence ends here, having generated nothing."""
        ids = [t for g in s.request.segments if isinstance(g, TokenSegment) for t in g.ids]
        try:
            s.prompt_lp = logits_ops.prompt_logprobs(logits[: n - 1], ids, s.request.sampling.prompt_logprobs or 0)
        except Exception as e:  # noqa: BLE001 - this sequence alone
            log.exception("prompt log-probabilities failed", extra={"request_id": s.request.request_id})
            self._fail(s, e)
            return
        if s.request.sampling.max_tokens == 0 and not s.done:
            s.done = True
            self._stats.completed_requests += 1
            s.emit(GenerationDelta("", (), 0, FinishReason.LENGTH, prompt_logprobs=s.prompt_lp))
            s.prompt_lp = None

    def _compiler(self) -> Any:
        if self._structured is None:
            from embedmesh.core.structured import StructuredCompiler

            self._structured = StructuredCompiler(self.tokenizer, self.info().vocab_size)
        return self._structured

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
        out = self._net()(
            inputs_embeds=self.embed(ids), attention_mask=mask, position_ids=positions, past_key_values=cache,
            use_cache=True, **self._adapters(rows),
        )
        for s in rows:
            s.position += 1
        self._sample_rows(out.logits[:, -1, :].float(), rows)
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
        """One token from a finite float32 logits row. Never builds NaN/Inf probabilities: the row is shifted so
        its maximum is 0 before the temperature divides it (softmax of values <= 0 with one 0 cannot overflow or be
        all zero), and whatever still is not a distribution falls back to greedy."""
        torch = self.torch
        p = s.request.sampling
        if p.temperature < GREEDY_BELOW or p.top_k == 1:
            return int(torch.argmax(logits))
        z = (logits - logits.max()) / p.temperature
        if p.top_k and p.top_k < z.shape[-1]:
            kth = torch.topk(z, p.top_k).values[-1]
            z = z.masked_fill(z < kth, float("-inf"))
        probs = torch.softmax(z, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = sorted_probs.cumsum(-1)
            # The most likely token is always kept (its preceding mass is 0 < top_p), so the sum below is > 0.
            cut = cumulative - sorted_probs > p.top_p
            sorted_probs = sorted_probs.masked_fill(cut, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
            probs = probs / probs.sum()
        total = float(probs.sum())
        if not (math.isfinite(total) and total > 0.0) or not bool(torch.isfinite(probs).all()):
            return int(torch.argmax(logits))
        return int(torch.multinomial(probs, 1, generator=s.generator))

    def _accept(self, s: _Seq, token: int, lp: TokenLogprob | None = None) -> None:
        """Record a sampled token, stream its text, finish the sequence if a stop rule fires."""
        p = s.request.sampling
        s.generated.append(token)
        if lp is not None:
            s.logprobs.append(lp)
        if p.frequency_penalty or p.presence_penalty:
            s.counts[token] = s.counts.get(token, 0) + 1
        s.pending = token
        self._stats.generated_tokens += 1
        finish: FinishReason | None = None
        grammar_done = s.matcher is not None and s.matcher.is_terminated()
        if token in self.eos_ids and (not p.ignore_eos or grammar_done):
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
            start = s.detok.emitted_tokens
            ids = tuple(s.generated[start:])
            s.detok.emitted_tokens = len(s.generated)
            lps = tuple(s.logprobs[start:]) if p.logprobs is not None else ()
            s.emit(GenerationDelta(text, ids, len(s.generated), finish, lps, s.prompt_lp))
            s.prompt_lp = None
