"""Start a real mesh (the launcher: workers, preprocessor, gateway as separate processes) on free loopback ports."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

__all__ = ["free_port", "port_bindable", "ignore_sigint", "Mesh", "start_mesh"]


def ignore_sigint() -> None:
    """A ``preexec_fn``: the child starts with SIGINT ignored, as a background job of a non-interactive shell does
    (``make test &``, a supervisor, a CI runner)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Mesh:
    proc: subprocess.Popen[bytes]
    gateway_port: int
    preprocessor_port: int
    worker_ports: list[int]
    log_path: str
    extra: dict[str, object] = field(default_factory=dict)
    scheme: str = "http"
    """"https" when the gateway serves TLS (``gateway_tls=True``); its CA is ``extra["tls_dir"]/ca.pem``."""

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.gateway_port}"

    @property
    def preprocessor(self) -> str:
        return f"127.0.0.1:{self.preprocessor_port}"

    @property
    def workers(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.worker_ports]

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def port_bindable(port: int) -> bool:
    """Whether a new listener (SO_REUSEADDR) could bind ``port`` on 127.0.0.1 now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _metrics_base(workers: int) -> int:
    """A base for the launcher's metrics ports (base+1..+3, +9, +10+i) below Linux's ephemeral range (32768+), so
    a client connection cannot take one of them, with every port it implies free right now."""
    for _ in range(200):
        base = random.randrange(10000, 32000, 100)
        if all(port_bindable(base + off) for off in (1, 2, 3, 9, *range(10, 10 + workers))):
            return base
    raise RuntimeError("no free block of metrics ports below 32000")


def _listen_ports(count: int, workers: int) -> tuple[list[int], list[int]]:
    """``count`` service ports and a run of ``workers`` consecutive worker ports (the launcher numbers workers from
    ``--worker-port`` up), all distinct, free now and below Linux's ephemeral range (so no client connection can take
    one between this check and the bind). They sit in the upper half of each hundred (``_metrics_base`` uses the
    lower half: base + 1 .. base + 10 + workers)."""
    if workers > 49:
        raise ValueError("at most 49 workers")
    taken: set[int] = set()
    for _ in range(500):
        first = random.randrange(100, 320) * 100 + 50 + random.randrange(0, 50 - workers)
        run = list(range(first, first + workers))
        if all(port_bindable(q) for q in run):
            taken.update(run)
            break
    else:
        raise RuntimeError("no free run of worker ports below 32000")
    ports: list[int] = []
    for _ in range(5000):
        if len(ports) == count:
            return ports, run
        q = random.randrange(100, 320) * 100 + random.randrange(50, 100)
        if q not in taken and port_bindable(q):
            taken.add(q)
            ports.append(q)
    raise RuntimeError("no free service ports below 32000")


def start_mesh(
    *, workers: int = 1, engine: str = "hf", timeout: float = 300, log_dir: str = "/tmp",
    env: dict[str, str] | None = None, extra_args: list[str] | None = None, tls: bool = False,
    gateway_tls: bool = False, sigint_ignored: bool = False,
) -> Mesh:
    """Start the launcher and wait until the gateway's /health says every service serves. ``tls=True`` runs the
    mesh with mutual TLS (the launcher's ``--tls``); the CA and certificates are in ``mesh.extra["tls_dir"]``
    (``client.pem`` / ``client-key.pem`` hold a mesh client certificate). ``gateway_tls=True`` (with ``tls``)
    serves the REST API over HTTPS too. ``sigint_ignored=True`` starts the launcher with SIGINT ignored, as a
    background job's is."""
    from embedmesh.launcher import MESH, PORT_FLAGS, parse_args

    # Every service deploy/mesh.yaml lists gets a free port through its launcher flag (the workers a run of them).
    singles = [name for name in MESH if name != "worker"]
    listen, ports = _listen_ports(len(singles), workers)
    port = dict(zip(singles, listen, strict=True))
    gw, pre, router, embed, vs = (port[n] for n in ("gateway", "preprocessor", "router", "worker-embed",
                                                    "vector-store"))
    import tempfile

    vs_dir = tempfile.mkdtemp(prefix="embedmesh-vs-")
    tls_dir = tempfile.mkdtemp(prefix="embedmesh-tls-") if tls or gateway_tls else ""
    first = ports[0]
    log_path = os.path.join(log_dir, f"embedmesh-mesh-{gw}.log")
    log = open(log_path, "wb")
    metrics_base = _metrics_base(workers)
    cmd = [sys.executable, "-m", "embedmesh.launcher", *(x for n in singles for x in (PORT_FLAGS[n], str(port[n]))),
           "--metrics-port-base", str(metrics_base), "--vector-store-data-dir", vs_dir,
           *(["--tls", "--tls-dir", tls_dir] if tls_dir else []), *(["--gateway-tls"] if gateway_tls else []),
           *(extra_args or []),
           "--worker-port", str(first), "--workers", str(workers), "--engine", engine]
    inside = parse_args(cmd[3:]).embedded_router
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})},
                            preexec_fn=ignore_sigint if sigint_ignored else None)  # noqa: PLW1509
    # "router": where RouterService answers: the router process, or the preprocessor when the router runs inside
    # it (the launcher's default with one replica); "router_port": the router process's own port either way.
    mesh = Mesh(proc, gw, pre, ports, log_path, {"metrics_base": metrics_base,
                                                   "router": f"127.0.0.1:{pre if inside else router}",
                                                   "router_port": f"127.0.0.1:{router}",
                                                   "embed_worker": f"127.0.0.1:{embed}",
                                                   "vector_store": f"127.0.0.1:{vs}", "tls_dir": tls_dir},
                "https" if gateway_tls else "http")
    ca = os.path.join(tls_dir, "ca.pem")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mesh exited early ({proc.returncode}):\n{mesh.log_tail()}")
        try:
            # The launcher writes the CA once it starts.
            context = ssl.create_default_context(cafile=ca) if gateway_tls and os.path.exists(ca) else None
            with urllib.request.urlopen(f"{mesh.base_url}/health", timeout=2, context=context) as r:
                if r.status == 200 and json.loads(r.read()).get("status") == "ok":  # every service serving
                    return mesh
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    mesh.stop()
    raise RuntimeError(f"mesh not healthy after {timeout}s:\n{mesh.log_tail()}")
