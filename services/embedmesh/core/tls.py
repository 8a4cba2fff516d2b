"""Transport security for the mesh: mutual TLS between services, TLS for clients on the public port, and the mesh
token for internal callers on ports that cannot demand a client certificate.

One process-wide setting, read once at start (``configure``), used by every server the process builds and every
channel it opens (``embedmesh.core.server``):

    setting          flag           env var                  effect
    certificate      --tls-cert     EMBEDMESH_TLS_CERT       this service's certificate chain (PEM)
    private key      --tls-key      EMBEDMESH_TLS_KEY        its key (PEM)
    mesh CA          --tls-ca       EMBEDMESH_TLS_CA         the CA that signs every mesh certificate (PEM)
    mesh token       --mesh-token   EMBEDMESH_MESH_TOKEN     a shared secret internal callers send as metadata
    behind a sidecar --tls-sidecar  EMBEDMESH_TLS_SIDECAR    calls arrive through this pod's own TLS sidecar
                                                             (Envoy), which names the real caller in
                                                             ``x-forwarded-client-cert`` (see core/callers.py)

With the three TLS files set, a service serves TLS only; internal ports (workers, router, cache, vector store)
require a client certificate signed by the mesh CA, so nobody without one completes the handshake. The public port
(the preprocessor's ``InferenceService``) serves TLS without demanding a client certificate — outside clients
authenticate with API keys there — and the mesh's own callers on it present the mesh token.
Without TLS, services bind 127.0.0.1 unless told otherwise (see each service's ``--host``).
"""

from __future__ import annotations

import argparse
import functools
import hmac
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = ["TlsFiles", "Security", "configure", "current", "add_security_args", "strip_security_args",
           "MESH_TOKEN_HEADER"]

MESH_TOKEN_HEADER = "x-embedmesh-mesh-token"
"""Metadata key carrying the mesh token on internal calls."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one service: its certificate chain, its key and the mesh CA."""

    cert: Path
    key: Path
    ca: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()


@dataclass(frozen=True)
class Security:
    """The process's transport security: TLS files (None = plaintext) and the mesh token (empty = none)."""

    tls: TlsFiles | None = None
    mesh_token: str = ""
    sidecar: bool = False
    """Calls reach this process through its pod's own TLS sidecar: a peer holding this process's own certificate is
    that sidecar, and the caller it names in ``x-forwarded-client-cert`` is the one to authorize."""

    @functools.cached_property
    def identity(self) -> str | None:
        """This process's mesh identity, from its certificate's CN (None without TLS); read once."""
        if self.tls is None:
            return None
        return _identity_of(self.tls.cert)

    @property
    def enabled(self) -> bool:
        """Whether the internal plane is protected (mTLS or a mesh token)."""
        return self.tls is not None or bool(self.mesh_token)

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials | None:
        """TLS credentials for a server port; None for plaintext."""
        if self.tls is None:
            return None
        cert, key, ca = self.tls.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for a channel to another mesh service (presents this service's certificate)."""
        if self.tls is None:
            return None
        cert, key, ca = self.tls.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def token_matches(self, presented: str) -> bool:
        """Constant-time comparison with the mesh token (False when none is configured)."""
        if not self.mesh_token or not presented:
            return False
        return hmac.compare_digest(self.mesh_token.encode(), presented.encode())


def _identity_of(cert: Path) -> str | None:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    from embedmesh.core import callers

    pem = x509.load_pem_x509_certificate(cert.read_bytes())
    names = [str(a.value) for a in pem.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return callers.identity({"x509_common_name": names})


_current = Security()


def configure(security: Security) -> None:
    """Set the process-wide transport security (each service's ``main`` calls this once, before serving)."""
    global _current
    _current = security


def current() -> Security:
    """The process-wide transport security."""
    return _current


def from_values(cert: str, key: str, ca: str, mesh_token: str, sidecar: bool = False) -> Security:
    """Validate the TLS file trio (all or none, each readable) and build a ``Security``."""
    given = [bool(cert), bool(key), bool(ca)]
    if any(given) and not all(given):
        raise ValueError("--tls-cert, --tls-key and --tls-ca go together: set all three or none")
    tls = None
    if all(given):
        files = TlsFiles(Path(cert), Path(key), Path(ca))
        for flag, path in (("--tls-cert", files.cert), ("--tls-key", files.key), ("--tls-ca", files.ca)):
            if not path.is_file():
                raise ValueError(f"{flag}: {path} is not a readable file (make them with "
                                 f"`python -m embedmesh.core.certs --out DIR`)")
        tls = files
    if sidecar and tls is None:
        raise ValueError("--tls-sidecar needs --tls-cert, --tls-key and --tls-ca (the pod's certificate)")
    return Security(tls=tls, mesh_token=mesh_token, sidecar=sidecar)


def add_security_args(p: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """Add ``--tls-cert/--tls-key/--tls-ca/--mesh-token`` (defaults from the environment) to a parser."""
    env = os.environ if env is None else env
    g = p.add_argument_group("mesh security")
    g.add_argument("--tls-cert", default=env.get("EMBEDMESH_TLS_CERT", ""), help="this service's certificate (PEM)")
    g.add_argument("--tls-key", default=env.get("EMBEDMESH_TLS_KEY", ""), help="its private key (PEM)")
    g.add_argument("--tls-ca", default=env.get("EMBEDMESH_TLS_CA", ""), help="the mesh CA (PEM)")
    g.add_argument("--mesh-token", default=env.get("EMBEDMESH_MESH_TOKEN", ""),
                   help="shared secret of internal callers (EMBEDMESH_MESH_TOKEN)")
    g.add_argument("--tls-sidecar", action="store_true",
                   default=env.get("EMBEDMESH_TLS_SIDECAR", "").lower() in ("1", "true", "yes"),
                   help="calls arrive through this pod's own TLS sidecar, which names the caller in "
                        "x-forwarded-client-cert (EMBEDMESH_TLS_SIDECAR=1)")


def strip_security_args(argv: Sequence[str] | None, env: Mapping[str, str] | None = None,
                        prog: str = "embedmesh") -> list[str]:
    """Read the security flags out of ``argv``, configure the process, and return the other arguments.

    Lets every service accept the same flags without each config parser repeating them."""
    import sys

    p = argparse.ArgumentParser(prog=prog, add_help=False)
    add_security_args(p, env)
    known, rest = p.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    try:
        configure(from_values(known.tls_cert, known.tls_key, known.tls_ca, known.mesh_token, known.tls_sidecar))
    except ValueError as e:
        p.error(str(e))
    return rest
