"""The one interface every worker engine implements (hf, vllm, sglang, echo).

Domain types only: no protobuf here. The worker's servicer converts messages to these and back.
Optional capabilities are concrete methods with a default that declines, so that adding one breaks no engine:
embeddings, LoRA, sleep and KV-block clearing raise ``NotImplementedError`` (the servicer answers
FAILED_PRECONDITION); KV events (``kv_event_source``), KV usage (``kv_usage``) and engine metrics
(``metrics_collector``) answer None/0 and ``worker/main.py`` wires what an engine offers, naming no engine.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from embedmesh.core.sampling import SamplingParams

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from embedmesh.core.kv_events import KvEvent

__all__ = [
    "EngineContext",
    "load_once",
    "FinishReason",
    "SamplingParams",
    "TokenSegment",
    "EmbedsSegment",
    "Segment",
    "GenerationRequest",
    "GenerationDelta",
    "TokenLogprob",
    "ModelInfo",
    "EngineStats",
    "EngineProgress",
    "KvEventSource",
    "Engine",
]


_O = TypeVar("_O")


@dataclass(frozen=True)
class EngineContext:
    """What an engine is built from (``build(context) -> Engine`` in its folder's ``__init__.py``): the worker's
    settings an engine may read, and the engine's own options. The registry makes it from the worker's config, so
    no engine depends on that config."""

    engine: str
    """The registered name of the engine being built."""
    model: str = "default"
    """``--model``: a local folder, or "default" for the engine's bundled model."""
    served_name: str = ""
    """``--served-name`` ("" = the engine's default: the default model's name or the folder's)."""
    routers: tuple[str, ...] = ()
    """KV router addresses (empty = not routable by KV overlap: an engine need not publish KV events)."""
    block_size: int = 16
    """Positions per KV block for routing hashes."""
    enable_lora: bool = False
    """``--enable-lora``: reserve LoRA adapter slots (engines whose adapters need it)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """Adapters the worker loads at start (name, folder): an engine that needs ``enable_lora`` for them turns it on."""
    options: Any = None
    """The engine's options (its spec's ``options`` class, ``engines/<name>/config.py``)."""

    def options_as(self, cls: type[_O]) -> _O:
        """The engine's options, as the class its factory expects."""
        if not isinstance(self.options, cls):
            raise TypeError(f"the {self.engine} engine's options are {type(self.options).__name__}, "
                            f"not {cls.__name__}")
        return self.options

    def name_to_serve(self, folder_name: str, default_model: str) -> str:
        """--served-name, else the default model's name for --model default (or that name), else the folder's."""
        return self.served_name or (default_model if self.model in ("default", default_model) else folder_name)


