"""The hf engine's options (``engines/hf/config.py``): the three shared knobs and its device, their defaults and
rules."""

from __future__ import annotations

import pytest

from embedmesh.services.worker.engines.hf.config import HFOptions


def test_defaults_and_fields() -> None:
    assert HFOptions() == HFOptions(max_batch_size=8, threads=2, dtype="float32", hf_device="cpu",
                                    hf_prefix_cache_blocks=256)
    assert [o.field for o in HFOptions.options()] == ["max_batch_size", "threads", "dtype", "hf_device",
                                                      "hf_prefix_cache_blocks"]
    assert [o.env for o in HFOptions.options()] == ["EMBEDMESH_WORKER_MAX_BATCH_SIZE", "EMBEDMESH_WORKER_THREADS",
                                                    "EMBEDMESH_WORKER_DTYPE", "EMBEDMESH_WORKER_HF_DEVICE",
                                                    "EMBEDMESH_WORKER_HF_PREFIX_CACHE_BLOCKS"]
    assert HFOptions(hf_device="cuda:1").hf_device == "cuda:1"


@pytest.mark.parametrize(("kw", "message"), [
    ({"max_batch_size": 0}, "max_batch_size must be >= 1"),
    ({"threads": 0}, "threads must be >= 1"),
    ({"dtype": "float64"}, "dtype must be float32, bfloat16 or float16, got 'float64'"),
    ({"hf_device": "tpu"}, "hf_device must be cpu, cuda or cuda:N, got 'tpu'"),
    ({"hf_device": "cuda:x"}, "hf_device must be cpu, cuda or cuda:N, got 'cuda:x'"),
    ({"hf_prefix_cache_blocks": -1}, "hf_prefix_cache_blocks must be >= 0, got -1"),
])
def test_bad_values(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as e:
        HFOptions(**kw)  # type: ignore[arg-type]
    assert str(e.value) == message
