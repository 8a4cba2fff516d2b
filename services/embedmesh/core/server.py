"""One server bootstrap for every service: grpc.aio server, message-size limits, health, reflection,
every method wrapped once for errors, tracing, metrics and authentication (``wrap_handler``; see
``embedmesh.core.auth``), TLS (see
``embedmesh.core.tls``), and a graceful drain on SIGTERM/SIGINT.

Drain order (SIGTERM): health NOT_SERVING everywhere → ``on_drain_start`` hooks (e.g. leave the router) → the
server stops accepting new calls and in-flight calls run to completion, bounded by ``grace_seconds`` → only then the
``on_drain`` hooks shut engines and close channels → the process exits. A stream in flight therefore ends normally.

Health: every registered service name (and "" for the whole server) starts NOT_SERVING; the service flips
itself to SERVING once loaded (``Server.set_serving``) and everything goes back to NOT_SERVING when draining,
so load balancers stop sending before the port closes.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer as AsyncReflection
from opentelemetry import trace
from prometheus_client import Counter

from embedmesh.core import auth, inbound, tls, tracebacks
from embedmesh.core.auth import Access
from embedmesh.core.authz import Authorizer
from embedmesh.core.call_metadata import Added, metadata_interceptors, open_adding
from embedmesh.core.errors import EmbedmeshError, InternalError, to_status
from embedmesh.core.health_bounds import BoundedHealth
from embedmesh.core.logs import get_logger
from embedmesh.core.telemetry import (
    RPC_IN_FLIGHT,
    RPC_LATENCY,
    RPC_REQUESTS,
    extract_context,
    service_name,
    tracer,
)

__all__ = ["ServerOptions", "Server", "channel_options", "server_options", "insecure_channel", "mesh_channel",
           "plain_mesh_channel", "run_service", "EVENT_LOOPS", "metadata_interceptors",
           "wrap_handler", "Observed", "unexpected_error",
           "LIVENESS", "Access"]

LIVENESS = "embedmesh.Liveness"
"""Health name that is SERVING while the process runs (for liveness probes): readiness names go NOT_SERVING
when a dependency is missing, and restarting the process would not bring that dependency back."""

log = get_logger(__name__)

MiB = 1024 * 1024

TENANT_REQUESTS = Counter("embedmesh_tenant_requests_total", "RPCs per tenant (named by tenant, never by key)",
                          ["service", "tenant", "code"])


@dataclass(frozen=True)
class ServerOptions:
    """How a service listens."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 in containers."""
    port: int = 0
    """TCP port; 0 picks a free one (the bound port is on ``Server.port``)."""
    max_message_bytes: int = 512 * MiB
    """Largest gRPC message sent or received (gRPC's own default is 4 MiB)."""
    grace_seconds: float = field(default_factory=lambda: float(os.environ.get("EMBEDMESH_DRAIN_GRACE_SECONDS", "30")))
    """How long in-flight calls may finish after a drain starts (EMBEDMESH_DRAIN_GRACE_SECONDS, read when the
    options are made; default 30 s)."""
    metrics_port: int = 0
    """Port of the Prometheus /metrics endpoint; 0 = none."""
    public: bool = False
    """A port outside clients reach (the preprocessor's): with TLS it does not demand a client certificate
    (clients authenticate with API keys; mesh callers with the mesh token). Internal ports demand one. A unary
    request on it is read only once its caller is authenticated (``core/inbound.py``)."""


KEEPALIVE_MS = 30_000
"""How often a connection is pinged while idle, by each side."""


