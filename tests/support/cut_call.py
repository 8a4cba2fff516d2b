"""A fake grpc.aio stream-stream call that the peer ends just as a write goes out: grpc.aio's core refuses the write
and the call's status becomes INTERNAL "Internal error from Core" (the peer's own status is lost). What
``core.mux.MuxSession`` must report as UNAVAILABLE (``cut_while_writing``), not INTERNAL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc


class CutCall:
    """Answers ``first`` (if given), then fails the first write and the reading with the core's refusal."""

    def __init__(self, first: Any = None) -> None:
        self._first = first
        self._cut = asyncio.Event()

    @staticmethod
    def _error() -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                    "Internal error from Core")

    async def write(self, data: bytes) -> None:
        self._cut.set()
        raise self._error()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Any]:
        if self._first is not None:
            yield self._first
        await self._cut.wait()
        raise self._error()

    def cancel(self) -> bool:
        return False
