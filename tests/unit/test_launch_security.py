"""The launcher's security settings for its children (embedmesh.launch_security): an open mesh says so and gets no
token; API keys get a fresh random mesh token each start; --tls makes a certificate for every child."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embedmesh import launch_security, launcher


def _args(*argv: str):  # type: ignore[no-untyped-def]
    return launcher.parse_args(list(argv))


def test_an_open_mesh_is_announced_and_gets_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*launch_security.KEY_VARS, "EMBEDMESH_MESH_TOKEN", "EMBEDMESH_TLS"):
        monkeypatch.delenv(var, raising=False)
    env: dict[str, str] = {}
    per_child, lines = launch_security.security_env(_args(), env)
    assert lines == [launch_security.OPEN_WARNING]
    assert per_child == {} and "EMBEDMESH_MESH_TOKEN" not in env


def test_api_keys_get_a_random_mesh_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EMBEDMESH_MESH_TOKEN", raising=False)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "k-1", "tenant": "a"}]}))
    tokens = set()
    for _ in range(2):
        env = {}
        _, lines = launch_security.security_env(_args("--api-keys-file", str(keys)), env)
        assert env["EMBEDMESH_API_KEYS_FILE"] == str(keys.resolve())
        assert len(env["EMBEDMESH_MESH_TOKEN"]) >= 32
        tokens.add(env["EMBEDMESH_MESH_TOKEN"])
        assert launch_security.OPEN_WARNING not in lines and any("API keys required" in x for x in lines)
    assert len(tokens) == 2


def test_tls_makes_certificates_for_every_child(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EMBEDMESH_MESH_TOKEN", raising=False)
    env: dict[str, str] = {}
    per_child, lines = launch_security.security_env(_args("--tls", "--tls-dir", str(tmp_path)), env)
    for name in ("gateway", "preprocessor", "router", "worker", "embed-worker", "vector-store"):
        files = per_child[name]
        assert Path(files["EMBEDMESH_TLS_CERT"]) == tmp_path / f"{name}.pem"
        assert all(Path(files[k]).is_file() for k in ("EMBEDMESH_TLS_CERT", "EMBEDMESH_TLS_KEY", "EMBEDMESH_TLS_CA"))
    assert env["EMBEDMESH_MESH_TOKEN"]
    assert any("mutual TLS" in x for x in lines)