def channel_options(max_message_bytes: int = 512 * MiB) -> list[tuple[str, Any]]:
    """Options every channel and server uses: large tensors are not refused at 4 MiB; idle connections (and the
    long-lived streams on them) are kept alive by a ping every ``KEEPALIVE_MS``, and a server accepts such pings —
    gRPC's server default (one ping per 5 minutes without data) answered the mesh's own 30 s pings with GOAWAY
    ``too_many_pings`` after ~90 s idle, dropping every idle connection and the streams on it."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # servers: pings without data are fine down to a third of the keepalive interval
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 3),
    ]


def server_options(max_message_bytes: int = 512 * MiB) -> list[tuple[str, Any]]:
    """A server's options: a channel's, and compressed messages refused.

    gRPC inflates a compressed message whole (up to the receive limit) and parses it before any handler runs, so
    before the API key or the peer's certificate is looked at: ~260 KB of gzip on the wire made a server allocate
    ~500 MiB for a caller with no credentials. No mesh channel compresses, and tensors do not compress; with only
    ``identity`` enabled, gRPC answers a compressed message UNIMPLEMENTED without inflating it."""
    return [*channel_options(max_message_bytes), ("grpc.compression_enabled_algorithms_bitset", 1)]


def mesh_channel(address: str, max_message_bytes: int = 512 * MiB, *, mesh_token: bool = True,
                 added: Sequence[Added] = ()) -> grpc.aio.Channel:
    """An aio channel to another mesh service with the mesh's options, and its credentials: TLS with this
    service's certificate when the process has TLS configured, the mesh token when it has one. Every call carries
    the trace context, then ``added``'s metadata, then the token (``core.call_metadata``).

    ``mesh_token=False`` for channels that carry calls on behalf of outside clients (the gateway's): those calls
    are authenticated by the client's own API key, never by the mesh's token."""
    sec = tls.current()
    adds = list(added)
    if sec.mesh_token and mesh_token:
        token = [(tls.MESH_TOKEN_HEADER, sec.mesh_token)]
        adds.append(Added(lambda: token, frozenset({tls.MESH_TOKEN_HEADER})))
    return open_adding(lambda icpt: _open_channel(sec, address, max_message_bytes, icpt), adds)


def _open_channel(sec: tls.Security, address: str, max_message_bytes: int,
                  interceptors: list[Any] | None) -> grpc.aio.Channel:
    """TLS with this service's certificate when the process has TLS configured, plaintext otherwise."""
    creds = sec.channel_credentials()
    if creds is not None:
        return grpc.aio.secure_channel(address, creds, options=channel_options(max_message_bytes),
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes), interceptors=interceptors)


EVENT_LOOPS = ("auto", "uvloop", "asyncio")
"""``EMBEDMESH_EVENT_LOOP``: ``auto`` (uvloop when installed, else asyncio's), ``uvloop`` (required), ``asyncio``."""

_T = TypeVar("_T")


