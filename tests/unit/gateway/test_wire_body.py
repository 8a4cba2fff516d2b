"""The gateway's fast path for big prompt_embeds: request bytes spliced by ``wire_body`` parse to the very message
the protobuf constructors build (``embeds_json``'s half of the fast path is tested in test_embeds_json.py)."""

from __future__ import annotations

import base64
import os
from typing import Any

import pytest

from embedmesh.gateway.translate import chat_params, completion_params
from embedmesh.gateway.wire_body import generate_request_bytes, plain_request_bytes
from embedmesh.inference.v1 import inference_pb2
from tests.unit.gateway.conftest import MODEL

BIG = os.urandom(300_000)  # lengths past one varint byte at every nesting level
SMALL = b"\x80\x02fake torch.save bytes \x00\xff"
OTHER = b"safetensors-ish header and data"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


COMPLETION_BODIES: list[dict[str, Any]] = [
    {"model": MODEL, "prompt": "", "prompt_embeds": b64(BIG)},
    {"model": MODEL, "prompt": ["", ""], "prompt_embeds": [b64(SMALL), b64(BIG)], "max_tokens": 3, "n": 2,
     "echo": True, "logprobs": 2, "stop": ["x"], "seed": 7},
    {"model": MODEL, "prompt": "also this", "prompt_embeds": [b64(BIG), {"id": "emb-1"}, b64(b""), b64(OTHER)],
     "prompt_embeds_prefix": b64(SMALL), "temperature": 0.5},
    {"model": MODEL, "prompt": [1, 2, 3], "prompt_embeds": [{"id": "emb-2"}, b64(OTHER)],
     "prompt_embeds_prefix": {"id": "emb-3"}},
    {"model": MODEL, "prompt": "go on", "prompt_embeds": [], "prompt_embeds_prefix": b64(BIG)},
]

CHAT_BODIES: list[dict[str, Any]] = [
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "prompt_embeds", "data": b64(BIG)}]}]},
    {"model": MODEL, "max_tokens": 5, "logprobs": True, "top_logprobs": 2, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "name": "ann", "content": [
            {"type": "text", "text": "look:"}, {"type": "prompt_embeds", "data": b64(BIG)},
            {"type": "prompt_embeds", "id": "emb-9"}, {"type": "text", "text": "and"},
            {"type": "prompt_embeds", "data": b64(SMALL)}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "42"},
        {"role": "user", "content": [{"type": "prompt_embeds", "data": b64(b"")},
                                     {"type": "prompt_embeds", "data": b64(OTHER)}]},
    ], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
     "tool_choice": "auto"},
]


def _generate(params: Any, chat: bool, stream: bool) -> inference_pb2.GenerateRequest:
    header = inference_pb2.GenerateHeader(stream=stream)
    (header.chat if chat else header.completion).CopyFrom(params)
    return inference_pb2.GenerateRequest(request=header)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", COMPLETION_BODIES)
def test_completion_bytes_parse_to_the_constructed_message(body: dict[str, Any], stream: bool) -> None:
    blobs: list[bytes] = []
    spliced = completion_params(body, blobs)
    data = generate_request_bytes(spliced, blobs, chat=False, stream=stream)
    assert blobs, "base64 prompt_embeds go to blobs"
    expected = _generate(completion_params(body), False, stream)
    assert inference_pb2.GenerateRequest.FromString(data) == expected
    assert inference_pb2.GenerateRequest.FromString(
        plain_request_bytes(spliced, blobs, chat=False, stream=stream)) == expected


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", CHAT_BODIES)
def test_chat_bytes_parse_to_the_constructed_message(body: dict[str, Any], stream: bool) -> None:
    blobs: list[bytes] = []
    spliced = chat_params(body, blobs)
    data = generate_request_bytes(spliced, blobs, chat=True, stream=stream)
    assert blobs
    expected = _generate(chat_params(body), True, stream)
    assert inference_pb2.GenerateRequest.FromString(data) == expected
    assert inference_pb2.GenerateRequest.FromString(
        plain_request_bytes(spliced, blobs, chat=True, stream=stream)) == expected


@pytest.mark.parametrize("chat", [False, True])
def test_a_request_without_blobs_is_its_params_in_a_header(chat: bool) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} if chat else \
        {"model": MODEL, "prompt": "hi", "max_tokens": 3}
    params = chat_params(body) if chat else completion_params(body)
    for stream in (False, True):
        data = generate_request_bytes(params, [], chat=chat, stream=stream)
        assert inference_pb2.GenerateRequest.FromString(data) == _generate(params, chat, stream)
        assert plain_request_bytes(params, [], chat=chat, stream=stream) == data


def test_no_base64_embeds_no_blobs() -> None:
    blobs: list[bytes] = []
    completion_params({"model": MODEL, "prompt": "hi", "prompt_embeds": [{"id": "emb-1"}]}, blobs)
    chat_params({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, blobs)
    assert blobs == []
