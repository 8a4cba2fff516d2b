"""How a wrapped RPC (``core/server.py``) takes its request messages in: unparsable bytes stand in as a
``BadMessage``; on a public port a one-message request is read only after the caller is authenticated; a refused
upload stream is drained so the client sees the refusal — unless the caller was never authenticated.

Why authenticate before the first read (``first_message``): grpc.aio reads and parses a unary request whole before
its handler runs, so before the key in the metadata is looked at. A caller with no credentials could make the
public port hold a message as big as the server's message limit (512 MiB), several at once. Registered as a
client-streaming handler instead, the call reaches its wrapper with only its metadata read: an unauthenticated
caller is refused at once, and gRPC never opens the stream's flow-control window past its initial size for a
message nobody asked for. The client cannot tell the difference (a unary call's bytes are a one-message stream).
The price: grpc.aio's streaming path, about 50-100 us more CPU per small unary call (client and server together,
measured on this 2-core machine under load), on the public port only.

The open services of a public port (grpc.health.v1, which the kubelet's probes call without credentials) must be
read for anyone. gRPC has no per-method receive limit on a server (a method config in ``grpc.service_config`` is
ignored by servers, tried: a 100 KB health request passed a 1 KiB ``maxRequestMessageBytes``), and the server's
limit is the public port's message cap. So an open method's one message is read through ``open_message``: at
most ``OPEN_READS_PER_ADDRESS`` at a time per caller address (an IPv6 one: its /64), each within
``OPEN_READ_SECONDS``; a call past that is refused RESOURCE_EXHAUSTED at once, unread (waiting would not help:
gRPC buffers an unread stream up to its flow-control window, which it grows to megabytes on a fast link); and a
message over ``OPEN_MESSAGE_BYTES`` is refused before it is parsed (``safe_deserializer``'s ``max_bytes``). What one
address can make the server hold for open methods is two messages, not one per call. A probe's message is read in
microseconds, so probes from one node do not collide. Reflection is not open on a
public port (``core/server.py``): it is read only after authentication, like the services it describes.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator, Callable
from typing import Any

from embedmesh.core.errors import InvalidArgument, ResourceExhausted, Unavailable

__all__ = ["BadMessage", "safe_deserializer", "bad_message", "checked_stream", "first_message", "drain",
           "open_message", "peer_address", "DRAIN_MESSAGES", "DRAIN_SECONDS", "OPEN_MESSAGE_BYTES",
           "OPEN_READS_PER_ADDRESS", "OPEN_READ_SECONDS", "UPLOAD_IDLE_SECONDS"]

DRAIN_MESSAGES = 4096
DRAIN_SECONDS = 10.0
UPLOAD_IDLE_SECONDS = 30.0
"""How long an idle-bound upload (``checked_stream``'s ``idle_field``) may send nothing before its end."""
OPEN_MESSAGE_BYTES = 4096
"""An open method's request (a health check names a service: tens of bytes), at most."""
OPEN_READS_PER_ADDRESS = 2
OPEN_READ_SECONDS = 10.0
"""Open methods' messages read at once per caller address, and how long one may take, waiting included."""


class BadMessage:
    """Stands in for a request whose bytes did not parse as the RPC's protobuf message."""

    def __init__(self, error: str) -> None:
        self.error = error


def safe_deserializer(deserialize: Callable[[bytes], Any] | None, method: str,
                      max_bytes: int = 0) -> Callable[[bytes], Any] | None:
    """Parse request bytes; bytes that are not the method's message, or more than ``max_bytes`` (0: any size),
    become a ``BadMessage`` (the handler then answers INVALID_ARGUMENT) instead of gRPC's UNKNOWN/INTERNAL."""
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        if max_bytes and len(raw) > max_bytes:
            return BadMessage(f"{len(raw)} bytes, over the {max_bytes} this method takes")
        try:
            return deserialize(raw)
        except Exception as e:  # noqa: BLE001 - DecodeError and friends: the client's bytes, not our bug
            return BadMessage(type(e).__name__)

    return parse


def bad_message(method: str, m: BadMessage) -> InvalidArgument:
    return InvalidArgument(f"request: the bytes sent to {method} are not a valid protobuf message of its request "
                           f"type ({m.error})", field="request", reason="MALFORMED_MESSAGE")


async def checked_stream(requests: AsyncIterator[Any], method: str,
                         idle_field: str | None = None) -> AsyncIterator[Any]:
    """The stream's messages, unparsable ones refused. ``idle_field``: the stream is an upload with an end, outside
    the pieces streams (which ``transport.pieces`` bounds alike), whose messages fill that field (its servicer's
    ``idle_bound_streams``, ``Server.add``): each message arrives within ``UPLOAD_IDLE_SECONDS`` of the one before,
    or the call is refused INVALID_ARGUMENT ``IDLE_TIMEOUT`` naming the field (an authenticated upload that goes
    silent would hold its tenant's slot until the client's own deadline). Long-lived streams (a worker's
    registration, the multiplexed mesh streams) have none."""
    it = aiter(requests)
    while True:
        try:
            if idle_field is None:
                r = await anext(it)
            else:
                async with asyncio.timeout(UPLOAD_IDLE_SECONDS):
                    r = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise InvalidArgument(f"{idle_field}: nothing arrived for {UPLOAD_IDLE_SECONDS:g} s; send the upload "
                                  "without pausing", field=idle_field, reason="IDLE_TIMEOUT") from None
        if isinstance(r, BadMessage):
            raise bad_message(method, r)
        yield r


async def first_message(requests: AsyncIterator[Any], method: str) -> Any:
    """The one message of a unary request served as a stream (read now, after authentication); a call that ends
    without one is INVALID_ARGUMENT. Whatever else a client sends is never read."""
    async for r in requests:
        return r
    raise InvalidArgument(f"request: {method} takes one request message and the call ended without one",
                          field="request", reason="MISSING_MESSAGE")


def peer_address(peer: str) -> str:
    """What open reads are counted by: the address of a gRPC peer (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``), an IPv6
    one's /64 (one host commonly holds a whole /64); anything else as it is."""
    kind, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0].strip("[]") if kind in ("ipv4", "ipv6") else rest
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return peer
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ip.ipv4_mapped or ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


