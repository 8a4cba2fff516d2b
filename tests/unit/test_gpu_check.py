"""``scripts/gpu_check.sh`` / ``gpu_check.py`` where no GPU is: the machine is refused with exit 2 and a reason, a
wrong ``--model`` is named, and a device run's log is written into docs/benchmarks.md's section by ``--record``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, cwd=ROOT)


def test_a_model_folder_without_a_config_is_named_and_refused(tmp_path: Path) -> None:
    r = _run("--model", str(tmp_path))
    assert r.returncode == 2
    assert f"--model {tmp_path} holds no config.json" in r.stderr


def test_an_unknown_argument_is_refused() -> None:
    r = _run("--fast")
    assert r.returncode == 2 and "unknown argument --fast" in r.stderr


def test_without_cuda_it_says_so_and_exits_2() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = _run()
    assert r.returncode == 2
    assert "CUDA is not available" in r.stderr and "--dry-run" in r.stderr


LOG = """\
name, memory.total [MiB], driver_version
{"ts": "2026-11-27T13:28:00Z", "level": "info", "service": "worker", "msg": "serving"}
Loading weights: 100%|##########| 272/272
[Some GPU (cuda)] in-process    1 client(s):      45.2 tokens/s (128 tokens, bfloat16)
[Some GPU (cuda)] through mesh   1 client(s):      38.1 tokens/s (128 tokens, bfloat16)
gpu_check: device='Some GPU (cuda)' model=m-random-weights dtype=bfloat16 inproc_1=45.2 mesh_1=38.1 embeds_equal=yes
"""


def test_record_writes_the_device_runs_figures_into_its_section(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_check = _load()
    from bench import docs_writer

    begin, end = docs_writer.markers("gpu_check.py")
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# Benchmarks\n\nwritten by people\n\n{begin}\nold figures\n{end}\n\nafter\n")
    monkeypatch.setattr(docs_writer, "DOC", page)
    log = tmp_path / "full.log"
    log.write_text(LOG)
    gpu_check.record(log)
    text = page.read_text()
    section = text[text.index(begin):text.index(end)]
    assert "old figures" not in section
    assert "Device: Some GPU (cuda)." in section and "--random-weights" in section
    assert "45.2 tokens/s" in section and "38.1 tokens/s" in section
    assert '"level"' not in section and "Loading weights" not in section and "memory.total" not in section
    assert text.startswith("# Benchmarks\n\nwritten by people") and text.rstrip().endswith("after")


def test_record_refuses_a_log_of_a_run_that_did_not_finish(tmp_path: Path) -> None:
    gpu_check = _load()
    log = tmp_path / "full.log"
    log.write_text(LOG.rsplit("gpu_check: device=", 1)[0])
    with pytest.raises(SystemExit, match="did not finish"):
        gpu_check.record(log)
