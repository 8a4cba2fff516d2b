"""The default embedding engine: a sentence-transformers model run with transformers on the CPU.

Pooling and normalisation are read from the model folder (``1_Pooling/config.json``, ``modules.json``), so the
vectors are the ones the model was trained to produce (mean pooling + L2 for all-MiniLM-L6-v2). Concurrent
requests are batched: the engine thread takes everything waiting (up to ``max_batch_inputs``) into one forward.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedmesh.core.errors import InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.services.worker.engines.base import Engine, EngineStats, GenerationRequest, ModelInfo

__all__ = ["HFEmbedEngine", "HFEmbedConfig"]

log = get_logger(__name__)


@dataclass(frozen=True)
class HFEmbedConfig:
    model_path: Path
    """A sentence-transformers folder (config.json, tokenizer, 1_Pooling/config.json)."""
    served_name: str
    """Name clients pass as ``model``."""
    max_batch_inputs: int = 64
    """Most inputs in one forward pass."""
    threads: int = 2
    """torch threads."""
    supports_dimensions: bool = False
    """Allow truncating vectors (only for Matryoshka-trained models; all-MiniLM-L6-v2 is not)."""


@dataclass(eq=False)
class _Job:
    inputs: list[str | list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[tuple[np.ndarray, list[int]]]
    enqueued: float = field(default_factory=time.monotonic)


class HFEmbedEngine(Engine):
    def __init__(self, config: HFEmbedConfig) -> None:
        self.config = config
        self._inbox: queue.Queue[_Job | None] = queue.Queue()
        self._stats = EngineStats()
        self._info: ModelInfo | None = None
        self.forward_passes = 0
        """Forward passes run (fewer than requests when batching works)."""

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        threading.Thread(target=self._run, name="hf-embed", daemon=True).start()

    def _load(self) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        torch.set_num_threads(self.config.threads)
        folder = self.config.model_path
        self.torch = torch
        self.model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        pooling = json.loads((folder / "1_Pooling" / "config.json").read_text()) \
            if (folder / "1_Pooling" / "config.json").exists() else {"pooling_mode_mean_tokens": True}
        self.pooling = "cls" if pooling.get("pooling_mode_cls_token") else "mean"
        modules = json.loads((folder / "modules.json").read_text()) if (folder / "modules.json").exists() else []
        self.normalize = any("Normalize" in m.get("type", "") for m in modules)
        st_cfg = folder / "sentence_bert_config.json"
        self.max_tokens = int(json.loads(st_cfg.read_text()).get("max_seq_length", 512)) if st_cfg.exists() \
            else int(self.model.config.max_position_embeddings)
        size = int(self.model.config.hidden_size)
        self._info = ModelInfo(self.config.served_name, "hf", size, self.max_tokens, "float32",
                               int(self.model.config.vocab_size), self.config.max_batch_inputs, task="embed",
                               embedding_size=size, supports_dimensions=self.config.supports_dimensions)
        log.info("embedding model loaded", extra={"path": str(folder), "pooling": self.pooling,
                                                  "normalize": self.normalize, "max_tokens": self.max_tokens})

    def info(self) -> ModelInfo:
        if self._info is None:
            raise Unavailable("model is still loading")
        return self._info

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

    # --- embeddings -------------------------------------------------------------------------------------------
    def _encode(self, inputs: list[str | list[int]]) -> list[list[int]]:
        """Token ids per input (with the model's special tokens); length and vocabulary checked per input."""
        info = self.info()
        out = []
        for i, item in enumerate(inputs):
            field_name = f"input[{i}]" if len(inputs) > 1 else "input"
            if isinstance(item, str):
                ids = self.tokenizer(item, add_special_tokens=True)["input_ids"]
            else:
                bad = [t for t in item if t < 0 or t >= info.vocab_size]
                if bad:
                    raise InvalidArgument(f"{field_name}: token id {bad[0]} is outside the vocabulary "
                                          f"[0, {info.vocab_size})", field=field_name, reason="TOKEN_OUT_OF_RANGE")
                ids = list(item)
            if len(ids) > self.max_tokens:
                raise InvalidArgument(
                    f"{field_name}: {len(ids)} tokens; {info.model} accepts at most {self.max_tokens}",
                    field=field_name, reason="INPUT_TOO_LONG")
            out.append(ids)
        return out

    async def embed(self, inputs: list[str | list[int]],
                    dimensions: int | None = None) -> tuple[np.ndarray, list[int]]:
        info = self.info()
        if dimensions is not None:
            if dimensions < 1 or dimensions > info.embedding_size:
                raise InvalidArgument(f"dimensions: must be in [1, {info.embedding_size}] for {info.model}",
                                      field="dimensions", reason="OUT_OF_RANGE")
            if dimensions != info.embedding_size and not info.supports_dimensions:
                raise InvalidArgument(
                    f"dimensions: {info.model} was not trained for shortened vectors (not Matryoshka); omit "
                    f"dimensions or pass {info.embedding_size}", field="dimensions", reason="UNSUPPORTED")
        loop = asyncio.get_running_loop()
        job = _Job(inputs, loop, loop.create_future())
        self._inbox.put(job)
        vectors, tokens = await job.future
        if dimensions is not None and dimensions != vectors.shape[1]:
            vectors = vectors[:, :dimensions]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(vectors, dtype=np.float32), tokens

    def _run(self) -> None:
        torch = self.torch
        while True:
            first = self._inbox.get()
            if first is None:
                return
            jobs = [first]
            count = len(first.inputs)
            while count < self.config.max_batch_inputs:
                try:
                    nxt = self._inbox.get(timeout=0.002)
                except queue.Empty:
                    break
                if nxt is None:
                    self._inbox.put(None)
                    break
                jobs.append(nxt)
                count += len(nxt.inputs)
            encoded: list[tuple[_Job, list[list[int]] | BaseException]] = []
            for job in jobs:
                try:
                    encoded.append((job, self._encode(job.inputs)))
                except BaseException as e:  # noqa: BLE001 - reported to that request only
                    encoded.append((job, e))
            rows = [ids for _, enc in encoded if not isinstance(enc, BaseException) for ids in enc]
            vectors = np.zeros((0, self.info().embedding_size), np.float32)
            if rows:
                try:
                    with torch.inference_mode():
                        vectors = self._forward(rows)
                except BaseException as e:  # noqa: BLE001
                    log.exception("embedding forward failed")
                    for job, _ in encoded:
                        job.loop.call_soon_threadsafe(_settle, job.future, None, Unavailable(f"engine error: {e!r}"))
                    continue
            at = 0
            for job, enc in encoded:
                if isinstance(enc, BaseException):
                    job.loop.call_soon_threadsafe(_settle, job.future, None, enc)
                    continue
                n = len(enc)
                result = (vectors[at:at + n], [len(ids) for ids in enc])
                at += n
                self._stats.completed_requests += 1
                job.loop.call_soon_threadsafe(_settle, job.future, result, None)

    def _forward(self, rows: list[list[int]]) -> np.ndarray:
        torch = self.torch
        out = np.zeros((len(rows), self.info().embedding_size), np.float32)
        # Sort by length so padding stays small; scatter back to the input order.
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        for start in range(0, len(order), self.config.max_batch_inputs):
            chunk = order[start:start + self.config.max_batch_inputs]
            width = max(len(rows[i]) for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, i in enumerate(chunk):
                ids[j, :len(rows[i])] = torch.tensor(rows[i])
                mask[j, :len(rows[i])] = 1
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                m = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            if self.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            self.forward_passes += 1
            out[chunk] = pooled.float().numpy()
        return out


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
