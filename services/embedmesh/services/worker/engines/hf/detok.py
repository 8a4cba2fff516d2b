"""Incremental detokenization with stop strings, shared by engines that stream text themselves.

Text is released only when it can no longer change: never a trailing incomplete UTF-8 sequence (decoded as
U+FFFD) and never a tail that could still grow into a stop string. A stop string ends the text just before it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] | list[str] = (), resumed: tuple[int, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = list(resumed)
        self._sent = 0
        """Characters of the decoded text already released."""
        self.emitted_tokens = 0
        """Token ids already reported in a delta (bookkeeping for the engine)."""
        if resumed:
            # Tokens generated elsewhere (a migrated stream): their text went out up to where this detokenizer would
            # have released it (held back: a trailing incomplete character, a tail that may grow into a stop).
            self._sent = self._releasable(self._text())

    def _releasable(self, text: str) -> int:
        """How much of ``text`` may be released when no stop string is in it."""
        end = len(text)
        while end > self._sent and text[end - 1] == "\ufffd":
            end -= 1
        return end - self._held_tail(text[:end])

    def _text(self) -> str:
        return self._tokenizer.decode(self._ids, skip_special_tokens=True)

    def _held_tail(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def add(self, token: int) -> tuple[str, bool]:
        """Add one token; returns (new text, stopped)."""
        self._ids.append(token)
        text = self._text()
        if self._stop:
            window = max(0, self._sent - max(len(s) for s in self._stop))
            hits = [i for i in (text.find(s, window) for s in self._stop) if i >= 0]
            if hits:
                end = min(hits)
                delta = text[self._sent:end] if end > self._sent else ""
                self._sent = max(self._sent, end)
                return delta, True
        end = self._releasable(text)
        if end <= self._sent:
            return "", False
        delta = text[self._sent:end]
        self._sent = end
        return delta, False

    def finish(self) -> tuple[str, bool]:
        """Release whatever is held back (the sequence ended for another reason)."""
        text = self._text()
        delta = text[self._sent:]
        self._sent = len(text)
        return delta, False
