"""Caps for clients without a valid API key, per client IP address, at the gateway's HTTP protocol
(``protocol.py``).

When API keys are configured, a client that has not shown a valid key is a stranger: all it can get is a 401 or an
open route (``/health``, ``/openapi.json``, ``/docs``), yet each of its connections holds a file descriptor and a
parser, and each request in flight a task. From one IP address (an IPv6 one: its /64, ``address_key``) such
clients may hold at most ``connections_per_ip`` connections that have not shown a valid key and
``requests_per_ip`` requests in flight; a connection at most ``PIPELINE_DEPTH`` pipelined requests. Past a cap
the request is answered 429 ``rate_limit_exceeded`` with ``Retry-After`` and its connection closed; a new
connection past the connection cap first closes the IP's oldest idle connection without a key (a slow header, an
idle keep-alive), and when none is idle it may only serve a request that carries a valid key.

A connection leaves the count for good when one of its requests carries a valid key: keyed clients are governed by
their key's limits (the gateway's per-tenant admission, ``app.py``, and the services' limits), never by these caps.
With no keys configured there are no strangers: the caps do not apply (the gateway's ``--max-inflight`` does).
Behind a proxy every client has the proxy's address: set the caps there (or to 0, off) instead.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

from embedmesh.core import auth

__all__ = ["ClientCaps", "PIPELINE_DEPTH", "CONNECTIONS_PER_IP", "REQUESTS_PER_IP", "key_is_valid", "presented_key",
           "address_key"]

CONNECTIONS_PER_IP = 64
REQUESTS_PER_IP = 32
"""Defaults of ``GatewayConfig.anon_connections_per_ip`` / ``anon_requests_per_ip``."""
PIPELINE_DEPTH = 8
"""Requests without a valid key queued on one connection behind the one being served (HTTP/1.1 pipelining)."""


def address_key(host: str) -> str:
    """What the caps count by: an IPv4 address (also written IPv4-mapped), or an IPv6 address's /64 — one host
    commonly holds a whole /64, so counting each address would give it 2^64 times the caps."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host  # not an address (a Unix socket's name): as it is
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


def presented_key(headers: list[tuple[bytes, bytes]]) -> auth.ApiKey | None:
    """The key of the key ring the request's one ``Authorization`` header carries (never one when keys are off:
    there is nothing to be governed by). Two headers are no key (the route answers 400)."""
    ring = auth.keyring()
    if not ring.enabled:
        return None
    sent = [v for k, v in headers if k == b"authorization"]
    if len(sent) != 1:
        return None
    return ring.lookup(auth.bearer_token(sent[0].decode("latin-1")))


def key_is_valid(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request carries a valid key (``presented_key``)."""
    return presented_key(headers) is not None


class ClientCaps:
    """The counts of one server (every connection of a uvicorn server shares one).

    Connections are opaque here: ``idle(conn)`` says whether one may be closed without cutting a request, ``close``
    closes it."""

    def __init__(self, connections_per_ip: int, requests_per_ip: int, idle: Callable[[Any], bool],
                 close: Callable[[Any], None]) -> None:
        self.connections_per_ip = connections_per_ip
        self.requests_per_ip = requests_per_ip
        self._idle = idle
        self._close = close
        self.anonymous: dict[str, dict[Any, None]] = {}  # per IP, in the order they connected
        self.requests: dict[str, int] = {}

    @property
    def active(self) -> bool:
        return auth.keyring().enabled

    def connected(self, ip: str, conn: Any) -> bool:
        """Count a new connection; False when it may only serve keyed requests (every other stranger's connection
        from ``ip`` is busy). The IP's oldest idle connection without a key is closed to make room."""
        if not self.active or not self.connections_per_ip:
            return True
        conns = self.anonymous.setdefault(ip, {})
        conns[conn] = None
        if len(conns) <= self.connections_per_ip:
            return True
        for old in list(conns):
            if old is not conn and self._idle(old):
                self.forget(ip, old)
                self._close(old)
                return True
        return False

    def keyed(self, ip: str, conn: Any) -> None:
        """``conn`` showed a valid key: it no longer counts."""
        self.forget(ip, conn)

    def forget(self, ip: str, conn: Any) -> None:
        conns = self.anonymous.get(ip)
        if conns is not None and conn in conns:
            del conns[conn]
            if not conns:
                del self.anonymous[ip]

    def take_request(self, ip: str) -> bool | None:
        """One more request without a key in flight from ``ip``: True when counted (release it), False when the caps
        are off (nothing to release), None when refused (past the cap)."""
        if not self.active or not self.requests_per_ip:
            return False
        held = self.requests.get(ip, 0)
        if held >= self.requests_per_ip:
            return None
        self.requests[ip] = held + 1
        return True

    def release_request(self, ip: str) -> None:
        left = self.requests.get(ip, 0) - 1
        if left > 0:
            self.requests[ip] = left
        else:
            self.requests.pop(ip, None)
