"""Engines for tests of the worker's serving paths."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from embedmesh.services.worker.engines.echo.engine import EchoEngine

__all__ = ["SlowEcho"]


class SlowEcho(EchoEngine):
    """Echo (model "m", hidden size 4) that waits ``delay`` seconds before each delta (none at 0) and records, in
    ``closed``, the request id of every generation that ended, finished or aborted."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__("m", hidden_size=4)
        self.delay = delay
        self.closed: list[str] = []

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        try:
            async for delta in super().generate(request):
                if self.delay:
                    await asyncio.sleep(self.delay)
                yield delta
        finally:
            self.closed.append(request.request_id)
