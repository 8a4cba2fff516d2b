"""Worker configuration: flags, their environment variables, and the bad values each refuses; engine knobs are
declared by each engine's folder and composed in."""

from __future__ import annotations

import pytest

from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines.echo import EchoOptions
from embedmesh.services.worker.engines.hf import HFOptions
from embedmesh.services.worker.engines.hf_embed import HFEmbedOptions
from embedmesh.services.worker.engines.sglang import SGLangOptions
from embedmesh.services.worker.engines.vllm import VLLMOptions


def test_vllm_flags_parse() -> None:
    c = WorkerConfig.from_args(["--engine", "vllm", "--vllm-block-size", "16", "--kv-cache-memory-bytes", "1024",
                                "--ready-timeout", "12.5", "--no-kv-events", "--kv-events-log", "/tmp/ev.jsonl",
                                "--routers", "a:1, b:2"])
    o = c.options_as(VLLMOptions)
    assert (o.vllm_block_size, o.kv_cache_memory_bytes, o.ready_timeout) == (16, 1024, 12.5)
    assert o.kv_events is False and o.kv_events_log == "/tmp/ev.jsonl" and c.routers == ("a:1", "b:2")


def test_environment_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDMESH_VLLM_READY_TIMEOUT", "7")
    monkeypatch.setenv("EMBEDMESH_VLLM_KV_EVENTS", "0")
    c = WorkerConfig.from_args(["--engine", "vllm"])
    assert c.options_as(VLLMOptions).ready_timeout == 7 and c.options_as(VLLMOptions).kv_events is False


# Every engine flag and variable of the flat config it replaced: (engine, flag argv, env, value, options field).
ENGINE_SETTINGS = [
    ("hf", ["--max-batch-size", "3"], ("EMBEDMESH_WORKER_MAX_BATCH_SIZE", "3"), "max_batch_size", 3),
    ("hf", ["--threads", "5"], ("EMBEDMESH_WORKER_THREADS", "5"), "threads", 5),
    ("hf", ["--dtype", "bfloat16"], ("EMBEDMESH_WORKER_DTYPE", "bfloat16"), "dtype", "bfloat16"),
    ("hf-embed", ["--threads", "4"], ("EMBEDMESH_WORKER_THREADS", "4"), "threads", 4),
    ("vllm", ["--dtype", "float16"], ("EMBEDMESH_WORKER_DTYPE", "float16"), "dtype", "float16"),
    ("vllm", ["--max-batch-size", "9"], ("EMBEDMESH_WORKER_MAX_BATCH_SIZE", "9"), "max_batch_size", 9),
    ("vllm", ["--max-model-len", "512"], ("EMBEDMESH_VLLM_MAX_MODEL_LEN", "512"), "max_model_len", 512),
    ("vllm", ["--gpu-memory-utilization", "0.5"], ("EMBEDMESH_VLLM_GPU_MEMORY_UTILIZATION", "0.5"),
     "gpu_memory_utilization", 0.5),
    ("vllm", ["--tensor-parallel-size", "2"], ("EMBEDMESH_VLLM_TP", "2"), "tensor_parallel_size", 2),
    ("vllm", ["--enable-sleep-mode"], ("EMBEDMESH_VLLM_ENABLE_SLEEP_MODE", "1"), "enable_sleep_mode", True),
    ("vllm", ["--vllm-block-size", "32"], ("EMBEDMESH_VLLM_BLOCK_SIZE", "32"), "vllm_block_size", 32),
    ("vllm", ["--kv-cache-memory-bytes", "99"], ("EMBEDMESH_VLLM_KV_CACHE_MEMORY_BYTES", "99"),
     "kv_cache_memory_bytes", 99),
    ("vllm", ["--ready-timeout", "3"], ("EMBEDMESH_VLLM_READY_TIMEOUT", "3"), "ready_timeout", 3.0),
    ("vllm", ["--no-kv-events"], ("EMBEDMESH_VLLM_KV_EVENTS", "0"), "kv_events", False),
    ("vllm", ["--kv-events-log", "/x"], ("EMBEDMESH_VLLM_KV_EVENTS_LOG", "/x"), "kv_events_log", "/x"),
    ("sglang", ["--sglang-task", "generate"], ("EMBEDMESH_SGLANG_TASK", "generate"), "sglang_task", "generate"),
    ("sglang", ["--sglang-device", "cuda"], ("EMBEDMESH_SGLANG_DEVICE", "cuda"), "sglang_device", "cuda"),
    ("sglang", ["--sglang-max-total-tokens", "64"], ("EMBEDMESH_SGLANG_MAX_TOTAL_TOKENS", "64"),
     "sglang_max_total_tokens", 64),
    ("sglang", ["--dtype", "bfloat16"], ("EMBEDMESH_WORKER_DTYPE", "bfloat16"), "dtype", "bfloat16"),
    ("echo", ["--hidden-size", "8"], None, "hidden_size", 8),
]