class _OpenReads:
    """Per caller address, the open-method reads under way (forgotten when none is)."""

    def __init__(self) -> None:
        self.reading: dict[str, int] = {}

    async def read(self, requests: AsyncIterator[Any], method: str, address: str) -> Any:
        held = self.reading.get(address, 0)
        if held >= OPEN_READS_PER_ADDRESS:
            raise ResourceExhausted(f"{held} calls of open methods from your address are being read; retry when "
                                    "they are answered", reason="OPEN_READS", retry_after_seconds=1.0)
        self.reading[address] = held + 1
        try:
            async with asyncio.timeout(OPEN_READ_SECONDS):
                return await first_message(requests, method)
        except TimeoutError:
            raise Unavailable(f"request: the message of {method} did not arrive within {OPEN_READ_SECONDS:g} s; "
                              "retry", field="request", reason="READ_TIMEOUT", retry_after_seconds=1.0) from None
        finally:
            left = self.reading[address] - 1
            if left:
                self.reading[address] = left
            else:
                del self.reading[address]


_open_reads = _OpenReads()


async def open_message(requests: AsyncIterator[Any], method: str, peer: str) -> Any:
    """The one message of an open method's call on a public port, read unless the caller's address has
    ``OPEN_READS_PER_ADDRESS`` being read (see the module's docstring)."""
    return await _open_reads.read(requests, method, peer_address(peer))


async def drain(requests: Any) -> None:
    """Read and drop what the client still sends on an upload stream being refused (at most ``DRAIN_MESSAGES``
    messages, for at most ``DRAIN_SECONDS``) before the refusal is sent: a grpc.aio client whose write fails because
    the call already ended reports its own INTERNAL ("Internal error from Core") instead of the refusal — a 500 at
    the gateway for an upload it forwards. A one-message request is read whole before any check runs, too.

    Only for a caller that was authenticated: an unauthenticated (or unauthorized) upload ends at once with its
    refusal, nothing it sends read — holding it open for ``DRAIN_SECONDS`` would give anyone a slot for free."""
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            count = 0
            async for _ in requests:
                count += 1
                if count >= DRAIN_MESSAGES:
                    return
    except Exception:  # noqa: BLE001 - timed out, or the stream cannot be read any more: refuse now
        return
