"""OpenAI error JSON ``{"error": {"message", "type", "param", "code"}}`` for request checks and failed gRPC calls.

    ApiError          any request the gateway answers with an OpenAI error body (HTTP status + the four fields)
    bad_request()     a 400 naming the offending parameter: what ``requests.parse`` makes of a refused body (the
                      request models' one way to an OpenAI error)
    from_grpc()       a failed call to the preprocessor, mapped by status code (table below)

gRPC → HTTP: INVALID_ARGUMENT / FAILED_PRECONDITION / OUT_OF_RANGE → 400 ``invalid_request_error``,
NOT_FOUND → 404, ALREADY_EXISTS → 409, RESOURCE_EXHAUSTED → 429, UNIMPLEMENTED → 501,
UNAVAILABLE / DEADLINE_EXCEEDED → 503, CANCELLED → 499, anything else → 500 ``server_error`` whose message says
nothing about internals. ``param`` is the field named in the status details (``ErrorInfo.metadata["field"]``),
``code`` the ``ErrorInfo.reason`` lowercased (the status code's name when the status has no details).

Retryable refusals carry ``Retry-After`` (whole seconds, at least 1): every 429 and 503, from the status's
``retry_after_seconds`` when the service sent one, else 1 s.
"""

from __future__ import annotations

import math
import re

import grpc
import orjson
from starlette.responses import Response

from embedmesh.core.errors import from_rpc_error

__all__ = ["ApiError", "bad_request", "error_response", "from_grpc", "RETRYABLE"]

RETRYABLE = (429, 503)
"""Statuses answered with a ``Retry-After`` header."""

_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
# The one INTERNAL message the mesh's own servers write (embedmesh.core.server): an incident id, no internals.
_INCIDENT = re.compile(r"internal error \(incident [0-9a-f]{6,32}\); see the service log")
_DETAILS_KEY = "grpc-status-details-bin"


class ApiError(Exception):
    """A request the gateway answers with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.retry_after = retry_after
        """Seconds the client should wait before retrying (429/503; None = the default of 1 s)."""

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """``Retry-After`` for retryable statuses (whole seconds, rounded up, at least 1)."""
        if self.status not in RETRYABLE:
            return {}
        wait = self.retry_after if self.retry_after is not None and math.isfinite(self.retry_after) else 1.0
        return {"retry-after": str(max(1, math.ceil(wait)))}


def bad_request(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 for ``param``; the message starts with the parameter's name so it reads alone too."""
    return ApiError(400, message if message.startswith(param) else f"{param}: {message}", param=param, code=code)


def _has_details(e: grpc.RpcError) -> bool:
    """True when a mesh service wrote the status (with details); False for statuses made by gRPC itself."""
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    return any((item[0] if isinstance(item, tuple) else item) == _DETAILS_KEY for item in trailing or ())


def from_grpc(e: grpc.RpcError) -> ApiError:
    """Map a failed call to HTTP status and OpenAI's error fields; internals never leak."""
    err = from_rpc_error(e)
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    status, kind = _HTTP.get(code, (500, "server_error"))
    message = err.message
    detailed = _has_details(e)
    if status == 500 and not _INCIDENT.fullmatch(message):
        message = "internal server error"
    elif status == 503 and not detailed:
        # gRPC's own text names addresses and transport internals ("failed to connect to all addresses; ...").
        message = ("the inference service did not answer in time" if code == grpc.StatusCode.DEADLINE_EXCEEDED
                   else "the inference service is unavailable; retry later")
    reason = err.reason if detailed and err.reason else code.name
    return ApiError(status, message, param=err.field, code=reason.lower(), type_=kind,
                    retry_after=err.retry_after_seconds)


def error_response(err: ApiError) -> Response:
    return Response(orjson.dumps(err.body()), status_code=err.status, media_type="application/json",
                    headers=err.headers())
