"""The metadata every call on a mesh channel carries, added at each call: the caller's trace context (W3C
``traceparent``, ``telemetry.inject_metadata``), then each ``Added`` in turn: the mesh token on the services'
channels, the client's ``Authorization`` on the gateway's (``gateway.auth.forwarding_channel``).

Two ways to add it, one switch (``core.fastpath``), the same metadata in the same order either way:

- fast path (default): ``MetadataChannel`` wraps the channel and puts the metadata straight into each call's
  arguments, so a call is grpc.aio's own ``UnaryUnaryCall`` (``UnaryStreamCall``, ...);
- plain path (``EMBEDMESH_FASTPATH=off``): grpc.aio client interceptors doing the same (``interceptors``). grpc.aio
  then runs every call as an ``InterceptedUnaryUnaryCall``: one more task and its callbacks per call (~5 % of the
  gateway's CPU per tiny request, docs/perf/front-door.md lever 5), and for streams one more queue and task that
  every write goes through.

The metadata is computed when the call is made, in the caller's context (its current span, the request's key), as
the interceptors compute it in the task grpc.aio starts from that context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from embedmesh.core import fastpath
from embedmesh.core.telemetry import TracingClientInterceptor, inject_metadata

__all__ = ["Added", "MetadataChannel", "with_metadata", "interceptors", "metadata_interceptors", "open_adding"]


@dataclass(frozen=True)
class Added:
    """Metadata added to every call: ``values()`` (read at each call; none: nothing changes), after dropping the
    caller's entries whose key is in ``replace`` (so a caller cannot send its own mesh token or key beside it)."""

    values: Callable[[], Sequence[tuple[str, str]]]
    replace: frozenset[str] = frozenset()

    def apply(self, metadata: Any) -> Any:
        add = self.values()
        if not add:
            return metadata
        md = [m for m in (metadata or ()) if (m[0] if isinstance(m, tuple) else m.key) not in self.replace]
        md.extend(add)
        return md


def with_metadata(metadata: Any, added: Sequence[Added]) -> list[tuple[str, Any]]:
    """A call's metadata as the mesh sends it: the caller's, the trace context, then each of ``added``."""
    md = inject_metadata(metadata)
    for a in added:
        md = a.apply(md)
    return md


def metadata_interceptors(extra: Callable[[], Sequence[tuple[str, str]]],
                          replace: frozenset[str] = frozenset()) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors adding ``extra()``'s metadata to every call (dropping keys in ``replace`` first).

    One instance per call kind: grpc.aio files an interceptor under the first kind it implements, so a single class
    implementing all four would only ever see unary-unary calls."""
    added = Added(extra, replace)

    def details_with(details: Any) -> Any:
        md = added.apply(details.metadata)
        return details if md is details.metadata else details._replace(metadata=md)

    class _UU(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(details_with(details), request)

    class _US(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(details_with(details), request)

    class _SU(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
            return await continuation(details_with(details), request_iterator)

    class _SS(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
            return await continuation(details_with(details), request_iterator)

    return [_UU(), _US(), _SU(), _SS()]


def interceptors(added: Sequence[Added]) -> list[grpc.aio.ClientInterceptor]:
    """The plain path: the trace context's interceptors, then each ``Added``'s."""
    out = TracingClientInterceptor()
    for a in added:
        out.extend(metadata_interceptors(a.values, a.replace))
    return out


class _Adding:
    """A multi-callable of the wrapped channel whose calls get the mesh's metadata (``with_metadata``)."""

    __slots__ = ("_inner", "_added")

    def __init__(self, inner: Any, added: tuple[Added, ...]) -> None:
        self._inner = inner
        self._added = added

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._inner(*args, metadata=with_metadata(metadata, self._added), **kwargs)


class _UnaryUnary(_Adding, grpc.aio.UnaryUnaryMultiCallable):
    __slots__ = ()


class _UnaryStream(_Adding, grpc.aio.UnaryStreamMultiCallable):
    __slots__ = ()


class _StreamUnary(_Adding, grpc.aio.StreamUnaryMultiCallable):
    __slots__ = ()


class _StreamStream(_Adding, grpc.aio.StreamStreamMultiCallable):
    __slots__ = ()


class MetadataChannel(grpc.aio.Channel):
    """The fast path: ``channel`` (one without interceptors) whose calls carry the mesh's metadata."""

    def __init__(self, channel: grpc.aio.Channel, added: Sequence[Added]) -> None:
        self._channel = channel
        self._added = tuple(added)

    async def __aenter__(self) -> MetadataChannel:
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        await self._channel.__aexit__(exc_type, exc_val, exc_tb)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _UnaryUnary(self._channel.unary_unary(method, *args, **kwargs), self._added)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _UnaryStream(self._channel.unary_stream(method, *args, **kwargs), self._added)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _StreamUnary(self._channel.stream_unary(method, *args, **kwargs), self._added)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _StreamStream(self._channel.stream_stream(method, *args, **kwargs), self._added)


def open_adding(open_channel: Callable[[list[grpc.aio.ClientInterceptor] | None], grpc.aio.Channel],
                added: Sequence[Added]) -> grpc.aio.Channel:
    """A channel from ``open_channel(interceptors)`` whose calls carry the mesh's metadata: the fast path's
    ``MetadataChannel``, or the plain path's interceptors (``core.fastpath``, read once, here)."""
    if fastpath.enabled():
        return MetadataChannel(open_channel(None), added)
    return open_channel(interceptors(added))