def event_loop_choice() -> str:
    """The event loop ``run_service`` will use: "uvloop" or "asyncio" (``EMBEDMESH_EVENT_LOOP``)."""
    choice = os.environ.get("EMBEDMESH_EVENT_LOOP", "auto").strip().lower() or "auto"
    if choice not in EVENT_LOOPS:
        raise SystemExit(f"EMBEDMESH_EVENT_LOOP must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("EMBEDMESH_EVENT_LOOP=uvloop but uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    return "uvloop"


def run_service(main: Coroutine[Any, Any, _T]) -> _T:
    """Run a service's main coroutine to the end on uvloop when it is installed (``EMBEDMESH_EVENT_LOOP``): a
    request through the mesh is mostly event-loop callbacks (grpc.aio's completions, futures, tasks), which
    uvloop runs for less (``bench/bench_fastpath.py`` measures both sides on the same loop)."""
    if event_loop_choice() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def plain_mesh_channel(address: str, max_message_bytes: int = 512 * MiB
                       ) -> tuple[grpc.aio.Channel, tuple[tuple[str, str], ...]]:
    """``mesh_channel`` without client interceptors, and the metadata its calls must carry (the mesh token, if
    any): for long-lived streams, whose writes an intercepted call routes through an extra queue and task. Such
    calls carry no trace context of their own (put it in the messages)."""
    sec = tls.current()
    metadata = ((tls.MESH_TOKEN_HEADER, sec.mesh_token),) if sec.mesh_token else ()
    return _open_channel(sec, address, max_message_bytes, None), metadata


insecure_channel = mesh_channel
"""Former name of ``mesh_channel`` (plaintext only when the process has no TLS configured)."""


async def _abort(context: grpc.aio.ServicerContext, err: EmbedmeshError) -> None:
    await context.abort_with_status(to_status(err))


def unexpected_error(exc: BaseException, method: str) -> InternalError:
    """An INTERNAL error naming a fresh incident id; the exception goes to the log under it, never to the caller."""
    incident = uuid.uuid4().hex[:12]
    log.error("unhandled error", exc_info=exc, extra={"method": method, "incident": incident})
    return InternalError(f"internal error (incident {incident}); see the service log")


class Observed:
    """One RPC's span, status code and latency (also one generation of a ``GenerateMany`` stream or one question of a
    ``RouteMany`` stream, each observed on its own: methods ``GenerateMany.generation``, ``RouteMany.question``)."""

    def __init__(self, method: str, metadata: Any) -> None:
        self.method = method.rsplit("/", 1)[-1]
        self.full = method
        self.code = "OK"
        self.tenant = ""
        self._span_cm = tracer().start_as_current_span(
            f"{service_name()} {self.method}", context=extract_context(metadata), kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.method": method},
        )
        self._t0 = time.perf_counter()

    def __enter__(self) -> Observed:
        self.span = self._span_cm.__enter__()
        self._in_flight = RPC_IN_FLIGHT.labels(service_name(), self.method)
        self._in_flight.inc()
        return self

    def fail(self, code: str) -> None:
        self.code = code
        self.span.set_attribute("rpc.grpc.status_code", code)
        self.span.set_status(trace.Status(trace.StatusCode.ERROR, code))

    def failed(self, exc: Exception) -> EmbedmeshError:
        """The error this RPC ends with because of ``exc``, marked on its span and metrics: a domain error as it is,
        anything else INTERNAL with an incident id (``unexpected_error``, logged); then ``exc`` drops its frames."""
        err = exc if isinstance(exc, EmbedmeshError) else unexpected_error(exc, self.full)
        tracebacks.drop(exc)
        self.fail(err.code.name)
        return err

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None and issubclass(exc[0], asyncio.CancelledError | GeneratorExit):
            self.code = "CANCELLED"
        self._span_cm.__exit__(None, None, None)
        self._in_flight.dec()
        RPC_REQUESTS.labels(service_name(), self.method, self.code).inc()
        RPC_LATENCY.labels(service_name(), self.method).observe(time.perf_counter() - self._t0)
        if self.tenant:
            TENANT_REQUESTS.labels(service_name(), self.tenant, self.code).inc()


async def _admit(request: Any, context: grpc.aio.ServicerContext, method: str, principal: auth.Principal,
                 authz: Authorizer | None, streaming_in: bool, one: bool, owed: list[auth.Principal],
                 idle_field: str | None = None) -> Any:
    """For an authenticated call: read a unary request served as a stream (``one``: only now, see
    ``core/inbound.py``), refuse unparsable request bytes (and a silent upload, ``idle_field``: see ``Server.add``),
    note a tenant whose limits apply (appended to ``owed``: the caller takes its slot, ``auth.take_slot``, and
    releases it) and serve the rest of the call as its principal; returns the request to hand on."""
    if one:
        request = await (inbound.open_message(request, method, context.peer()) if authz and authz.access is Access.OPEN
                         else inbound.first_message(request, method))
    if streaming_in:
        request = inbound.checked_stream(request, method, idle_field)
    elif isinstance(request, inbound.BadMessage):
        raise inbound.bad_message(method, request)
    if authz and authz.access is Access.PUBLIC and auth.limited(principal):
        owed.append(principal)  # its tenant's slot is taken next (auth.take_slot: in Redis when shared)
    auth.set_principal(principal)
    return request


def _caller(context: grpc.aio.ServicerContext, metadata: Any, authz: Authorizer | None,
            obs: Observed) -> auth.Principal:
    """Who calls, from the metadata alone (no message read yet when the request is a stream)."""
    principal = authz.principal(metadata, context) if authz else auth.current_principal()
    obs.tenant = principal.tenant
    return principal


def _wrap_unary(fn: Callable[..., Awaitable[Any]], method: str, authz: Authorizer | None = None,
                streaming_in: bool = False, one: bool = False,
                idle_field: str | None = None) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        metadata = context.invocation_metadata()
        raw = request
        with Observed(method, metadata) as obs:
            owed: list[auth.Principal] = []
            held: auth.Held = None
            principal: auth.Principal | None = None
            try:
                principal = _caller(context, metadata, authz, obs)
                request = await _admit(request, context, method, principal, authz, streaming_in, one, owed,
                                       idle_field)
                if owed:
                    held = await auth.take_slot(owed[0])
                return await fn(request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as e:  # noqa: BLE001 - domain errors keep their status; anything else is INTERNAL
                error = obs.failed(e)
                if streaming_in and principal is not None:
                    await inbound.drain(raw)
                await _abort(context, error)
            finally:
                auth.release_slot(held)

    return wrapper


def _wrap_stream(
    fn: Callable[..., AsyncIterator[Any]], method: str,
    authz: Authorizer | None = None, streaming_in: bool = False, one: bool = False, upload: bool = False,
    idle_field: str | None = None,
) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        metadata = context.invocation_metadata()
        raw = request
        with Observed(method, metadata) as obs:
            owed: list[auth.Principal] = []
            held: auth.Held = None
            principal: auth.Principal | None = None
            try:
                principal = _caller(context, metadata, authz, obs)
                request = await _admit(request, context, method, principal, authz, streaming_in, one, owed,
                                       idle_field)
                if owed:
                    held = await auth.take_slot(owed[0])
                async for item in fn(request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as e:  # noqa: BLE001
                error = obs.failed(e)
                if upload and principal is not None:
                    await inbound.drain(raw)
                await _abort(context, error)
            finally:
                auth.release_slot(held)

    return wrapper


def wrap_handler(handler: grpc.RpcMethodHandler, method: str, access: Access | None,
                 require_client_cert: bool = False, read_after_auth: bool = False,
                 parser: Callable[[bytes], Any] | None = None, upload: bool = False,
                 idle_field: str | None = None) -> grpc.RpcMethodHandler:
    """``handler`` (of RPC ``method``) with what every RPC of the mesh gets: domain exceptions mapped to status codes
    with details (anything else becomes INTERNAL with an incident id), a server span parented by the caller's
    traceparent, Prometheus counts and latency, authentication for its ``access`` level, and request bytes that are
    not a protobuf of the RPC's type refused as INVALID_ARGUMENT. Built once per method (``Server.add``); each call
    reads its own metadata from its context.

    ``read_after_auth`` (public ports): a unary request is served as a one-message stream, read only once the
    caller is authenticated (``core/inbound.py``). ``parser``: the request deserializer the service handed over for
    this RPC (``Server.add``), used instead of protobuf's. ``upload``, ``idle_field``: see ``Server.add``."""
    authz = Authorizer(access, require_client_cert, method) if access is not None else None
    one = read_after_auth and authz is not None
    kw = dict(
        request_deserializer=inbound.safe_deserializer(
            parser or handler.request_deserializer, method,
            max_bytes=inbound.OPEN_MESSAGE_BYTES if one and access is Access.OPEN else 0),
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary:
        if one:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, method, authz, one=True),
                                                        **kw)
        return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, method, authz), **kw)
    if handler.unary_stream:
        fn = handler.unary_stream
        if inspect.isasyncgenfunction(fn):
            if one:
                return grpc.stream_stream_rpc_method_handler(_wrap_stream(fn, method, authz, one=True), **kw)
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(fn, method, authz), **kw)
        if one and inspect.iscoroutinefunction(fn):  # writes its answers with context.write (health's Watch)
            return grpc.stream_stream_rpc_method_handler(_wrap_unary(fn, method, authz, one=True), **kw)
        return handler  # the generated base class's UNIMPLEMENTED stub: nothing to protect
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            _wrap_unary(handler.stream_unary, method, authz, streaming_in=True, idle_field=idle_field), **kw)
    if handler.stream_stream:
        fn = handler.stream_stream
        if inspect.isasyncgenfunction(fn):
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(fn, method, authz, streaming_in=True, upload=upload, idle_field=idle_field), **kw)
    return handler  # the generated base class's UNIMPLEMENTED stub: nothing to protect


