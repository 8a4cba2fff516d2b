"""Runs an embedmesh worker with ``--engine sglang`` inside the SGLang venv (started by conftest.py).

Until the worker's config lists "sglang" among its engines, this adds it and routes ``build_engine`` to the sglang
adapter; once it does, this is the plain worker entry point. SGLang spawns its scheduler with multiprocessing's
``spawn`` method, which re-imports this file: everything runs under the ``__main__`` guard.
"""

from __future__ import annotations

import sys


def _main(argv: list[str]) -> None:
    from embedmesh.services.worker import config, main

    if "sglang" not in config.ENGINES:
        from embedmesh.services.worker.engines.sglang_engine import from_worker_config

        config.ENGINES = (*config.ENGINES, "sglang")  # type: ignore[misc]
        plain = main.build_engine
        main.build_engine = lambda c: from_worker_config(c) if c.engine == "sglang" else plain(c)  # type: ignore[misc]
    main.main(argv)


if __name__ == "__main__":
    _main(sys.argv[1:])
