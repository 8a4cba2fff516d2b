"""Every service entry point drains on SIGINT and on SIGTERM even when it starts with SIGINT ignored, as a process
started by a background job of a non-interactive shell (``make run &``, a supervisor, a CI runner) does: Python
installs no KeyboardInterrupt handler then, so only a handler of the service's own stops it."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.mesh import free_port, ignore_sigint

GRPC_SERVICES = {
    "router": ("embedmesh.services.router.main", []),
    "worker": ("embedmesh.services.worker.main", ["--engine", "echo"]),
    "preprocessor": ("embedmesh.services.preprocessor.main", ["--workers", "127.0.0.1:1"]),
    "encoder-cache": ("embedmesh.services.encoder_cache.main", []),
    "vector-store": ("embedmesh.services.vector_store.main", ["--tokenizer", "approx",
                                                              "--inference-addr", "127.0.0.1:1"]),
}
"""Each gRPC service's module and the arguments it needs to start alone (no other service reachable)."""


LOOPS = ["uvloop", "asyncio"]
"""Both event loops ``run_service`` can run (``EMBEDMESH_EVENT_LOOP``): each installs signal handlers its own way."""


def _start(module: str, args: list[str], log: Path, loop: str) -> subprocess.Popen[str]:
    """Start ``module`` with SIGINT ignored on ``loop``; return once it says it listens (its stop handlers are in
    place by then)."""
    env = {**os.environ, "EMBEDMESH_TRACE_CONSOLE": "0", "EMBEDMESH_EVENT_LOOP": loop}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=err, text=True,
                                env=env, preexec_fn=ignore_sigint)
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 120
    seen = []
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=0.5):
                line = proc.stdout.readline()
                seen.append(line)
                if " listening on " in line:
                    return proc
    finally:
        sel.close()
    proc.kill()
    proc.wait()
    raise AssertionError(f"{module} did not start: {''.join(seen)}\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen[str], sig: signal.Signals, log: Path) -> list[dict[str, object]]:
    """Send ``sig``; the process must exit 0 within 30 s. Returns its JSON log records."""
    proc.send_signal(sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{signal.Signals(sig).name} did not stop it:\n{log.read_text()[-4000:]}") from None
    finally:
        assert proc.stdout is not None
        proc.stdout.close()
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "Traceback" not in text
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


def test_the_helper_starts_a_process_with_sigint_ignored() -> None:
    out = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT))"],
                         capture_output=True, text=True, preexec_fn=ignore_sigint, check=True).stdout
    assert out.strip() == str(signal.SIG_IGN)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("service", list(GRPC_SERVICES))
def test_a_grpc_service_started_with_sigint_ignored_drains_on_a_stop_signal(
        service: str, sig: signal.Signals, loop: str, tmp_path: Path) -> None:
    module, args = GRPC_SERVICES[service]
    log = tmp_path / "service.log"
    proc = _start(module, ["--host", "127.0.0.1", "--port", str(free_port()), *args,
                           *(["--data-dir", str(tmp_path / "vs")] if service == "vector-store" else [])], log, loop)
    records = _stop(proc, sig, log)
    msgs = [r["msg"] for r in records if r.get("service") == service]
    # Server.drain: health NOT_SERVING, in-flight calls finish, drain hooks, then "stopped".
    assert "draining" in msgs and msgs[-1] == "stopped", msgs


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_gateway_started_with_sigint_ignored_drains_on_a_stop_signal(sig: signal.Signals, loop: str,
                                                                         tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    proc = _start("embedmesh.gateway.main", ["--port", "0", "--preprocessor", "127.0.0.1:1"], log, loop)
    records = _stop(proc, sig, log)
    stopping = [r for r in records if r["msg"] == "stopping"]
    assert [r["signal"] for r in stopping] == [sig.name]
    assert records[-1]["msg"] == "stopped"
