"""The worker (``embedmesh.services.worker.main``) with the echo engine slowed to
``EMBEDMESH_HOSTS_TOKEN_DELAY_MS`` per token, so a stream lasts long enough for a fault to cut it mid-way.

The delay lives in this test shim (the echo engine itself answers at once, as benchmarks want); everything else —
the worker's server, its router link, TLS — is the worker as deployed.

    python -m tests.hosts.slow_echo --engine echo --host ... --port ... --routers ...
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from embedmesh.services.worker import main as worker_main
from embedmesh.services.worker.engines.echo import engine as echo

DELAY_S = float(os.environ.get("EMBEDMESH_HOSTS_TOKEN_DELAY_MS", "50")) / 1000
_generate = echo.EchoEngine.generate


async def _slow_generate(self: echo.EchoEngine, request: Any) -> AsyncIterator[Any]:
    async for delta in _generate(self, request):
        yield delta
        await asyncio.sleep(DELAY_S)


echo.EchoEngine.generate = _slow_generate  # type: ignore[method-assign]

if __name__ == "__main__":
    worker_main.main()
