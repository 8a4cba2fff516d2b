"""Who is calling: API keys naming tenants, admin keys, mesh identity; per-tenant limits.

Every service that clients reach (the preprocessor's public port, the vector store, the gateway) loads the same key
ring and checks keys itself — nothing is trusted because of where it came from. Keys are read once at start from

    --api-keys-file PATH   EMBEDMESH_API_KEYS_FILE   JSON: {"keys": [{"key" | "key_sha256", "tenant", "admin",
                                                      "max_concurrent_requests", "requests_per_second",
                                                      "tokens_per_minute"}]}
    --api-key KEY          EMBEDMESH_API_KEY         one key of tenant "default" (vLLM's --api-key)
                           EMBEDMESH_API_KEYS        "key1=tenantA,key2=tenantB" (several keys, no limits)
    --admin-key KEY        EMBEDMESH_ADMIN_KEYS      comma-separated admin keys (tenant "admin")

Keys are compared in constant time (SHA-256 digests, every key compared, no early exit) and never logged: a key is
known in logs and metrics only by its tenant.

Access levels of an RPC (``Access``): OPEN (health, reflection), PUBLIC (an API key, or a mesh caller acting for a
tenant), ADMIN (an admin key or a mesh caller), MESH (a mesh caller: verified mesh certificate or the mesh token;
an admin key is accepted too, for direct calls by operators).

With no key configured, PUBLIC calls are open and belong to tenant ``default``; with no TLS and no mesh token,
MESH and ADMIN calls are open too (local use on 127.0.0.1; the launcher says so loudly).
"""

from __future__ import annotations

import argparse
import contextvars
import enum
import hashlib
import hmac
import json
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedmesh.core.errors import PermissionDenied, ResourceExhausted, Unauthenticated

__all__ = ["Access", "ApiKey", "KeyRing", "Principal", "TenantLimiter", "current_principal", "current_tenant",
           "principal_scope", "set_principal", "add_key_args", "keyring_from_values", "configure_keys", "keyring",
           "limiter", "PRIORITIES", "configure_shared", "limited", "take_slot", "release_slot", "Held",
           "DEFAULT_TENANT", "MESH_TENANT", "TENANT_HEADER", "authenticate", "bearer_token"]

DEFAULT_TENANT = "default"
"""Tenant of every caller when no API key is configured (local use)."""
MESH_TENANT = "mesh"
"""Tenant of a mesh caller that names none while keys are configured (reserved: no key may name it)."""
TENANT_HEADER = "x-embedmesh-tenant"
"""Metadata naming the tenant a mesh caller acts for; honoured only from callers with a mesh credential."""


class Access(enum.Enum):
    """Who may call an RPC."""

    OPEN = "open"
    PUBLIC = "public"
    ADMIN = "admin"
    MESH = "mesh"


@dataclass(frozen=True)
class ApiKey:
    """One configured key. ``digest`` is SHA-256 of the key; the key itself is not kept."""

    digest: bytes
    tenant: str
    admin: bool = False
    max_concurrent_requests: int = 0
    """0 = unlimited."""
    requests_per_second: float = 0.0
    """Token bucket refill rate; 0 = unlimited. Burst = max(1, rate)."""
    tokens_per_minute: int = 0
    """Prompt + completion tokens per rolling minute; 0 = unlimited."""
    weight: float = 1.0
    """The tenant's share of the workers when they are saturated (the preprocessor's ``--fair-share-slots``)."""
    priority: str = "interactive"
    """``interactive`` or ``batch``: batch work waits while interactive work waits (under saturation only)."""


PRIORITIES = ("interactive", "batch")
"""A key's ``priority`` values, served in this order."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Principal:
    """The authenticated caller of one request."""

    tenant: str
    admin: bool = False
    mesh: bool = False
    key: ApiKey | None = None


_ANONYMOUS = Principal(DEFAULT_TENANT, admin=False, mesh=False)
_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("embedmesh_principal", default=_ANONYMOUS)


def current_principal() -> Principal:
    """The caller of the request being served (``default`` tenant outside a request or with auth off)."""
    return _principal.get()


def current_tenant() -> str:
    return _principal.get().tenant


def set_principal(p: Principal) -> None:
    """Serve the rest of the current task as ``p`` (each gRPC call runs in its own task and context, so nothing
    leaks to other calls; unlike ``principal_scope`` this survives a streaming handler being closed from another
    context)."""
    _principal.set(p)


@contextmanager
def principal_scope(p: Principal) -> Iterator[None]:
    """Serve the enclosed code as ``p``."""
    token = _principal.set(p)
    try:
        yield
    finally:
        _principal.reset(token)


def bearer_token(value: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` value ('' when absent or another scheme)."""
    if not value:
        return ""
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


