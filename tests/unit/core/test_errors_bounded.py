"""core.errors.to_status bounds what it puts in a call's trailers: a message quoting a megabyte of client text (a
model name, a role) still fits gRPC's 8 KiB metadata limit, so the caller gets the error's own code and field, not
RESOURCE_EXHAUSTED 'received metadata size exceeds'."""

from __future__ import annotations

import base64

import grpc
from google.rpc import error_details_pb2, status_pb2

from embedmesh.core.errors import InvalidArgument, NotFound, bounded, from_rpc_error, to_status, to_status_message

METADATA_LIMIT = 8192  # gRPC's default max_metadata_size


def _wire_size(status: grpc.Status) -> int:
    """Bytes of the trailers as sent: grpc-status, grpc-message (percent-encoded) and the base64 details."""
    msg = status.details.encode()
    size = len("grpc-status") + 2 + len("grpc-message") + sum(1 if 0x20 <= b < 0x7F and b != 0x25 else 3 for b in msg)
    for key, value in status.trailing_metadata:
        size += len(key) + len(base64.b64encode(value))
    return size


def _details(status: grpc.Status) -> status_pb2.Status:
    raw = dict(status.trailing_metadata)["grpc-status-details-bin"]
    return status_pb2.Status.FromString(raw)


def test_a_one_megabyte_message_quoting_client_text_fits_the_trailers() -> None:
    name = "é" * (1 << 20)  # 2 MiB of UTF-8, percent-encoded threefold in grpc-message
    status = to_status(InvalidArgument(f"model: {name!r} is not served " + "ü" * (1 << 20), field="model",
                                       reason="NOT_SERVED"))
    assert _wire_size(status) < METADATA_LIMIT - 1024
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT
    details = _details(status)
    assert details.message.startswith("model: '" + "é" * 32 + f"…({1 << 20} chars)' is not served ")
    assert len(details.message.encode()) <= 1024
    bad = error_details_pb2.BadRequest()
    assert details.details[1].Unpack(bad) and bad.field_violations[0].field == "model"


def test_a_long_message_without_quotes_is_cut_with_its_length() -> None:
    text = "x" * 100_000
    status = to_status(NotFound(text))
    assert status.details.endswith("…(100000 chars)") and len(status.details) <= 1024
    assert status.details.startswith("x" * 900)
    assert to_status_message(NotFound(text)).message == status.details


def test_a_short_message_is_unchanged_and_a_short_quoted_value_kept_whole() -> None:
    message = "model: 'tiny-llm' is not served"
    assert to_status(NotFound(message, field="model")).details == message


def test_a_huge_field_name_is_cut_too_and_the_error_still_round_trips() -> None:
    status = to_status(InvalidArgument("bad", field="f" * 50_000, reason="BAD"))
    assert _wire_size(status) < METADATA_LIMIT - 1024
    err = from_rpc_error(grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(),
                                              grpc.aio.Metadata(*status.trailing_metadata), details=status.details))
    assert err.reason == "BAD" and err.field is not None and err.field.startswith("f" * 200)


def test_apostrophes_in_the_servers_own_words_are_not_a_quoted_value() -> None:
    # Two apostrophes more than 64 characters apart ("tensor's" ... "Generate's") are words, not a repr'd value.
    text = ("prompt_embeds.data: GenerateInline takes every tensor's bytes inline; a tensor without data must be "
            "sent as rows after the header on Generate's pieces stream")
    assert bounded(text) == text
    long = "m" * 300
    cut = bounded(f"the server's model {long!r} isn't served")
    assert cut.startswith("the server's model 'mmmm") and cut.endswith("…(300 chars)' isn't served"), cut
