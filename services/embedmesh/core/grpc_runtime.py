"""How gRPC's core runs in the mesh's processes; imported first by every service package (and the gateway), before
anything imports ``grpc``.

gRPC reads ``GRPC_EXPERIMENTS`` once, when ``grpc`` is imported; setting it later changes nothing. With grpcio
1.85's defaults a Python process moves every message through gRPC's EventEngine threads and then hands it to the
asyncio loop, a thread switch each way. The mesh turns two experiments off (``event_engine_client``,
``event_engine_listener``), so connections run on the poller gRPC's asyncio integration wakes directly. Measured on
this 2-core machine (``bench/bench_cpu.py``, alternating runs): a bare grpc.aio unary hop 0.47-0.53 → 0.40-0.42 ms
p50 and 0.31-0.34 → 0.25-0.28 ms of server CPU; the mesh's preprocessor 1.15 → 0.93-0.99 ms of CPU per tiny
completion, 1-client p50 over gRPC 1.90 → 1.57-1.66 ms and over REST 2.25-2.72 → 1.85 ms. Everything else —
TLS, keepalive, health, drain — behaves the same (the whole test suite runs this way).

An operator's own ``GRPC_EXPERIMENTS`` (even empty: gRPC's defaults) is left as it is, and so are gRPC's defaults
with ``EMBEDMESH_FASTPATH=off`` (``core.fastpath``). grpcio is pinned
(pyproject.toml), so the names stay valid; a gRPC that no longer knows one logs it and ignores it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from embedmesh.core import fastpath

__all__ = ["GRPC_EXPERIMENTS", "apply"]

GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"
"""gRPC core experiments the mesh turns off (a leading ``-`` disables one)."""


def apply(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``GRPC_EXPERIMENTS`` unless the environment already has it; whether it was set here."""
    if "GRPC_EXPERIMENTS" in environ or not fastpath.enabled(environ):
        return False
    environ["GRPC_EXPERIMENTS"] = GRPC_EXPERIMENTS
    return True


apply()
