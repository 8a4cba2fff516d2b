"""The sglang engine's options (``engines/sglang/config.py``): defaults, the older ``EMBEDMESH_SGLANG_*`` names,
and the task and token-pool rules."""

from __future__ import annotations

import pytest

from embedmesh.services.worker.engines.sglang.config import SGLangOptions


def test_defaults_and_variables() -> None:
    assert SGLangOptions() == SGLangOptions("embed", "cpu", 8192, "float32", 8)
    env = {o.field: (o.env, o.aliases) for o in SGLangOptions.options()}
    assert env["sglang_task"] == ("EMBEDMESH_WORKER_SGLANG_TASK", ("EMBEDMESH_SGLANG_TASK",))
    assert env["sglang_device"][1] == ("EMBEDMESH_SGLANG_DEVICE",)
    assert env["sglang_max_total_tokens"][1] == ("EMBEDMESH_SGLANG_MAX_TOTAL_TOKENS",)


@pytest.mark.parametrize("kw", [{"sglang_task": "chat"}, {"sglang_max_total_tokens": 0}])
def test_bad_task_or_pool(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError) as e:
        SGLangOptions(**kw)  # type: ignore[arg-type]
    assert str(e.value) == "sglang_task must be 'embed' or 'generate' and sglang_max_total_tokens >= 1"


def test_both_tasks_are_accepted() -> None:
    assert SGLangOptions(sglang_task="generate").sglang_task == "generate"
