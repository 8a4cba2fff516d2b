"""The Python client installs on its own: its wheel carries the generated stubs, and in a fresh venv without torch
or the server code it imports and builds Tensor messages."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CHECK = """
import sys, numpy as np
from embedmesh_client import Client, to_tensor, from_tensor
t = to_tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
assert list(t.shape) == [2, 3] and from_tensor(t)[1, 2] == 5.0
assert "torch" not in sys.modules
try:
    import embedmesh.services
except ImportError:
    print("ok: client only")
else:
    raise SystemExit("the server code is importable: the wheel leaked it")
"""


def test_client_wheel_installs_without_torch_or_server(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT / "clients" / "python"), "-w",
                    str(wheels)], check=True, timeout=300)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", *map(str, wheels.glob("*.whl"))], check=True, timeout=600)
    installed = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                               check=True).stdout.lower()
    assert "torch" not in installed and "embedmesh-client" in installed
    out = subprocess.run([str(py), "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ok: client only" in out.stdout