_TENANT_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _check_tenant(name: str, where: str) -> str:
    if not name or len(name) > 64 or not set(name) <= _TENANT_OK:
        raise ValueError(f"{where}: tenant must be 1-64 characters of [A-Za-z0-9._-], got {name!r}")
    return name


def _key_tenant(name: str, where: str) -> str:
    if name == MESH_TENANT:
        raise ValueError(f"{where}: tenant {MESH_TENANT!r} is reserved for the mesh's own callers")
    return _check_tenant(name, where)


class KeyRing:
    """The configured keys; ``authenticate`` maps a presented key to its ``ApiKey`` in constant time."""

    def __init__(self, keys: Sequence[ApiKey] = ()) -> None:
        self.keys = tuple(keys)

    @property
    def enabled(self) -> bool:
        """Whether clients must present a key."""
        return bool(self.keys)

    def lookup(self, presented: str) -> ApiKey | None:
        if not presented:
            return None
        d = _digest(presented)
        found: ApiKey | None = None
        for k in self.keys:  # every key is compared: the time does not depend on which one matches
            if hmac.compare_digest(k.digest, d):
                found = k
        return found

    def tenants(self) -> list[str]:
        return sorted({k.tenant for k in self.keys})

    @classmethod
    def parse_file(cls, path: Path) -> list[ApiKey]:
        """Keys from a JSON file (see the module docstring); ValueError naming the entry on a bad one."""
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"api keys file {path}: cannot read it as JSON ({e})") from None
        entries = doc.get("keys") if isinstance(doc, dict) else doc
        if not isinstance(entries, list):
            raise ValueError(f"api keys file {path}: expected {{\"keys\": [...]}}")
        out = []
        for i, e in enumerate(entries):
            where = f"api keys file {path}: keys[{i}]"
            if not isinstance(e, dict):
                raise ValueError(f"{where}: expected an object")
            if "key" in e and isinstance(e["key"], str) and len(e["key"]) >= 8:
                digest = _digest(e["key"])
            elif isinstance(e.get("key_sha256"), str) and len(e["key_sha256"]) == 64:
                digest = bytes.fromhex(e["key_sha256"])
            else:
                raise ValueError(f"{where}: needs \"key\" (at least 8 characters) or \"key_sha256\" (64 hex digits)")
            limits = {}
            for name, kind in (("max_concurrent_requests", int), ("requests_per_second", float),
                               ("tokens_per_minute", int)):
                v = e.get(name, 0)
                if not isinstance(v, int | float) or isinstance(v, bool) or v < 0 or not math.isfinite(v):
                    raise ValueError(f"{where}: {name} must be a number >= 0")
                limits[name] = kind(v)
            weight = e.get("weight", 1.0)
            if not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 < weight <= 1000 \
                    or not math.isfinite(weight):
                raise ValueError(f"{where}: weight must be a number in (0, 1000]")
            priority = e.get("priority", PRIORITIES[0])
            if priority not in PRIORITIES:
                raise ValueError(f"{where}: priority must be one of {', '.join(PRIORITIES)}")
            out.append(ApiKey(digest, _key_tenant(str(e.get("tenant", DEFAULT_TENANT)), where),
                              admin=bool(e.get("admin", False)), weight=float(weight), priority=priority, **limits))
        return out


def keyring_from_values(keys_file: str = "", api_key: str = "", api_keys: str = "",
                        admin_keys: str = "") -> KeyRing:
    """Build the key ring from the flag/env values (ValueError naming the bad one)."""
    keys: list[ApiKey] = []
    if keys_file:
        keys += KeyRing.parse_file(Path(keys_file))
    if api_key:
        keys.append(ApiKey(_digest(api_key), DEFAULT_TENANT))
    for i, item in enumerate(x.strip() for x in api_keys.split(",") if x.strip()):
        key, sep, tenant = item.rpartition("=")
        if not sep or not key:
            raise ValueError(f"EMBEDMESH_API_KEYS entry {i}: expected key=tenant")
        keys.append(ApiKey(_digest(key), _key_tenant(tenant, f"EMBEDMESH_API_KEYS entry {i}")))
    for key in (x.strip() for x in admin_keys.split(",") if x.strip()):
        keys.append(ApiKey(_digest(key), "admin", admin=True))
    return KeyRing(keys)


