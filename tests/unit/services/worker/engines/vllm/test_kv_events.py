"""Translation of vLLM's KV event batches into the mesh's events, with synthetic batches shaped like vLLM 0.32's
(``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, opaque vLLM hashes, zeros for embeddings positions)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from embedmesh.core.block_hash import ROOT, adapter_block_hashes, block_hashes
from embedmesh.core.kv_events import to_proto
from embedmesh.services.worker.engines.base import EmbedsSegment, TokenSegment
from embedmesh.services.worker.engines.vllm.kv_events import (
    Cleared,
    KvEventTranslator,
    MeshKvEvent,
    Removed,
    Stored,
    event_rows,
)

B = 4  # the mesh's block size in these tests


# Shaped like vllm.distributed.kv_events (the translator goes by class name and attributes only).
@dataclass
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = 0


@dataclass
class BlockRemoved:
    block_hashes: list[Any]
    medium: str | None = "GPU"
    group_idx: int | None = 0


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class Batch:
    events: list[Any] = field(default_factory=list)
    ts: float = 0.0


class Harness:
    def __init__(self, block_size: int = B, **kw: Any) -> None:
        self.got: list[list[MeshKvEvent]] = []
        self.t = KvEventTranslator(block_size, self.got.append, **kw)
        self.seq = 0

    def send(self, *events: Any) -> list[MeshKvEvent]:
        before = len(self.got)
        assert self.t.accept(self.seq, Batch(list(events))) is None
        self.seq += 1
        return [e for batch in self.got[before:] for e in batch]


def vh(name: str) -> bytes:
    """An opaque vLLM block hash (vLLM uses SHA-256 bytes by default)."""
    return hashlib.sha256(name.encode()).digest()


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], size: int, **kw: Any) -> BlockStored:
    return BlockStored(hashes, parent, tokens, size, **kw)


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)


def test_token_prompt_blocks_map_to_the_mesh_hashes() -> None:
    h = Harness()
    ids = tuple(range(100, 110))  # 2 full mesh blocks + 2 positions
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    ours = block_hashes([ids], B)
    assert h.send(stored([vh("a"), vh("b")], None, list(ids[:8]), B)) == [Stored(ROOT, tuple(ours))]
    assert h.t.block_count == 2


def test_vllm_blocks_larger_than_the_mesh_blocks_carry_several_mesh_hashes() -> None:
    h = Harness()
    ids = tuple(range(1, 17))
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    ours = block_hashes([ids], B)
    assert h.send(stored([vh("a"), vh("b")], None, list(ids), 8)) == [Stored(ROOT, tuple(ours))]
    assert h.send(BlockRemoved([vh("b")])) == [Removed(tuple(ours[2:]))]
    assert h.t.snapshot() == [Stored(ROOT, tuple(ours[:2]))]


def test_vllm_blocks_smaller_than_the_mesh_blocks() -> None:
    h = Harness(block_size=8)
    ids = tuple(range(1, 17))
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    ours = block_hashes([ids], 8)
    out = h.send(stored([vh("a"), vh("b"), vh("c"), vh("d")], None, list(ids), 4))
    assert out == [Stored(ROOT, tuple(ours))]
    assert h.send(BlockRemoved([vh("a")])) == []  # the mesh block ends in "b"
    assert h.send(BlockRemoved([vh("b")])) == [Removed((ours[0],))]


def test_blocks_filled_by_generated_tokens_chain_under_the_prompt() -> None:
    h = Harness()
    ids = tuple(range(1, 7))  # 6 positions: block 0 full, block 1 half prompt
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    ours = block_hashes([ids], B)
    assert h.send(stored([vh("a")], None, list(ids[:4]), B)) == [Stored(ROOT, (ours[0],))]
    generated = [50, 51, 52, 53, 54, 55]
    out = h.send(stored([vh("b")], vh("a"), [5, 6, 50, 51], B))
    full = block_hashes([ids, tuple(generated[:2])], B)
    assert out == [Stored(ours[0], (full[1],))]
    out = h.send(stored([vh("c")], vh("b"), generated[2:6], B))
    full = block_hashes([ids, tuple(generated)], B)
    assert out == [Stored(full[1], (full[2],))]


def test_embeddings_blocks_with_zero_token_ids_use_the_prompt_sent() -> None:
    h = Harness()
    e = rows(8, 0)
    h.t.track("r1", [EmbedsSegment(e)], sent_rows=e)
    ours = block_hashes([e], B)
    assert h.send(stored([vh("a"), vh("b")], None, [0] * 8, B)) == [Stored(ROOT, tuple(ours))]


def test_vllm_digests_tell_two_embeddings_prompts_of_one_length_apart() -> None:
    h = Harness()
    e1, e2 = rows(4, 1), rows(4, 2)
    h.t.track("r1", [EmbedsSegment(e1)], sent_rows=e1)
    h.t.track("r2", [EmbedsSegment(e2)], sent_rows=e2)  # newer: would win without a digest
    digest1 = hashlib.sha256(e1.tobytes()).digest()
    out = h.send(stored([vh("a")], None, [0] * 4, B, extra_keys=[(digest1,)]))
    assert out == [Stored(ROOT, tuple(block_hashes([e1], B)))]


def test_mixed_prompt_sent_as_embeddings_hashes_like_the_preprocessor() -> None:
    h = Harness()
    ids, e = (7, 8, 9), rows(5, 3)
    sent = np.concatenate([rows(3, 9), e])  # the engine looked the ids up in the embedding table
    h.t.track("r1", [TokenSegment(ids), EmbedsSegment(e)], sent_rows=sent)
    digests = [(hashlib.sha256(sent[i:i + 4].tobytes()).digest(),) for i in (0, 4)]
    out = h.send(stored([vh("a"), vh("b")], None, [0] * 8, B, extra_keys=digests))
    assert out == [Stored(ROOT, tuple(block_hashes([ids, e], B)))]


def test_token_ids_that_disagree_place_nothing() -> None:
    h = Harness()
    ids = (1, 2, 3, 4)
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    assert h.send(stored([vh("a")], None, [1, 2, 3, 5], B)) == []
    assert h.send(stored([vh("x")], vh("unknown-parent"), [1, 2, 3, 4], B)) == []
    assert h.t.counters["unplaced_blocks"] == 2


def test_shared_prefix_and_reuse_reports_are_not_repeated() -> None:
    h = Harness()
    p1, p2 = tuple(range(1, 9)), tuple(range(1, 5)) + (90, 91, 92, 93)
    h.t.track("r1", [TokenSegment(p1)], sent_tokens=p1)
    h.t.track("r2", [TokenSegment(p2)], sent_tokens=p2)
    o1, o2 = block_hashes([p1], B), block_hashes([p2], B)
    assert h.send(stored([vh("a"), vh("b")], None, list(p1), B)) == [Stored(ROOT, tuple(o1))]
    # vLLM reports r2's cached first block again (parent None), then its new second block under it.
    assert h.send(stored([vh("a")], None, list(p2[:4]), B), stored([vh("c")], vh("a"), list(p2[4:]), B)) == [
        Stored(o2[0], (o2[1],))]
    snap = h.t.snapshot()
    assert snap[0] == Stored(ROOT, (o1[0],)) and set(snap[1:]) == {Stored(o1[0], (o1[1],)), Stored(o1[0], (o2[1],))}


def test_removed_and_cleared() -> None:
    h = Harness()
    ids = tuple(range(1, 9))
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    ours = block_hashes([ids], B)
    h.send(stored([vh("a"), vh("b")], None, list(ids), B))
    assert h.send(BlockRemoved([vh("b"), vh("never-stored")])) == [Removed((ours[1],))]
    assert h.send(AllBlocksCleared()) == [Cleared()]
    assert h.t.snapshot() == [] and h.t.block_count == 0
    assert h.send(BlockRemoved([vh("a")])) == []


def test_a_local_reset_clears_at_once_and_vllms_late_clear_is_harmless() -> None:
    h = Harness()
    ids = tuple(range(1, 9))
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    h.send(stored([vh("a"), vh("b")], None, list(ids), B))
    h.t.cleared()
    assert h.got[-1] == [Cleared()] and h.t.snapshot() == []
    ours = block_hashes([ids], B)
    out = h.send(AllBlocksCleared(), stored([vh("a")], None, list(ids[:4]), B))
    assert out == [Cleared(), Stored(ROOT, (ours[0],))]


def test_offload_tiers_are_not_reported() -> None:
    h = Harness()
    ids = (1, 2, 3, 4)
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    assert h.send(stored([vh("b")], None, list(ids), B, medium="CPU")) == []
    assert h.t.counters["skipped_blocks"] == 1


def test_lora_blocks_map_to_the_adapters_chain_never_the_base_models() -> None:
    h = Harness()
    ids = tuple(range(1, 9))
    base = block_hashes([ids], B)
    sql = adapter_block_hashes(base, "sql")
    assert set(sql).isdisjoint(base)
    h.t.track("base", [TokenSegment(ids)], sent_tokens=ids)
    h.t.track("lora", [TokenSegment(ids)], sent_tokens=ids, adapter="sql", lora_id=1)
    # The newest tracked request has the same tokens, but its adapter differs from the event's: the base one wins.
    assert h.send(stored([vh("a"), vh("b")], None, list(ids), B)) == [Stored(ROOT, tuple(base))]
    assert h.send(stored([vh("la"), vh("lb")], None, list(ids), B, lora_name="sql", lora_id=1)) == \
        [Stored(ROOT, tuple(sql))]
    assert h.t.block_count == 4
    assert h.send(BlockRemoved([vh("lb")])) == [Removed((sql[1],))]


def test_lora_blocks_of_an_adapter_nobody_tracked_are_not_placed() -> None:
    h = Harness()
    ids = (1, 2, 3, 4)
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids, adapter="sql", lora_id=1)
    assert h.send(stored([vh("a")], None, list(ids), B, lora_id=2)) == []  # another adapter (by id)
    assert h.send(stored([vh("b")], None, list(ids), B, lora_name="chat", lora_id=1)) == []  # by name
    assert h.send(stored([vh("c")], None, list(ids), B)) == []  # the base model
    assert h.t.counters["unplaced_blocks"] == 3
    assert h.send(stored([vh("d")], None, list(ids), B, lora_id=1)) == \
        [Stored(ROOT, tuple(adapter_block_hashes(block_hashes([ids], B), "sql")))]


def test_a_gap_holds_batches_until_the_replay_fills_it() -> None:
    h = Harness()
    ids = tuple(range(1, 13))
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    ours = block_hashes([ids], B)
    b0 = Batch([stored([vh("a")], None, list(ids[:4]), B)])
    b1 = Batch([stored([vh("b")], vh("a"), list(ids[4:8]), B)])
    b2 = Batch([stored([vh("c")], vh("b"), list(ids[8:]), B)])
    assert h.t.accept(0, b0) is None
    assert h.t.accept(2, b2) == 1 and h.t.awaiting_replay  # replay from 1; b2 held
    assert h.t.accept(3, Batch()) is None  # still waiting: no second replay request
    assert len(h.got) == 1
    assert h.t.accept(1, b1) is None  # the replay's batch fills the gap, the held ones follow
    assert h.t.accept(2, b2) is None  # the replay repeats a batch already applied: ignored
    h.t.replay_done()
    assert [e for batch in h.got for e in batch] == [Stored(ROOT, (ours[0],)), Stored(ours[0], (ours[1],)),
                                                     Stored(ours[1], (ours[2],))]
    assert not h.t.awaiting_replay and h.t.counters["gaps"] == 1 and h.t.counters["lost"] == 0


def test_a_gap_the_replay_cannot_fill_resets_the_mapping() -> None:
    h = Harness()
    ids = tuple(range(1, 9))
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    ours = block_hashes([ids], B)
    h.t.accept(0, Batch([stored([vh("a")], None, list(ids[:4]), B)]))
    assert h.t.accept(5, Batch([stored([vh("a2")], None, list(ids[:4]), B)])) == 1
    h.t.replay_done()  # vLLM's replay buffer no longer had 1..4
    assert h.got[1:] == [[Cleared()], [Stored(ROOT, (ours[0],))]]
    assert h.t.counters["lost"] == 1 and h.t.block_count == 1
    assert h.t.accept(6, Batch([BlockRemoved([vh("a2")])])) is None
    assert h.got[-1] == [Removed((ours[0],))]


def test_a_late_first_batch_asks_for_a_replay_from_zero() -> None:
    h = Harness()
    assert h.t.accept(3, Batch()) == 0


def test_events_after_the_request_finished_are_placed_until_it_expires() -> None:
    now = [0.0]
    h = Harness(keep_finished=1, finished_ttl_seconds=10, clock=lambda: now[0])
    ids = (1, 2, 3, 4)
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    h.t.finish("r1")
    now[0] = 5
    assert h.send(stored([vh("a")], None, list(ids), B)) == [Stored(ROOT, tuple(block_hashes([ids], B)))]
    now[0] = 20
    assert h.send(stored([vh("b")], vh("a"), [5, 6, 7, 8], B)) == []  # r1 expired: nothing to hash with


def test_finished_requests_are_bounded() -> None:
    h = Harness(keep_finished=2)
    for i in range(5):
        ids = (i, i, i, i)
        h.t.track(f"r{i}", [TokenSegment(ids)], sent_tokens=ids)
        h.t.finish(f"r{i}")
    assert h.send(stored([vh("0")], None, [0, 0, 0, 0], B)) == []
    assert h.send(stored([vh("4")], None, [4, 4, 4, 4], B)) != []


def test_finished_embeddings_are_bounded_in_bytes() -> None:
    per_request = 2 * 4 * 8 * 4  # 4 rows of 8 float32, held twice (the segment and the tensor sent)
    h = Harness(keep_finished_bytes=2 * per_request)
    for i in range(3):
        e = rows(4, i)
        h.t.track(f"r{i}", [EmbedsSegment(e)], sent_rows=e.copy())
        h.t.finish(f"r{i}")
    assert list(h.t._requests) == ["r1", "r2"]


def test_track_needs_what_vllm_was_given() -> None:
    t = KvEventTranslator(B, lambda _: None)
    with pytest.raises(ValueError):
        t.track("r", [TokenSegment((1,))])
    with pytest.raises(ValueError):
        KvEventTranslator(0, lambda _: None)


def test_int_block_hashes_work_too() -> None:
    """``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` makes vLLM publish 64-bit ints instead of bytes."""
    h = Harness()
    ids = tuple(range(1, 9))
    h.t.track("r1", [TokenSegment(ids)], sent_tokens=ids)
    assert h.send(stored([11, 12], None, list(ids), B)) == [Stored(ROOT, tuple(block_hashes([ids], B)))]  # type: ignore[list-item]
    assert h.send(BlockRemoved([12])) == [Removed((block_hashes([ids], B)[1],))]


def test_router_proto_events() -> None:
    msgs = to_proto([Stored(ROOT, (1, 2)), Removed((2,)), Cleared()])
    assert [m.WhichOneof("kind") for m in msgs] == ["stored", "removed", "cleared"]
    assert list(msgs[0].stored.block_hashes) == [1, 2] and msgs[0].stored.parent_hash == 0
    assert list(msgs[1].removed.block_hashes) == [2]


def test_event_rows_are_json_ready_and_keep_order() -> None:
    import json

    rows = event_rows([Stored(ROOT, (5, 6)), Removed((6,)), Cleared()])
    assert json.loads(json.dumps(rows)) == [{"kind": "stored", "parent": ROOT, "hashes": [5, 6]},
                                            {"kind": "removed", "hashes": [6]}, {"kind": "cleared"}]
