"""Sync and async clients for the public gRPC API (InferenceService, EncoderCacheService) of the preprocessor.

Options: TLS (``tls=True`` or your own ``grpc.ChannelCredentials``), an API key sent as ``authorization: Bearer``
metadata, a default deadline, and retries with exponential backoff for idempotent calls only (ListModels, Embed,
upload: content-addressed, so repeating it is harmless). Generation is never retried.
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
from embedmesh_client.errors import from_rpc_error
from embedmesh_client.requests import chat_params, completion_params, embed_request, put_messages
from embedmesh_client.tensors import from_tensor

__all__ = ["Client", "AsyncClient"]

T = TypeVar("T")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _credentials(tls: bool | grpc.ChannelCredentials) -> grpc.ChannelCredentials | None:
    if tls is True:
        return grpc.ssl_channel_credentials()
    return tls or None


class Client:
    """Blocking client. Use as a context manager or call ``close()``."""

    def __init__(self, address: str, *, tls: bool | grpc.ChannelCredentials = False, api_key: str | None = None,
                 timeout: float = 300.0, retries: int = 3, max_message_bytes: int = 512 << 20) -> None:
        creds = _credentials(tls)
        opts = _options(max_message_bytes)
        self._channel = grpc.secure_channel(address, creds, opts) if creds else grpc.insecure_channel(address, opts)
        self._inference = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._cache = cache_pb2_grpc.EncoderCacheServiceStub(self._channel)
        self._md = _metadata(api_key)
        self.timeout = timeout
        self.retries = retries

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

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
        req = inference_pb2.CompleteRequest(params=completion_params(model, **kw))
        return self._call(lambda: self._inference.Complete(req, timeout=self.timeout, metadata=self._md), False)

    def stream_complete(self, model: str, **kw: Any) -> Iterator[inference_pb2.StreamCompleteResponse]:
        req = inference_pb2.StreamCompleteRequest(params=completion_params(model, **kw))
        call = self._inference.StreamComplete(req, timeout=self.timeout, metadata=self._md)
        try:
            yield from call
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    def chat(self, model: str, messages: Sequence[dict[str, Any]], **kw: Any) -> inference_pb2.ChatResponse:
        req = inference_pb2.ChatRequest(params=chat_params(model, messages, **kw))
        return self._call(lambda: self._inference.Chat(req, timeout=self.timeout, metadata=self._md), False)

    def stream_chat(self, model: str, messages: Sequence[dict[str, Any]],
                    **kw: Any) -> Iterator[inference_pb2.StreamChatResponse]:
        req = inference_pb2.StreamChatRequest(params=chat_params(model, messages, **kw))
        call = self._inference.StreamChat(req, timeout=self.timeout, metadata=self._md)
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


class AsyncClient:
    """The same API over ``grpc.aio``."""

    def __init__(self, address: str, *, tls: bool | grpc.ChannelCredentials = False, api_key: str | None = None,
                 timeout: float = 300.0, retries: int = 3, max_message_bytes: int = 512 << 20) -> None:
        creds = _credentials(tls)
        opts = _options(max_message_bytes)
        self._channel = grpc.aio.secure_channel(address, creds, opts) if creds else \
            grpc.aio.insecure_channel(address, opts)
        self._inference = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._cache = cache_pb2_grpc.EncoderCacheServiceStub(self._channel)
        self._md = _metadata(api_key)
        self.timeout = timeout
        self.retries = retries

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

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
        req = inference_pb2.CompleteRequest(params=completion_params(model, **kw))
        return await self._call(lambda: self._inference.Complete(req, timeout=self.timeout, metadata=self._md), False)

    async def stream_complete(self, model: str, **kw: Any) -> AsyncIterator[inference_pb2.StreamCompleteResponse]:
        req = inference_pb2.StreamCompleteRequest(params=completion_params(model, **kw))
        call = self._inference.StreamComplete(req, timeout=self.timeout, metadata=self._md)
        try:
            async for item in call:
                yield item
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    async def chat(self, model: str, messages: Sequence[dict[str, Any]], **kw: Any) -> inference_pb2.ChatResponse:
        req = inference_pb2.ChatRequest(params=chat_params(model, messages, **kw))
        return await self._call(lambda: self._inference.Chat(req, timeout=self.timeout, metadata=self._md), False)

    async def stream_chat(self, model: str, messages: Sequence[dict[str, Any]],
                          **kw: Any) -> AsyncIterator[inference_pb2.StreamChatResponse]:
        req = inference_pb2.StreamChatRequest(params=chat_params(model, messages, **kw))
        call = self._inference.StreamChat(req, timeout=self.timeout, metadata=self._md)
        try:
            async for item in call:
                yield item
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