class _Registrar:
    """Stands in for the grpc.aio server while a generated ``add_*Servicer_to_server`` registers a servicer: each
    method handler is wrapped once (``wrap_handler``) and the wrapped ones are registered on the real server."""

    def __init__(self, server: grpc.aio.Server, access_for: Callable[[str], Access], require_client_cert: bool,
                 read_after_auth: bool = False, parsers: Mapping[str, Callable[[bytes], Any]] | None = None,
                 uploads: Iterable[str] = (), idle_bound: Mapping[str, str] | None = None) -> None:
        self._server = server
        self._parsers = parsers or {}
        self._uploads = frozenset(uploads)
        self._idle_bound = idle_bound or {}
        self._access_for = access_for
        self._require_client_cert = require_client_cert
        self._read_after_auth = read_after_auth
        self.registered = False

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """The generated code also passes the same handlers to ``add_registered_method_handlers``: those are
        wrapped and registered there; these unwrapped ones are dropped."""

    def add_registered_method_handlers(self, service: str, method_handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        wrapped = {name: wrap_handler(h, f"/{service}/{name}", self._access_for(f"/{service}/{name}"),
                                      self._require_client_cert, self._read_after_auth, self._parsers.get(name),
                                      name in self._uploads, self._idle_bound.get(name))
                   for name, h in method_handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        self._server.add_registered_method_handlers(service, wrapped)
        self.registered = True


def _open_access(method: str) -> Access:
    """Access on a port's open services: health is open (probes carry no key), reflection wants an API key."""
    return Access.OPEN if method.lstrip("/").startswith(health.SERVICE_NAME + "/") else Access.PUBLIC


def add_public_health(server: grpc.aio.Server,
                      access_for: Callable[[str], Access] = _open_access) -> health.aio.HealthServicer:
    """Health on a client-facing port: open to probes, but at most ``inbound.OPEN_READS_PER_ADDRESS`` of its
    messages read at once per caller address and one over 4 KiB refused before it is parsed (core/inbound.py)."""
    checks = BoundedHealth()  # Watch streams bounded per caller address and in all (core/health_bounds.py)
    health_pb2_grpc.add_HealthServicer_to_server(checks, _Registrar(server, access_for, False, read_after_auth=True))
    return checks


def add_public_reflection(server: grpc.aio.Server, names: list[str],
                          access_for: Callable[[str], Access] = _open_access) -> None:
    """Reflection on a client-facing port: described to authenticated callers only, read after the key."""
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        AsyncReflection(names), _Registrar(server, access_for, False, read_after_auth=True))


class Server:
    """A service's gRPC server with health, reflection and drain.

    Usage::

        server = Server("preprocessor", options)
        server.add(add_InferenceServiceServicer_to_server, servicer, "embedmesh.inference.v1.InferenceService")
        await server.start()
        ... load ...
        server.set_serving(True)
        await server.wait_for_termination()   # returns after SIGTERM/SIGINT and a graceful stop
    """

    def __init__(self, name: str, options: ServerOptions) -> None:
        self.name = name
        self.options = options
        self._access: dict[str, Access] = {}
        self._require_client_cert = tls.current().tls is not None and not options.public
        # No server interceptor: every method is wrapped once when its service is added (``wrap_handler``).
        self._server = grpc.aio.server(options=server_options(options.max_message_bytes))
        if options.public:  # open to probes; at most two messages read at once per address (core/inbound.py)
            self._access[health.SERVICE_NAME] = Access.OPEN
            self.health = add_public_health(self._server, self._access_for)
        else:
            self.health = BoundedHealth()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._service_names: list[str] = []
        self.port = 0
        self._stopped = asyncio.Event()
        self._draining = False
        self._drain_hooks: list[Callable[[], Awaitable[None]]] = []
        self._drain_start_hooks: list[Callable[[], Awaitable[None]]] = []

    def add(self, register: Callable[[Any, grpc.aio.Server], None], servicer: Any, full_name: str,
            access: Access = Access.MESH, methods: dict[str, Access] | None = None,
            parsers: Mapping[str, Callable[[bytes], Any]] | None = None, uploads: Iterable[str] | None = None) -> None:
        """Register a servicer under its fully qualified service name (for health and reflection).

        ``access``: who may call its RPCs (default: mesh callers and admin keys only); ``methods`` overrides it
        per RPC name (e.g. ``{"Stats": Access.ADMIN}``). ``parsers``: RPC name -> request deserializer used instead
        of protobuf's (one that keeps a message's tensor bytes uncopied); by default the servicer's own
        ``request_parsers``. ``uploads``: RPCs whose request stream is an upload with an end, not a long-lived stream
        (a refusal waits for the client to finish sending, ``inbound.drain``); by default its ``upload_streams``.
        The servicer's ``idle_bound_streams`` (RPC name -> the field its messages fill): uploads with an end, outside
        the pieces streams, refused when they go silent (``inbound.checked_stream``); by default none."""
        self._service_names.append(full_name)
        self._access[full_name] = access
        for m, a in (methods or {}).items():
            self._access[f"{full_name}/{m}"] = a
        parsers = getattr(servicer, "request_parsers", None) if parsers is None else parsers
        uploads = getattr(servicer, "upload_streams", ()) if uploads is None else uploads
        registrar = _Registrar(self._server, self._access_for, self._require_client_cert, self.options.public,
                               parsers, uploads, getattr(servicer, "idle_bound_streams", None))
        register(servicer, registrar)  # type: ignore[arg-type]
        if not registrar.registered:
            # Only the generated registration hands over its method handlers; anything else would be served
            # unwrapped (no authentication, no error mapping), so it is refused.
            raise TypeError(f"{full_name}: register it with the generated add_*Servicer_to_server function")

    def _access_for(self, method: str) -> Access:
        name = method.lstrip("/")
        if name in self._access:
            return self._access[name]
        return self._access.get(name.rsplit("/", 1)[0], Access.MESH)

    def on_drain(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run ``hook`` once the server has stopped and in-flight calls have finished (shut engines, close
        channels): nothing still being served depends on what it closes."""
        self._drain_hooks.append(hook)

    def on_drain_start(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run ``hook`` as soon as a drain starts, before in-flight calls are waited for (leave a registry, stop
        taking work from elsewhere); it must not break calls in flight."""
        self._drain_start_hooks.append(hook)

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def start(self) -> None:
        names = [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        if self.options.public:  # described to authenticated callers only, read after the key (core/inbound.py)
            self._access[reflection.SERVICE_NAME] = Access.PUBLIC
            add_public_reflection(self._server, names, self._access_for)
        else:
            reflection.enable_server_reflection(names, self._server)
        creds = tls.current().server_credentials(require_client_cert=self._require_client_cert)
        bind = f"{self.options.host}:{self.options.port}"
        if creds is not None:
            self.port = self._server.add_secure_port(bind, creds)
        else:
            self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise RuntimeError(f"{self.name}: could not bind {self.options.host}:{self.options.port}")
        await self.set_serving(False)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self._server.start()
        if self.options.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(self.options.metrics_port, addr=self.options.host)
        log.info("listening", extra={"address": self.address, "services": self._service_names,
                                     "metrics_port": self.options.metrics_port,
                                     "tls": "off" if tls.current().tls is None else
                                     ("server" if not self._require_client_cert else "mutual")})

    async def set_serving(self, serving: bool, names: Iterable[str] | None = None) -> None:
        """Flip health for the given service names (default: all, plus the server-wide "")."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in names if names is not None else ["", *self._service_names]:
            await self.health.set(name, status)

    async def drain(self) -> None:
        """NOT_SERVING everywhere, drain-start hooks, stop accepting and let in-flight calls finish (bounded by
        ``grace_seconds``), then the drain hooks (engines, channels), then stop."""
        if self._stopped.is_set() or self._draining:
            return
        self._draining = True
        log.info("draining", extra={"grace_seconds": self.options.grace_seconds})
        await self.set_serving(False)
        await self._run_hooks(self._drain_start_hooks)
        await self._server.stop(self.options.grace_seconds)
        await self._run_hooks(self._drain_hooks)
        self._stopped.set()
        log.info("stopped")

    @staticmethod
    async def _run_hooks(hooks: list[Callable[[], Awaitable[None]]]) -> None:
        for hook in hooks:
            try:
                await hook()
            except Exception:  # noqa: BLE001 - a failing hook must not block shutdown
                log.exception("drain hook failed")

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT start a graceful drain."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.drain()))

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()
