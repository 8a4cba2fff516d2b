"""Client authentication at the REST edge.

Every route needs ``Authorization: Bearer <key>`` when API keys are configured (the same key ring the gRPC
services load, see ``embedmesh.core.auth``): a missing or wrong key is a 401 with OpenAI's error JSON
(``invalid_api_key``) before the body is read. Only ``/health``, ``/openapi.json`` and ``/docs`` are open, and
``/metrics`` unless ``--metrics-require-key`` is set: a route outside ``/v1/`` (``/sleep``, ``/wake_up``,
``/is_sleeping``) is checked here as well as by the service behind it. More than one ``Authorization`` header is
a 400 whether or not keys are configured: which one a proxy, the gateway and a service each read would otherwise
be a matter of chance.

The gateway holds no privilege of its own over client data: it forwards the client's ``Authorization`` header as
gRPC metadata on every call it makes for the request (``forwarding_channel``), and the preprocessor and vector
store authenticate the key again and derive the tenant themselves. Its channels never carry the mesh token.
"""

from __future__ import annotations

import contextvars

import grpc
from starlette.requests import Request

from embedmesh.core import auth
from embedmesh.core.call_metadata import Added
from embedmesh.core.server import mesh_channel
from embedmesh.gateway import affinity
from embedmesh.gateway.errors import ApiError

__all__ = ["authenticate_request", "forwarding_channel", "needs_key"]

_authorization: contextvars.ContextVar[str] = contextvars.ContextVar("embedmesh_authorization", default="")


OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs"})
"""Routes that never need a key (the kubelet's probes call /health; the API's description is public)."""


def needs_key(path: str, metrics_require_key: bool) -> bool:
    """Whether ``path`` is behind the API key (when keys are configured): every route but the open ones."""
    if path == "/metrics":
        return metrics_require_key
    return path not in OPEN_PATHS


def authenticate_request(request: Request, metrics_require_key: bool = False) -> auth.Principal | None:
    """Check the request's key (401 ``invalid_api_key`` when missing or wrong) and remember the header so the
    gRPC calls made for this request forward it. None when no key is needed."""
    sent = request.headers.getlist("authorization")
    if len(sent) > 1:
        raise ApiError(400, f"{len(sent)} Authorization headers: send exactly one ('Authorization: Bearer <key>')",
                       code="duplicate_header", param="Authorization")
    header = sent[0] if sent else ""
    # Set for this request's task only (each ASGI request runs in its own context); never reset, so a streaming
    # body that starts its gRPC call after the handler returned still forwards it.
    _authorization.set(header)
    ring = auth.keyring()
    if not ring.enabled or not needs_key(request.url.path, metrics_require_key):
        return None
    token = auth.bearer_token(header)
    key = ring.lookup(token)
    if key is None:
        message = ("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'." if not token else
                   "Incorrect API key provided.")
        raise ApiError(401, message, code="invalid_api_key", type_="invalid_request_error")
    return auth.Principal(key.tenant, admin=key.admin, key=key)


def _forwarded() -> list[tuple[str, str]]:
    """The current request's ``Authorization`` header as gRPC metadata (none outside a request)."""
    header = _authorization.get()
    return [("authorization", header)] if header else []


_FORWARD = Added(_forwarded, frozenset({"authorization"}))
"""The request's key replaces any ``authorization`` a call was given."""


_AFFINITY = Added(affinity.metadata, frozenset({affinity.HEADER}))
"""The request's image affinity key (``gateway.affinity``), which the gateway's Envoy egress hashes."""


def forwarding_channel(address: str) -> grpc.aio.Channel:
    """A channel to a mesh service that carries the client's key (TLS when configured, never the mesh token) and,
    for a request carrying an image, its affinity key."""
    return mesh_channel(address, mesh_token=False, added=[_FORWARD, _AFFINITY])
