"""The launcher's supervision of its children: how each is spawned (its own session, dying with the launcher), the
wait for the mesh's /health, the watch that notices a child gone, and the ordered stop.

Every child leads its own session, so its process group is its own and everything it starts stays in it: a vLLM
worker's engine core and workers, a multiprocessing resource tracker. When a child is gone (exited, crashed,
SIGKILLed), what it started lives on unless someone stops it; a vLLM worker's engine processes hold ~7.5 GB. On a
bare host nobody else does (a container runtime kills a container's processes with it), so the launcher empties the
group of every child gone: SIGTERM to the group, then SIGKILL to what is left after ``GROUP_GRACE`` seconds
(``ProcessGroups``). The watch does it as soon as it notices a child gone, without holding up the watch; the stop
does it for every child once each has drained and exited. The group is signalled only after its leader is gone:
a SIGTERM to the whole group at once would stop the engine under a worker still draining its requests.

One gap stays: a SIGKILLed launcher cannot do any of this. Its children die with it (``PR_SET_PDEATHSIG``), their
own children do not."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GROUP_GRACE", "STOP_SIGNALS", "MeshProcess", "ProcessGroups", "StopSignals", "end_groups",
           "force_stop", "spawn_process", "stop_all", "wait_healthy", "watch"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What stops the mesh (Ctrl-C, an orchestrator's stop), and what each child drains on."""

GROUP_GRACE = 5.0
"""Seconds what is left of a gone child's process group has between SIGTERM and SIGKILL: time for an engine's
processes to shut down, and for a resource tracker (which ignores SIGTERM) to see its parent gone, free what it
tracks and exit."""

_PR_SET_PDEATHSIG = 1


@dataclass
class MeshProcess:
    name: str
    address: str
    proc: subprocess.Popen[bytes]


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to SIGKILL the child when the launcher dies (Linux; None elsewhere).
    libc is resolved here, in the parent: the child only makes the system call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the line above: nobody would stop this child
            os._exit(1)

    return preexec


def _child_preexec() -> Callable[[], None]:
    """The ``preexec_fn`` of every child: the stop signals back at their defaults, then ``_die_with_parent``.

    exec keeps an *ignored* signal ignored (only handled ones go back to default), so a launcher started with SIGINT
    ignored would hand that on; a child then starts as it would from a terminal, whatever started the launcher."""
    die = _die_with_parent()

    def preexec() -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        if die is not None:
            die()

    return preexec


def spawn_process(name: str, module: str, args: list[str], env: dict[str, str],
                  python: str = sys.executable) -> subprocess.Popen[bytes]:
    """Start ``python -m module args`` as a child of the launcher, leading its own session and process group."""
    # Own session per child: Ctrl-C reaches the launcher, which stops children in order; each child dies with the
    # launcher (PR_SET_PDEATHSIG) even when the launcher is SIGKILLed; and the group (id = the child's pid) holds
    # whatever the child starts, for ``ProcessGroups`` to stop once the child is gone.
    return subprocess.Popen([python, "-m", module, *args], env=env, start_new_session=True,
                            preexec_fn=_child_preexec())  # noqa: PLW1509 - the launcher runs no threads


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group is empty (or not ours to signal)."""
    if pgid <= 1:  # 0 would be the launcher's own group, 1 init's: never a child's
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class ProcessGroups:
    """The process groups of children that are gone, being emptied: SIGTERM when one is added, SIGKILL to what is
    left of it ``grace`` seconds later. ``tick`` does what is due and never waits.

    A group id is the pid of the child that led it; the kernel hands that pid to no new process while the group has
    a member, so the signals reach what the child left behind and nothing else."""

    def __init__(self, grace: float = GROUP_GRACE) -> None:
        self.grace = grace
        self._due: dict[int, float] = {}
        """Group id -> when SIGKILL is due (time.monotonic)."""

    def end(self, pgid: int) -> None:
        """Start emptying group ``pgid`` (its leader must be gone or going): SIGTERM to every member now."""
        if pgid not in self._due and _signal_group(pgid, signal.SIGTERM):
            self._due[pgid] = time.monotonic() + self.grace

    def tick(self) -> None:
        """Forget the groups now empty; SIGKILL what is left of those past their grace."""
        now = time.monotonic()
        for pgid, due in list(self._due.items()):
            if not _signal_group(pgid, 0):
                del self._due[pgid]
            elif now >= due:
                _signal_group(pgid, signal.SIGKILL)
                del self._due[pgid]

    def pending(self) -> bool:
        return bool(self._due)


def end_groups(pgids: Iterable[int], grace: float = GROUP_GRACE) -> None:
    """Empty every group in ``pgids`` (their leaders gone): SIGTERM, SIGKILL after ``grace``; returns when none is
    left to signal, ``grace`` seconds at most."""
    groups = ProcessGroups(grace)
    for pgid in pgids:
        groups.end(pgid)
    groups.tick()
    while groups.pending():
        time.sleep(0.05)
        groups.tick()


def wait_healthy(url: str, procs: list[MeshProcess], timeout: float, ca: Path | None = None) -> bool:
    """Until the gateway's /health says every service serves (``"status": "ok"``)."""
    context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.proc.poll() is not None:
                print(f"[launcher] {p.name} exited with code {p.proc.returncode}; see its log above", flush=True)
                return False
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as r:
                if r.status == 200 and json.loads(r.read()).get("status") == "ok":
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass
        time.sleep(0.3)
    return False


