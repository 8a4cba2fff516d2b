"""Worker configuration: flags, their environment variables, and the bad values each refuses."""

from __future__ import annotations

import pytest

from embedmesh.services.worker.config import WorkerConfig


def test_vllm_flags_parse() -> None:
    c = WorkerConfig.from_args(["--engine", "vllm", "--vllm-block-size", "16", "--kv-cache-memory-bytes", "1024",
                                "--ready-timeout", "12.5", "--no-kv-events", "--kv-events-log", "/tmp/ev.jsonl",
                                "--routers", "a:1, b:2"])
    assert (c.vllm_block_size, c.kv_cache_memory_bytes, c.ready_timeout) == (16, 1024, 12.5)
    assert c.kv_events is False and c.kv_events_log == "/tmp/ev.jsonl" and c.routers == ("a:1", "b:2")


def test_environment_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDMESH_VLLM_READY_TIMEOUT", "7")
    monkeypatch.setenv("EMBEDMESH_VLLM_KV_EVENTS", "0")
    c = WorkerConfig.from_args(["--engine", "vllm"])
    assert c.ready_timeout == 7 and c.kv_events is False


@pytest.mark.parametrize(("argv", "needle"), [
    (["--engine", "nope"], "unknown engine 'nope'; known engines: hf, hf-embed, vllm, sglang, echo"),
    (["--port", "70000"], "port must be in"),
    (["--max-batch-size", "0"], "max_batch_size"),
    (["--threads", "0"], "threads"),
    (["--block-size", "0"], "block_size"),
    (["--vllm-block-size", "-1"], "vllm_block_size"),
    (["--kv-cache-memory-bytes", "-5"], "kv_cache_memory_bytes"),
    (["--ready-timeout", "0"], "ready_timeout"),
    (["--dtype", "int8"], "dtype must be"),
    (["--sglang-task", "chat"], "sglang_task"),
])
def test_bad_values_are_refused_naming_the_setting(argv: list[str], needle: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # On the command line: argparse's usage and the message on stderr, exit status 2, no traceback.
    with pytest.raises(SystemExit) as exit_:
        WorkerConfig.from_args(argv)
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err


def test_an_engine_nobody_registered_is_refused_in_code_too() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tpu'; known engines: hf, hf-embed, vllm, sglang, echo"):
        WorkerConfig(engine="tpu")

