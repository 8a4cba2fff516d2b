"""Hypothesis settings shared by the fuzz tests: a bounded run inside ``make test``, a long one with ``make fuzz``.

``EMBEDMESH_FUZZ_EXAMPLES`` (set by ``make fuzz``) replaces every fuzz test's default number of examples, so the
same properties run for minutes instead of seconds. Failures are kept in ``.hypothesis/`` and replayed first on
the next run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["fuzz_settings", "EXAMPLES_ENV"]

EXAMPLES_ENV = "EMBEDMESH_FUZZ_EXAMPLES"


def fuzz_settings(default_examples: int) -> settings:
    """``default_examples`` in ``make test``; ``$EMBEDMESH_FUZZ_EXAMPLES`` when set. No per-example deadline:
    a slow example on a loaded machine is not a failure, and the example count bounds the run."""
    examples = int(os.environ.get(EXAMPLES_ENV) or default_examples)
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
