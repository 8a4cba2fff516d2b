"""The launcher's security settings for its children: the keys file, the throwaway CA and one certificate per service
(``--tls``), the mesh token when TLS or keys are on, and the lines that say what is on. Which child holds the token
is ``core/callers.needs_mesh_token``'s rule, applied where each child is spawned (``launcher.start_mesh``)."""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

__all__ = ["KEY_VARS", "OPEN_WARNING", "security_env"]


KEY_VARS = ("EMBEDMESH_API_KEYS", "EMBEDMESH_API_KEY", "EMBEDMESH_API_KEYS_FILE", "EMBEDMESH_ADMIN_KEYS")
"""Environment variables that turn API keys on (every child inherits them)."""

OPEN_WARNING = ("SECURITY: no API keys — every client on this host can use the mesh; set "
                "EMBEDMESH_API_KEYS=key=tenant or --api-keys-file, and --tls for mutual TLS")


def security_env(a: argparse.Namespace, env: dict[str, str]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Per-child security variables (by certificate name) and the lines that say what is on.

    Mutates ``env`` (shared by every child): the keys file and, when TLS or keys are on, a fresh mesh token."""
    if a.api_keys_file:
        env["EMBEDMESH_API_KEYS_FILE"] = str(Path(a.api_keys_file).resolve())
    keys = any(env.get(k) for k in KEY_VARS)
    per_child: dict[str, dict[str, str]] = {}
    lines: list[str] = []
    if a.tls:
        from embedmesh.core.certs import SERVICE_NAMES, make_mesh_certs

        out = Path(a.tls_dir)
        hosts = list(dict.fromkeys(["localhost", "127.0.0.1", a.host]))
        make_mesh_certs(out, SERVICE_NAMES, hosts=hosts)
        for name in SERVICE_NAMES:
            per_child[name] = {"EMBEDMESH_TLS_CERT": str(out / f"{name}.pem"),
                               "EMBEDMESH_TLS_KEY": str(out / f"{name}-key.pem"),
                               "EMBEDMESH_TLS_CA": str(out / "ca.pem")}
    if a.tls or keys:
        env.setdefault("EMBEDMESH_MESH_TOKEN", secrets.token_urlsafe(32))
    if not keys:
        lines.append(OPEN_WARNING if not a.tls else OPEN_WARNING.split(", and --tls")[0])
    else:
        lines.append("security: API keys required on /v1/* and the public gRPC port")
    if a.tls:
        lines.append(f"security: mutual TLS between services (throwaway CA and certificates in {a.tls_dir}; "
                     f"a client with a mesh certificate uses client.pem/client-key.pem)"
                     + ("; the gateway serves HTTPS" if a.gateway_tls else "; the gateway serves plain HTTP"))
    elif keys:
        lines.append("security: no TLS inside the mesh (add --tls for mutual TLS); internal calls carry a random "
                     "mesh token")
    return per_child, lines
