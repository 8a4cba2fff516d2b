"""The vllm engine's factory (``engines/vllm/__init__.py: build``): the worker's flags reach ``VLLMConfig`` (sleep
mode, LoRA, block sizes, readiness), KV events only when routers listen, ``--kv-events-log`` attached, and the
engine's own metrics offered. vLLM itself is not started (the engine loads it in ``start``)."""

from __future__ import annotations

from pathlib import Path

from embedmesh.services.worker.config import WorkerConfig
from embedmesh.services.worker.engines import registry
from embedmesh.services.worker.engines.registry import engine_context
from embedmesh.services.worker.engines.vllm import VLLMOptions, build


def test_vllm_gets_sleep_mode_and_lora_from_the_worker_flags() -> None:
    from embedmesh.services.worker.engines.vllm.engine import VLLMEngine

    config = WorkerConfig.from_args(["--engine", "vllm", "--enable-sleep-mode", "--enable-lora"])
    engine = registry.build_engine(config)
    assert isinstance(engine, VLLMEngine)
    assert engine.config.enable_sleep_mode and engine.config.enable_lora
    assert not registry.build_engine(WorkerConfig.from_args(["--engine", "vllm"])).config.enable_sleep_mode


def test_vllm_offers_kv_events_only_to_routers_and_its_metrics(tmp_path: Path) -> None:
    plain = registry.build_engine(WorkerConfig.from_args(["--engine", "vllm"]))
    assert plain.kv_event_source() is None and plain.kv_usage() == 0.0
    log = tmp_path / "ev.jsonl"
    routed = registry.build_engine(WorkerConfig.from_args(["--engine", "vllm", "--routers", "r:1",
                                                           "--kv-events-log", str(log)]))
    assert routed.kv_event_source() is routed
    names = {m.name for m in routed.metrics_collector("w").collect()}
    assert {"embedmesh_vllm_num_running", "embedmesh_vllm_kv_usage", "embedmesh_vllm_preemptions"} <= names
    assert log.exists()  # the --kv-events-log listener is attached by the engine's factory
    assert registry.build_engine(WorkerConfig.from_args(
        ["--engine", "vllm", "--routers", "r:1", "--no-kv-events"])).kv_event_source() is None


def test_every_option_reaches_the_engine_config() -> None:
    from embedmesh.services.worker.engines.vllm.engine import VLLMEngine

    engine = build(engine_context(WorkerConfig.from_args([
        "--engine", "vllm", "--served-name", "served", "--dtype", "bfloat16", "--max-model-len", "512",
        "--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "2", "--max-batch-size", "3",
        "--vllm-block-size", "32", "--kv-cache-memory-bytes", "1024", "--ready-timeout", "7",
        "--block-size", "8", "--routers", "r:1"])))
    assert isinstance(engine, VLLMEngine)
    c = engine.config
    assert (c.served_name, c.dtype, c.max_model_len, c.gpu_memory_utilization, c.tensor_parallel_size,
            c.max_num_seqs) == ("served", "bfloat16", 512, 0.5, 2, 3)
    assert (c.block_size, c.kv_cache_memory_bytes, c.kv_events, c.kv_event_block_size,
            c.ready_timeout_seconds) == (32, 1024, True, 8, 7.0)


def test_zero_means_vllms_own_block_size_and_cache_size() -> None:
    c = build(engine_context(WorkerConfig(engine="vllm", with_options=VLLMOptions()))).config  # type: ignore[attr-defined]
    assert c.block_size is None and c.kv_cache_memory_bytes is None and c.kv_events is False
