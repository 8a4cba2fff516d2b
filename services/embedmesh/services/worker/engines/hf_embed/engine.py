"""The default embedding engine: a sentence-transformers model run with transformers on the CPU.

Pooling and normalisation are read from the model folder (``modules.json``, ``1_Pooling/config.json``,
``sentence_bert_config.json``), so the vectors are the ones the model was trained to produce: mean pooling over the
attention mask + L2 normalisation for all-MiniLM-L6-v2, equal to sentence-transformers' to 1e-5 (a unit test checks).

Concurrent requests are batched: when the engine thread is free it takes every request waiting (up to
``max_batch_inputs`` inputs) and runs their inputs sorted by length (less padding) in forward passes of at most
``max_batch_inputs`` rows; requests that arrive during a forward pass make the next batch. A lone request is never
held back waiting for company (``batch_wait_ms`` = 0, the default; it was 2 ms, which every request at low load paid:
batch-1 embeddings 52 → 58 sentences/s through the mesh, ``bench/bench_embeddings.py``); a positive
``batch_wait_ms`` keeps collecting that long after the first request.

Input rules (``engines/embed_inputs.py``, shared with the sglang engine):
- text is tokenized with the model's tokenizer and its special tokens ([CLS] ... [SEP]);
- token ids are the model's input as given: include the special tokens, as ``tokenizer(text).input_ids`` returns
  them, and the vector equals the text's; ids < 0 or >= the vocabulary size are a 400 naming ``input[i]``;
- an input longer than the model's ``max_seq_length`` (256 for MiniLM) is a 400 naming ``input[i]``: we never
  truncate silently, so a vector always describes the whole input;
- ``dimensions``: equal to the model's size is a no-op; smaller truncates and re-normalises only for models
  flagged ``supports_dimensions`` (Matryoshka-trained; all-MiniLM-L6-v2 is not); anything else is a 400.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.services.worker.engines.base import Engine, EngineStats, GenerationRequest, ModelInfo
from embedmesh.services.worker.engines.embed_inputs import InputEncoder, check_dimensions, read_pooling_spec, shorten

__all__ = ["HFEmbedConfig", "HFEmbedEngine"]

log = get_logger(__name__)


@dataclass(frozen=True)
class HFEmbedConfig:
    model_path: Path
    """A sentence-transformers folder (config.json, tokenizer, modules.json, 1_Pooling/config.json)."""
    served_name: str
    """Name clients pass as ``model``."""
    max_batch_inputs: int = 64
    """Most inputs in one forward pass (and most collected into one batch)."""
    batch_wait_ms: float = 0.0
    """How long the engine keeps collecting concurrent requests after the first one arrives (0: it takes what waits
    and starts at once; requests arriving meanwhile make the next batch)."""
    threads: int = 2
    """torch threads."""
    supports_dimensions: bool = False
    """Allow shortened vectors (only for Matryoshka-trained models; all-MiniLM-L6-v2 is not)."""

    def __post_init__(self) -> None:
        if self.max_batch_inputs < 1:
            raise ValueError("max_batch_inputs must be >= 1")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ValueError("batch_wait_ms must be in [0, 1000]")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")


@dataclass(eq=False)
class _Job:
    inputs: list[str | list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[tuple[np.ndarray, list[int]]]


class HFEmbedEngine(Engine):
    """Embeddings with transformers on the CPU; one engine thread owns the model (torch is not re-entrant here)."""

    def __init__(self, config: HFEmbedConfig) -> None:
        self.config = config
        self._inbox: queue.Queue[_Job | None] = queue.Queue()
        self._stats = EngineStats()
        self._info: ModelInfo | None = None
        self._thread: threading.Thread | None = None
        self.forward_passes = 0
        """Forward passes run (fewer than requests when batching works)."""

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._run, name="hf-embed", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        torch.set_num_threads(self.config.threads)
        folder = self.config.model_path
        self._torch = torch
        self._model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        cfg = self._model.config
        self.spec = read_pooling_spec(folder, int(cfg.max_position_embeddings))
        size = int(cfg.hidden_size)
        self._encoder = InputEncoder(tokenizer, self.config.served_name, int(cfg.vocab_size), self.spec.max_tokens)
        self._info = ModelInfo(
            self.config.served_name, "hf-embed", size, self.spec.max_tokens, "float32", int(cfg.vocab_size),
            self.config.max_batch_inputs, task="embed", embedding_size=size,
            supports_dimensions=self.config.supports_dimensions,
        )
        log.info("embedding model loaded", extra={"path": str(folder), "pooling": self.spec.pooling,
                                                  "normalize": self.spec.normalize, "max_tokens": self.spec.max_tokens})

    def info(self) -> ModelInfo:
        if self._info is None:
            raise Unavailable("model is still loading", reason="LOADING")
        return self._info

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (valid after ``start``)."""
        return self._encoder.tokenizer

    def stats(self) -> EngineStats:
        self._stats.queued_requests = self._inbox.qsize()
        return self._stats

    async def shutdown(self) -> None:
        self._inbox.put(None)

    def generate(self, request: GenerationRequest) -> Any:
        raise InvalidArgument(f"model: {self.config.served_name} is an embedding model; use /v1/embeddings",
                              field="model", reason="WRONG_TASK")

    async def abort(self, request_id: str) -> bool:
        return False

    async def embed(self, inputs: list[str | list[int]],
                    dimensions: int | None = None) -> tuple[np.ndarray, list[int]]:
        """Vectors (len(inputs), dimensions or the model's size) in input order, and each input's token count."""
        check_dimensions(dimensions, self.info())
        loop = asyncio.get_running_loop()
        job = _Job(inputs, loop, loop.create_future())
        self._inbox.put(job)
        vectors, tokens = await job.future
        return shorten(vectors, dimensions), tokens

    # --- engine thread --------------------------------------------------------------------------------------------
    def _collect(self, first: _Job) -> list[_Job]:
        jobs, count = [first], len(first.inputs)
        wait = self.config.batch_wait_ms / 1000
        while count < self.config.max_batch_inputs:
            try:
                nxt = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._inbox.put(None)  # keep the stop signal for the loop
                break
            jobs.append(nxt)
            count += len(nxt.inputs)
        return jobs

    def _run(self) -> None:
        while True:
            first = self._inbox.get()
            if first is None:
                return
            jobs = self._collect(first)
            self._stats.active_requests = len(jobs)
            self._stats.max_batch_seen = max(self._stats.max_batch_seen, sum(len(j.inputs) for j in jobs))
            encoded: list[tuple[_Job, list[list[int]] | BaseException]] = []
            for job in jobs:
                try:
                    encoded.append((job, self._encoder.encode(job.inputs)))
                except Exception as e:  # noqa: BLE001 - a bad input fails its own request only
                    encoded.append((job, e))
            rows = [ids for _, enc in encoded if not isinstance(enc, BaseException) for ids in enc]
            try:
                vectors = self._forward(rows) if rows else None
            except Exception as e:  # noqa: BLE001 - reported to every request of the batch
                log.exception("embedding forward failed")
                for job, _ in encoded:
                    job.loop.call_soon_threadsafe(_settle, job.future, None, Unavailable(f"engine error: {e!r}"))
                continue
            at = 0
            for job, enc in encoded:
                if isinstance(enc, BaseException):
                    job.loop.call_soon_threadsafe(_settle, job.future, None, enc)
                    continue
                assert vectors is not None
                n = len(enc)
                result = (vectors[at:at + n], [len(ids) for ids in enc])
                at += n
                self._stats.completed_requests += 1
                job.loop.call_soon_threadsafe(_settle, job.future, result, None)
            self._stats.active_requests = 0

    def _forward(self, rows: list[list[int]]) -> np.ndarray:
        torch = self._torch
        out = np.zeros((len(rows), self.info().embedding_size), np.float32)
        # Sorted by length so a batch pads little; rows are scattered back to their own places.
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        with torch.inference_mode():
            for start in range(0, len(order), self.config.max_batch_inputs):
                chunk = order[start:start + self.config.max_batch_inputs]
                width = max(len(rows[i]) for i in chunk)
                ids = torch.zeros(len(chunk), width, dtype=torch.long)
                mask = torch.zeros(len(chunk), width, dtype=torch.long)
                for j, i in enumerate(chunk):
                    ids[j, :len(rows[i])] = torch.tensor(rows[i])
                    mask[j, :len(rows[i])] = 1
                hidden = self._model(input_ids=ids, attention_mask=mask).last_hidden_state
                if self.spec.pooling == "cls":
                    pooled = hidden[:, 0]
                else:
                    m = mask.unsqueeze(-1).to(hidden.dtype)
                    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
                if self.spec.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                self.forward_passes += 1
                out[chunk] = pooled.float().numpy()
        return out


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller went away (cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
