"""The tests that start and stop meshes, run the way a background job of a non-interactive shell runs them
(``make test &``, a supervisor, a CI runner): pytest starts with SIGINT ignored, and so does every launcher it
starts. The harness still stops each mesh with SIGINT (``Mesh.stop``, as Ctrl-C would), and each must exit 0 with
every child gone — not be SIGKILLed after the harness's timeout."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.mesh import ignore_sigint

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]

TESTS = [
    "tests/unit/test_launcher.py",
    # The session mesh of tests/e2e (hf worker, every service): its teardown asserts the launcher stopped with 0.
    "tests/e2e/test_bad_input.py::test_a_filter_nested_150_deep_is_a_400",
]

_RUN = ("import signal, sys, pytest\n"
        "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, 'SIGINT should be ignored at start'\n"
        "sys.exit(pytest.main(sys.argv[1:]))\n")


def test_the_mesh_tests_pass_when_pytest_starts_with_sigint_ignored() -> None:
    r = subprocess.run([sys.executable, "-c", _RUN, "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                       preexec_fn=ignore_sigint, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=900)
    tail = r.stdout[-6000:]
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and not re.search(r"failed|error", summary), tail
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # this process was not touched
