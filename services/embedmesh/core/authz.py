"""Who is calling, for one RPC: the caller's API key, its mesh certificate's identity for this method
(``core/callers.py``, with the identity its own sidecar forwards when the process runs behind one), the mesh token
where it counts — turned into an ``auth.Principal`` or a refusal. Built once per method by ``server.wrap_handler``."""

from __future__ import annotations

from typing import Any

import grpc

from embedmesh.core import auth, callers, tls
from embedmesh.core.auth import Access
from embedmesh.core.errors import PermissionDenied, Unauthenticated

__all__ = ["Authorizer", "peer_has_mesh_cert", "md_value"]


def peer_has_mesh_cert(context: grpc.aio.ServicerContext) -> bool:
    """Whether the peer presented a certificate the server verified (mutual TLS)."""
    try:
        ac = context.auth_context()
    except Exception:  # noqa: BLE001 - no auth context on plaintext ports
        return False
    return bool(ac.get("x509_pem_cert") or ac.get("x509_common_name"))


def md_value(metadata: Any, key: str) -> str:
    """The first value of ``key`` in a call's metadata, as text (empty when absent)."""
    for item in metadata or ():
        k, v = item if isinstance(item, tuple) else (item.key, item.value)
        if k == key:
            return v if isinstance(v, str) else v.decode("latin-1")
    return ""


class Authorizer:
    """Authenticates one call for its access level and holds the tenant's concurrency slot while it runs."""

    def __init__(self, access: Access, require_client_cert: bool, method: str = "") -> None:
        self.access = access
        self.require_client_cert = require_client_cert
        self.method = method

    def principal(self, metadata: Any, context: grpc.aio.ServicerContext) -> auth.Principal:
        """On a port that demands mesh certificates, the certificate's identity decides whether the caller is the
        mesh for this method (``core/callers.py``), and the mesh token is not a credential there: it is a secret
        several services hold, a certificate names one. Elsewhere the token is what makes a mesh caller."""
        sec = tls.current()
        cert = self.require_client_cert and peer_has_mesh_cert(context)
        who: str | None = None
        if cert:
            who = callers.identity(context.auth_context())
            if sec.sidecar and who is not None and who == sec.identity:
                # our own sidecar: it names the caller whose TLS it terminated (core/callers.py)
                who = callers.forwarded_identity(md_value(metadata, callers.XFCC_HEADER)) or who
            cert = callers.may_call(self.method, who)
        try:
            return auth.authenticate(
                self.access,
                authorization=md_value(metadata, "authorization"),
                mesh_cert=cert,
                mesh_token=md_value(metadata, tls.MESH_TOKEN_HEADER),
                tenant_header=md_value(metadata, auth.TENANT_HEADER),
                security_enabled=sec.enabled,
                token_ok=not self.require_client_cert and sec.token_matches(md_value(metadata,
                                                                                      tls.MESH_TOKEN_HEADER)),
            )
        except (Unauthenticated, PermissionDenied):
            if self.require_client_cert and not cert and peer_has_mesh_cert(context):
                raise PermissionDenied(callers.describe_refusal(self.method, who), reason="CALLER_NOT_ALLOWED") \
                    from None
            raise
