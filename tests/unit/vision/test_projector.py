"""The class-name projector: probabilities -> rows of the language model's own embedding matrix."""

from __future__ import annotations

import numpy as np
import pytest

from embedmesh.vision.projector import ClassNameProjector

VOCAB = {"cat": 1, " cat": 2, "dog": 3, " dog": 4, "fox": 5, " fox": 6, ",": 7, " red": 8, "red": 9}
NAMES = ["cat", "dog", "red fox"]


def encode(text: str) -> list[int]:
    out, rest = [], text
    while rest:
        for tok in sorted(VOCAB, key=len, reverse=True):
            if rest.startswith(tok):
                out.append(VOCAB[tok])
                rest = rest[len(tok):]
                break
        else:
            raise ValueError(rest)
    return out


E = np.arange(10 * 4, dtype=np.float32).reshape(10, 4) / 10


def projector(**kw: object) -> ClassNameProjector:
    return ClassNameProjector(E, encode, NAMES, **kw)  # type: ignore[arg-type]


def test_top_class_verbatim_others_faded_towards_the_mean() -> None:
    rows = projector(top_k=3, min_prob=0.05).rows(np.array([0.2, 0.6, 0.2], dtype=np.float32))
    mean = E.mean(axis=0)
    w = 0.2 / 0.6
    expected = np.stack([
        E[3],                                  # "dog" (top, weight 1)
        E[7], w * E[2] + (1 - w) * mean,       # ", cat"
        E[7], w * E[8] + (1 - w) * mean, w * E[6] + (1 - w) * mean,  # ", red fox"
    ])
    np.testing.assert_allclose(rows, expected, rtol=1e-6)


def test_classes_under_min_prob_are_dropped_but_the_top_is_kept() -> None:
    p = projector(top_k=3, min_prob=0.5)
    assert [c.name for c in p.choose(np.array([0.01, 0.02, 0.03], dtype=np.float32))] == ["red fox"]
    np.testing.assert_allclose(p.rows(np.array([0.9, 0.05, 0.05], dtype=np.float32)), E[[1]])


def test_identity_changes_with_what_the_rows_depend_on() -> None:
    a, b = projector(), projector(top_k=2)
    c = ClassNameProjector(E * 2, encode, NAMES)
    assert len({a.identity, b.identity, c.identity}) == 3
    assert projector().identity == a.identity


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        ClassNameProjector(E[0], encode, NAMES)
    with pytest.raises(ValueError):
        ClassNameProjector(E[:5], encode, NAMES)  # ids past the matrix
    with pytest.raises(ValueError):
        projector().rows(np.ones(5, dtype=np.float32))
