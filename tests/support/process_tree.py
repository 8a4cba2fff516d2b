"""A child that starts a grandchild in its own process group, as a vLLM worker starts its engine core: run as
``python -m tests.support.process_tree PID_FILE term|ignore``, it starts the grandchild, writes the grandchild's pid
to ``PID_FILE`` once the grandchild is ready, and sleeps. With ``ignore`` the grandchild ignores SIGTERM (only
SIGKILL stops it). The child itself keeps every signal at its default: SIGTERM or SIGKILL ends it alone, and the
grandchild lives on in its group. ``alive`` and ``wait_gone`` tell when processes are gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

_GRANDCHILD = """
import os, signal, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(os.getpid(), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], limit: float = 30) -> list[int]:
    """Those of ``pids`` still running after up to ``limit`` seconds of waiting for them all to end."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def read_pid(pid_file: Path, limit: float = 30.0) -> int:
    """The grandchild's pid once the child wrote it (within ``limit`` seconds)."""
    deadline = time.monotonic() + limit
    while not pid_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no pid in {pid_file} after {limit:g} s")
        time.sleep(0.02)
    return int(pid_file.read_text())


def main() -> None:
    pid_file, on_term = Path(sys.argv[1]), sys.argv[2]
    grandchild = subprocess.Popen([sys.executable, "-c", _GRANDCHILD, on_term], stdout=subprocess.PIPE)
    assert grandchild.stdout is not None
    pid = grandchild.stdout.readline().strip().decode()  # printed once its SIGTERM disposition is set
    tmp = pid_file.with_suffix(".tmp")
    tmp.write_text(pid)
    os.replace(tmp, pid_file)  # whole or absent: the reader never sees half a pid
    time.sleep(600)


if __name__ == "__main__":
    main()
