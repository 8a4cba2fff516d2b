"""One switch for every performance bypass: ``EMBEDMESH_FASTPATH=off`` selects the plain path of each at once.

Each bypass does what a plain library call does, with fewer copies or fewer thread switches; the plain call stays
beside it, so that a bypass can be shown to change speed only (CI runs the completions, chat and uploads suites
both ways: ``make test-plain``) and an operator can rule the bypasses out when chasing a problem. The bypasses:

==========================  ======================================================  ===================================
bypass                      fast path (default)                                     plain path (``off``)
==========================  ======================================================  ===================================
gRPC core experiments       ``core.grpc_runtime``: EventEngine client/listener off   gRPC's own defaults
base64 slots                ``gateway.embeds_json``: long base64 decoded in place    ``orjson.loads`` of the whole body
spliced request bytes       ``gateway.wire_body``, ``core.transport.wire.generate_request_     protobuf constructors and
                            bytes``: tensor bytes spliced into the wire bytes        ``SerializeToString``
cut-out tensor views        ``core.transport.wire.split_*_request``: rows as views of the      protobuf's own parser
                            received buffer
RESP client                 ``encoder_cache.resp``: Redis bulk values straight       redis-py for every command
                            into the array
call metadata               ``core.call_metadata``: trace context, forwarded key     grpc.aio client interceptors
                            and mesh token put into each call by the channel         (the same metadata, same order)
==========================  ======================================================  ===================================

Not switched, because they are not bypasses: the gateway's uvicorn protocol subclass (``gateway.protocol``) holds
the header and body deadlines against slow clients, a security rule the plain path must keep too; the pieces streams
(``core.transport.pieces``) carry prompts larger than one gRPC message; the multiplexed worker and router streams
(``core.mux``) are the mesh's one stream shape per hop.

The value is read from the environment at each use (a dictionary lookup), so a test can flip it; the launcher's
children inherit it. Any value other than off/0/false/no (case-insensitive) leaves the bypasses on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["ENV", "enabled"]

ENV = "EMBEDMESH_FASTPATH"

_OFF = frozenset({"off", "0", "false", "no"})


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the performance bypasses are on (the default)."""
    value = environ.get(ENV)
    return value is None or value.strip().lower() not in _OFF