def add_key_args(p: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """``--api-keys-file``, ``--api-key``, ``--admin-key`` with defaults from the environment."""
    env = os.environ if env is None else env
    g = p.add_argument_group("client authentication")
    g.add_argument("--api-keys-file", default=env.get("EMBEDMESH_API_KEYS_FILE", ""),
                   help="JSON file of API keys with tenants and limits")
    g.add_argument("--api-key", default=env.get("EMBEDMESH_API_KEY", ""), help="one API key (tenant 'default')")
    g.add_argument("--admin-key", default=env.get("EMBEDMESH_ADMIN_KEYS", ""), help="comma-separated admin keys")


# --- per-tenant limits ----------------------------------------------------------------------------------------


@dataclass
class _TenantState:
    inflight: int = 0
    tokens: float = 0.0
    stamp: float = field(default_factory=time.monotonic)
    used: list[tuple[float, int]] = field(default_factory=list)
    """(time, tokens) charged in the last minute."""


class TenantLimiter:
    """Concurrency, requests per second (token bucket) and tokens per minute, per tenant.

    A tenant at its limit is refused at once with RESOURCE_EXHAUSTED and a ``retry_after_seconds``; other tenants'
    state is separate, so one tenant at its limit never slows another.
    """

    def __init__(self, clock: callable = time.monotonic) -> None:  # type: ignore[valid-type]
        self._clock = clock
        self._state: dict[str, _TenantState] = {}
        self._lock = threading.Lock()

    def _get(self, tenant: str, key: ApiKey) -> _TenantState:
        s = self._state.get(tenant)
        if s is None:
            s = self._state[tenant] = _TenantState(tokens=max(1.0, key.requests_per_second), stamp=self._clock())
        return s

    def acquire(self, p: Principal) -> bool:
        """Admit one request of ``p`` or raise ResourceExhausted; True when a release is owed."""
        k = p.key
        if k is None or not (k.max_concurrent_requests or k.requests_per_second or k.tokens_per_minute):
            return False
        with self._lock:
            s = self._get(p.tenant, k)
            now = self._clock()
            if k.max_concurrent_requests and s.inflight >= k.max_concurrent_requests:
                raise ResourceExhausted(
                    f"tenant {p.tenant!r} has {s.inflight} requests in flight, its limit; retry when one finishes",
                    reason="RATE_LIMIT_EXCEEDED", retry_after_seconds=1.0)
            if k.requests_per_second:
                burst = max(1.0, k.requests_per_second)
                s.tokens = min(burst, s.tokens + (now - s.stamp) * k.requests_per_second)
                s.stamp = now
                if s.tokens < 1.0:
                    wait = (1.0 - s.tokens) / k.requests_per_second
                    raise ResourceExhausted(
                        f"tenant {p.tenant!r} is over its {k.requests_per_second:g} requests per second",
                        reason="RATE_LIMIT_EXCEEDED", retry_after_seconds=wait)
            if k.tokens_per_minute:
                s.used = [(t, n) for t, n in s.used if now - t < 60.0]
                if sum(n for _, n in s.used) >= k.tokens_per_minute:
                    wait = 60.0 - (now - s.used[0][0]) if s.used else 1.0
                    raise ResourceExhausted(
                        f"tenant {p.tenant!r} is over its {k.tokens_per_minute} tokens per minute",
                        reason="RATE_LIMIT_EXCEEDED", retry_after_seconds=max(wait, 0.001))
            if k.requests_per_second:
                s.tokens -= 1.0
            s.inflight += 1
            return True

    def release(self, p: Principal) -> None:
        with self._lock:
            s = self._state.get(p.tenant)
            if s is not None and s.inflight > 0:
                s.inflight -= 1

    def charge_tokens(self, p: Principal, tokens: int) -> None:
        """Count ``tokens`` (prompt + completion) against the tenant's tokens per minute (in Redis too, for every
        replica, when limits are shared)."""
        if p.key is None or not p.key.tokens_per_minute or tokens <= 0:
            return
        with self._lock:
            self._get(p.tenant, p.key).used.append((self._clock(), int(tokens)))
        if _shared is not None:
            _in_background(_shared.charge(p.tenant, int(tokens)))


# --- limits shared by every replica (core/shared_limits.py) --------------------------------------------------

Held = Any
"""What ``take_slot`` returns and ``release_slot`` gives back: None, a Principal (a local slot) or a shared Lease."""

_shared: Any = None
_background: set[Any] = set()


def configure_shared(shared: Any) -> None:
    """Share the per-key limits with every replica through ``shared`` (a ``SharedLimits``; None: this process
    only)."""
    global _shared
    _shared = shared


def limited(p: Principal) -> bool:
    """Whether ``p``'s key carries any limit (the common unlimited case costs nothing more)."""
    k = p.key
    return k is not None and bool(k.max_concurrent_requests or k.requests_per_second or k.tokens_per_minute)


async def take_slot(p: Principal) -> Held:
    """Admit one request of ``p`` under its key's limits, or raise ResourceExhausted. In Redis when limits are
    shared; in this process when not, or when Redis fails (said once in the log)."""
    shared = _shared
    if shared is not None and p.key is not None:
        k = p.key
        try:
            return await shared.acquire(p.tenant, k.max_concurrent_requests, k.requests_per_second,
                                        k.tokens_per_minute)
        except ResourceExhausted:
            raise
        except Exception as e:  # noqa: BLE001 - Redis down or failing: this process's own limits apply
            shared.failed(e)
    return p if _limiter.acquire(p) else None


def release_slot(held: Held) -> None:
    """Give back what ``take_slot`` took (a shared lease is released in the background: this runs in ``finally``
    blocks, also of generators being closed)."""
    if held is None:
        return
    if isinstance(held, Principal):
        _limiter.release(held)
    elif _shared is not None:
        _in_background(_shared.release(held))


def _in_background(coro: Any) -> None:
    import asyncio

    try:
        task = asyncio.get_running_loop().create_task(coro)
    except RuntimeError:  # no loop (a synchronous caller): nothing to schedule it on
        coro.close()
        return
    _background.add(task)

    def done(t: Any) -> None:
        _background.discard(t)
        if not t.cancelled() and t.exception() is not None and _shared is not None:
            _shared.failed(t.exception())

    task.add_done_callback(done)


# --- process-wide configuration ----------------------------------------------------------------------------

_keyring = KeyRing()
_limiter = TenantLimiter()


def configure_keys(ring: KeyRing) -> None:
    """Set the process's key ring (each service's ``main`` calls this once)."""
    global _keyring
    _keyring = ring


def keyring() -> KeyRing:
    return _keyring


def limiter() -> TenantLimiter:
    return _limiter


def authenticate(access: Access, *, authorization: str, mesh_cert: bool, mesh_token: str,
                 tenant_header: str, security_enabled: bool, token_ok: bool) -> Principal:
    """Decide who the caller is for an RPC of ``access`` level, or raise Unauthenticated / PermissionDenied.

    ``mesh_cert``: the peer presented a certificate the server verified against the mesh CA; ``token_ok``: the
    mesh token it sent matches. ``security_enabled``: this process protects its internal plane (TLS or token).
    """
    ring = _keyring
    mesh = mesh_cert or token_ok or not security_enabled
    key = ring.lookup(bearer_token(authorization))
    if access is Access.OPEN:
        return _ANONYMOUS
    if access is Access.PUBLIC:
        if authorization and ring.enabled:
            # A credential that is presented must be valid, whoever forwards it (a mesh peer included).
            if key is None:
                raise Unauthenticated("incorrect API key provided", reason="INVALID_API_KEY")
            return Principal(key.tenant, admin=key.admin, mesh=False, key=key)
        if mesh_cert or token_ok:
            tenant = DEFAULT_TENANT if not ring.enabled else MESH_TENANT
            if tenant_header:
                try:
                    tenant = _check_tenant(tenant_header, TENANT_HEADER)
                except ValueError as e:
                    raise PermissionDenied(str(e), reason="BAD_TENANT") from None
            return Principal(tenant, admin=True, mesh=True)
        if not ring.enabled:
            return _ANONYMOUS
        raise Unauthenticated("missing API key: send it as 'Authorization: Bearer <key>'",
                              reason="INVALID_API_KEY")
    # ADMIN and MESH. Admin RPCs on a port clients reach stay closed to plain key holders even on an unprotected
    # local mesh once keys are configured; MESH RPCs of internal ports are open only while the process has neither
    # TLS nor a mesh token (the launcher makes a token whenever keys or TLS are on).
    if access is Access.ADMIN and not (mesh_cert or token_ok) and ring.enabled:
        mesh = False
    if mesh:
        return Principal(tenant_header or DEFAULT_TENANT, admin=True, mesh=True)
    if key is not None and key.admin:
        return Principal(key.tenant, admin=True, mesh=False, key=key)
    if key is not None:
        raise PermissionDenied("this call needs an admin key or a mesh certificate", reason="ADMIN_REQUIRED")
    raise Unauthenticated("this call needs an admin key or a mesh certificate", reason="INVALID_API_KEY")
