"""Engine options (``engines/options.py``): the shared fields' rules on construction, then the engine's own
``validate``; one flag for a field several engines declare alike, a clash refused; values read flag over variable
over default."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from embedmesh.core.config import option
from embedmesh.services.worker.engines import options
from embedmesh.services.worker.engines.options import EngineOptions


@dataclass(frozen=True)
class _A(EngineOptions):
    dtype: str = options.dtype()
    threads: int = options.threads()
    a_size: int = 3
    """A's own knob."""

    def validate(self) -> None:
        if self.a_size > 10:
            raise ValueError("a_size must be <= 10")


@dataclass(frozen=True)
class _B(EngineOptions):
    threads: int = options.threads()
    max_batch_size: int = options.max_batch_size()
    b_mode: str = option("x", aliases=("EMBEDMESH_OLD_B_MODE",))
    """B's own knob."""


@dataclass(frozen=True)
class _Clash(EngineOptions):
    threads: int = 4
    """Declared unlike the shared definition."""


@pytest.mark.parametrize(("make", "message"), [
    (lambda: _A(dtype="int8"), "dtype must be float32, bfloat16 or float16, got 'int8'"),
    (lambda: _A(threads=0), "threads must be >= 1"),
    (lambda: _B(max_batch_size=0), "max_batch_size must be >= 1"),
    (lambda: _A(a_size=11), "a_size must be <= 10"),
])
def test_rules_run_on_construction(make: object, message: str) -> None:
    with pytest.raises(ValueError) as e:
        make()  # type: ignore[operator]
    assert str(e.value) == message


def test_shared_fields_have_one_default_and_every_dtype_is_accepted() -> None:
    assert (_A().dtype, _A().threads, _B().max_batch_size) == ("float32", 2, 8)
    assert [_A(dtype=d).dtype for d in options.DTYPES] == ["float32", "bfloat16", "float16"]


def _parser(*groups: tuple[str, type[EngineOptions]]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    options.add_arguments(p, groups)
    return p


def test_a_field_several_engines_declare_is_one_flag_in_the_first_group() -> None:
    p = _parser(("a", _A), ("b", _B))
    titles = {g.title: [a.option_strings[0] for a in g._group_actions] for g in p._action_groups}
    assert titles["a engine"] == ["--dtype", "--threads", "--a-size"]
    assert titles["b engine"] == ["--max-batch-size", "--b-mode"]
    assert [a.dest for a in p._actions].count("threads") == 1


def test_a_field_declared_differently_is_refused_naming_both_engines() -> None:
    with pytest.raises(ValueError, match="engine option 'threads' is declared differently by a and clash"):
        _parser(("a", _A), ("clash", _Clash))


def test_values_come_from_the_flag_then_the_variables_then_the_default() -> None:
    p = _parser(("a", _A), ("b", _B))
    env = {"EMBEDMESH_WORKER_THREADS": "6", "EMBEDMESH_OLD_B_MODE": "old", "EMBEDMESH_WORKER_A_SIZE": "4"}
    assert options.from_values(_B, p.parse_args([]), env, p) == _B(threads=6, b_mode="old")
    assert options.from_values(_B, p.parse_args(["--threads", "3", "--b-mode", "new"]), env, p) == _B(
        threads=3, b_mode="new")
    assert options.from_values(_A, p.parse_args([]), {}, p) == _A()
    assert options.from_values(_A, p.parse_args([]), env, p) == _A(threads=6, a_size=4)


def test_a_bad_value_read_is_a_value_error() -> None:
    p = _parser(("a", _A))
    with pytest.raises(ValueError, match="a_size must be <= 10"):
        options.from_values(_A, p.parse_args(["--a-size", "12"]), {}, p)
