"""gRPC health (``grpc.health.v1.Health``) with its ``Watch`` streams bounded per caller address and in all.

A ``Watch`` call is open to anyone (the kubelet's probes and gRPC's client-side health checking carry no key) and
lasts until the caller ends it. grpc_health's own servicer holds every one it is given: one address with no
credentials held 2376 of them on a public port (3000 opened at once, each naming a different service: the server's
peak grew by 86 MiB), and nothing stopped it from opening more, on more connections. Here a caller's address (an
IPv6 one's /64, as ``core/inbound.py`` counts open reads) holds at most ``WATCHES_PER_ADDRESS`` watches at once and
the server at most ``WATCHES`` in all; one past either is refused ``RESOURCE_EXHAUSTED`` at once (its message was
already read, within ``inbound``'s bounds for open methods: 4 KiB, two at a time per address), and the slot is
given back when the stream ends, however it ends. ``Check`` is one message and one answer: unchanged.

What ``Check``'s message may cost is ``core/inbound.py``'s: gRPC Python has no per-method receive limit on a
server, so a message up to the port's cap is still received (at most two per address at a time, each within
``OPEN_READ_SECONDS``) and refused over ``OPEN_MESSAGE_BYTES`` before it is parsed.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health

from embedmesh.core.inbound import peer_address

__all__ = ["BoundedHealth", "WATCHES_PER_ADDRESS", "WATCHES"]

WATCHES_PER_ADDRESS = 16
"""Watch streams one caller address may hold at once (a client-side health check holds one per subchannel)."""
WATCHES = 1024
"""Watch streams the server holds at once, all callers together (about 36 KiB each, measured)."""


class BoundedHealth(health.aio.HealthServicer):
    """grpc_health's asyncio servicer with ``Watch`` bounded (module docstring)."""

    def __init__(self, per_address: int = WATCHES_PER_ADDRESS, total: int = WATCHES) -> None:
        super().__init__()
        self.per_address = per_address
        self.total = total
        self.watching: dict[str, int] = {}
        """Per caller address, the watches it holds (an address holding none is forgotten)."""
        self.watches = 0

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 - gRPC's name
        address = peer_address(context.peer())
        held = self.watching.get(address, 0)
        if held >= self.per_address:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"your address holds {held} health watches, the most one address may hold; end one "
                                "first (or poll Check)", trailing_metadata=(("retry-after", "1"),))
        if self.watches >= self.total:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this server holds {self.watches} health watches, the most it holds; poll Check "
                                "or retry later", trailing_metadata=(("retry-after", "1"),))
        self.watching[address] = held + 1
        self.watches += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watches -= 1
            left = self.watching[address] - 1
            if left:
                self.watching[address] = left
            else:
                del self.watching[address]
