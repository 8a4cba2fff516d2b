"""The embedded default engine: a transformers causal LM on the CPU with continuous batching.

One engine thread owns the model. Between decode steps it admits waiting sequences: they are prefilled together
(left-padded ``inputs_embeds``), and their KV cache is merged into the running batch's cache, so a new request
never waits for the whole batch to finish. Finished or aborted rows leave the batch at once.

Every prompt is prefilled from embeddings: token ids go through the model's own embedding layer first. So a
prompt given as ``embed_tokens(ids)`` and the same prompt given as ids run the identical computation, and greedy
decoding gives the same text. A resumed request (a stream migrated from a lost worker) prefills its resumed
tokens after the prompt the same way and goes on from there.

The parts (vLLM v1's split): ``scheduler.py`` what runs next (the inbox, aborts), ``runner.py`` the forward passes
and the batch's KV cache (its invariants are in its docstring), ``sampler.py`` logits to tokens and the stop rules,
``lora.py`` the adapters; ``sequence.py`` one sequence's state. This module is the ``Engine`` they make up: the
request side on the event loop, and the engine thread's loop with its failure containment.

Failure is contained (the engine thread must outlive any request):
- sampling never yields NaN probabilities, and a row whose logits are not finite fails alone
  (NON_FINITE_COMPUTATION, ``sampler.py``); rows never mix in a forward pass, so the rest of the batch goes on;
- an exception in a prefill fails only the sequences being prefilled; one in a decode step fails the batch it ran
  and resets the cache; the thread goes on. Only what escapes that (BaseException) stops it, and then every
  waiting and later request fails at once (ENGINE_FAILED) while the worker's watchdog restarts the worker.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from embedmesh.core.errors import EmbedmeshError, InvalidArgument, Unavailable
from embedmesh.core.kv_events import KvEvent
from embedmesh.core.logs import get_logger
from embedmesh.services.worker.engines.base import (
    Engine,
    EngineProgress,
    EngineStats,
    GenerationDelta,
    GenerationRequest,
    KvEventSource,
    ModelInfo,
)
from embedmesh.services.worker.engines.hf.detok import IncrementalDetokenizer
from embedmesh.services.worker.engines.hf.kv_blocks import PrefixReuse
from embedmesh.services.worker.engines.hf.lora import LoraAdapters
from embedmesh.services.worker.engines.hf.prefix_cache import PrefixCache, PrefixCacheCollector
from embedmesh.services.worker.engines.hf.runner import HFEngineConfig, ModelRunner
from embedmesh.services.worker.engines.hf.sampler import GREEDY_BELOW, Sampler
from embedmesh.services.worker.engines.hf.scheduler import Scheduler
from embedmesh.services.worker.engines.hf.sequence import Seq, fail_step
from embedmesh.services.worker.validate import check_generation

__all__ = ["HFEngine", "HFEngineConfig", "GREEDY_BELOW"]

log = get_logger(__name__)


class HFEngine(Engine, KvEventSource):
    """transformers on the CPU; see the module docstring for the batching scheme."""

    resumes = True
    """A resumed request's tokens are prefilled after its prompt (through the embedding layer, as every token is),
    and the sampler, the detokenizer and the grammar continue from them (``sampler.Sampler.prepare``)."""

    def __init__(self, config: HFEngineConfig) -> None:
        self.config = config
        self._stats = EngineStats()
        self._scheduler = Scheduler(self._stats)
        self._runner = ModelRunner(config)
        self._sampler = Sampler(self._runner, self._stats)
        self._model_lock = threading.Lock()
        """Held by the engine thread for each step and by adapter loads/unloads: the model never changes mid-pass."""
        self._lora = LoraAdapters(self._runner, self._model_lock, self._adapter_in_use)
        self._thread: threading.Thread | None = None
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
        self.prefix_cache = PrefixCache(config.prefix_cache_blocks, config.block_size, self._publish)
        """KV blocks of earlier prompts (``prefix_cache.py``); capacity 0 = off."""
        self._reuse: PrefixReuse | None = None
        self._kv_listeners: list[Callable[[list[KvEvent]], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # The loaded model's parts (the peft model once an adapter is loaded).
    @property
    def model(self) -> Any:
        return self._runner.model

    @property
    def tokenizer(self) -> Any:
        return self._runner.tokenizer

    @property
    def embed(self) -> Any:
        return self._runner.embed

    # --- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._runner.load, self._tick)
        self._reuse = PrefixReuse(self.prefix_cache, self._runner.torch)
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        self._steps += 1

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def info(self) -> ModelInfo:
        if self._runner.info is None:
            raise Unavailable("model is still loading")
        return self._runner.info

    def stats(self) -> EngineStats:
        s = self._stats
        s.queued_requests = self._scheduler.inbox.qsize()
        s.active_requests = len(self._scheduler.by_id)
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
        return EngineProgress(steps=self._steps, busy=self._active > 0 or self._scheduler.inbox.qsize() > 0,
                              failed=failed)

    def fail_all(self, error: Exception) -> int:
        if isinstance(error, EmbedmeshError):
            self._refusal = error
        failed = 0
        for seq in list(self._scheduler.by_id.values()):
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
        self._scheduler.inbox.put(None)
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
        if adapter and not self._lora.serves(adapter):
            raise InvalidArgument(f"model: the LoRA adapter {request.lora_adapter!r} is not loaded on this worker",
                                  field="model", reason="LORA_NOT_LOADED")
        by_id = self._scheduler.by_id
        if request.request_id in by_id:
            raise InvalidArgument(f"request id {request.request_id!r} is already running", field="request_id")
        seq = Seq(
            request=request,
            out=asyncio.Queue(),
            loop=asyncio.get_running_loop(),
            detok=IncrementalDetokenizer(self.tokenizer, request.sampling.stop, request.resumed),
        )
        by_id[request.request_id] = seq
        self._scheduler.inbox.put(seq)
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
            by_id.pop(request.request_id, None)

    async def abort(self, request_id: str) -> bool:
        seq = self._scheduler.by_id.get(request_id)
        if seq is None or seq.done:
            return False
        seq.aborted = True
        return True

    # --- LoRA adapters (``lora.py``) ---------------------------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> bool:
        """Load once: concurrent calls for one name share the first call's result. A folder that is not an
        adapter of this model is refused naming ``path``, and nothing of it stays loaded."""
        return await self._lora.load(name, path)

    async def unload_lora(self, name: str) -> bool:
        """Refuse new requests for ``name`` at once; let running ones finish; then free it and the prefix cache's
        blocks computed under it (an adapter loaded later under that name may hold other weights)."""
        unloaded = await self._lora.unload(name)
        if unloaded:
            self.prefix_cache.drop_adapter(name)
        return unloaded

    async def list_loras(self) -> dict[str, str]:
        return self._lora.loaded()

    def lora_names(self) -> list[str]:
        return list(self._lora.loaded())

    def _adapter_in_use(self, name: str) -> bool:
        return any(s.request.lora_adapter == name and not s.done for s in self._scheduler.by_id.values())

    # --- prefix cache and its KV events (``prefix_cache.py``) --------------------------------------------------
    async def clear_kv_blocks(self) -> bool:
        """Drop every block of the prefix cache (published as cleared); the engine keeps no other KV between
        requests. Without a prefix cache there is nothing to clear (FAILED_PRECONDITION, as before)."""
        if not self.prefix_cache.enabled:
            raise NotImplementedError
        return self.prefix_cache.clear()

    def kv_event_source(self) -> KvEventSource | None:
        """This engine while its prefix cache is on: the routers then index what it really holds."""
        return self if self.prefix_cache.enabled else None

    def on_kv_events(self, listener: Callable[[list[KvEvent]], None]) -> None:
        self._kv_listeners.append(listener)

    def kv_snapshot(self) -> list[KvEvent]:
        return self.prefix_cache.snapshot()

    def metrics_collector(self, worker_id: str) -> PrefixCacheCollector | None:
        """The prefix cache's hits, blocks and bytes (``embedmesh_hf_prefix_*``) while it is on."""
        return PrefixCacheCollector(self.prefix_cache, worker_id) if self.prefix_cache.enabled else None

    def _publish(self, events: list[KvEvent]) -> None:
        """From any thread (the engine thread stores and evicts): the listeners get the events on the event loop,
        in the order the cache made them."""
        if self._loop is not None and self._kv_listeners and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, events)

    def _deliver(self, events: list[KvEvent]) -> None:
        for listener in self._kv_listeners:
            try:
                listener(events)
            except Exception:  # noqa: BLE001 - one failing listener must not stop the others
                log.exception("KV event listener failed")

    def _keep_blocks(self, cache: Any, mask: Any, rows: list[Seq], finished_only: bool) -> None:
        """Store what ``rows`` computed in the prefix cache; a failure here turns the cache off (logged) and never
        fails a request."""
        if self._reuse is None or not self.prefix_cache.enabled or cache is None:
            return
        try:
            self._reuse.keep(cache, mask, rows, finished_only)
        except Exception:  # noqa: BLE001 - the cache is an optimisation: without it every request still runs
            log.exception("storing KV blocks failed; the prefix cache is off from now on")
            self.prefix_cache.clear()
            self.prefix_cache.capacity = 0

    # --- engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        torch = self._runner.torch
        rows: list[Seq] = []
        cache: Any = None
        mask: Any = None
        incoming: list[Seq] | None = []
        try:
            with torch.inference_mode():
                while True:
                    self._active = len(rows)
                    incoming = self._scheduler.take(block=not rows, room=self.config.max_batch_size - len(rows))
                    if incoming is None:
                        return
                    self._active = len(rows) + len(incoming)
                    live = [s for s in incoming if not self._scheduler.abort_if_needed(s)]
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
                    left = self._scheduler.inbox.get_nowait()
                except queue.Empty:
                    break
                if left is not None:
                    left.emit(error)

    def _admit_guarded(self, new: list[Seq], cache: Any, mask: Any,
                       rows: list[Seq]) -> tuple[Any, Any, list[Seq]]:
        """Prefill ``new`` and merge it into the running batch. A failed prefill fails only ``new`` (the running
        batch is untouched until the merge); a failed merge fails everything it may have half-changed."""
        try:
            prefilled = self._prefill(new)
        except Exception as e:  # noqa: BLE001 - one batch's failure must not stop the engine
            fail_step(new, e, "prefill")
            return cache, mask, rows
        if prefilled is None:
            return cache, mask, rows
        new_cache, new_mask, admitted = prefilled
        if cache is None or not rows:
            return new_cache, new_mask, admitted
        try:
            return (self._runner.merge(cache, mask, new_cache, new_mask), self._runner.cat_mask(mask, new_mask),
                    rows + admitted)
        except Exception as e:  # noqa: BLE001
            fail_step(rows + admitted, e, "merge")
            return None, None, []

    def _decode_guarded(self, cache: Any, mask: Any, rows: list[Seq]) -> tuple[Any, Any, list[Seq]]:
        """Drop finished rows, decode one step, drop again; when it raises, the rows it ran fail (its cache may be
        half-updated, so it is dropped with them) and the engine goes on with an empty batch."""
        try:
            cache, mask, rows = self._drop_finished(cache, mask, rows)
            if not rows:
                return None, None, []
            self._stats.max_batch_seen = max(self._stats.max_batch_seen, len(rows))
            cache, mask, logits = self._runner.decode(cache, mask, rows, self._lora.net(),
                                                      self._lora.forward_args(rows))
            self._sample_rows(logits, rows)
            return self._drop_finished(cache, mask, rows)
        except Exception as e:  # noqa: BLE001 - one batch's failure must not stop the engine
            fail_step(rows, e, "decode")
            return None, None, []

    def _drop_finished(self, cache: Any, mask: Any, rows: list[Seq]) -> tuple[Any, Any, list[Seq]]:
        for s in rows:
            self._scheduler.abort_if_needed(s)
        if any(s.done for s in rows):
            self._keep_blocks(cache, mask, rows, finished_only=True)
        return self._runner.drop(cache, mask, rows)

    def _prefill(self, new: list[Seq]) -> tuple[Any, Any, list[Seq]] | None:
        """Prefill ``new`` together and sample each one's first token: (cache, mask, sequences) to merge into the
        running batch, or None when none of them could start. A sequence whose prompt cannot be built fails alone."""
        embeds, ready, pasts = [], [], []
        for s in new:
            try:
                e = self._runner.prompt_embeds(s)
                self._sampler.prepare(s)
                past = self._reuse.find(s, e.shape[0]) if self._reuse is not None else []
            except Exception as err:  # noqa: BLE001 - this sequence alone
                log.exception("building the prompt failed", extra={"request_id": s.request.request_id})
                s.fail(err)
                continue
            embeds.append(e)
            ready.append(s)
            pasts.append(past)
        if not ready:
            return None
        out = self._runner.prefill(embeds, ready, self._lora.net(), self._lora.forward_args(ready), pasts)
        for i, s in enumerate(ready):
            if s.request.sampling.prompt_logprobs is not None:
                self._sampler.score_prompt(s, out.logits[i, out.length - s.position:].float().cpu(), s.position)
        self._sample_rows(out.logits[:, -1, :].float(), ready)
        self._keep_blocks(out.cache, out.mask, ready, finished_only=False)
        # Rows that failed stay until ``_drop_finished``: cache rows and sequences stay aligned.
        return out.cache, out.mask, ready

    def _sample_rows(self, logits: Any, seqs: list[Seq]) -> None:
        """One token per live row (``Sampler.sample_rows``, on the CPU); the one place the engine thread samples."""
        self._sampler.sample_rows(logits.cpu(), seqs)
