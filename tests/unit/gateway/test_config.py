"""GatewayConfig: defaults, env vars, flags over env, range checks, printing."""

from __future__ import annotations

import pytest

from embedmesh.gateway.config import GatewayConfig


def test_defaults() -> None:
    c = GatewayConfig.from_args([], env={})
    assert (c.host, c.port, c.preprocessor) == ("127.0.0.1", 8000, "127.0.0.1:50051")
    assert c.max_body_bytes == 1 << 30 and c.request_timeout_seconds > 0


def test_env_then_flags() -> None:
    env = {"EMBEDMESH_GATEWAY_HOST": "0.0.0.0", "EMBEDMESH_GATEWAY_PORT": "9000",
           "EMBEDMESH_PREPROCESSOR_ADDR": "pre:1234"}
    c = GatewayConfig.from_args([], env=env)
    assert (c.host, c.port, c.preprocessor) == ("0.0.0.0", 9000, "pre:1234")
    c = GatewayConfig.from_args(["--port", "9100", "--preprocessor", "other:1"], env=env)
    assert (c.host, c.port, c.preprocessor) == ("0.0.0.0", 9100, "other:1")


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--max-body-bytes", "10"], ["--request-timeout", "0"],
                                  ["--port", "abc"], ["--tenant-share", "0"], ["--tenant-share", "1.5"]])
def test_bad_values_exit_with_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        GatewayConfig.from_args(argv, env={})
    assert info.value.code == 2


def test_prints_itself() -> None:
    c = GatewayConfig(port=1234)
    assert "port=1234" in str(c) and "preprocessor='127.0.0.1:50051'" in str(c)
    assert c.describe()["port"] == 1234