@pytest.mark.parametrize(("engine", "argv", "env", "name", "value"), ENGINE_SETTINGS)
def test_every_engine_flag_and_variable_keeps_its_name_and_meaning(
        engine: str, argv: list[str], env: tuple[str, str] | None, name: str, value: object,
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert getattr(WorkerConfig.from_args(["--engine", engine, *argv]).engine_options, name) == value
    if env is not None:
        monkeypatch.setenv(*env)
        assert getattr(WorkerConfig.from_args(["--engine", engine]).engine_options, name) == value


def test_defaults_are_the_flat_configs() -> None:
    assert WorkerConfig.from_args([]).engine_options == HFOptions(max_batch_size=8, threads=2, dtype="float32")
    assert WorkerConfig(engine="hf-embed").engine_options == HFEmbedOptions(threads=2)
    assert WorkerConfig(engine="echo").engine_options == EchoOptions(hidden_size=576)
    assert WorkerConfig(engine="sglang").engine_options == SGLangOptions("embed", "cpu", 8192, "float32", 8)
    v = WorkerConfig.from_args(["--engine", "vllm"]).options_as(VLLMOptions)
    assert (v.max_model_len, v.gpu_memory_utilization, v.tensor_parallel_size, v.enable_sleep_mode,
            v.vllm_block_size, v.kv_cache_memory_bytes, v.ready_timeout, v.kv_events, v.kv_events_log) == (
        4096, 0.9, 1, False, 0, 0, 300.0, True, "")


def test_options_of_another_engine_are_refused_in_code() -> None:
    with pytest.raises(ValueError, match="the options of the echo engine must be EchoOptions, got HFOptions"):
        WorkerConfig(engine="echo", with_options=HFOptions())
    with pytest.raises(TypeError, match="not VLLMOptions"):
        WorkerConfig(engine="hf").options_as(VLLMOptions)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--engine", "nope"], "unknown engine 'nope'; known engines: hf, hf-embed, vllm, sglang, echo"),
    (["--port", "70000"], "port must be in"),
    (["--max-batch-size", "0"], "max_batch_size"),
    (["--threads", "0"], "threads"),
    (["--block-size", "0"], "block_size"),
    (["--vllm-block-size", "-1"], "vllm_block_size"),
    (["--kv-cache-memory-bytes", "-5"], "kv_cache_memory_bytes"),
    (["--ready-timeout", "0"], "ready_timeout"),
    (["--dtype", "int8"], "dtype must be float32, bfloat16 or float16, got 'int8'"),
    (["--sglang-task", "chat"], "sglang_task"),
    (["--engine", "echo", "--sglang-task", "chat"], "sglang_task"),
])
def test_bad_values_are_refused_naming_the_setting(argv: list[str], needle: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # On the command line: argparse's usage and the message on stderr, exit status 2, no traceback; an engine's
    # option is checked whichever engine runs.
    with pytest.raises(SystemExit) as exit_:
        WorkerConfig.from_args(argv)
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err


def test_an_engine_nobody_registered_is_refused_in_code_too() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tpu'; known engines: hf, hf-embed, vllm, sglang, echo"):
        WorkerConfig(engine="tpu")


def test_help_gives_every_flag_a_text() -> None:
    parser = WorkerConfig.parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 30
    assert not [a.option_strings for a in flags if not a.help]
