"""Least privilege inside the mesh: which service's certificate may make which internal call.

A certificate from the mesh CA gets a peer past the TLS handshake of an internal port; that alone no longer makes it
a mesh caller. The caller's identity is read from its certificate and checked against ``MESH_CALLERS`` for the
method it calls: only workers register with a router (``WorkerStream``), only preprocessors route and generate, and
the gateway — which faces clients — is a mesh caller nowhere: on the vector store its calls carry the client's key
like any client's, and it holds no mesh token (the launcher does not hand it one). A compromised gateway can do no
more than a client can.

Identity: the first DNS label of the certificate's common name, without a leading ``embedmesh-``. The launcher's
certificates say ``CN=embedmesh-<name>`` (``core/certs.py``), the cert-manager overlay's say
``CN=<name>.<namespace>.svc.cluster.local`` (``deploy/k8s``); both give ``<name>``.

Behind a sidecar (the Kubernetes mTLS overlay: each pod's Envoy terminates the caller's TLS and opens its own to the
app with the pod's certificate), the app's peer is its own sidecar and holds the app's own certificate. With
``EMBEDMESH_TLS_SIDECAR=1`` (set only by that overlay), a peer holding the process's own identity stands for the
caller that its sidecar names in ``x-forwarded-client-cert`` (the sidecar sets it from the caller's certificate and
drops whatever the caller sent: ``forward_client_cert_details: SANITIZE_SET``); without the header it is itself.
Without the setting, the header is ignored.

A certificate whose identity may not make the call is treated as no mesh credential at all: a MESH call is then
refused PERMISSION_DENIED naming the identity and the call (``describe_refusal``), a PUBLIC call needs an API key
like any client's. The mesh token still makes a mesh caller (it is what a mesh without TLS has, and what the vector
store presents on the preprocessor's public port); it is handed only to the services that need it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MESH_CALLERS", "OPERATOR", "XFCC_HEADER", "identity", "forwarded_identity", "may_call",
           "describe_refusal", "needs_mesh_token"]

XFCC_HEADER = "x-forwarded-client-cert"

OPERATOR = "client"
"""The operator's certificate (the launcher's ``client.pem``): every internal call, as an admin key may — for
debugging with grpcurl. Issue it to people, never to a service."""

MESH_CALLERS: Mapping[str, frozenset[str]] = {
    # A method's own entry wins over its service's.
    "embedmesh.router.v1.RouterService": frozenset({"preprocessor"}),
    "embedmesh.router.v1.RouterService/WorkerStream": frozenset({"worker"}),
    "embedmesh.worker.v1.WorkerService": frozenset({"preprocessor"}),
    "embedmesh.cache.v1.EncoderCacheService": frozenset({"preprocessor"}),
    "embedmesh.imageencoder.v1.ImageEncoderService": frozenset({"preprocessor"}),
    # Nobody calls the vector store as the mesh: the gateway forwards its client's key.
    "embedmesh.vectorstore.v1.VectorStoreService": frozenset(),
    # The vector store embeds through the preprocessor (with the mesh token on its public port; a certificate
    # where the port demands one).
    "embedmesh.inference.v1.InferenceService": frozenset({"vector-store"}),
}
"""Service (``package.Service``) or method (``package.Service/Method``) → the identities that may call it as the
mesh. A service not listed here accepts every mesh certificate (health and reflection are not wrapped at all)."""


def identity(auth_context: Mapping[str, Any]) -> str | None:
    """The mesh identity of a verified peer certificate (see the module docstring); None when there is none."""
    names = auth_context.get("x509_common_name") or ()
    for raw in names:
        cn = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        label = cn.split(".", 1)[0].strip().lower()
        if label.startswith("embedmesh-"):
            label = label[len("embedmesh-"):]
        if label:
            return label
    return None


def forwarded_identity(xfcc: str) -> str | None:
    """The identity of the caller a sidecar names in ``x-forwarded-client-cert`` (its last element: the hop that
    reached this pod), from the ``Subject``'s CN; None when the header names none."""
    elements = _split(xfcc, ",")
    if not xfcc or not elements:
        return None
    for field in _split(elements[-1], ";"):
        key, _, value = field.partition("=")
        if key.strip().lower() != "subject":
            continue
        for rdn in _split(value.strip().strip('"'), ","):
            k, _, v = rdn.partition("=")
            if k.strip().upper() == "CN":
                return identity({"x509_common_name": [v.strip()]})
    return None


def _split(text: str, sep: str) -> list[str]:
    """``text`` split on ``sep`` outside double quotes (XFCC quotes values that hold ',' ';' or '=')."""
    out, cur, quoted = [], [], False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == sep and not quoted:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def _allowed(method: str) -> frozenset[str] | None:
    """``method`` is ``/package.Service/Method``; None when its service is not listed."""
    path = method.lstrip("/")
    if path in MESH_CALLERS:
        return MESH_CALLERS[path]
    return MESH_CALLERS.get(path.split("/", 1)[0])


def may_call(method: str, who: str | None) -> bool:
    """Whether a peer whose certificate says ``who`` calls ``method`` as the mesh."""
    allowed = _allowed(method)
    if allowed is None or who == OPERATOR:
        return True
    return who in allowed


def describe_refusal(method: str, who: str | None) -> str:
    """Why a certificate is not a mesh credential for ``method``, for PERMISSION_DENIED."""
    allowed = sorted(_allowed(method) or ())
    by = ", ".join(allowed) if allowed else "no service"
    return (f"the caller's certificate ({who or 'no identity'}) may not call {method.lstrip('/')} as the mesh; "
            f"it is for {by} (or an admin key)")


TOKEN_USERS_WITH_TLS = frozenset({"preprocessor", "vector-store"})
"""With mutual TLS, the mesh token is a credential only on the preprocessor's public port (which cannot demand
certificates from clients): the preprocessor checks it and the vector store presents it. Nobody else holds it."""
NEVER_TOKEN = frozenset({"gateway"})
"""Services that face clients and call the mesh only on a client's behalf, with the client's key."""


def needs_mesh_token(service: str, tls: bool) -> bool:
    """Whether ``service`` (a certificate name: ``worker``, ``vector-store``...) is handed the mesh token. Without
    TLS the token is the internal plane's only credential, so every service but the client-facing ones gets it."""
    if service in NEVER_TOKEN:
        return False
    return service in TOKEN_USERS_WITH_TLS if tls else True
