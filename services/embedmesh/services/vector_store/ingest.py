"""Background ingestion: chunk -> embed (batches) -> commit chunks and ``completed`` atomically -> index.

One asyncio task per store file, at most ``concurrency`` running at once. Progress (chunks_done / chunks_total) is
written after every embedded batch and logged. Failures mark the file ``failed`` with OpenAI's ``last_error`` codes
(``invalid_file`` for unusable content, ``server_error`` for the embedding service or the index). A cancelled task
writes nothing. A process that dies mid-file leaves it ``in_progress`` with no chunks; ``requeue`` at start-up picks
it up again (or marks it failed).

Metrics (the dashboard's "Vector store" row): ``embedmesh_vector_store_files_ingested_total{status}`` counts every
ingestion task once as it ends (completed, failed, or cancelled — a file removed, re-added or cancelled before it
completed), ``embedmesh_vector_store_ingestion_duration_seconds`` observes each completed or failed file from the
start of its work, ``embedmesh_vector_store_chunks_indexed_total`` counts chunks committed, and
``embedmesh_vector_store_ingestions_in_progress`` is the number of ingestion tasks queued or running.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from embedmesh.core.errors import EmbedmeshError, InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.services.vector_store.chunking import TokenCounter, chunk_text
from embedmesh.services.vector_store.embedder import Embedder
from embedmesh.services.vector_store.files import decode_text
from embedmesh.services.vector_store.index.base import VectorIndex
from embedmesh.services.vector_store.metrics import CHUNKS_INDEXED, FILES_INGESTED, IN_PROGRESS, INGESTION_SECONDS
from embedmesh.services.vector_store.objects import AUTO_CHUNKING, ChunkingSpec
from embedmesh.services.vector_store.store import MetadataStore, PendingFile

__all__ = ["Ingestor"]

log = get_logger(__name__)

try:
    from psycopg import OperationalError as _PgOperationalError

    _CONNECTION_LOST: tuple[type[Exception], ...] = (_PgOperationalError,)
    """PostgreSQL's "connection lost / refused" family (a server restart, a network cut): retried per file."""
except ImportError:  # the embedded backend alone
    _CONNECTION_LOST = ()



SPECIAL_TOKENS = 2
"""Tokens the embedding model adds to every input ([CLS] and [SEP] for MiniLM); chunks are counted without them."""


