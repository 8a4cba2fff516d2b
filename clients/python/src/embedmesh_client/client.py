"""Sync and async clients for the public gRPC API: InferenceService and EncoderCacheService (the preprocessor) and
VectorStoreService (the vector-store service: its own process and port, ``vector_store_address``).

Options: TLS (``tls=True`` or your own ``grpc.ChannelCredentials``), an API key sent as ``authorization: Bearer``
metadata, a default deadline, and retries with exponential backoff for idempotent calls only (ListModels, Embed,
upload: content-addressed, so repeating it is harmless; the vector store's reads and searches). Generation is never
retried, nor is anything that creates or deletes a file or a vector store (a repeat would create a second one, or
report NOT_FOUND for a delete that went through).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from embedmesh.cache.v1 import cache_pb2_grpc
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc
from embedmesh.vectorstore.v1 import vectorstore_pb2, vectorstore_pb2_grpc
from embedmesh_client import vector_stores as vs
from embedmesh_client.errors import from_rpc_error
from embedmesh_client.requests import (
    CHUNKED_MIN,
    chat_params,
    chunk_messages,
    completion_params,
    embed_request,
    fill_rows,
    put_messages,
)
from embedmesh_client.tensors import from_tensor

__all__ = ["Client", "AsyncClient"]

T = TypeVar("T")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


_GENERATE = "/embedmesh.inference.v1.InferenceService/Generate"
_GENERATE_INLINE = "/embedmesh.inference.v1.InferenceService/GenerateInline"
UNARY_MAX = 1 << 20


class _Calls:
    """The generation calls as raw calls taking message bytes (``requests.chunk_messages``: one copy of each piece of
    rows, none by protobuf): ``pieces``, ``InferenceService.Generate`` for a header and its rows; ``inline``,
    ``InferenceService.GenerateInline`` for one message (the same bytes as a one-message Generate stream; a unary
    request costs grpc's client and the server less CPU); ``whole``, GenerateInline made as a unary call, for a
    small request (under ``UNARY_MAX``) whose answer comes without stream, which is exactly one event (the same call on
    the wire: one message and the status; the unary path costs the client less again; with big messages it was
    measured slower, and slowed the calls after it on the channel)."""

    def __init__(self, channel: Any) -> None:
        events = inference_pb2.GenerateResponse.FromString
        self.pieces = channel.stream_stream(_GENERATE, request_serializer=None, response_deserializer=events)
        self.inline = channel.unary_stream(_GENERATE_INLINE, request_serializer=None, response_deserializer=events)
        self.whole = channel.unary_unary(_GENERATE_INLINE, request_serializer=None, response_deserializer=events)


class _Prepared:
    """A completion or chat, its raw tensors' bytes kept aside (``rows``): sent as rows after the header (Generate)
    when they are big enough (``CHUNKED_MIN``), else put back into the header, one message (GenerateInline)."""

    def __init__(self, task: str, params: Any, rows: list[memoryview], stream: bool) -> None:
        self.task = task
        self.params = params
        self.rows = rows
        self.stream = stream

    @classmethod
    def completion(cls, model: str, kw: dict[str, Any], stream: bool) -> _Prepared:
        rows: list[memoryview] = []
        return cls("completion", completion_params(model, rows=rows, **kw), rows, stream)

    @classmethod
    def chat(cls, model: str, messages: Sequence[dict[str, Any]], kw: dict[str, Any], stream: bool) -> _Prepared:
        rows: list[memoryview] = []
        return cls("chat", chat_params(model, messages, rows=rows, **kw), rows, stream)

    def messages(self) -> Iterator[bytes]:
        """The messages: the header, then the rows in pieces (a Generate stream); or the header alone with the rows
        inside when they are small (a GenerateInline request: ``inline``)."""
        if sum(len(r) for r in self.rows) < CHUNKED_MIN:
            fill_rows(self.params, self.rows)
            self.rows = []
        header = inference_pb2.GenerateHeader(stream=self.stream, **{self.task: self.params})
        return chunk_messages(header.SerializeToString(), self.rows)

    @property
    def inline(self) -> bool:
        """Whether ``messages`` is one message (after it was called)."""
        return not self.rows


def _whole(events: Sequence[inference_pb2.GenerateResponse], kind: str) -> Any:
    """The one ``completion`` / ``chat`` event of a non-streamed Generate."""
    for event in events:
        if event.WhichOneof("event") == kind:
            return getattr(event, kind)
    raise RuntimeError(f"the mesh's Generate answer held no {kind} event")


def _credentials(tls: bool | grpc.ChannelCredentials) -> grpc.ChannelCredentials | None:
    if tls is True:
        return grpc.ssl_channel_credentials()
    return tls or None


def _create_store_request(name: str, file_ids: Sequence[str], chunking_strategy: Any, expires_after: Any,
                          metadata: dict[str, str] | None) -> vectorstore_pb2.CreateVectorStoreRequest:
    req = vectorstore_pb2.CreateVectorStoreRequest(name=name, file_ids=list(file_ids), metadata=metadata or {})
    chunking = vs.chunking_strategy(chunking_strategy)
    if chunking is not None:
        req.chunking_strategy.CopyFrom(chunking)
    if expires_after is not None:
        req.expires_after.CopyFrom(vs.expires_after(expires_after))
    return req


def _create_store_file_request(store_id: str, file_id: str, attributes: dict[str, vs.Attribute] | None,
                               chunking_strategy: Any) -> vectorstore_pb2.CreateVectorStoreFileRequest:
    req = vectorstore_pb2.CreateVectorStoreFileRequest(vector_store_id=store_id, file_id=file_id,
                                                       attributes=vs.attributes(attributes))
    chunking = vs.chunking_strategy(chunking_strategy)
    if chunking is not None:
        req.chunking_strategy.CopyFrom(chunking)
    return req


class Client:
    """Blocking client. Use as a context manager or call ``close()``."""

    def __init__(self, address: str, *, tls: bool | grpc.ChannelCredentials = False, api_key: str | None = None,
                 timeout: float = 300.0, retries: int = 3, max_message_bytes: int = 512 << 20,
                 vector_store_address: str | None = None) -> None:
        """``address``: the preprocessor. ``vector_store_address``: the vector-store service (``make run``:
        127.0.0.1:50101); default ``address``, for a proxy that routes by gRPC service name."""
        creds = _credentials(tls)
        opts = _options(max_message_bytes)

        def channel(target: str) -> grpc.Channel:
            return grpc.secure_channel(target, creds, opts) if creds else grpc.insecure_channel(target, opts)

        self._channel = channel(address)
        self._vs_channel = channel(vector_store_address) if vector_store_address not in (None, address) else None
        self._inference = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._generate = _Calls(self._channel)
        self._cache = cache_pb2_grpc.EncoderCacheServiceStub(self._channel)
        self._vs = vectorstore_pb2_grpc.VectorStoreServiceStub(self._vs_channel or self._channel)
        self._md = _metadata(api_key)
        self.timeout = timeout
        self.retries = retries

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        if self._vs_channel is not None:
            self._vs_channel.close()

    def _call(self, fn: Callable[[], T], idempotent: bool) -> T:
        delay = 0.1
        for attempt in range(self.retries + 1 if idempotent else 1):
            try:
                return fn()
            except grpc.RpcError as e:
                if not idempotent or e.code() not in _RETRYABLE or attempt == self.retries:
                    raise from_rpc_error(e) from None
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def complete(self, model: str, **kw: Any) -> inference_pb2.CompleteResponse:
        """One ``GenerateInline`` call; big raw tensors (``CHUNKED_MIN`` bytes or more) go as rows after the header
        of a ``Generate`` call instead."""
        return _whole(self._events(_Prepared.completion(model, kw, stream=False)), "completion")

    def stream_complete(self, model: str, **kw: Any) -> Iterator[inference_pb2.StreamCompleteResponse]:
        for event in self._events(_Prepared.completion(model, kw, stream=True)):
            yield event.completion_chunk

    def chat(self, model: str, messages: Sequence[dict[str, Any]], **kw: Any) -> inference_pb2.ChatResponse:
        """One ``GenerateInline`` call, or ``Generate`` with big raw tensors in the parts, as for ``complete``."""
        return _whole(self._events(_Prepared.chat(model, messages, kw, stream=False)), "chat")

    def stream_chat(self, model: str, messages: Sequence[dict[str, Any]],
                    **kw: Any) -> Iterator[inference_pb2.StreamChatResponse]:
        for event in self._events(_Prepared.chat(model, messages, kw, stream=True)):
            yield event.chat_chunk

    def _events(self, p: _Prepared) -> Iterator[inference_pb2.GenerateResponse]:
        messages = p.messages()
        one = next(messages) if p.inline else b""
        if p.inline and not p.stream and len(one) < UNARY_MAX:
            try:
                yield self._generate.whole(one, timeout=self.timeout, metadata=self._md)
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
            return
        if p.inline:
            call = self._generate.inline(one, timeout=self.timeout, metadata=self._md)
        else:
            call = self._generate.pieces(messages, timeout=self.timeout, metadata=self._md)
        try:
            yield from call
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    def embed(self, model: str, inputs: Any, dimensions: int | None = None) -> np.ndarray:
        req = embed_request(model, inputs, dimensions)
        resp = self._call(lambda: self._inference.Embed(req, timeout=self.timeout, metadata=self._md), True)
        return from_tensor(resp.embeddings)

    def upload_embeds(self, tensor: Any, ttl_seconds: int | None = None) -> str:
        """Upload once (in 1 MiB chunks); returns the id to pass as ``embeds=`` / ``prefix=`` / a chat part."""
        resp = self._call(lambda: self._cache.Put(put_messages(tensor, ttl_seconds), timeout=self.timeout,
                                                  metadata=self._md), True)
        return resp.key

    def list_models(self) -> list[inference_pb2.Model]:
        resp = self._call(lambda: self._inference.ListModels(inference_pb2.ListModelsRequest(), timeout=self.timeout,
                                                             metadata=self._md), True)
        return list(resp.models)

    def list_adapters(self) -> list[inference_pb2.Model]:
        """Loaded LoRA adapters (models whose ``parent`` is their base model)."""
        return [m for m in self.list_models() if m.parent]

    def load_lora_adapter(self, name: str, path: str,
                          workers: Sequence[str] = ()) -> inference_pb2.LoadLoraAdapterResponse:
        """Load an adapter (admin key needed when keys are configured); then use ``name`` as the model."""
        req = inference_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path, workers=list(workers))
        return self._call(lambda: self._inference.LoadLoraAdapter(req, timeout=self.timeout, metadata=self._md),
                          False)

    def unload_lora_adapter(self, name: str) -> inference_pb2.UnloadLoraAdapterResponse:
        req = inference_pb2.UnloadLoraAdapterRequest(lora_name=name)
        return self._call(lambda: self._inference.UnloadLoraAdapter(req, timeout=self.timeout, metadata=self._md),
                          False)

    # --- vector stores (VectorStoreService at ``vector_store_address``) ------------------------------------------
    def upload_file(self, data: bytes, filename: str, purpose: str = "assistants",
                    content_type: str = "") -> vectorstore_pb2.File:
        """Upload a text file (text/plain, text/markdown or JSON) in 1 MiB chunks; returns it with its "file-..." id.
        Not retried: each upload stores a new file."""
        return self._call(lambda: self._vs.UploadFile(vs.upload_file_messages(data, filename, purpose, content_type),
                                                      timeout=self.timeout, metadata=self._md), False).file

    def list_files(self, purpose: str = "", *, limit: int | None = None, order: str | None = None,
                   after: str | None = None, before: str | None = None) -> vectorstore_pb2.ListFilesResponse:
        """One page (``.data``, ``.page.has_more`` / ``.page.last_id`` for the next ``after``), newest first."""
        req = vectorstore_pb2.ListFilesRequest(purpose=purpose, page=vs.page_request(limit, order, after, before))
        return self._call(lambda: self._vs.ListFiles(req, timeout=self.timeout, metadata=self._md), True)

    def get_file(self, file_id: str) -> vectorstore_pb2.File:
        req = vectorstore_pb2.GetFileRequest(file_id=file_id)
        return self._call(lambda: self._vs.GetFile(req, timeout=self.timeout, metadata=self._md), True).file

    def get_file_content(self, file_id: str) -> bytes:
        req = vectorstore_pb2.GetFileContentRequest(file_id=file_id)
        return self._call(lambda: b"".join(m.chunk for m in self._vs.GetFileContent(
            req, timeout=self.timeout, metadata=self._md)), True)

    def delete_file(self, file_id: str) -> vectorstore_pb2.DeleteFileResponse:
        """Delete a file and remove it from every vector store that holds it."""
        req = vectorstore_pb2.DeleteFileRequest(file_id=file_id)
        return self._call(lambda: self._vs.DeleteFile(req, timeout=self.timeout, metadata=self._md), False)

    def create_vector_store(self, name: str = "", file_ids: Sequence[str] = (), *, chunking_strategy: Any = None,
                            expires_after: Any = None,
                            metadata: dict[str, str] | None = None) -> vectorstore_pb2.VectorStore:
        """A new "vs_..." store; its files are ingested in the background (poll ``get_vector_store`` until
        ``file_counts.in_progress`` is 0). ``chunking_strategy``: ``{"type": "static", "static":
        {"max_chunk_size_tokens": 400, "chunk_overlap_tokens": 100}}``; ``expires_after``: ``{"days": 7}``."""
        req = _create_store_request(name, file_ids, chunking_strategy, expires_after, metadata)
        return self._call(lambda: self._vs.CreateVectorStore(req, timeout=self.timeout, metadata=self._md),
                          False).vector_store

    def list_vector_stores(self, *, limit: int | None = None, order: str | None = None, after: str | None = None,
                           before: str | None = None) -> vectorstore_pb2.ListVectorStoresResponse:
        req = vectorstore_pb2.ListVectorStoresRequest(page=vs.page_request(limit, order, after, before))
        return self._call(lambda: self._vs.ListVectorStores(req, timeout=self.timeout, metadata=self._md), True)

    def get_vector_store(self, store_id: str) -> vectorstore_pb2.VectorStore:
        req = vectorstore_pb2.GetVectorStoreRequest(vector_store_id=store_id)
        return self._call(lambda: self._vs.GetVectorStore(req, timeout=self.timeout, metadata=self._md),
                          True).vector_store

    def delete_vector_store(self, store_id: str) -> vectorstore_pb2.DeleteVectorStoreResponse:
        """Delete a store and its index (the files stay)."""
        req = vectorstore_pb2.DeleteVectorStoreRequest(vector_store_id=store_id)
        return self._call(lambda: self._vs.DeleteVectorStore(req, timeout=self.timeout, metadata=self._md), False)

    def create_vector_store_file(self, store_id: str, file_id: str, attributes: dict[str, vs.Attribute] | None = None,
                                 *, chunking_strategy: Any = None) -> vectorstore_pb2.VectorStoreFile:
        """Add an uploaded file to a store (status IN_PROGRESS until ingested); ``attributes`` feed search filters."""
        req = _create_store_file_request(store_id, file_id, attributes, chunking_strategy)
        return self._call(lambda: self._vs.CreateVectorStoreFile(req, timeout=self.timeout, metadata=self._md),
                          False).file

    def list_vector_store_files(self, store_id: str, *, status: str | None = None, limit: int | None = None,
                                order: str | None = None, after: str | None = None,
                                before: str | None = None) -> vectorstore_pb2.ListVectorStoreFilesResponse:
        """``status``: only "in_progress", "completed", "failed" or "cancelled" files (default all)."""
        req = vectorstore_pb2.ListVectorStoreFilesRequest(vector_store_id=store_id, filter=vs.file_status(status),
                                                          page=vs.page_request(limit, order, after, before))
        return self._call(lambda: self._vs.ListVectorStoreFiles(req, timeout=self.timeout, metadata=self._md), True)

    def get_vector_store_file(self, store_id: str, file_id: str) -> vectorstore_pb2.VectorStoreFile:
        req = vectorstore_pb2.GetVectorStoreFileRequest(vector_store_id=store_id, file_id=file_id)
        return self._call(lambda: self._vs.GetVectorStoreFile(req, timeout=self.timeout, metadata=self._md),
                          True).file

    def delete_vector_store_file(self, store_id: str, file_id: str) -> vectorstore_pb2.DeleteVectorStoreFileResponse:
        """Remove a file from a store (the file itself stays)."""
        req = vectorstore_pb2.DeleteVectorStoreFileRequest(vector_store_id=store_id, file_id=file_id)
        return self._call(lambda: self._vs.DeleteVectorStoreFile(req, timeout=self.timeout, metadata=self._md),
                          False)

    def search_vector_store(self, store_id: str, query: str | Sequence[str] | None = None,
                            max_num_results: int | None = None, filters: Any = None, *, query_embedding: Any = None,
                            score_threshold: float | None = None, ranker: str | None = None,
                            rewrite_query: bool = False) -> vectorstore_pb2.SearchVectorStoreResponse:
        """Nearest chunks, best first (``.data[i].file_id / .score / .content[0].text``). ``query``: one or more
        strings, or ``query_embedding=`` a vector instead; ``filters``: an OpenAI filter dict (``{"type": "eq",
        "key": "topic", "value": "food"}``, ``{"type": "and", "filters": [...]}``) or a ``Filter`` message."""
        req = vs.search_request(store_id, query, query_embedding=query_embedding, max_num_results=max_num_results,
                                filters=filters, score_threshold=score_threshold, ranker=ranker,
                                rewrite_query=rewrite_query)
        return self._call(lambda: self._vs.SearchVectorStore(req, timeout=self.timeout, metadata=self._md), True)


class AsyncClient:
    """The same API over ``grpc.aio``."""

    def __init__(self, address: str, *, tls: bool | grpc.ChannelCredentials = False, api_key: str | None = None,
                 timeout: float = 300.0, retries: int = 3, max_message_bytes: int = 512 << 20,
                 vector_store_address: str | None = None) -> None:
        creds = _credentials(tls)
        opts = _options(max_message_bytes)

        def channel(target: str) -> grpc.aio.Channel:
            return grpc.aio.secure_channel(target, creds, opts) if creds else grpc.aio.insecure_channel(target, opts)

        self._channel = channel(address)
        self._vs_channel = channel(vector_store_address) if vector_store_address not in (None, address) else None
        self._inference = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._generate = _Calls(self._channel)
        self._cache = cache_pb2_grpc.EncoderCacheServiceStub(self._channel)
        self._vs = vectorstore_pb2_grpc.VectorStoreServiceStub(self._vs_channel or self._channel)
        self._md = _metadata(api_key)
        self.timeout = timeout
        self.retries = retries

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        if self._vs_channel is not None:
            await self._vs_channel.close()

    async def _call(self, fn: Callable[[], Any], idempotent: bool) -> Any:
        delay = 0.1
        for attempt in range(self.retries + 1 if idempotent else 1):
            try:
                return await fn()
            except grpc.aio.AioRpcError as e:
                if not idempotent or e.code() not in _RETRYABLE or attempt == self.retries:
                    raise from_rpc_error(e) from None
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def complete(self, model: str, **kw: Any) -> inference_pb2.CompleteResponse:
        """One ``GenerateInline`` call; big raw tensors (``CHUNKED_MIN`` bytes or more) go as rows after the header
        of a ``Generate`` call instead."""
        return _whole([e async for e in self._events(_Prepared.completion(model, kw, stream=False))], "completion")

    async def stream_complete(self, model: str, **kw: Any) -> AsyncIterator[inference_pb2.StreamCompleteResponse]:
        async for event in self._events(_Prepared.completion(model, kw, stream=True)):
            yield event.completion_chunk

    async def chat(self, model: str, messages: Sequence[dict[str, Any]], **kw: Any) -> inference_pb2.ChatResponse:
        """One ``GenerateInline`` call, or ``Generate`` with big raw tensors in the parts, as for ``complete``."""
        return _whole([e async for e in self._events(_Prepared.chat(model, messages, kw, stream=False))], "chat")

    async def stream_chat(self, model: str, messages: Sequence[dict[str, Any]],
                          **kw: Any) -> AsyncIterator[inference_pb2.StreamChatResponse]:
        async for event in self._events(_Prepared.chat(model, messages, kw, stream=True)):
            yield event.chat_chunk

    async def _events(self, p: _Prepared) -> AsyncIterator[inference_pb2.GenerateResponse]:
        messages = p.messages()
        one = next(messages) if p.inline else b""
        if p.inline and not p.stream and len(one) < UNARY_MAX:
            try:
                yield await self._generate.whole(one, timeout=self.timeout, metadata=self._md)
            except grpc.aio.AioRpcError as e:
                raise from_rpc_error(e) from None
            return
        if p.inline:
            call = self._generate.inline(one, timeout=self.timeout, metadata=self._md)
        else:
            call = self._generate.pieces(messages, timeout=self.timeout, metadata=self._md)
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    async def embed(self, model: str, inputs: Any, dimensions: int | None = None) -> np.ndarray:
        req = embed_request(model, inputs, dimensions)
        resp = await self._call(lambda: self._inference.Embed(req, timeout=self.timeout, metadata=self._md), True)
        return from_tensor(resp.embeddings)

    async def upload_embeds(self, tensor: Any, ttl_seconds: int | None = None) -> str:
        async def messages() -> AsyncIterator[Any]:
            for m in put_messages(tensor, ttl_seconds):
                yield m

        resp = await self._call(lambda: self._cache.Put(messages(), timeout=self.timeout, metadata=self._md), True)
        return resp.key

    async def list_models(self) -> list[inference_pb2.Model]:
        resp = await self._call(lambda: self._inference.ListModels(inference_pb2.ListModelsRequest(),
                                                                   timeout=self.timeout, metadata=self._md), True)
        return list(resp.models)

    async def list_adapters(self) -> list[inference_pb2.Model]:
        return [m for m in await self.list_models() if m.parent]

    async def load_lora_adapter(self, name: str, path: str,
                                workers: Sequence[str] = ()) -> inference_pb2.LoadLoraAdapterResponse:
        req = inference_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path, workers=list(workers))
        return await self._call(lambda: self._inference.LoadLoraAdapter(req, timeout=self.timeout,
                                                                        metadata=self._md), False)

    async def unload_lora_adapter(self, name: str) -> inference_pb2.UnloadLoraAdapterResponse:
        req = inference_pb2.UnloadLoraAdapterRequest(lora_name=name)
        return await self._call(lambda: self._inference.UnloadLoraAdapter(req, timeout=self.timeout,
                                                                          metadata=self._md), False)

    # --- vector stores (VectorStoreService at ``vector_store_address``) ------------------------------------------
    async def upload_file(self, data: bytes, filename: str, purpose: str = "assistants",
                          content_type: str = "") -> vectorstore_pb2.File:
        async def messages() -> AsyncIterator[vectorstore_pb2.UploadFileRequest]:
            for m in vs.upload_file_messages(data, filename, purpose, content_type):
                yield m

        resp = await self._call(lambda: self._vs.UploadFile(messages(), timeout=self.timeout, metadata=self._md),
                                False)
        return resp.file

    async def list_files(self, purpose: str = "", *, limit: int | None = None, order: str | None = None,
                         after: str | None = None, before: str | None = None) -> vectorstore_pb2.ListFilesResponse:
        req = vectorstore_pb2.ListFilesRequest(purpose=purpose, page=vs.page_request(limit, order, after, before))
        return await self._call(lambda: self._vs.ListFiles(req, timeout=self.timeout, metadata=self._md), True)

    async def get_file(self, file_id: str) -> vectorstore_pb2.File:
        req = vectorstore_pb2.GetFileRequest(file_id=file_id)
        resp = await self._call(lambda: self._vs.GetFile(req, timeout=self.timeout, metadata=self._md), True)
        return resp.file

    async def get_file_content(self, file_id: str) -> bytes:
        req = vectorstore_pb2.GetFileContentRequest(file_id=file_id)

        async def read() -> bytes:
            return b"".join([m.chunk async for m in self._vs.GetFileContent(req, timeout=self.timeout,
                                                                            metadata=self._md)])

        return await self._call(read, True)

    async def delete_file(self, file_id: str) -> vectorstore_pb2.DeleteFileResponse:
        req = vectorstore_pb2.DeleteFileRequest(file_id=file_id)
        return await self._call(lambda: self._vs.DeleteFile(req, timeout=self.timeout, metadata=self._md), False)

    async def create_vector_store(self, name: str = "", file_ids: Sequence[str] = (), *,
                                  chunking_strategy: Any = None, expires_after: Any = None,
                                  metadata: dict[str, str] | None = None) -> vectorstore_pb2.VectorStore:
        req = _create_store_request(name, file_ids, chunking_strategy, expires_after, metadata)
        resp = await self._call(lambda: self._vs.CreateVectorStore(req, timeout=self.timeout, metadata=self._md),
                                False)
        return resp.vector_store

    async def list_vector_stores(self, *, limit: int | None = None, order: str | None = None,
                                 after: str | None = None,
                                 before: str | None = None) -> vectorstore_pb2.ListVectorStoresResponse:
        req = vectorstore_pb2.ListVectorStoresRequest(page=vs.page_request(limit, order, after, before))
        return await self._call(lambda: self._vs.ListVectorStores(req, timeout=self.timeout, metadata=self._md),
                                True)

    async def get_vector_store(self, store_id: str) -> vectorstore_pb2.VectorStore:
        req = vectorstore_pb2.GetVectorStoreRequest(vector_store_id=store_id)
        resp = await self._call(lambda: self._vs.GetVectorStore(req, timeout=self.timeout, metadata=self._md), True)
        return resp.vector_store

    async def delete_vector_store(self, store_id: str) -> vectorstore_pb2.DeleteVectorStoreResponse:
        req = vectorstore_pb2.DeleteVectorStoreRequest(vector_store_id=store_id)
        return await self._call(lambda: self._vs.DeleteVectorStore(req, timeout=self.timeout, metadata=self._md),
                                False)

    async def create_vector_store_file(self, store_id: str, file_id: str,
                                       attributes: dict[str, vs.Attribute] | None = None, *,
                                       chunking_strategy: Any = None) -> vectorstore_pb2.VectorStoreFile:
        req = _create_store_file_request(store_id, file_id, attributes, chunking_strategy)
        resp = await self._call(lambda: self._vs.CreateVectorStoreFile(req, timeout=self.timeout,
                                                                       metadata=self._md), False)
        return resp.file

    async def list_vector_store_files(self, store_id: str, *, status: str | None = None, limit: int | None = None,
                                      order: str | None = None, after: str | None = None,
                                      before: str | None = None) -> vectorstore_pb2.ListVectorStoreFilesResponse:
        req = vectorstore_pb2.ListVectorStoreFilesRequest(vector_store_id=store_id, filter=vs.file_status(status),
                                                          page=vs.page_request(limit, order, after, before))
        return await self._call(lambda: self._vs.ListVectorStoreFiles(req, timeout=self.timeout,
                                                                      metadata=self._md), True)

    async def get_vector_store_file(self, store_id: str, file_id: str) -> vectorstore_pb2.VectorStoreFile:
        req = vectorstore_pb2.GetVectorStoreFileRequest(vector_store_id=store_id, file_id=file_id)
        resp = await self._call(lambda: self._vs.GetVectorStoreFile(req, timeout=self.timeout, metadata=self._md),
                                True)
        return resp.file

    async def delete_vector_store_file(self, store_id: str,
                                       file_id: str) -> vectorstore_pb2.DeleteVectorStoreFileResponse:
        req = vectorstore_pb2.DeleteVectorStoreFileRequest(vector_store_id=store_id, file_id=file_id)
        return await self._call(lambda: self._vs.DeleteVectorStoreFile(req, timeout=self.timeout,
                                                                       metadata=self._md), False)

    async def search_vector_store(self, store_id: str, query: str | Sequence[str] | None = None,
                                  max_num_results: int | None = None, filters: Any = None, *,
                                  query_embedding: Any = None, score_threshold: float | None = None,
                                  ranker: str | None = None,
                                  rewrite_query: bool = False) -> vectorstore_pb2.SearchVectorStoreResponse:
        req = vs.search_request(store_id, query, query_embedding=query_embedding, max_num_results=max_num_results,
                                filters=filters, score_threshold=score_threshold, ranker=ranker,
                                rewrite_query=rewrite_query)
        return await self._call(lambda: self._vs.SearchVectorStore(req, timeout=self.timeout, metadata=self._md),
                                True)