def stop_all(procs: list[MeshProcess], grace: float = 40.0, group_grace: float = GROUP_GRACE) -> None:
    """SIGTERM in reverse start order (gateway first), wait ``grace`` seconds (the drain, plus a margin), then
    SIGKILL stragglers; then empty every child's process group (``end_groups``)."""
    for p in reversed(procs):
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in reversed(procs):
        try:
            p.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()
    end_groups((p.proc.pid for p in procs), group_grace)


def force_stop(procs: list[MeshProcess]) -> None:
    """A second Ctrl-C while draining: SIGKILL whatever still runs, every child's whole group at once."""
    for p in procs:
        if not _signal_group(p.proc.pid, signal.SIGKILL) and p.proc.poll() is None:
            p.proc.kill()
    for p in procs:
        p.proc.wait()


def _survivable(p: MeshProcess, procs: list[MeshProcess]) -> str | None:
    """Why the mesh keeps serving without ``p`` (gone), or None when it cannot: one worker or router replica of
    several (the router drops the worker; the preprocessors ask the other routers), the embedding worker, or an image
    encode service (the preprocessor skips it for the others, or refuses image parts while none answers)."""
    if p.name == "embed-worker":
        return "the mesh serves generation without it"
    if p.name.startswith("image-encoder-"):
        return "the mesh serves text without it (images it would encode are refused UNAVAILABLE)"
    for prefix, what in (("worker-", "worker(s)"), ("router", "router replica(s)")):
        if p.name.startswith(prefix):
            alive = [q for q in procs if q.name.startswith(prefix) and q.proc.poll() is None]
            if alive:
                return f"{len(alive)} {what} still serving"
    return None


def watch(procs: list[MeshProcess], grace: float, group_grace: float = GROUP_GRACE) -> int:
    """Until a child the mesh cannot serve without exits (then stop the rest: exit status 1). The group of every
    child gone is emptied as soon as it is noticed, while the watch goes on."""
    reported: set[str] = set()
    groups = ProcessGroups(group_grace)
    while True:
        for p in procs:
            if p.proc.poll() is None or p.name in reported:
                continue
            reported.add(p.name)
            groups.end(p.proc.pid)
            why = _survivable(p, procs)
            if why is not None:
                print(f"[launcher] {p.name} exited with code {p.proc.returncode}; {why}", flush=True)
                continue
            print(f"[launcher] {p.name} exited with code {p.proc.returncode}; stopping the mesh", flush=True)
            stop_all(procs, grace, group_grace)
            return 1
        groups.tick()
        time.sleep(0.1 if groups.pending() else 0.5)


class StopSignals:
    """The launcher's own SIGINT and SIGTERM handler, installed whatever the launcher inherited: started as a
    background job of a non-interactive shell it inherits SIGINT *ignored* (and Python then installs no
    KeyboardInterrupt handler), so without this Ctrl-C from a test harness or supervisor would never stop it.

    A signal before ``arm`` (while the children are being started) is remembered and acted on at ``arm``, so the
    children started so far are stopped in order rather than left to ``PR_SET_PDEATHSIG``; once armed, a signal
    raises KeyboardInterrupt in the main loop."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._armed = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        first = self.received is None
        self.received = signum
        if self._armed or not first:  # a second signal during start-up stops waiting too
            raise KeyboardInterrupt

    def arm(self) -> None:
        """From here on a signal interrupts; raises at once if one came while disarmed."""
        self._armed = True
        if self.received is not None:
            raise KeyboardInterrupt
