"""encoder_cache.main: the command line and its variables become the server options, the cache config and the
tensor cap; impossible combinations are usage errors; the process serves and prints its address."""

from __future__ import annotations

import subprocess
import sys

import pytest

from embedmesh.services.encoder_cache import main as cache_main
from embedmesh.services.encoder_cache.tiered import DEFAULT_MAX_TTL_SECONDS


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("EMBEDMESH_CACHE_HOST", "EMBEDMESH_CACHE_PORT", "EMBEDMESH_CACHE_METRICS_PORT", "REDIS_URL",
                "EMBEDMESH_CACHE_CAPACITY_BYTES", "EMBEDMESH_CACHE_TTL_SECONDS", "EMBEDMESH_CACHE_MAX_TTL_SECONDS",
                "EMBEDMESH_MAX_EMBEDS_BYTES"):
        monkeypatch.delenv(var, raising=False)
    options, config, max_bytes = cache_main.parse([])
    assert (options.host, options.port, options.metrics_port) == ("127.0.0.1", 50071, 0)
    assert (config.capacity_bytes, config.redis_url, config.default_ttl_seconds) == (1 << 30, "", 3600)
    assert config.max_ttl_seconds == DEFAULT_MAX_TTL_SECONDS and max_bytes == 256 << 20


def test_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://r:6379/0")
    monkeypatch.setenv("EMBEDMESH_CACHE_PORT", "6000")
    monkeypatch.setenv("EMBEDMESH_CACHE_MAX_TTL_SECONDS", "7200")
    options, config, max_bytes = cache_main.parse(["--port", "0", "--capacity-bytes", "1024", "--default-ttl", "60",
                                                   "--max-tensor-bytes", "4096", "--host", "0.0.0.0"])
    assert (options.host, options.port) == ("0.0.0.0", 0)
    assert (config.redis_url, config.capacity_bytes, config.default_ttl_seconds, config.max_ttl_seconds) == (
        "redis://r:6379/0", 1024, 60, 7200)
    assert max_bytes == 4096


@pytest.mark.parametrize("argv", [
    ["--capacity-bytes", "-1"],
    ["--default-ttl", "0"],
    ["--default-ttl", "100", "--max-ttl", "50"],
    ["--max-tensor-bytes", "1023"],
])
def test_impossible_values_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cache_main.parse(argv)
    assert info.value.code == 2
    assert "capacity must be >= 0, 1 <= default ttl <= max ttl and max tensor bytes >= 1024" in capsys.readouterr().err


def test_the_process_serves_and_prints_its_address() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "embedmesh.services.encoder_cache.main", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("encoder-cache listening on 127.0.0.1:") and line.rstrip().endswith("(L2: none)")
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_help_lists_the_flags() -> None:
    r = subprocess.run([sys.executable, "-m", "embedmesh.services.encoder_cache.main", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for flag in ("--port", "--redis-url", "--capacity-bytes", "--max-ttl", "--max-tensor-bytes"):
        assert flag in r.stdout, flag
