"""A fake preprocessor (InferenceService test double) and the gateway on a real uvicorn, both on a background
event loop, so tests drive them with the real (synchronous) openai SDK and httpx."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import uvicorn

from embedmesh.common.v1 import common_pb2
from embedmesh.core.errors import EmbedmeshError
from embedmesh.core.server import Server, ServerOptions
from embedmesh.core.transport import wire
from embedmesh.core.transport.received import Received
from embedmesh.gateway import GatewayConfig, create_app
from embedmesh.gateway.protocol import GatewayHttpProtocol
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.services.preprocessor.servicer import InferenceServicer
from embedmesh.tensor.v1 import tensor_pb2

SERVICE = "embedmesh.inference.v1.InferenceService"
MODEL = "fake-model"
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
MAX_BODY_BYTES = 1 << 20


def delta(index: int, text: str, finish: int = 0, rid: str = "cmpl-fake") -> inference_pb2.StreamCompleteResponse:
    return inference_pb2.StreamCompleteResponse(id=rid, model=MODEL, index=index, text=text, finish_reason=finish)


def usage_event(prompt: int, completion: int, rid: str = "cmpl-fake") -> inference_pb2.StreamCompleteResponse:
    return inference_pb2.StreamCompleteResponse(
        id=rid, model=MODEL,
        usage=common_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion))


@dataclass
class Script:
    """What the fake does on its next calls (tests set it; ``reset`` between tests)."""

    error: EmbedmeshError | None = None
    """Raised by the next Complete/StreamComplete/ListModels before anything is sent."""
    choices: list[tuple[str, int]] = field(default_factory=lambda: [("Hello there", STOP)])
    """(text, finish reason) of Complete's choices."""
    choice_protos: list[Any] | None = None
    """Whole ``Choice`` messages for Complete/Chat instead of ``choices`` (log-probabilities, tool calls)."""
    stream: list[Any] = field(default_factory=lambda: [
        delta(0, "Hel"), delta(1, "Wor"), delta(0, "lo"), delta(1, "ld", LENGTH), delta(0, "", STOP),
        usage_event(3, 4)])
    """StreamComplete's messages in order; an EmbedmeshError item is raised at that point."""
    hang_before_first: bool = False
    """Complete/StreamComplete send nothing and wait forever (a long prefill, a long generation)."""
    hang_after: bool = False
    """After ``stream``, StreamComplete goes on sending a delta every 20 ms forever (a long generation)."""
    refuse_pieces: EmbedmeshError | None = None
    """Raised by a Generate call whose tensors' bytes came as rows after its header, once they all arrived."""


@dataclass
class Sent:
    """What one Generate call carried: the task's params, the header, the rows after it and the message count."""

    params: Any
    header: Any
    rows: bytes
    messages: int


