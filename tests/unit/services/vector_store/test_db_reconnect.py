"""A PostgreSQL connection the server drops (a restart, pg_terminate_backend) fails the statement that finds it
broken, and the next ``run`` connects again instead of failing for good (found by tests/hosts: PostgreSQL restarted
while files were being ingested left the vector store answering 500 to everything)."""

from __future__ import annotations

import psycopg
import pytest

from embedmesh.services.vector_store.db import Database
from tests.support import postgres_server


async def test_run_connects_again_after_the_server_drops_the_connection(pg: postgres_server.PostgresServer) -> None:
    dsn = pg.database()
    db = Database.postgres(dsn)
    try:
        pid = await db.run(lambda: db.one("SELECT pg_backend_pid()"))
        assert pid is not None
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid[0],))
        with pytest.raises(psycopg.OperationalError):
            await db.run(lambda: db.one("SELECT 1"))
        assert await db.run(lambda: db.one("SELECT 1")) == (1,)
        again = await db.run(lambda: db.one("SELECT pg_backend_pid()"))
        assert again is not None and again[0] != pid[0]
    finally:
        db.close()
