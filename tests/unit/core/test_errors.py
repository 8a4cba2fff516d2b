"""core.errors: each error class has its gRPC status and stable reason; ``to_status`` packs ErrorInfo (reason, domain,
field, retry hint) and, for field errors, a BadRequest field violation; ``from_rpc_error`` turns a failed call back
into the same error, keeping field, reason and retry hint."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2

from embedmesh.core import errors
from embedmesh.core.errors import (
    DOMAIN,
    EmbedmeshError,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
    to_status,
)

CLASSES = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    (NotFound, grpc.StatusCode.NOT_FOUND, "NOT_FOUND"),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION"),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, "INVALID_API_KEY"),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED"),
    (Unavailable, grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"),
    (InternalError, grpc.StatusCode.INTERNAL, "INTERNAL"),
]


class FakeRpcError(grpc.RpcError):
    """What a client sees: the code, the message and the trailing metadata a server sent for a status."""

    def __init__(self, status: grpc.Status | None = None, code: grpc.StatusCode | None = None,
                 message: str = "") -> None:
        self._code = status.code if status is not None else code
        self._details = status.details if status is not None else message
        self._trailing = tuple(status.trailing_metadata) if status is not None else ()

    def code(self) -> grpc.StatusCode:
        return self._code  # type: ignore[return-value]

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailing


def _unpack(status: grpc.Status) -> status_pb2.Status:
    for key, value in status.trailing_metadata:
        if key == "grpc-status-details-bin":
            out = status_pb2.Status()
            out.ParseFromString(value)
            return out
    raise AssertionError("no grpc-status-details-bin in the trailing metadata")


@pytest.mark.parametrize("cls,code,reason", CLASSES)
def test_each_error_class_has_its_status_code_and_default_reason(cls: type[EmbedmeshError], code: grpc.StatusCode,
                                                                 reason: str) -> None:
    err = cls("something is off")
    assert isinstance(err, EmbedmeshError)
    assert (err.code, err.reason, err.message, str(err)) == (code, reason, "something is off", "something is off")
    assert err.field is None and err.retry_after_seconds is None
    assert cls("m", reason="CUSTOM").reason == "CUSTOM"


@pytest.mark.parametrize("cls,code,reason", CLASSES)
def test_to_status_carries_code_message_and_error_info(cls: type[EmbedmeshError], code: grpc.StatusCode,
                                                       reason: str) -> None:
    status = to_status(cls("the message"))
    assert status.code == code and status.details == "the message"
    rich = _unpack(status)
    assert rich.code == getattr(code_pb2, code.name) and rich.message == "the message"
    assert len(rich.details) == 1  # no field: ErrorInfo only, no BadRequest
    info = error_details_pb2.ErrorInfo()
    assert rich.details[0].Unpack(info)
    assert (info.reason, info.domain, dict(info.metadata)) == (reason, DOMAIN, {})


def test_field_errors_add_a_field_violation_and_the_field_in_error_info() -> None:
    rich = _unpack(to_status(InvalidArgument("temperature must be >= 0", field="temperature", reason="OUT_OF_RANGE")))
    info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
    assert rich.details[0].Unpack(info) and rich.details[1].Unpack(bad)
    assert info.reason == "OUT_OF_RANGE" and info.metadata["field"] == "temperature"
    assert [(v.field, v.description) for v in bad.field_violations] == [("temperature", "temperature must be >= 0")]


def test_retry_after_is_sent_with_millisecond_precision_and_never_negative() -> None:
    info = error_details_pb2.ErrorInfo()
    _unpack(to_status(ResourceExhausted("slow down", retry_after_seconds=1.23456))).details[0].Unpack(info)
    assert info.metadata["retry_after_seconds"] == "1.235"
    _unpack(to_status(ResourceExhausted("slow down", retry_after_seconds=-4))).details[0].Unpack(info)
    assert info.metadata["retry_after_seconds"] == "0.000"


@pytest.mark.parametrize("cls,code,reason", CLASSES)
def test_from_rpc_error_round_trips_class_field_reason_and_retry_hint(cls: type[EmbedmeshError],
                                                                     code: grpc.StatusCode, reason: str) -> None:
    sent = cls("over there", field="input", reason="SOME_REASON", retry_after_seconds=2.5)
    got = from_rpc_error(FakeRpcError(to_status(sent)))
    assert type(got) is cls
    assert (got.message, got.field, got.reason, got.retry_after_seconds) == ("over there", "input", "SOME_REASON",
                                                                             2.5)


def test_from_rpc_error_without_details_keeps_the_message_and_the_class_default_reason() -> None:
    got = from_rpc_error(FakeRpcError(code=grpc.StatusCode.NOT_FOUND, message="no model x"))
    assert type(got) is NotFound and got.message == "no model x" and got.field is None
    assert got.reason == "NOT_FOUND" and got.retry_after_seconds is None


@pytest.mark.parametrize("code", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED])
def test_deadline_and_cancel_become_unavailable(code: grpc.StatusCode) -> None:
    assert type(from_rpc_error(FakeRpcError(code=code, message="late"))) is Unavailable


@pytest.mark.parametrize("code", [grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED])
def test_other_codes_become_internal(code: grpc.StatusCode) -> None:
    got = from_rpc_error(FakeRpcError(code=code, message="boom"))
    assert type(got) is InternalError and got.message == "boom"


def test_every_exported_error_class_maps_back_from_its_own_code() -> None:
    # Two classes sharing a code would make from_rpc_error answer with the wrong one.
    classes = [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)
               and getattr(errors, n) is not EmbedmeshError]
    assert len({c.code for c in classes}) == len(classes) == len(CLASSES)
