"""VectorStoreConfig: flags, EMBEDMESH_VECTOR_STORE_* variables, the older names (--no-requeue, NO_REQUEUE,
EMBEDMESH_PREPROCESSOR_ADDR), bad values, and the password kept out of describe()."""

from __future__ import annotations

import pytest

from embedmesh.services.vector_store.config import VectorStoreConfig


def test_defaults() -> None:
    assert VectorStoreConfig.from_args([], env={}) == VectorStoreConfig()


def test_flags_and_variables() -> None:
    env = {"EMBEDMESH_VECTOR_STORE_BACKEND": "pgvector", "EMBEDMESH_VECTOR_STORE_POSTGRES_DSN": "host=x",
           "EMBEDMESH_PREPROCESSOR_ADDR": "pre:1", "EMBEDMESH_VECTOR_STORE_DIMENSIONS": "8",
           "EMBEDMESH_VECTOR_STORE_NO_REQUEUE": "1", "EMBEDMESH_VECTOR_STORE_HNSW_EF_SEARCH": "64"}
    c = VectorStoreConfig.from_args([], env=env)
    assert (c.backend, c.postgres_dsn, c.inference_addr, c.dimensions) == ("pgvector", "host=x", "pre:1", 8)
    assert (c.requeue_on_start, c.hnsw_ef_search) == (False, 64)
    assert VectorStoreConfig.from_args([], env={"EMBEDMESH_VECTOR_STORE_INFERENCE_ADDR": "own:1",
                                                "EMBEDMESH_PREPROCESSOR_ADDR": "pre:1"}).inference_addr == "own:1"
    c = VectorStoreConfig.from_args(["--no-requeue", "--hnsw-m", "8", "--inference-addr", "f:1"], env={})
    assert (c.requeue_on_start, c.hnsw_m, c.inference_addr) == (False, 8, "f:1")
    assert VectorStoreConfig.from_args(["--requeue"], env=env).requeue_on_start is True


@pytest.mark.parametrize(("argv", "needle"), [
    (["--backend", "faiss"], "argument --backend: invalid choice: 'faiss'"),
    (["--backend", "pgvector"], "the pgvector backend needs postgres_dsn"),
    (["--dimensions", "0"], "dimensions must be in [1, 16000]"),
    (["--embed-batch-size", "0"], "embed_batch_size must be in [1, 1024]"),
    (["--max-concurrent-ingestions", "0"], "max_concurrent_ingestions must be >= 1"),
    (["--hnsw-ef-search", "0"], "hnsw_m must be >= 2, ef values >= 1"),
    (["--index-flush-seconds", "0"], "index_flush_seconds must be > 0"),
    (["--port", "-1"], "port must be in [0, 65535], got -1"),
])
def test_bad_values_are_usage_errors_naming_the_setting(argv: list[str], needle: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        VectorStoreConfig.from_args(argv, env={})
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_describe_hides_the_dsn() -> None:
    assert VectorStoreConfig(backend="pgvector", postgres_dsn="password=x").describe()["postgres_dsn"] == "<set>"
