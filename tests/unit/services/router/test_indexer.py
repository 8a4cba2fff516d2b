"""The radix indexer against a brute-force model, under interleaved events from many workers (more than 64, so
the bitmasks spill past one machine word, and with workers leaving so that slots are reused)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from embedmesh.services.router.indexer import RadixIndexer

# Chains are prefixes of a few fixed "prompts" that share a system prompt: prompts 0 and 1 share their first two
# blocks, as chained hashes of a common prefix do.
PROMPTS = 4
DEPTH = 6


def chain(p: int, n: int = DEPTH) -> list[int]:
    shared = min(n, 2) if p < 2 else 0
    return [i + 1 for i in range(shared)] + [p * 1000 + i + 1 for i in range(shared, n)]


class Brute:
    """The definition: a worker's score is the length of the longest prefix of the query it holds entirely."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}

    def stored(self, w: str, hashes: list[int]) -> None:
        self.held.setdefault(w, set()).update(hashes)

    def removed(self, w: str, hashes: list[int]) -> None:
        self.held.get(w, set()).difference_update(hashes)

    def cleared(self, w: str) -> None:
        if w in self.held:
            self.held[w] = set()

    def remove_worker(self, w: str) -> None:
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


workers = st.integers(0, 69).map(lambda i: f"w{i}")
event = st.one_of(
    st.tuples(st.just("stored"), workers, st.integers(0, PROMPTS - 1), st.integers(0, DEPTH - 1),
              st.integers(1, DEPTH)),
    st.tuples(st.just("removed"), workers, st.integers(0, PROMPTS - 1), st.integers(0, DEPTH - 1),
              st.integers(1, 3)),
    st.tuples(st.just("cleared"), workers, st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("left"), workers, st.just(0), st.just(0), st.just(0)),
)


def apply(idx: RadixIndexer, brute: Brute, ev: tuple[str, str, int, int, int]) -> None:
    kind, w, prompt, start, length = ev
    full = chain(prompt)
    hashes = full[start:start + length]
    if kind == "stored":
        idx.stored(w, full[start - 1] if start else 0, hashes)
        brute.stored(w, hashes)
    elif kind == "removed":
        idx.removed(w, hashes)
        brute.removed(w, hashes)
    elif kind == "cleared":
        idx.cleared(w)
        brute.cleared(w)
    else:
        idx.remove_worker(w)
        brute.remove_worker(w)


@settings(max_examples=300, deadline=None)
@given(st.lists(event, max_size=120), st.lists(st.tuples(st.integers(0, PROMPTS - 1), st.integers(0, DEPTH)),
                                               min_size=1, max_size=4))
def test_find_matches_equals_brute_force(events: list[tuple[str, str, int, int, int]],
                                         queries: list[tuple[int, int]]) -> None:
    idx, brute = RadixIndexer(), Brute()
    for i, ev in enumerate(events):
        apply(idx, brute, ev)
        if i % 10 == 0:  # check along the way, not only at the end
            for p, n in queries:
                assert idx.find_matches(chain(p, n)) == brute.matches(chain(p, n))
    for p, n in queries:
        q = chain(p, n)
        assert idx.find_matches(q) == brute.matches(q)
        assert idx.find_matches(iter(q)) == brute.matches(q), "any iterable works"
    assert idx.worker_block_count == sum(len(v) for v in brute.held.values())
    assert idx.node_count == len(set().union(*brute.held.values())) if brute.held else idx.node_count == 0
    for w, held in brute.held.items():
        assert idx.blocks_of(w) == len(held)
        assert all(idx.holds(w, h) for h in held)


def test_early_exit_pruning_and_slot_reuse() -> None:
    idx = RadixIndexer()
    idx.stored("a", 0, [1, 2, 3])
    idx.stored("b", 0, [1, 2])
    assert idx.find_matches([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert idx.find_matches([9, 1, 2]) == {}, "the first block decides: no worker, no walk"
    assert idx.find_matches([]) == {}
    idx.cleared("a")
    assert idx.find_matches([1, 2, 3]) == {"b": 2}
    assert idx.node_count == 2, "node 3 went with its last holder"
    idx.remove_worker("b")
    assert idx.node_count == 0 and idx.worker_block_count == 0 and idx.workers == ["a"]
    idx.stored("c", 0, [5])  # reuses b's slot; nothing of b may leak into c
    assert idx.find_matches([1]) == {} and idx.find_matches([5]) == {"c": 1}


def test_hole_in_a_chain_stops_the_count_and_unknown_removals_are_ignored() -> None:
    idx = RadixIndexer()
    idx.stored("a", 0, [1, 2, 3, 4])
    idx.removed("a", [2, 99])
    idx.removed("nobody", [1])
    assert idx.find_matches([1, 2, 3, 4]) == {"a": 1}
    idx.stored("a", 7, [3])  # parent unknown to the index: stored anyway, harmless
    assert idx.blocks_of("a") == 3


def test_many_workers_beyond_64_bits() -> None:
    idx = RadixIndexer()
    for i in range(200):
        idx.stored(f"w{i}", 0, [1, 2, 3][: 1 + i % 3])
    m = idx.find_matches([1, 2, 3])
    assert len(m) == 200 and all(m[f"w{i}"] == 1 + i % 3 for i in range(200))
