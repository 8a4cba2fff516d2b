"""Runs an embedmesh worker with ``--engine sglang`` inside the SGLang venv (started by conftest.py).

The plain worker entry point (the engine registry knows "sglang"). SGLang spawns its scheduler with multiprocessing's
``spawn`` method, which re-imports this file: everything runs under the ``__main__`` guard.
"""

from __future__ import annotations

import sys


def _main(argv: list[str]) -> None:
    from embedmesh.services.worker import main

    main.main(argv)


if __name__ == "__main__":
    _main(sys.argv[1:])
