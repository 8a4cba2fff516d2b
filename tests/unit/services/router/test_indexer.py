"""The radix indexer against a brute-force model, under interleaved events from many workers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from embedmesh.services.router.indexer import RadixIndexer

# Chains are prefixes of a few fixed "prompts": block i of prompt p has hash p*1000 + i + 1.
PROMPTS = 4
DEPTH = 6


def chain(p: int, n: int) -> list[int]:
    return [p * 1000 + i + 1 for i in range(n)]


class Brute:
    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}

    def stored(self, w: str, hashes: list[int]) -> None:
        self.held.setdefault(w, set()).update(hashes)

    def removed(self, w: str, hashes: list[int]) -> None:
        self.held.get(w, set()).difference_update(hashes)

    def cleared(self, w: str) -> None:
        self.held.pop(w, None)

    def matches(self, hashes: list[int]) -> dict[str, int]:
        out = {}
        for w, held in self.held.items():
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            if n:
                out[w] = n
        return out


event = st.one_of(
    st.tuples(st.just("stored"), st.sampled_from("abcde"), st.integers(0, PROMPTS - 1), st.integers(0, DEPTH - 1),
              st.integers(1, DEPTH)),
    st.tuples(st.just("removed"), st.sampled_from("abcde"), st.integers(0, PROMPTS - 1), st.integers(0, DEPTH - 1),
              st.integers(1, 3)),
    st.tuples(st.just("cleared"), st.sampled_from("abcde"), st.just(0), st.just(0), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(event, max_size=60), st.integers(0, PROMPTS - 1), st.integers(1, DEPTH))
def test_find_matches_equals_brute_force(events: list[tuple[str, str, int, int, int]], p: int, n: int) -> None:
    idx, brute = RadixIndexer(), Brute()
    for kind, w, prompt, start, length in events:
        full = chain(prompt, DEPTH)
        if kind == "stored":
            hashes = full[start:start + length]
            parent = full[start - 1] if start else 0
            idx.stored(w, parent, hashes)
            brute.stored(w, hashes)
        elif kind == "removed":
            hashes = full[start:start + length]
            idx.removed(w, hashes)
            brute.removed(w, hashes)
        else:
            idx.cleared(w)
            brute.cleared(w)
        assert idx.worker_block_count == sum(len(v) for v in brute.held.values())
    assert idx.find_matches(chain(p, n)) == brute.matches(chain(p, n))


def test_early_exit_and_pruning() -> None:
    idx = RadixIndexer()
    idx.stored("a", 0, [1, 2, 3])
    idx.stored("b", 0, [1, 2])
    assert idx.find_matches([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert idx.find_matches([9, 1, 2]) == {}
    idx.cleared("a")
    assert idx.find_matches([1, 2, 3]) == {"b": 2}
    assert idx.node_count == 2  # node 3 pruned with its last holder
    idx.remove_worker("b")
    assert idx.node_count == 0 and idx.worker_block_count == 0
