"""The gateway's error responses (``gateway/errors.py``): retryable errors carry ``Retry-After`` in whole seconds,
at least 1; others none."""

from __future__ import annotations

from embedmesh.gateway.errors import ApiError, error_response


def test_retry_after_on_retryable_gateway_errors() -> None:
    assert error_response(ApiError(503, "x")).headers["retry-after"] == "1"
    assert error_response(ApiError(429, "x", retry_after=2.2)).headers["retry-after"] == "3"
    assert error_response(ApiError(503, "x", retry_after=0.001)).headers["retry-after"] == "1"
    assert "retry-after" not in error_response(ApiError(400, "x")).headers
