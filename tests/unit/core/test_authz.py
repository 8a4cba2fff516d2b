"""core.authz on its own: metadata values as text, a verified peer certificate recognised from the auth context, and
the per-method decision — a certificate whose identity may not make the call is a PERMISSION_DENIED naming it, the
mesh token counts only where no certificate is demanded, and behind its sidecar a process authorizes the caller the
sidecar names. (Over the wire with real certificates: test_callers.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from embedmesh.core import auth, tls
from embedmesh.core.auth import Access
from embedmesh.core.authz import Authorizer, md_value, peer_has_mesh_cert
from embedmesh.core.errors import PermissionDenied, Unauthenticated


class _Context:
    def __init__(self, cn: str | None) -> None:
        self._ac = {"x509_common_name": [cn.encode()], "x509_pem_cert": [b"-----"]} if cn else {}

    def auth_context(self) -> dict[str, Any]:
        return self._ac


@pytest.fixture
def token() -> Iterator[str]:
    tls.configure(tls.Security(mesh_token="mesh-token-0123456789"))
    yield "mesh-token-0123456789"
    tls.configure(tls.Security())
    auth.configure_keys(auth.KeyRing())


def test_metadata_values_are_text_and_absent_is_empty() -> None:
    md = [("authorization", "Bearer k"), ("x-bin", b"caf\xe9")]
    assert md_value(md, "authorization") == "Bearer k"
    assert md_value(md, "x-bin") == "caf\u00e9"
    assert md_value(md, "missing") == "" and md_value(None, "x") == ""


def test_a_peer_certificate_is_seen_only_when_the_handshake_verified_one() -> None:
    assert peer_has_mesh_cert(_Context("embedmesh-worker"))
    assert not peer_has_mesh_cert(_Context(None))


@pytest.mark.parametrize("cn, allowed", [("embedmesh-preprocessor", True), ("embedmesh-gateway", False),
                                         ("embedmesh-worker", False), ("embedmesh-client", True)])
def test_a_certificate_is_the_mesh_only_for_the_calls_of_its_identity(token: str, cn: str, allowed: bool) -> None:
    authz = Authorizer(Access.MESH, require_client_cert=True, method="/embedmesh.worker.v1.WorkerService/GenerateMany")
    md = [(tls.MESH_TOKEN_HEADER, token)]  # the token does not count on a port that demands certificates
    if allowed:
        assert authz.principal(md, _Context(cn)).mesh
    else:
        with pytest.raises(PermissionDenied) as info:
            authz.principal(md, _Context(cn))
        assert info.value.reason == "CALLER_NOT_ALLOWED" and cn.removeprefix("embedmesh-") in info.value.message


def test_the_token_makes_a_mesh_caller_where_no_certificate_is_demanded(token: str) -> None:
    authz = Authorizer(Access.MESH, require_client_cert=False, method="/embedmesh.worker.v1.WorkerService/GenerateMany")
    assert authz.principal([(tls.MESH_TOKEN_HEADER, token)], _Context(None)).mesh
    with pytest.raises(Unauthenticated):
        authz.principal([(tls.MESH_TOKEN_HEADER, "wrong")], _Context(None))