def fit_auto_chunking(spec: ChunkingSpec, max_input_tokens: int) -> ChunkingSpec:
    """``auto`` chunking (800/400, OpenAI's) cut to what the embedding model takes in one input: an 800-token chunk
    would fail the whole file against a 256-token model such as all-MiniLM-L6-v2, so ``auto`` means the model's
    length (minus its special tokens) with half of it as overlap there. A ``static`` strategy is the client's
    explicit choice and is kept (a chunk the model refuses fails the file, naming the sizes)."""
    room = max_input_tokens - SPECIAL_TOKENS
    if spec != AUTO_CHUNKING or max_input_tokens <= 0 or room >= spec.max_chunk_size_tokens:
        return spec
    room = max(room, 1)
    return ChunkingSpec(max_chunk_size_tokens=room, chunk_overlap_tokens=min(spec.chunk_overlap_tokens, room // 2))


class Ingestor:
    def __init__(self, store: MetadataStore, index: VectorIndex, embedder: Embedder, tokenizer: TokenCounter,
                 concurrency: int = 2, retries: int = 4, retry_delay_seconds: float = 1.0) -> None:
        self.store = store
        self.index = index
        self.embedder = embedder
        self.tokenizer = tokenizer
        self._sem = asyncio.Semaphore(concurrency)
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.retries = retries
        self.retry_delay = retry_delay_seconds

    def submit(self, p: PendingFile) -> None:
        """Start (or restart) ingesting a store file in the background."""
        self.cancel(p.store_id, p.file_id)
        key = (p.store_id, p.file_id)
        task = asyncio.create_task(self._run(p), name=f"ingest {p.store_id}/{p.file_id}")
        self._tasks[key] = task
        IN_PROGRESS.inc()
        task.add_done_callback(lambda t, key=key: self._ended(key, t))

    def _ended(self, key: tuple[str, str], task: asyncio.Task[str]) -> None:
        # A done callback runs for every task, even one cancelled before it started (its coroutine never ran).
        if self._tasks.get(key) is task:
            self._tasks.pop(key, None)
        IN_PROGRESS.dec()
        if task.cancelled():
            FILES_INGESTED.labels(status="cancelled").inc()
        else:
            FILES_INGESTED.labels(status="failed" if task.exception() is not None else task.result()).inc()

    def cancel(self, store_id: str, file_id: str) -> None:
        task = self._tasks.pop((store_id, file_id), None)
        if task is not None:
            task.cancel()

    def cancel_store(self, store_id: str) -> None:
        for s, f in list(self._tasks):
            if s == store_id:
                self.cancel(s, f)

    def cancel_file(self, file_id: str) -> None:
        for s, f in list(self._tasks):
            if f == file_id:
                self.cancel(s, f)

    @property
    def running(self) -> int:
        return len(self._tasks)

    async def requeue(self, retry: bool) -> int:
        """Files left in progress by a previous process: ingest them again (retry) or mark them failed."""
        pending = await self.store.db.run(self.store.pending)
        for p in pending:
            if retry:
                log.info("re-queueing a file left in progress", extra={"store": p.store_id, "file": p.file_id})
                self.submit(p)
            else:
                await self.store.db.run(self.store.fail, p, "server_error",
                                        "the service stopped while ingesting this file; add it again")
        return len(pending)

    async def _embed(self, texts: list[str]) -> np.ndarray:
        for attempt in range(self.retries + 1):
            try:
                return await self.embedder.embed_batch(texts)
            except Unavailable:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(self.retry_delay * 2**attempt)
        raise AssertionError("unreachable")

    async def _run(self, p: PendingFile) -> str:
        """Ingest one store file; returns how it ended: "completed", "failed" or "cancelled".

        A database connection lost on the way (PostgreSQL restarted or out of reach) is not the file's fault: the
        file is tried again from its start, ``retries`` times with backoff, on a new connection (``Database.run``
        opens one). Its chunks are committed only at the end, all at once, so nothing is stored twice. Past the
        retries the error ends the task and the file stays ``in_progress`` (``requeue`` picks it up at the next
        start): marking it failed needs the database that is missing."""
        for attempt in range(self.retries + 1):
            try:
                return await self._run_once(p)
            except _CONNECTION_LOST as e:
                if attempt == self.retries:
                    raise
                log.warning("database connection lost while ingesting; trying the file again",
                            extra={"store": p.store_id, "file": p.file_id, "error": type(e).__name__})
                await asyncio.sleep(self.retry_delay * 2**attempt)
        raise AssertionError("unreachable")

    async def _run_once(self, p: PendingFile) -> str:
        async with self._sem:
            db = self.store.db
            t0 = time.perf_counter()
            committed = False
            try:
                if not await db.run(self.store.is_current, p):
                    return "cancelled"
                media_type, content = await db.run(self.store.ingest_source, p.file_id)
                text = decode_text(content, media_type)
                chunking = fit_auto_chunking(p.chunking, await self.embedder.max_input_tokens())
                chunks = await asyncio.to_thread(chunk_text, text, chunking, self.tokenizer)
                if not chunks:
                    raise InvalidArgument("the file holds no text to index", field="file", reason="EMPTY_FILE")
                total = len(chunks)
                await db.run(self.store.set_progress, p, 0, total)
                parts: list[np.ndarray] = []
                done = 0
                bs = self.embedder.batch_size
                for i in range(0, total, bs):
                    parts.append(await self._embed([c.text for c in chunks[i:i + bs]]))
                    done = min(total, i + bs)
                    await db.run(self.store.set_progress, p, done, total)
                    log.info("ingest progress", extra={"store": p.store_id, "file": p.file_id, "chunks_done": done,
                                                       "chunks_total": total})
                vectors = np.concatenate(parts)
                ids = await db.run(self.store.complete, p, chunks, vectors)
                if ids is None:
                    log.info("ingest dropped: the file was cancelled, removed or re-added",
                             extra={"store": p.store_id, "file": p.file_id})
                    return "cancelled"
                committed = True
                CHUNKS_INDEXED.inc(total)
                await self.index.added(p.store_id, p.file_id, ids, vectors)
                seconds = time.perf_counter() - t0
                INGESTION_SECONDS.observe(seconds)
                log.info("ingest completed", extra={"store": p.store_id, "file": p.file_id, "chunks": total,
                                                    "seconds": round(seconds, 3)})
                return "completed"
            except asyncio.CancelledError:
                log.info("ingest cancelled", extra={"store": p.store_id, "file": p.file_id})
                raise
            except _CONNECTION_LOST:
                raise  # _run tries the file again; recording a failure would need the lost connection
            except InvalidArgument as e:
                failed = await db.run(self.store.fail, p, "invalid_file", e.message)
                log.warning("ingest failed", extra={"store": p.store_id, "file": p.file_id, "error": e.message})
            except EmbedmeshError as e:
                failed = await db.run(self.store.fail, p, "server_error", e.message)
                log.warning("ingest failed", extra={"store": p.store_id, "file": p.file_id, "error": e.message})
            except Exception as e:  # noqa: BLE001 - a background task must record its failure, not vanish
                log.exception("ingest crashed", extra={"store": p.store_id, "file": p.file_id})
                failed = await db.run(self.store.fail, p, "server_error", f"internal error: {type(e).__name__}")
            if not failed:
                # Nothing recorded: the rows were committed before the error (the index is reconciled from them),
                # or the file was cancelled, removed or re-added while this ran.
                return "completed" if committed else "cancelled"
            INGESTION_SECONDS.observe(time.perf_counter() - t0)
            return "failed"

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
