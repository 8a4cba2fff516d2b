"""Abuse that needs no key, on a real mesh with API keys (echo worker): the preprocessor's public gRPC port refuses a
caller without a key before it reads its message (the preprocessor's peak memory measured, 128 MiB messages), an
upload stream without a key that never ends is refused at once, and the gateway caps the slow connections of
clients without a key from one address while a tenant is served throughout (``gateway/client_caps.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import openai
import pytest

from embedmesh.core.transport.wire import varint as _varint
from embedmesh.gateway import client_caps
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.tensor.v1 import tensor_pb2
from tests.support import generate as gen
from tests.support.mesh import Mesh, start_mesh
from tests.support.procmem import hwm_mib as _hwm_mib

pytestmark = pytest.mark.e2e

KEY = "sk-delta-0123456789"
OPTS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]


@pytest.fixture(scope="module")
def amesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": KEY, "tenant": "delta"}]}))
    m = start_mesh(engine="echo", env={"EMBEDMESH_API_KEYS_FILE": str(keys), "EMBEDMESH_TRACE_CONSOLE": "0"},
                   extra_args=["--embed-worker-port", "0", "--vector-store-port", "0"])
    yield m
    m.stop()


def _pid_listening(port: int) -> int:
    """The process whose command line names the preprocessor's service and ``port``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"embedmesh.services.preprocessor.main" in args and str(port).encode() in args:
            return int(pid)
    raise AssertionError(f"no preprocessor process for port {port}")


def _complete(amesh: Mesh, key: str = "") -> inference_pb2.CompleteResponse:
    params = inference_pb2.CompletionParams(model="echo", prompts=["hello"])
    params.sampling.max_tokens = 2
    md = [("authorization", f"Bearer {key}")] if key else []
    with grpc.insecure_channel(amesh.preprocessor, options=OPTS) as ch:
        return gen.complete(inference_pb2_grpc.InferenceServiceStub(ch), params, metadata=md, timeout=60)


def test_a_message_without_a_key_is_refused_before_the_preprocessor_reads_it(amesh: Mesh) -> None:
    pid = _pid_listening(amesh.preprocessor_port)
    assert _complete(amesh, KEY).choices  # served with the key
    before = _hwm_mib(pid)
    bomb = b"\xfa\x3f" + _varint(128 << 20) + bytes(128 << 20)  # unknown field 1023: 128 MiB of zeros
    with grpc.insecure_channel(amesh.preprocessor, options=OPTS) as ch:
        embed = ch.unary_unary("/embedmesh.inference.v1.InferenceService/Embed",  # a unary method
                               request_serializer=lambda b: b, response_deserializer=lambda b: b)
        generate = ch.stream_stream("/embedmesh.inference.v1.InferenceService/Generate",  # a streaming one
                                    request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for call in [lambda: embed(bomb, timeout=60), lambda: list(generate(iter([bomb]), timeout=60))] * 2:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
    grown = _hwm_mib(pid) - before
    # Well under one message (128 MiB), whatever gRPC's receive buffers take (reading them whole gave +792 MiB).
    assert grown < 64, f"the preprocessor's peak memory grew by {grown:.0f} MiB for messages it refused"
    assert _complete(amesh, KEY).choices


async def test_an_upload_without_a_key_that_never_ends_is_refused_at_once(amesh: Mesh) -> None:
    """It used to be read for up to 10 s (the drain for refused uploads) before the refusal; 5 s is the deadline."""
    t = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[4, 576])
    params = inference_pb2.CompletionParams(model="echo", prompt_embeds=[inference_pb2.PromptEmbeds(tensor=t)])
    first = gen.header(completion=params)

    async def never_ends() -> AsyncIterator[inference_pb2.GenerateRequest]:
        yield first
        while True:
            await asyncio.sleep(0.1)
            yield gen.rows(b"\0" * 64)

    async with grpc.aio.insecure_channel(amesh.preprocessor, options=OPTS) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            call = inference_pb2_grpc.InferenceServiceStub(ch).Generate(never_ends(), timeout=5)
            [e async for e in call]
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()


def test_slow_connections_without_a_key_are_capped_per_address_and_a_tenant_is_served(amesh: Mesh) -> None:
    """100 connections from one address, each sending half a header section and nothing more: the oldest are
    answered 429 with Retry-After and closed as newer ones arrive, so at most the cap stay open; a tenant's
    requests are served meanwhile."""
    extra = 36
    socks = []
    try:
        for _ in range(client_caps.CONNECTIONS_PER_IP + extra):
            s = socket.create_connection(("127.0.0.1", amesh.gateway_port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            socks.append(s)
        refused = []
        for s in socks[:extra]:  # the oldest: made room for the newer ones
            got = b""
            while chunk := s.recv(65536):
                got += chunk
            refused.append(got)
        for got in refused:
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 429 ") and b"retry-after: 1" in head.lower(), got[:200]
            assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
        # the newest are still open, waiting for the rest of their headers: nothing to read on any of them
        readable, _, _ = select.select(socks[extra:], [], [], 0.5)
        assert not readable, [socks.index(s) for s in readable]
        client = openai.OpenAI(base_url=f"{amesh.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert client.completions.create(model="echo", prompt="hi", max_tokens=2).choices
    finally:
        for s in socks:
            s.close()