class FinishReason(Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass(frozen=True)
class TokenSegment:
    """Prompt positions given as token ids."""

    ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class EmbedsSegment:
    """Prompt positions given as embedding rows, (rows, hidden_size), already in the model dtype.

    For bf16 models the array holds the raw bf16 bits as uint16 (see ``embedmesh.core.tensors``).
    """

    rows: np.ndarray

    def __len__(self) -> int:
        return int(self.rows.shape[0])


Segment = TokenSegment | EmbedsSegment


@dataclass
class GenerationRequest:
    request_id: str
    segments: list[Segment]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    lora_adapter: str = ""
    """A loaded LoRA adapter's name; empty = the base model."""
    resumed: tuple[int, ...] = ()
    """Tokens this sequence already generated on another worker (a migrated stream): the engine continues after
    them as if it had generated them (they follow the prompt as positions; every sampling setting but
    ``max_tokens`` sees them as generated: penalties, min_tokens, the seed's offset), and streams only what follows.
    Only engines whose ``resumes`` is True get such a request."""

    @property
    def prompt_len(self) -> int:
        """The prompt's positions (without ``resumed``)."""
        return sum(len(s) for s in self.segments)

    @property
    def positions(self) -> int:
        """Positions before the first token to generate: the prompt's and the resumed tokens'."""
        return self.prompt_len + len(self.resumed)


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probability: the token there and the most likely alternatives.

    ``logprob`` is the log-softmax of the model's raw logits at the position (before temperature, penalties, bias
    and grammar masks, as vLLM's default ``raw_logprobs``); None only for a prompt's first token, which nothing
    predicts. ``top`` holds (token id, logprob) pairs, most likely first."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationDelta:
    """New output since the previous delta; the last one has ``finish_reason`` set."""

    text: str
    token_ids: tuple[int, ...]
    completion_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per id in ``token_ids`` when the request asked for log-probabilities."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """On the first delta only, one per prompt position, when the request asked for them."""


@dataclass(frozen=True)
class ModelInfo:
    model: str
    engine: str
    hidden_size: int
    max_context_tokens: int
    dtype: str
    """torch-style dtype name without the prefix: "float32", "bfloat16", "float16"."""
    vocab_size: int
    max_batch_size: int
    task: str = "generate"
    """"generate" or "embed"."""
    embedding_size: int = 0
    """Vector length of an embedding model."""
    supports_dimensions: bool = False
    """Whether vectors may be truncated (Matryoshka-trained models)."""


@dataclass
class EngineStats:
    active_requests: int = 0
    queued_requests: int = 0
    completed_requests: int = 0
    aborted_requests: int = 0
    generated_tokens: int = 0
    max_batch_seen: int = 0
    sleeping: bool = False


@dataclass(frozen=True)
class EngineProgress:
    """What the worker's watchdog reads (``Engine.progress``) to tell a busy engine from a stuck one."""

    steps: int
    """Monotonic count of units of work done (model forward passes, layers): any increase is progress."""
    busy: bool
    """Work is queued or running; an engine only counts as stalled while this is true."""
    failed: str | None = None
    """Why the engine can serve no more (its thread died), or None while it can."""


class KvEventSource(Protocol):
    """What an engine that reports its KV cache offers (``Engine.kv_event_source``): the routers get its events
    live and a snapshot when they re-sync."""

    def on_kv_events(self, listener: Callable[[list[KvEvent]], None]) -> None:
        """Call ``listener`` (on the event loop) with each batch of events, in the mesh's block hashes."""

    def kv_snapshot(self) -> list[KvEvent]:
        """Every block held now, as stored events."""


class Engine(ABC):
    """An inference engine behind a worker."""

    resumes: bool = False
    """Whether the engine continues a generation from ``GenerationRequest.resumed`` (stream migration); the
    servicer refuses such a request for an engine that does not (FAILED_PRECONDITION ``RESUME_UNSUPPORTED``)."""

    @abstractmethod
    async def start(self) -> None:
        """Load the model. The worker reports NOT_SERVING until this returns."""

    @abstractmethod
    def info(self) -> ModelInfo:
        """Model description; valid after ``start``."""

    async def ready_info(self) -> ModelInfo:
        """``info()`` once the engine can take requests. The default answers at once (``info()`` raises
        Unavailable while loading); an engine that lets early requests wait for its model (vllm) waits here, so
        the worker can check a request against the model without refusing it during the load."""
        return self.info()

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream deltas. Closing the iterator early (client gone) must abort the sequence."""

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Stop a running sequence; False when it is not running."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Counters for GetStats and metrics."""

    def token_text(self, token_id: int) -> str:
        """One token's text decoded alone (shown beside log-probabilities); "" for an engine without a tokenizer."""
        return ""

    async def check_health(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Raise if the engine can no longer serve."""

    async def shutdown(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release the engine."""

    # --- watchdog (optional; the default leaves the engine unwatched) --------------------------------------
    def progress(self) -> EngineProgress | None:
        """Progress for the worker's watchdog, or None (this default): the engine is not watched.

        An engine that answers must also implement ``fail_all``. Engines whose work runs on the event loop itself
        (echo) or in a process the engine library supervises (vllm, sglang) keep the default.
        """
        return None

    def fail_all(self, error: Exception) -> int:
        """Fail every queued and running request with ``error`` and refuse new ones from now on; return how many
        were failed. The watchdog calls it (from the event loop) before the worker exits."""
        return 0

    # --- admin (optional; engines without them answer FAILED_PRECONDITION through the servicer) -------------
    async def load_lora(self, name: str, path: str) -> bool:
        """Load an adapter; False when it was already loaded."""
        raise NotImplementedError

    async def unload_lora(self, name: str) -> bool:
        raise NotImplementedError

    async def list_loras(self) -> dict[str, str]:
        """name -> folder."""
        raise NotImplementedError

    def lora_names(self) -> list[str]:
        """Adapters usable now, read without awaiting (the router heartbeat carries them); none by default."""
        return []

    async def sleep(self, level: int) -> None:
        raise NotImplementedError

    async def wake_up(self) -> None:
        raise NotImplementedError

    async def clear_kv_blocks(self) -> bool:
        raise NotImplementedError

    # --- routing and metrics (optional; the worker wires what an engine offers) -------------------------------
    def kv_event_source(self) -> KvEventSource | None:
        """The engine's KV cache events for the routers, or None (this default): the routers track this worker's
        cache approximately from the requests they route."""
        return None

    def kv_usage(self) -> float:
        """Fraction of the KV cache in use (0..1), reported to the routers with the load; 0 when not known."""
        return 0.0

    def metrics_collector(self, worker_id: str) -> Collector | None:
        """A Prometheus collector of the engine's own figures, registered beside the worker's; None by default."""
        return None

    async def embed(self, inputs: list[str | list[int]],
                    dimensions: int | None = None) -> tuple[np.ndarray, list[int]]:
        """Pooled, normalised float32 vectors (one row per input, in order) and each input's token count.
        Embedding engines only."""
        raise NotImplementedError


async def load_once(loading: dict[str, asyncio.Future[bool]], name: str, load: Callable[[], Awaitable[None]]) -> bool:
    """Run ``load`` for ``name`` unless a load of that name is already running: then wait for it and return False
    (its error, if it fails, reaches every caller). True when this call loaded. The engines' ``load_lora`` use it,
    so concurrent loads of one adapter load it once."""
    pending = loading.get(name)
    if pending is not None:
        await asyncio.shield(pending)
        return False
    future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    loading[name] = future
    try:
        await load()
        future.set_result(True)
        return True
    except BaseException as e:
        future.set_exception(e)
        future.exception()  # retrieved: concurrent waiters re-raise it, nobody else needs to
        raise
    finally:
        loading.pop(name, None)
