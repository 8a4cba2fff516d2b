"""``EncoderPool``: image encoders built on first use, one per key (a model folder), for the preprocessor's encode
stage (``vision.stage``) and the encode service (``services.image_encoder``) alike.

    get(key)  -> the key's encoder, built once in a thread off the event loop (torch is imported then, not at
                 start-up); callers that ask while it is being built wait for that build, never start another,
                 and a caller cancelled meanwhile does not cancel it
              -> a build that failed on a known cause (missing packages, no embedding matrix, a bad file: ImportError,
                 RuntimeError, OSError, ValueError) is remembered: every later ``get`` of that key raises
                 ``EncoderBroken`` at once, without building again (restart the process to try again)

Builds run one at a time, whatever their key (each loads weights and uses the CPU's threads). The caller words the
refusal: ``EncoderBroken.why`` is the build's error text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from embedmesh.core.logs import get_logger

__all__ = ["EncoderPool", "EncoderBroken", "BUILD_ERRORS"]

log = get_logger("vision")

K = TypeVar("K", bound=Hashable)
E = TypeVar("E")

BUILD_ERRORS: tuple[type[BaseException], ...] = (ImportError, RuntimeError, OSError, ValueError)
"""A build that fails with one of these is remembered as broken; any other error reaches the callers waiting on that
build and is not remembered (a bug, not a missing file)."""


class EncoderBroken(Exception):
    """The key's encoder failed to build (now or before); ``why``: that failure's text."""

    def __init__(self, key: Hashable, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why


class EncoderPool(Generic[K, E]):
    """Encoders by key, each built once by ``build(key)``; a failed build remembered (see the module docstring)."""

    def __init__(self, build: Callable[[K], E], *, logger: logging.Logger | None = None) -> None:
        """``logger``: where a failed build is logged (the caller's; this module's by default)."""
        self.build = build
        self.log = logger or log
        self._built: dict[K, E] = {}
        self._broken: dict[K, str] = {}
        self._pending: dict[K, asyncio.Future[None]] = {}
        self._one_at_a_time = asyncio.Lock()

    def broken(self, key: K) -> str | None:
        """The failure text of ``key``'s build, or None when it did not fail (built, not tried, or building)."""
        return self._broken.get(key)

    async def get(self, key: K) -> E:
        """``key``'s encoder, built now if it is the first ask; ``EncoderBroken`` when its build failed."""
        enc = self._built.get(key)
        if enc is not None:
            return enc
        if key not in self._broken:
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = asyncio.ensure_future(self._build(key))
                pending.add_done_callback(_retrieved)
            await asyncio.shield(pending)  # re-raises an error not remembered (every waiter sees it)
            enc = self._built.get(key)
            if enc is not None:
                return enc
        raise EncoderBroken(key, self._broken.get(key, "not built"))

    async def _build(self, key: K) -> None:
        try:
            async with self._one_at_a_time:
                try:
                    enc = await asyncio.to_thread(self.build, key)
                except BUILD_ERRORS as e:
                    self.log.warning("image encoder failed to load", extra={"folder": str(key), "error": str(e)})
                    self._broken[key] = str(e)
                else:
                    self._built[key] = enc
        finally:
            del self._pending[key]


def _retrieved(fut: asyncio.Future[None]) -> None:
    """Marks a build's error as seen when every caller waiting on it was cancelled (no 'never retrieved' noise)."""
    if not fut.cancelled():
        fut.exception()
