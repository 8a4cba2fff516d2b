"""core.kv_events: the mesh's KV events become the router protocol's ``KvEvent`` messages, one per event, in order,
with the block hashes (full 64-bit range) and the parent hash unchanged."""

from __future__ import annotations

import pytest

from embedmesh.core.kv_events import Cleared, Removed, Stored, to_proto
from embedmesh.router.v1 import router_pb2


def test_each_event_kind_becomes_its_oneof_case_in_order() -> None:
    msgs = to_proto([Stored(parent_hash=7, block_hashes=[1, 2, 3]), Removed(block_hashes=[2]), Cleared(),
                     Stored(parent_hash=0, block_hashes=[9])])
    assert [m.WhichOneof("kind") for m in msgs] == ["stored", "removed", "cleared", "stored"]
    assert (msgs[0].stored.parent_hash, list(msgs[0].stored.block_hashes)) == (7, [1, 2, 3])
    assert list(msgs[1].removed.block_hashes) == [2]
    assert (msgs[3].stored.parent_hash, list(msgs[3].stored.block_hashes)) == (0, [9])


def test_no_events_no_messages() -> None:
    assert to_proto([]) == []


def test_events_survive_the_wire_with_full_width_hashes() -> None:
    big = [2**64 - 1, 2**63, 1]
    sent = to_proto([Stored(parent_hash=2**64 - 2, block_hashes=big), Removed(block_hashes=big[:1])])
    back = [router_pb2.KvEvent.FromString(m.SerializeToString()) for m in sent]
    assert back == sent
    assert back[0].stored.parent_hash == 2**64 - 2 and list(back[0].stored.block_hashes) == big
    assert list(back[1].removed.block_hashes) == [2**64 - 1]


def test_events_are_frozen_values() -> None:
    e = Stored(parent_hash=1, block_hashes=(2, 3))
    assert e == Stored(1, (2, 3)) and Removed((4,)) == Removed((4,)) and Cleared() == Cleared()
    with pytest.raises(AttributeError):
        e.parent_hash = 5  # type: ignore[misc]


def test_stored_runs_joins_only_pairs_that_chain() -> None:
    from embedmesh.core.kv_events import Stored, stored_runs

    pairs = [(0, 11), (11, 12), (12, 13), (0, 21), (21, 22), (12, 31)]
    assert stored_runs(pairs) == [Stored(0, (11, 12, 13)), Stored(0, (21, 22)), Stored(12, (31,))]
    assert stored_runs([]) == []
