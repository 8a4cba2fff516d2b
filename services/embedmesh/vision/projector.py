"""A training-free projector: class probabilities -> soft-token rows in a language model's own embedding space.

What it is, plainly: no network was trained to map images into the language model. The classifier's top classes
(at most ``top_k``, each at least ``min_prob``) are written as their names, and each name's tokens are looked up in
the language model's *input embedding matrix* (the rows a text prompt would get). Each class's rows are weighted by
its probability relative to the top class, ``w = p / p_top``: ``row = w * E[token] + (1 - w) * mean(E)``, so the
top class reads as its name verbatim and less likely classes fade towards the vocabulary's mean row. Names are
separated by the rows of ``","``. An image of a cat thus becomes a handful of rows close to
"tiger cat, Egyptian cat, tabby".

The model is language-aligned with the image only through those class names: it can answer what the classifier
recognized (1000 ImageNet classes), nothing about layout, colour, text or count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import blake3
import numpy as np

__all__ = ["ClassNameProjector", "Choice"]


@dataclass(frozen=True)
class Choice:
    """A class the projector wrote: its name, probability and weight."""

    name: str
    prob: float
    weight: float


class ClassNameProjector:
    def __init__(self, embedding: np.ndarray, encode: Callable[[str], Sequence[int]], class_names: Sequence[str],
                 *, top_k: int = 3, min_prob: float = 0.05) -> None:
        """``embedding``: the language model's ``(vocab, hidden)`` input embedding matrix (float32);
        ``encode``: its tokenizer, text -> ids without special tokens."""
        if embedding.ndim != 2:
            raise ValueError(f"embedding must be (vocab, hidden), got shape {embedding.shape}")
        if not 1 <= top_k <= len(class_names) or not 0.0 <= min_prob < 1.0:
            raise ValueError("top_k must be in [1, classes] and min_prob in [0, 1)")
        self.embedding = np.asarray(embedding, dtype=np.float32)
        self.mean = self.embedding.mean(axis=0)
        self.top_k = top_k
        self.min_prob = min_prob
        self.names = list(class_names)
        self._first = [np.asarray(encode(n), dtype=np.int64) for n in self.names]
        self._later = [np.asarray(encode(" " + n), dtype=np.int64) for n in self.names]
        self._comma = np.asarray(encode(","), dtype=np.int64)
        vocab = self.embedding.shape[0]
        for ids in (*self._first, *self._later, self._comma):
            if ids.size == 0 or int(ids.max()) >= vocab or int(ids.min()) < 0:
                raise ValueError("the tokenizer gives ids outside the embedding matrix (wrong model folder?)")
        h = blake3.blake3(b"class-name-projector/1\0")
        h.update(f"{top_k}:{min_prob}:{self.embedding.shape}\0".encode())
        h.update("\0".join(self.names).encode())
        h.update(np.ascontiguousarray(self.embedding).view(np.uint8).data)
        self.identity = f"class-name-projector/1:{h.hexdigest()[:32]}"
        """Names everything the rows depend on (matrix, names, k, threshold): part of every cache key."""

    @property
    def hidden_size(self) -> int:
        return int(self.embedding.shape[1])

    def choose(self, probs: np.ndarray) -> list[Choice]:
        """The classes written, most likely first: the top ``top_k``, those under ``min_prob`` dropped (the top one
        always kept)."""
        if probs.shape != (len(self.names),):
            raise ValueError(f"expected {len(self.names)} probabilities, got shape {probs.shape}")
        order = np.argsort(-probs, kind="stable")[: self.top_k]
        top = float(probs[order[0]])
        out = []
        for rank, c in enumerate(order):
            p = float(probs[c])
            if rank and p < self.min_prob:
                break
            out.append(Choice(self.names[int(c)], p, p / top if top > 0 else 1.0))
        return out

    def rows(self, probs: np.ndarray) -> np.ndarray:
        """``(n, hidden)`` float32 soft-token rows for one image's class probabilities."""
        pieces: list[np.ndarray] = []
        index = {n: i for i, n in enumerate(self.names)}
        for rank, choice in enumerate(self.choose(probs)):
            i = index[choice.name]
            if rank:
                pieces.append(self.embedding[self._comma])
            tokens = self.embedding[self._later[i] if rank else self._first[i]]
            pieces.append(choice.weight * tokens + (1.0 - choice.weight) * self.mean)
        return np.ascontiguousarray(np.concatenate(pieces).astype(np.float32))
