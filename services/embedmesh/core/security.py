"""Every service's security flags in one place: ``configure_from_argv`` reads the TLS, mesh-token and API-key flags
(and their env vars) out of the command line, configures the process, and hands the rest to the service's own
config parser. See ``embedmesh.core.tls`` and ``embedmesh.core.auth`` for what each setting does."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from embedmesh.core import auth, tls
from embedmesh.core.logs import get_logger

__all__ = ["configure_from_argv", "describe"]

log = get_logger(__name__)


def configure_from_argv(argv: Sequence[str] | None, env: Mapping[str, str] | None = None,
                        prog: str = "embedmesh") -> list[str]:
    """Configure TLS, the mesh token and the key ring from ``argv``/``env``; return the remaining arguments."""
    p = argparse.ArgumentParser(prog=prog, add_help=False)
    tls.add_security_args(p, env)
    auth.add_key_args(p, env)
    known, rest = p.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    import os

    env = os.environ if env is None else env
    try:
        tls.configure(tls.from_values(known.tls_cert, known.tls_key, known.tls_ca, known.mesh_token,
                                      known.tls_sidecar))
        auth.configure_keys(auth.keyring_from_values(known.api_keys_file, known.api_key,
                                                     env.get("EMBEDMESH_API_KEYS", ""), known.admin_key))
    except ValueError as e:
        p.error(str(e))
    redis_url = env.get("REDIS_URL", "")
    if redis_url and auth.keyring().enabled:
        # Keys' limits count for every replica together (core/shared_limits.py); Redis connects on first use.
        from embedmesh.core.shared_limits import SharedLimits

        auth.configure_shared(SharedLimits(redis_url))
    return rest


def describe() -> dict[str, object]:
    """What is configured, for the start-up log (never a key or the token)."""
    sec = tls.current()
    ring = auth.keyring()
    return {"tls": sec.tls is not None, "mesh_token": bool(sec.mesh_token), "api_keys": len(ring.keys),
            "tenants": ring.tenants(), "shared_limits": auth._shared is not None}
