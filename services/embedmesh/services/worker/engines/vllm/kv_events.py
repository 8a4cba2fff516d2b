"""vLLM's KV cache events in the mesh's terms: blocks stored (under a parent), blocks removed, everything cleared,
keyed by the mesh's own chained block hashes (``embedmesh.core.block_hash``) rather than vLLM's.

vLLM publishes batches of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` over ZMQ (PUB, one sequence
number per batch, a ROUTER socket replaying recent batches on request). Its block hashes cannot be recomputed from
what the router sees (they chain SHA-256 over vLLM's own keys), and for positions given as embeddings it reports
token ids of zero. So the translation works from the prompts this worker sent:

* the engine ``track``s every request (its segments, as the preprocessor hashed them, and what vLLM was given);
* a ``BlockStored`` is placed at a position (0, or right after its parent, whose position we learned earlier),
  matched to the tracked request whose content agrees (token ids; for embeddings, vLLM's per-block SHA-256 digest
  of the rows when it sends one), and its blocks mapped to the mesh hashes of the mesh blocks that end inside them;
* the map vLLM hash -> mesh hashes is kept while vLLM holds the block, so ``BlockRemoved`` translates and a
  router's re-sync is answered from ``snapshot()``.

Sequence numbers are checked: a gap holds later batches and asks the caller to replay from the first missing one;
when the replay cannot fill it the mapping is reset and the router told ``Cleared`` (it then under-counts this
worker's cache, which costs routing quality, never correctness). Blocks computed under a LoRA adapter carry its
id (``lora_id``, and ``lora_name`` where vLLM sends it): they match only requests tracked with that adapter and
map to the adapter's chain (``adapter_block_hashes``), so the router never credits a base-model prefix with an
adapter's blocks or the other way round. Offloaded tiers (medium other than vLLM's primary one) are not reported.

    KvEventTranslator     pure bookkeeping, no I/O (unit-tested with synthetic batches)
    VllmKvEventSubscriber ZMQ SUB + replay (DEALER) feeding a translator, on the asyncio loop
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embedmesh.core.block_hash import ROOT, adapter_block_hashes, block_hashes
from embedmesh.core.kv_events import Cleared, KvEvent, Removed, Stored, stored_runs
from embedmesh.core.logs import get_logger
from embedmesh.services.worker.engines.base import Segment, TokenSegment

__all__ = [
    "Stored",
    "Removed",
    "Cleared",
    "MeshKvEvent",
    "KvEventTranslator",
    "VllmKvEventSubscriber",
    "event_rows",
    "events_log",
]

log = get_logger(__name__)

PRIMARY_MEDIA = frozenset({None, "GPU"})
"""vLLM labels its main KV pool "GPU" on every platform (the CPU build too); "CPU"/"STORAGE" are offload tiers."""


MeshKvEvent = KvEvent
"""The events this module produces (``core.kv_events``: one definition for producers and the router)."""
Sink = Callable[[list[MeshKvEvent]], None]
"""Receives the translation of one vLLM batch (never an empty list)."""


@dataclass
class _Tracked:
    """A request whose blocks may still be reported: what the router hashed and what vLLM was given."""

    segments: list[Segment]
    prompt_len: int
    sent_tokens: Sequence[int] | None
    """Token ids when vLLM got a TokensPrompt."""
    sent_rows: np.ndarray | None
    """The embeddings tensor vLLM got (EmbedsPrompt), in the bytes vLLM hashes; its token ids read as zeros."""
    generated: list[int] = field(default_factory=list)
    mesh_hashes: list[int] = field(default_factory=list)
    """Mesh hashes of the full blocks known so far (prompt first, then blocks completed by generated tokens)."""
    digests: dict[tuple[int, int], bytes] = field(default_factory=dict)
    finished_at: float | None = None
    adapter: str = ""
    """LoRA adapter name ("" = the base model); the mesh hashes are its chain."""
    lora_id: int = 0
    """vLLM's integer id of that adapter (0 = none)."""

    def same_lora(self, ev: Any) -> bool:
        """The event's blocks were computed under this request's adapter (or both under the base model)."""
        name = getattr(ev, "lora_name", None) or ""
        lid = getattr(ev, "lora_id", None) or 0
        if not (name or lid):
            return not self.adapter
        return bool(self.adapter) and (not name or name == self.adapter) and (not lid or lid == self.lora_id)

    @property
    def nbytes(self) -> int:
        """Tensor bytes this entry keeps alive (finished entries are bounded by it)."""
        rows = sum(s.rows.nbytes for s in self.segments if not isinstance(s, TokenSegment))
        return rows + (self.sent_rows.nbytes if self.sent_rows is not None else 0)


