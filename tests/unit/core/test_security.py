"""core.security: ``configure_from_argv`` reads the TLS, mesh-token and API-key flags (or their variables) out of a
command line, configures the process and returns the service's own arguments; bad values are usage errors;
``describe`` reports what is on without a secret."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from embedmesh.core import auth, security, tls
from embedmesh.core.certs import make_mesh_certs


@pytest.fixture
def restore() -> Iterator[None]:
    sec, ring = tls.current(), auth.keyring()
    yield
    tls.configure(sec)
    auth.configure_keys(ring)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_mesh_certs(out, names=["router"])
    return out


def test_flags_configure_tls_token_and_keys_and_the_rest_is_returned(restore: None, certs: Path,
                                                                      tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "file-key-123", "tenant": "acme"}]}))
    rest = security.configure_from_argv(
        ["--port", "7001", "--tls-cert", str(certs / "router.pem"), "--tls-key", str(certs / "router-key.pem"),
         "--tls-ca", str(certs / "ca.pem"), "--mesh-token", "tok-123", "--api-keys-file", str(keys),
         "--api-key", "single-key-1", "--admin-key", "adm-12345678", "--verbose"], env={})
    assert rest == ["--port", "7001", "--verbose"]
    sec = tls.current()
    assert sec.tls is not None and sec.tls.cert == certs / "router.pem" and sec.mesh_token == "tok-123"
    ring = auth.keyring()
    assert ring.lookup("file-key-123").tenant == "acme"  # type: ignore[union-attr]
    assert ring.lookup("single-key-1").tenant == auth.DEFAULT_TENANT  # type: ignore[union-attr]
    assert ring.lookup("adm-12345678").admin  # type: ignore[union-attr]
    assert security.describe() == {"tls": True, "mesh_token": True, "api_keys": 3,
                                   "tenants": ["acme", "admin", "default"], "shared_limits": False}


def test_environment_supplies_the_values_and_the_tenant_list(restore: None) -> None:
    rest = security.configure_from_argv([], env={"EMBEDMESH_MESH_TOKEN": "env-token",
                                                 "EMBEDMESH_API_KEYS": "ka-12345678=alpha,kb-12345678=beta"})
    assert rest == []
    assert tls.current() == tls.Security(mesh_token="env-token")
    assert auth.keyring().lookup("kb-12345678").tenant == "beta"  # type: ignore[union-attr]
    described = security.describe()
    assert described == {"tls": False, "mesh_token": True, "api_keys": 2, "tenants": ["alpha", "beta"],
                         "shared_limits": False}
    assert "env-token" not in repr(described) and "ka-12345678" not in repr(described)


def test_nothing_set_means_plaintext_and_no_keys(restore: None) -> None:
    assert security.configure_from_argv(["--x"], env={}) == ["--x"]
    assert not tls.current().enabled and not auth.keyring().enabled
    assert security.describe() == {"tls": False, "mesh_token": False, "api_keys": 0, "tenants": [],
                                   "shared_limits": False}


def test_redis_url_shares_the_keys_limits_only_when_there_are_keys(restore: None) -> None:
    try:
        security.configure_from_argv([], env={"REDIS_URL": "redis://127.0.0.1:6379/0"})
        assert security.describe()["shared_limits"] is False  # no keys, no limits to share
        security.configure_from_argv([], env={"REDIS_URL": "redis://127.0.0.1:6379/0",
                                              "EMBEDMESH_API_KEYS": "ka-12345678=alpha"})
        assert security.describe()["shared_limits"] is True
    finally:
        auth.configure_shared(None)


@pytest.mark.parametrize("argv,env,message", [
    (["--tls-cert", "a.pem"], {}, "--tls-cert, --tls-key and --tls-ca go together"),
    ([], {"EMBEDMESH_API_KEYS": "no-tenant"}, "EMBEDMESH_API_KEYS entry 0: expected key=tenant"),
    (["--api-keys-file", "/nonexistent/keys.json"], {}, "cannot read it as JSON"),
])
def test_bad_values_are_usage_errors_naming_the_problem(restore: None, capsys: pytest.CaptureFixture[str],
                                                        argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        security.configure_from_argv(argv, env=env, prog="vector-store")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "vector-store: error:" in err and message in err