class FakeInference(inference_pb2_grpc.InferenceServiceServicer):
    """Records every request; answers from ``script``; notes calls the client cancelled. Its requests are parsed as
    the preprocessor's are (the same ``request_parsers``)."""

    request_parsers = InferenceServicer.request_parsers
    upload_streams = InferenceServicer.upload_streams

    def __init__(self) -> None:
        self.script = Script()
        self.requests: list[tuple[str, Any]] = []
        self.cancelled = threading.Event()
        self.sent_after_cancel = 0
        self.inline_calls = 0
        """GenerateInline calls (the rest came as Generate streams)."""

    def reset(self) -> None:
        self.script = Script()
        self.requests.clear()
        self.cancelled.clear()

    def last(self, method: str) -> Any:
        return [r for m, r in self.requests if m == method][-1]

    def _choices(self) -> list[inference_pb2.Choice]:
        if self.script.choice_protos is not None:
            return list(self.script.choice_protos)
        return [inference_pb2.Choice(index=i, text=t, finish_reason=f) for i, (t, f) in enumerate(self.script.choices)]

    async def Generate(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """The one generation call: recorded under the name of its shape ("Complete", "StreamChat", ...; with a
        "Chunks" suffix when rows followed the header) as a ``Sent`` whose ``params`` are the task's."""
        header, rows, messages = None, bytearray(), 0
        async for m in request_iterator:
            messages += 1
            if isinstance(m, Received):  # inline tensors cut out of a big header (core.transport.wire): put back
                m, views = m.message, m.views
                for path, view in views.items():
                    pe = m.request.completion.prompt_embeds[int(path[14:-1]) if "[" in path else 0]
                    getattr(pe, pe.WhichOneof("source")).data = bytes(view)
            if isinstance(m, wire.RowsPiece):
                rows += m.data
            elif isinstance(m, inference_pb2.GenerateInlineRequest) or m.WhichOneof("part") == "request":
                header = m.request
            else:
                rows += m.rows
        assert header is not None
        chat = header.WhichOneof("task") == "chat"
        sent = Sent(header.chat if chat else header.completion, header, bytes(rows), messages)
        shape = ("Stream" if header.stream else "") + ("Chat" if chat else "Complete")
        self.requests.append((shape + ("Chunks" if messages > 1 else ""), sent))
        if messages > 1 and self.script.refuse_pieces is not None:
            raise self.script.refuse_pieces
        if not header.stream:
            answer = await (self.chat(sent, context) if chat else self.complete(sent, context))
            yield inference_pb2.GenerateResponse(**{"chat" if chat else "completion": answer})
            return
        async for item in (self.stream_chat(sent, context) if chat else self.stream_complete(sent, context)):
            yield inference_pb2.GenerateResponse(**{"chat_chunk" if chat else "completion_chunk": item})

    async def GenerateInline(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """The same call in one message (a unary request), recorded and answered as Generate's one message is (inline
        tensors cut out of the received bytes come as the call's wire views: put back too)."""
        self.inline_calls += 1
        async def one() -> Any:
            yield request  # a ``Received``, as the real servicer's parsers give it

        async for event in self.Generate(one(), context):
            yield event

    async def complete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.script.error is not None:
            raise self.script.error
        if self.script.hang_before_first:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        choices = self._choices()
        return inference_pb2.CompleteResponse(id="cmpl-fake", model=request.params.model, choices=choices,
                                              usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=2,
                                                                     total_tokens=7))

    async def stream_complete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        context.add_done_callback(lambda _: self.cancelled.set() if context.cancelled() else None)
        try:
            if self.script.error is not None:
                raise self.script.error
            if self.script.hang_before_first:
                await asyncio.sleep(3600)
            for item in self.script.stream:
                if isinstance(item, EmbedmeshError):
                    raise item
                yield item
            while self.script.hang_after:
                await asyncio.sleep(0.02)
                yield delta(0, "x")
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def chat(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.script.error is not None:
            raise self.script.error
        choices = self._choices()
        return inference_pb2.ChatResponse(id="chatcmpl-fake", model=request.params.model, choices=choices,
                                          usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=2, total_tokens=7))

    async def stream_chat(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.script.error is not None:
            raise self.script.error
        for item in self.script.stream:
            msg = inference_pb2.StreamChatResponse()
            msg.ParseFromString(item.SerializeToString())  # same field numbers
            msg.id = "chatcmpl-fake"
            yield msg

    async def ListModels(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        self.requests.append(("ListModels", request))
        if self.script.error is not None:
            raise self.script.error
        return inference_pb2.ListModelsResponse(models=[inference_pb2.Model(
            id=MODEL, hidden_size=576, max_context_tokens=2048, dtype=tensor_pb2.DATA_TYPE_FP32, engines=["hf"],
            task="generate", ready_workers=1, created=1700000000)])


class Harness:
    """The fake preprocessor and two gateways (one wired to it, one to a dead port) on one background loop."""

    def __init__(self) -> None:
        self.fake = FakeInference()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway-test-loop", daemon=True)
        self._thread.start()
        self._servers: list[uvicorn.Server] = []
        self.run(self._start())

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _serve(self, config: GatewayConfig) -> str:
        server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=0, log_config=None,
                                               http=GatewayHttpProtocol, access_log=False, lifespan="on",
                                               timeout_graceful_shutdown=1))
        self._servers.append(server)
        self.loop.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _start(self) -> None:
        self.grpc = Server("fake-preprocessor", ServerOptions(port=0, grace_seconds=0.5))
        self.grpc.add(inference_pb2_grpc.add_InferenceServiceServicer_to_server, self.fake, SERVICE)
        await self.grpc.start()
        await self.grpc.set_serving(True)
        self.url = await self._serve(GatewayConfig(port=0, preprocessor=self.grpc.address,
                                                   max_body_bytes=MAX_BODY_BYTES, request_timeout_seconds=30))
        # Nothing listens on port 1 of the loopback: every call fails with UNAVAILABLE from gRPC itself.
        self.dead_url = await self._serve(GatewayConfig(port=0, preprocessor="127.0.0.1:1"))

    def set_serving(self, serving: bool) -> None:
        self.run(self.grpc.set_serving(serving))

    async def _stop(self) -> None:
        for s in self._servers:
            s.should_exit = True
        await asyncio.sleep(0.2)
        await self.grpc.drain()

    def close(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="session")
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


@pytest.fixture
def gw(harness: Harness) -> Iterator[Harness]:
    """The harness with a fresh script and an empty request log (and SERVING health)."""
    harness.fake.reset()
    harness.set_serving(True)
    yield harness


@pytest.fixture
def client(gw: Harness) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=20)


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# --- one route module on a bare app, with a scripted stub (the mirrored tests of the route modules) ----------------
class FakeStub:
    """A gRPC stub double: ``answers[method]`` is the response message, an exception to raise, a function of the
    request, or a list (a server stream). Records ``(method, request, timeout)``; a streamed request is recorded as
    the list of its messages."""

    def __init__(self, **answers: Any) -> None:
        self.answers = answers
        self.calls: list[tuple[str, Any, float | None]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self.answers:
            raise AttributeError(name)
        answer = self.answers[name]
        if isinstance(answer, list):
            async def stream(request: Any, timeout: float | None = None) -> Any:
                self.calls.append((name, request, timeout))
                for m in answer:
                    yield m
            return stream

        async def unary(request: Any, timeout: float | None = None) -> Any:
            if hasattr(request, "__aiter__"):
                request = [m async for m in request]
            self.calls.append((name, request, timeout))
            if isinstance(answer, BaseException):
                raise answer
            return answer(request) if callable(answer) else answer
        return unary

    def last(self, method: str) -> Any:
        return [r for m, r, _ in self.calls if m == method][-1]


def rpc_error(err: EmbedmeshError) -> grpc.aio.AioRpcError:
    """The AioRpcError a client sees when a mesh service raises ``err`` (status details included)."""
    from embedmesh.core.errors import to_status

    status = to_status(err)
    return grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata),
                                details=status.details)


def route_client(routes: list[Any]) -> Any:
    """A TestClient of a bare app holding ``routes``; ApiError answered as OpenAI error JSON, as ``create_app``
    does."""
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from embedmesh.gateway.errors import ApiError, error_response

    async def on_error(request: Any, e: Exception) -> Any:
        assert isinstance(e, ApiError)
        return error_response(e)

    return TestClient(Starlette(routes=routes, exception_handlers={ApiError: on_error}))


def bare_gateway(**config: Any) -> Any:
    """A ``Gateway`` whose channel is never opened (tests set ``stub``)."""
    from embedmesh.gateway.context import Gateway

    return Gateway(GatewayConfig(**{"preprocessor": "127.0.0.1:1", **config}))
