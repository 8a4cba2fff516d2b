"""core/tracebacks.drop: an exception kept after its handling lets go of the frames it passed through (and the
exceptions chained to it let go of theirs), so the locals of those frames go without a garbage collection."""

from __future__ import annotations

import gc
import weakref

from embedmesh.core import tracebacks


class _Big:
    pass


def _fail(kept: list[BaseException], refs: list[weakref.ref[_Big]]) -> None:
    big = _Big()
    refs.append(weakref.ref(big))
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise ValueError("outer") from inner
    except ValueError as e:
        kept.append(e)
        keep_me = kept  # noqa: F841 - the frame holds what holds the error: a cycle through its traceback
        if drop:
            tracebacks.drop(e)


drop = False


def _run(dropping: bool) -> tuple[bool, BaseException]:
    global drop
    drop = dropping
    kept: list[BaseException] = []
    refs: list[weakref.ref[_Big]] = []
    gc.collect()
    gc.disable()
    try:
        _fail(kept, refs)
        error = kept[0]
        del kept
        return refs[0]() is not None, error
    finally:
        gc.enable()


def test_the_frames_locals_go_once_the_traceback_is_dropped() -> None:
    alive, error = _run(True)
    assert not alive
    assert error.__traceback__ is None and error.__cause__ is not None
    assert error.__cause__.__traceback__ is None  # the chained exception's frames go too
    assert str(error) == "outer" and isinstance(error.__cause__, KeyError)  # the error itself is kept


def test_without_it_the_cycle_keeps_them_until_a_collection() -> None:
    """The control: the same error, its traceback kept, holds the frame's locals."""
    alive, error = _run(False)
    assert alive and error.__traceback__ is not None


def test_a_self_referencing_chain_ends() -> None:
    a, b = ValueError("a"), KeyError("b")
    a.__context__, b.__context__ = b, a
    assert tracebacks.drop(a) is a
    assert tracebacks.drop(None) is None