@dataclass(frozen=True)
class _Block:
    """One block vLLM holds, as the mesh sees it."""

    end: int
    """Position just past the block."""
    last_mesh: int
    """Mesh hash of the last mesh block ending at or before ``end`` (``ROOT`` if none): a child's parent."""
    parent_mesh: int
    """Mesh hash before ``mesh_hashes`` (for snapshots)."""
    mesh_hashes: tuple[int, ...]
    """Mesh blocks that end inside this vLLM block (none when vLLM's blocks are smaller than the mesh's)."""


class KvEventTranslator:
    """Turns vLLM KV event batches into mesh events (see the module docstring); single-threaded."""

    def __init__(self, block_size: int, sink: Sink, *, keep_finished: int = 64,
                 keep_finished_bytes: int = 256 << 20, finished_ttl_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self._sink = sink
        self._keep_finished = keep_finished
        self._keep_bytes = keep_finished_bytes
        self._ttl = finished_ttl_seconds
        self._clock = clock
        self._requests: OrderedDict[str, _Tracked] = OrderedDict()
        """Insertion order = submission order; the newest match wins ties."""
        self._blocks: dict[Hashable, _Block] = {}
        self._refs: dict[int, int] = {}
        """mesh hash -> number of vLLM blocks mapping to it (a Removed goes out when it drops to 0)."""
        self._expected: int = 0
        """Next vLLM sequence number (vLLM's publisher counts from 0)."""
        self._held: dict[int, Any] = {}
        """Batches that arrived after a gap, waiting for the replay to fill it."""
        self.counters = {"batches": 0, "stored_blocks": 0, "removed_blocks": 0, "unplaced_blocks": 0,
                         "skipped_blocks": 0, "gaps": 0, "lost": 0, "cleared": 0}

    # --- requests ---------------------------------------------------------------------------------------------
    def track(self, request_id: str, segments: list[Segment], *, sent_tokens: Sequence[int] | None = None,
              sent_rows: np.ndarray | None = None, adapter: str = "", lora_id: int = 0) -> None:
        """Remember a request before it reaches vLLM (exactly one of ``sent_tokens`` / ``sent_rows``), with the
        LoRA adapter it runs under (name and vLLM's id) if any."""
        if (sent_tokens is None) == (sent_rows is None):
            raise ValueError("give exactly one of sent_tokens and sent_rows")
        prompt_len = sum(len(s) for s in segments)
        pieces = [s.ids if isinstance(s, TokenSegment) else s.rows for s in segments]
        self._requests[request_id] = _Tracked(
            segments, prompt_len, sent_tokens, sent_rows,
            mesh_hashes=adapter_block_hashes(block_hashes(pieces, self.block_size), adapter),
            adapter=adapter, lora_id=lora_id)
        self._requests.move_to_end(request_id)

    def finish(self, request_id: str) -> None:
        """The request ended; its late events are still placed for a while (events and outputs race)."""
        t = self._requests.get(request_id)
        if t is not None:
            t.finished_at = self._clock()
        self._expire()

    def _expire(self) -> None:
        now = self._clock()
        finished = [rid for rid, t in self._requests.items() if t.finished_at is not None]
        kept = sum(self._requests[rid].nbytes for rid in finished)
        for i, rid in enumerate(finished):  # oldest first
            t = self._requests[rid]
            assert t.finished_at is not None
            if i < len(finished) - self._keep_finished or now - t.finished_at > self._ttl or kept > self._keep_bytes:
                kept -= t.nbytes
                del self._requests[rid]

    # --- batches ----------------------------------------------------------------------------------------------
    def accept(self, seq: int, batch: Any) -> int | None:
        """Apply one batch in sequence order. Returns the sequence number to replay from when there is a gap
        (the batch is held until the replay ends), otherwise None."""
        if seq < self._expected:
            return None  # a duplicate (replay overlapping what arrived live)
        if seq > self._expected:
            first_gap = not self._held
            self._held[seq] = batch
            if first_gap:
                self.counters["gaps"] += 1
                return self._expected
            return None
        self._apply(batch)
        self._expected = seq + 1
        self._drain()
        return None

    def replay_done(self) -> None:
        """The replay answered (or failed); batches still missing are lost: reset the mapping and go on."""
        if not self._held:
            return
        self.counters["lost"] += 1
        log.warning("vLLM KV events lost; resetting the block map",
                    extra={"expected": self._expected, "next_held": min(self._held)})
        self._reset(notify=True)
        self._expected = min(self._held)
        self._drain()

    def cleared(self) -> None:
        """The engine's prefix cache was reset: tell the router now. (vLLM queues its own AllBlocksCleared until
        its next scheduler step, which may be long after an idle reset; it is harmless when it comes.)"""
        self.counters["cleared"] += 1
        self._reset(notify=True)

    @property
    def awaiting_replay(self) -> bool:
        return bool(self._held)

    def _drain(self) -> None:
        while self._expected in self._held:
            self._apply(self._held.pop(self._expected))
            self._expected += 1

    def _apply(self, batch: Any) -> None:
        self.counters["batches"] += 1
        self._expire()
        out: list[MeshKvEvent] = []
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                out.extend(self._stored(ev))
            elif kind == "BlockRemoved":
                out.extend(self._removed(ev))
            elif kind == "AllBlocksCleared":
                self.counters["cleared"] += 1
                self._reset(notify=False)
                out.append(Cleared())
        if out:
            self._sink(out)

    def _reset(self, *, notify: bool) -> None:
        """Forget every block; ``notify`` sends Cleared (a vLLM AllBlocksCleared is forwarded by ``_apply``)."""
        self._blocks.clear()
        self._refs.clear()
        if notify:
            self._sink([Cleared()])

    def _primary(self, ev: Any) -> bool:
        return getattr(ev, "medium", None) in PRIMARY_MEDIA and getattr(ev, "group_idx", None) in (None, 0)

    def _removed(self, ev: Any) -> list[MeshKvEvent]:
        if not self._primary(ev):
            return []
        gone: list[int] = []
        for h in ev.block_hashes:
            blk = self._blocks.pop(_key(h), None)
            if blk is None:
                continue
            self.counters["removed_blocks"] += 1
            for m in blk.mesh_hashes:
                self._refs[m] -= 1
                if self._refs[m] == 0:
                    del self._refs[m]
                    gone.append(m)
        return [Removed(tuple(gone))] if gone else []

    def _stored(self, ev: Any) -> list[MeshKvEvent]:
        n = len(ev.block_hashes)
        if not self._primary(ev):
            self.counters["skipped_blocks"] += n
            return []
        if ev.parent_block_hash is None:
            start, parent_last = 0, ROOT
        else:
            parent = self._blocks.get(_key(ev.parent_block_hash))
            if parent is None:
                self.counters["unplaced_blocks"] += n
                return []
            start, parent_last = parent.end, parent.last_mesh
        size = len(ev.token_ids) // n if n and ev.token_ids else int(ev.block_size)
        end = start + size * n
        extra = list(getattr(ev, "extra_keys", None) or [None] * n)
        req = self._match(start, end, size, ev.token_ids, extra, parent_last, ev)
        if req is None:
            self.counters["unplaced_blocks"] += n
            return []
        self._learn_generated(req, start, ev.token_ids)
        hashes = self._mesh_hashes_to(req, end)
        if hashes is None:
            self.counters["unplaced_blocks"] += n
            return []
        fresh: list[tuple[int, int]] = []
        """(parent, hash) of every mesh block the router does not know yet, in chain order."""
        for j, vh in enumerate(ev.block_hashes):
            b_start, b_end = start + j * size, start + (j + 1) * size
            first, last = b_start // self.block_size, b_end // self.block_size  # mesh blocks [first, last)
            key = _key(vh)
            if key in self._blocks:  # already held (a prefix-cache reuse report): nothing new
                continue
            mesh = tuple(hashes[first:last])
            self._blocks[key] = _Block(b_end, hashes[last - 1] if last > 0 else ROOT,
                                       hashes[first - 1] if first > 0 else ROOT, mesh)
            self.counters["stored_blocks"] += 1
            for i in range(first, last):
                m = hashes[i]
                self._refs[m] = self._refs.get(m, 0) + 1
                if self._refs[m] == 1:
                    fresh.append((hashes[i - 1] if i > 0 else ROOT, m))
        return list(stored_runs(fresh))

    # --- matching ---------------------------------------------------------------------------------------------
    def _match(self, start: int, end: int, size: int, token_ids: Sequence[int], extra: list[Any],
               parent_last: int, ev: Any = None) -> _Tracked | None:
        """The newest tracked request whose content (and LoRA adapter) agrees with the event's."""
        for t in reversed(self._requests.values()):
            if start > t.prompt_len + len(t.generated):
                continue
            if ev is not None and not t.same_lora(ev):
                continue
            if start > 0 and not self._parent_agrees(t, start, parent_last):
                continue
            if self._content_agrees(t, start, end, size, token_ids, extra):
                return t
        return None

    def _parent_agrees(self, t: _Tracked, start: int, parent_last: int) -> bool:
        i = start // self.block_size - 1
        if i < 0:
            return parent_last == ROOT
        hashes = self._mesh_hashes_to(t, start)
        return hashes is not None and i < len(hashes) and hashes[i] == parent_last

    def _content_agrees(self, t: _Tracked, start: int, end: int, size: int, token_ids: Sequence[int],
                        extra: list[Any]) -> bool:
        got = list(token_ids)
        stop = min(end, t.prompt_len)
        if stop > start:
            if t.sent_tokens is not None:
                if got[:stop - start] != list(t.sent_tokens[start:stop]):
                    return False
            elif any(got[:stop - start]):
                return False
        g0, g1 = max(start, t.prompt_len), min(end, t.prompt_len + len(t.generated))
        if g1 > g0 and got[g0 - start:g1 - start] != t.generated[g0 - t.prompt_len:g1 - t.prompt_len]:
            return False
        if t.sent_rows is None:
            return True
        for j, keys in enumerate(extra):
            digest = _embeds_digest(keys)
            b_start = start + j * size
            if digest is not None and b_start < t.prompt_len and digest != _digest(t, b_start, b_start + size):
                return False
        return True

    def _learn_generated(self, t: _Tracked, start: int, token_ids: Sequence[int]) -> None:
        """Generated tokens come from the events themselves (vLLM reports real ids after the prompt)."""
        for i, tok in enumerate(token_ids):
            g = start + i - t.prompt_len
            if g == len(t.generated):
                t.generated.append(int(tok))

    def _mesh_hashes_to(self, t: _Tracked, end: int) -> list[int] | None:
        """Mesh hashes of every full mesh block ending at or before ``end`` (None when tokens are unknown)."""
        need = end // self.block_size
        if len(t.mesh_hashes) < need:
            known = t.prompt_len + len(t.generated)
            if known < need * self.block_size:
                return None
            pieces: list[tuple[int, ...] | np.ndarray] = [
                s.ids if isinstance(s, TokenSegment) else s.rows for s in t.segments if len(s)]
            pieces.append(tuple(t.generated))
            t.mesh_hashes = adapter_block_hashes(block_hashes(pieces, self.block_size), t.adapter)
        return t.mesh_hashes

    # --- snapshot ---------------------------------------------------------------------------------------------
    def snapshot(self) -> list[MeshKvEvent]:
        """Every block vLLM holds as Stored events, parents before children (answers a router's re-sync)."""
        out: list[MeshKvEvent] = []
        seen: set[int] = set()
        for blk in sorted(self._blocks.values(), key=lambda b: b.end):
            fresh = tuple(m for m in blk.mesh_hashes if m not in seen)
            if fresh:
                seen.update(fresh)
                i = blk.mesh_hashes.index(fresh[0])
                out.append(Stored(blk.mesh_hashes[i - 1] if i else blk.parent_mesh, fresh))
        return out

    @property
    def block_count(self) -> int:
        """Mesh blocks currently reported as stored."""
        return len(self._refs)




def _key(h: Any) -> Hashable:
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h  # type: ignore[no-any-return]


def _embeds_digest(keys: Any) -> bytes | None:
    """vLLM's per-block prompt-embeds digest (SHA-256) among a block's untagged extra keys."""
    if not keys:
        return None
    for k in keys:
        if isinstance(k, (bytes, bytearray)) and len(k) == 32:
            return bytes(k)
    return None


def _digest(t: _Tracked, start: int, end: int) -> bytes:
    d = t.digests.get((start, end))
    if d is None:
        assert t.sent_rows is not None
        d = hashlib.sha256(np.ascontiguousarray(t.sent_rows[start:end]).tobytes()).digest()
        t.digests[(start, end)] = d
    return d


def event_rows(events: list[MeshKvEvent]) -> list[dict[str, Any]]:
    """Mesh events as JSON-ready rows (``--kv-events-log``): kind, and parent / block hashes where they apply."""
    rows: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, Stored):
            rows.append({"kind": "stored", "parent": e.parent_hash, "hashes": list(e.block_hashes)})
        elif isinstance(e, Removed):
            rows.append({"kind": "removed", "hashes": list(e.block_hashes)})
        else:
            rows.append({"kind": "cleared"})
    return rows


