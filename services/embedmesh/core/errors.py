"""The mesh's exception tree and its mapping to gRPC status codes with ``google.rpc.Status`` details.

    EmbedmeshError                 base; never raised directly
    ├── InvalidArgument            bad user input (INVALID_ARGUMENT, HTTP 400); names the field and the rule
    ├── NotFound                   a named thing does not exist (NOT_FOUND, HTTP 404)
    ├── FailedPrecondition         valid input the current state cannot serve (FAILED_PRECONDITION, HTTP 400)
    ├── ResourceExhausted          over a configured limit or queue full (RESOURCE_EXHAUSTED, HTTP 429)
    ├── Unauthenticated            no credential or a wrong one (UNAUTHENTICATED, HTTP 401)
    ├── PermissionDenied           a valid credential that may not do this (PERMISSION_DENIED, HTTP 403)
    ├── Unavailable                recoverable: a dependency is down or still loading (UNAVAILABLE, HTTP 503)
    └── InternalError              a bug or an engine failure; leaks no internals (INTERNAL, HTTP 500)

Each error carries ``reason`` (UPPER_SNAKE, stable, for programs), ``field`` (the offending parameter, for people
and OpenAI's ``param``), ``message`` and, for retryable refusals, ``retry_after_seconds``. On the wire they
travel as ``ErrorInfo`` (reason, domain, metadata with ``field`` and ``retry_after_seconds``) and, for field
errors, ``BadRequest.FieldViolation`` — never as strings in a response field.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from embedmesh.common.v1 import common_pb2

DOMAIN = "embedmesh"

__all__ = [
    "DOMAIN",
    "answered_by_peer",
    "EmbedmeshError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "ResourceExhausted",
    "Unauthenticated",
    "PermissionDenied",
    "Unavailable",
    "InternalError",
    "MAX_MESSAGE_BYTES",
    "bounded",
    "to_status",
    "from_rpc_error",
    "to_status_message",
    "rpc_error",
    "rpc_error_from_status",
]


class EmbedmeshError(Exception):
    """Base of every error the mesh reports to a caller."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    default_reason: ClassVar[str] = "UNKNOWN"

    def __init__(self, message: str, *, field: str | None = None, reason: str | None = None,
                 retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.reason = reason or self.default_reason
        self.retry_after_seconds = retry_after_seconds
        """When set, the caller may retry after this many seconds (HTTP ``Retry-After``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, field={self.field!r}, reason={self.reason!r})"


class InvalidArgument(EmbedmeshError):
    """The request breaks a validation rule; fix the named field."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"


class NotFound(EmbedmeshError):
    """The named resource (model, request id, cache key, file) does not exist."""

    code = grpc.StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class FailedPrecondition(EmbedmeshError):
    """The request is well formed but the system's state cannot serve it."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class ResourceExhausted(EmbedmeshError):
    """A limit or a queue is full; retry later or send less."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class Unauthenticated(EmbedmeshError):
    """No credential, or one the mesh does not know; send a valid API key (``Authorization: Bearer``)."""

    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = "INVALID_API_KEY"


class PermissionDenied(EmbedmeshError):
    """The credential is valid but may not call this (admin plane, mesh-internal RPCs)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class Unavailable(EmbedmeshError):
    """A dependency is down, draining or still loading; retrying may succeed."""

    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class InternalError(EmbedmeshError):
    """Unexpected failure; details are in the server's log under the request id."""

    code = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"


_BY_CODE: dict[grpc.StatusCode, type[EmbedmeshError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Unauthenticated, PermissionDenied,
                Unavailable, InternalError)
}


MAX_MESSAGE_BYTES = 1024
"""Most UTF-8 bytes of an error message on the wire. A message travels three times in a call's trailers (the status
message, percent-encoded as ``grpc-message``; and, base64-encoded in ``grpc-status-details-bin``, the status's message
and the BadRequest description): bounded so, no error reaches gRPC's 8 KiB metadata limit, whatever a client sent."""
_MAX_FIELD_BYTES = 256
_MAX_QUOTED = 64
_QUOTED = re.compile(f"(?<!\\w)'[^']{{{_MAX_QUOTED + 1},}}'(?!\\w)|(?<!\\w)\"[^\"]{{{_MAX_QUOTED + 1},}}\"(?!\\w)")
"""A quoted value as ``repr`` writes one: the quote not inside a word, so two apostrophes ("the tensor's ...
Generate's") never pass for one."""


def _cut_quoted(m: re.Match[str]) -> str:
    q = m.group(0)
    return f"{q[0]}{q[1:1 + _MAX_QUOTED // 2]}…({len(q) - 2} chars){q[0]}"


def bounded(text: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """``text`` fit for the wire: a quoted value past 64 chars cut to its head and its length (a client's model name
    or role echoed in a message), then the whole cut to ``limit`` UTF-8 bytes with ``…(N chars)``."""
    if len(text) <= limit // 4 and "'" not in text and '"' not in text:
        return text
    work = _QUOTED.sub(_cut_quoted, text)
    raw = work.encode("utf-8", "replace")
    if len(raw) <= limit:
        return work
    tail = f"…({len(text)} chars)"
    head = raw[:limit - len(tail.encode())].decode("utf-8", "ignore")
    return head + tail


def to_status(err: EmbedmeshError) -> grpc.Status:
    """Build the rich gRPC status (code, message, ErrorInfo, BadRequest) for ``err``; its message and field are
    ``bounded``, so the trailers fit gRPC's metadata limit whatever client text the message quotes."""
    details: list[Any] = []
    message = bounded(err.message)
    field = bounded(err.field, _MAX_FIELD_BYTES) if err.field else err.field
    info = error_details_pb2.ErrorInfo(reason=bounded(err.reason, 128), domain=DOMAIN)
    if field:
        info.metadata["field"] = field
    if err.retry_after_seconds is not None:
        info.metadata["retry_after_seconds"] = f"{max(0.0, err.retry_after_seconds):.3f}"
    packed = any_pb2.Any()
    packed.Pack(info)
    details.append(packed)
    if field:
        bad = error_details_pb2.BadRequest(
            field_violations=[error_details_pb2.BadRequest.FieldViolation(field=field, description=message)]
        )
        packed = any_pb2.Any()
        packed.Pack(bad)
        details.append(packed)
    status = status_pb2.Status(code=getattr(code_pb2, err.code.name), message=message, details=details)
    return rpc_status.to_status(status)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def to_status_message(err: EmbedmeshError) -> common_pb2.RpcStatus:
    """``err`` as the status one request of a multiplexed stream ends with (``RpcStatus``): code, message and the
    details a call's ``grpc-status-details-bin`` would carry."""
    status = to_status(err)
    details = next((v for k, v in status.trailing_metadata or () if k == "grpc-status-details-bin"), b"")
    return common_pb2.RpcStatus(code=err.code.value[0], message=bounded(err.message),
                                status_details=details)


def rpc_error(code: grpc.StatusCode, message: str, details: bytes = b"") -> grpc.aio.AioRpcError:
    """The ``AioRpcError`` a call ending with ``code``/``message`` raises (``details``: a serialized
    ``google.rpc.Status`` in the trailing metadata), for failures a multiplexed stream reports without a call."""
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", details)) if details else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=message)


def rpc_error_from_status(status: common_pb2.RpcStatus) -> grpc.aio.AioRpcError:
    """The ``AioRpcError`` a call ending with ``status`` raises (its details in the trailing metadata), so callers
    handle a request of a multiplexed stream exactly as a call (``from_rpc_error`` reads field and reason)."""
    return rpc_error(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message, status.status_details)


def answered_by_peer(e: grpc.RpcError) -> bool:
    """The failed call's status came from the mesh service it called (which always sends its status details), not
    from gRPC itself (connection lost, no such method, a local failure)."""
    return _details_bytes(e) is not None


def _details_bytes(e: grpc.RpcError) -> bytes | None:
    """The serialized ``google.rpc.Status`` a failed call's trailing metadata carries, if any."""
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    for item in trailing or ():
        key, value = item if isinstance(item, tuple) else (item, trailing[item])
        if key == "grpc-status-details-bin":
            return value  # type: ignore[no-any-return]
    return None


def _status_details(e: grpc.RpcError) -> status_pb2.Status | None:
    raw = _details_bytes(e)
    if raw is None:
        return None
    status = status_pb2.Status()
    status.ParseFromString(raw)
    return status


def from_rpc_error(e: grpc.RpcError) -> EmbedmeshError:
    """Turn a failed call's status back into the matching error, keeping field and reason.

    Lets a service re-raise what a downstream service said (the preprocessor passing on a worker's
    INVALID_ARGUMENT) without flattening it into INTERNAL.
    """
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    message = (e.details() if hasattr(e, "details") else None) or str(e)
    field = None
    reason = None
    retry_after: float | None = None
    status = _status_details(e)
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
                field = info.metadata.get("field") or field
                try:
                    retry_after = float(info.metadata["retry_after_seconds"])
                except (KeyError, ValueError):
                    pass
    cls = _BY_CODE.get(code)
    if cls is None:
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            cls = Unavailable
        else:
            cls = InternalError
    return cls(message, field=field, reason=reason, retry_after_seconds=retry_after)
