"""``python -m embedmesh.gateway.main``: announces its address, serves, and stops cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import httpx
import pytest


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_main_serves_and_stops_cleanly(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "embedmesh.gateway.main", "--port", "0", "--preprocessor",
                             "127.0.0.1:1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"EMBEDMESH_TRACE_CONSOLE": "0", "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.fullmatch(r"gateway listening on (http://127\.0\.0\.1:(\d+))\n", line)
        assert m, line
        r = httpx.get(f"{m.group(1)}/health", timeout=10)
        assert r.status_code == 503  # nothing listens at the preprocessor address
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    logs = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    assert logs and all(x["service"] == "gateway" for x in logs)
    assert logs[-1]["msg"] == "stopped"
    assert "Traceback" not in err
