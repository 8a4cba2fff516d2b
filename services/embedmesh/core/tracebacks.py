"""Letting go of an exception's frames once it has been handled (logged, turned into a status).

An error kept past its handling (``error = obs.failed(e)`` in a call's wrapper, the error an arrival keeps for its
waiters) holds, through its traceback, every frame it passed through; when one of those frames holds the error (or
what holds it), that is a reference cycle: every local of the failed call — its request, its buffers — stays until
the next garbage collection instead of going when the call ends."""

from __future__ import annotations

__all__ = ["drop"]


def drop(exc: BaseException | None) -> BaseException | None:
    """Clear the tracebacks of ``exc`` and of the exceptions chained to it (``__cause__``, else ``__context__``);
    returns ``exc``. Call it only once whatever prints the traceback (a log line's ``exc_info``) has run."""
    seen: set[int] = set()
    todo = exc
    while todo is not None and id(todo) not in seen:
        seen.add(id(todo))
        todo.__traceback__ = None
        todo = todo.__cause__ if todo.__cause__ is not None else todo.__context__
    return exc
