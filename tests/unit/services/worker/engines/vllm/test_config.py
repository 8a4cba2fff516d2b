"""The vllm engine's options (``engines/vllm/config.py``): defaults, the older ``EMBEDMESH_VLLM_*`` names, and the
rules on block size, cache size and the readiness wait."""

from __future__ import annotations

import pytest

from embedmesh.services.worker.engines.vllm.config import VLLMOptions


def test_defaults() -> None:
    o = VLLMOptions()
    assert (o.dtype, o.max_batch_size, o.max_model_len, o.gpu_memory_utilization, o.tensor_parallel_size,
            o.enable_sleep_mode, o.vllm_block_size, o.kv_cache_memory_bytes, o.ready_timeout, o.kv_events,
            o.kv_events_log) == ("float32", 8, 4096, 0.9, 1, False, 0, 0, 300.0, True, "")


def test_older_variable_names_are_aliases() -> None:
    aliases = {o.field: o.aliases for o in VLLMOptions.options()}
    assert aliases["tensor_parallel_size"] == ("EMBEDMESH_VLLM_TP",)
    assert aliases["kv_events_log"] == ("EMBEDMESH_VLLM_KV_EVENTS_LOG",)
    assert aliases["dtype"] == () and aliases["max_batch_size"] == ()


@pytest.mark.parametrize(("kw", "message"), [
    ({"vllm_block_size": -1}, "vllm_block_size and kv_cache_memory_bytes must be >= 0 (0 = vLLM's default)"),
    ({"kv_cache_memory_bytes": -1}, "vllm_block_size and kv_cache_memory_bytes must be >= 0 (0 = vLLM's default)"),
    ({"ready_timeout": 0.0}, "ready_timeout must be > 0 seconds"),
    ({"dtype": "int8"}, "dtype must be float32, bfloat16 or float16, got 'int8'"),
])
def test_bad_values(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as e:
        VLLMOptions(**kw)  # type: ignore[arg-type]
    assert str(e.value) == message