def events_log(path: str) -> Callable[[list[MeshKvEvent]], None]:
    """A KV-event listener appending each event to ``path`` as a JSON line (``--kv-events-log``)."""
    import json

    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life, line-buffered
    log.info("writing KV events", extra={"path": path})

    def write(events: list[MeshKvEvent]) -> None:
        out.writelines(json.dumps(row) + "\n" for row in event_rows(events))

    return write


END_SEQ = -1
"""vLLM's replay socket ends an answer with this sequence number."""


class VllmKvEventSubscriber:
    """Reads vLLM's ZMQ KV event stream into a translator (on the asyncio loop, so the translator needs no lock).

    On a gap it asks vLLM's replay socket (ROUTER) for the missing batches: a DEALER sends ``["", start]`` and
    reads ``["", topic, seq, payload]`` frames until ``seq == -1``.
    """

    def __init__(self, translator: KvEventTranslator, endpoint: str, replay_endpoint: str | None,
                 topic: str = "", replay_timeout_seconds: float = 2.0) -> None:
        self.translator = translator
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout = replay_timeout_seconds
        self._task: asyncio.Task[None] | None = None
        self._ctx: Any = None

    def start(self) -> None:
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._task = asyncio.create_task(self._run(), name="vllm-kv-events")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    async def _run(self) -> None:
        import zmq
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        decode = Decoder(type=KVEventBatch).decode
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        try:
            while True:
                _, seq_bytes, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                try:
                    replay_from = self.translator.accept(seq, decode(payload))
                except Exception:  # a bad batch must not stop the stream: report it and continue
                    log.exception("vLLM KV event batch failed to translate", extra={"seq": seq})
                    continue
                if replay_from is not None:
                    await self._replay(replay_from, decode)
        finally:
            sub.close(linger=0)

    async def _replay(self, start: int, decode: Callable[[bytes], Any]) -> None:
        import zmq

        if self.replay_endpoint is None:
            self.translator.replay_done()
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self.replay_timeout)
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                self.translator.accept(seq, decode(frames[3]))
        except TimeoutError:
            log.warning("vLLM KV event replay timed out", extra={"from": start})
        finally:
            sock.close(linger=0)
            self.translator.replay_done()
