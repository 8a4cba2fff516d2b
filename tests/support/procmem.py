"""A process's memory as Linux reports it in ``/proc/<pid>/status``, in MiB: for tests that bound what a server
allocates for input it refuses."""

from __future__ import annotations


def _status_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def rss_mib(pid: int) -> float:
    """Resident memory now."""
    return _status_mib(pid, "VmRSS")


def hwm_mib(pid: int) -> float:
    """Peak resident memory so far (the high-water mark)."""
    return _status_mib(pid, "VmHWM")
