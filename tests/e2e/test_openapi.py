"""schemathesis against the live gateway's own /openapi.json, on an echo mesh with its vector store: every operation
of the document gets generated requests (valid and invalid), and no answer may be a 5xx, have a status, media
type, headers or body the document does not give that operation. ``EMBEDMESH_FUZZ_EXAMPLES`` (``make fuzz``) makes
the run long; ``make test`` runs a few examples per operation."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from embedmesh.gateway import GatewayConfig, create_app, openapi
from tests.support.mesh import Mesh, start_mesh

pytestmark = pytest.mark.e2e

EXAMPLES = max(8, int(os.environ.get("EMBEDMESH_FUZZ_EXAMPLES", "0")) // 10)


def _unconfigured(response: Any) -> bool:
    """The one 5xx this mesh gives by design: an echo mesh starts no vector store (the launcher's
    ``NO_MODEL_ENGINES``), so its gateway answers every /v1/files and /v1/vector_stores route with 501."""
    if response.status_code != 501:
        return False
    err = response.json().get("error") or {}
    return err.get("code") == "not_implemented" and "vector store is not configured" in err.get("message", "")


def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """schemathesis's ``not_a_server_error``, but for the 501 of a route whose service this mesh does not run."""
    if case.path.startswith(("/v1/files", "/v1/vector_stores")) and _unconfigured(response):
        return True
    return not_a_server_error(ctx, response, case)


ANSWERED: dict[str, Counter[int]] = {}
"""Statuses each operation answered in this run."""
SERVED: list[str] = []
"""The echo mesh's model names (set when it starts)."""

CHECKS = [no_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def emesh() -> Iterator[Mesh]:
    m = start_mesh(engine="echo", env={"EMBEDMESH_TRACE_CONSOLE": "0"})
    SERVED[:] = [x["id"] for x in httpx.get(f"{m.base_url}/v1/models", timeout=30).json()["data"]]
    yield m
    m.stop()


# The document the gateway serves, built here from an app with the same routes (checked equal below), so pytest
# can collect one test per operation before the mesh starts.
DOCUMENT = openapi.document(create_app(GatewayConfig(vector_store="127.0.0.1:1")).routes)


def test_the_document_is_served_open_and_lists_the_mesh_routes(emesh: Mesh) -> None:
    doc = httpx.get(f"{emesh.base_url}/openapi.json", timeout=30).json()
    assert doc == DOCUMENT
    assert {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/files", "/v1/vector_stores",
            "/openapi.json", "/docs"} <= set(doc["paths"])
    page = httpx.get(f"{emesh.base_url}/docs", timeout=30)
    assert page.status_code == 200 and "/v1/vector_stores/{id}/search" in page.text


schema = schemathesis.openapi.from_dict(DOCUMENT)


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_gateway_answers_as_its_document_says(case: Any, emesh: Mesh) -> None:
    # A body that names a model names the mesh's, so a valid body goes past the model lookup to the preprocessor's
    # checks and the worker (a generated name, or the examples' SmolLM2, would stop every one at the lookup).
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = SERVED[0]
    r = case.call_and_validate(base_url=emesh.base_url, checks=CHECKS, timeout=60)
    ANSWERED.setdefault(f"{case.method} {case.path}", Counter())[r.status_code] += 1


def test_the_run_reached_past_the_checks() -> None:
    """Generated bodies were served, not only refused: the fuzzing reached the preprocessor and the worker."""
    if not ANSWERED:
        pytest.skip("counts the answers of test_the_gateway_answers_as_its_document_says, run before it")
    for op in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert ANSWERED.get(op, {}).get(200), (op, ANSWERED.get(op))
