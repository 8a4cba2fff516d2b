"""Typed errors carrying the server's status details (code, field, reason)."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

__all__ = ["EmbedmeshClientError", "from_rpc_error"]


class EmbedmeshClientError(Exception):
    """A call failed. ``code`` is the gRPC status, ``field`` the offending request field, ``reason`` a stable
    machine-readable cause (e.g. HIDDEN_SIZE_MISMATCH)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None, reason: str | None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field
        self.reason = reason


def from_rpc_error(e: grpc.RpcError) -> EmbedmeshClientError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    message = (e.details() if hasattr(e, "details") else None) or str(e)
    field = reason = None
    for key, value in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status()
            status.ParseFromString(value)
            for d in status.details:
                if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    d.Unpack(info)
                    reason = info.reason
                    field = info.metadata.get("field")
    return EmbedmeshClientError(code, message, field, reason)
