"""OpenAI error JSON: ``{"error": {"message", "type", "param", "code"}}`` from gRPC statuses and request checks."""

from __future__ import annotations

import grpc
import orjson
from starlette.responses import Response

from embedmesh.core.errors import from_rpc_error

__all__ = ["ApiError", "error_response", "from_grpc"]

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


class ApiError(Exception):
    """A request the gateway answers with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}" if not message.startswith(param) else message, param=param, code=code)


def from_grpc(e: grpc.RpcError) -> ApiError:
    """Map a failed call to HTTP status and OpenAI's error fields; internals never leak."""
    err = from_rpc_error(e)
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    status, kind = _HTTP.get(code, (500, "server_error"))
    message = err.message if status < 500 or status in (501, 503, 504) else "internal server error"
    if status == 500 and "incident" in err.message:
        message = err.message
    return ApiError(status, message, param=err.field, code=(err.reason or code.name).lower(), type_=kind)


def error_response(err: ApiError) -> Response:
    return Response(orjson.dumps(err.body()), status_code=err.status, media_type="application/json")
