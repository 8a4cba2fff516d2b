"""The encode stage's remote mode: the preprocessor's client of ``ImageEncoderService`` (``--image-encoder-address``).

The preprocessor keeps everything it must not delegate: it decodes the file (caps before allocation), computes the
cache key from the pixels and the encoder's identity, and validates the answered rows with the prompt_embeds rules
(``VisionStage``). The service only runs the tower and the projector:

    GetInfo(model)              once per served model: the encoder's identity (the cache key's encoder part) and
                                its row width; the service must run the encoder this preprocessor is configured for
    Encode(model, pixels,       on a cache miss: the decoded RGB pixels as a UINT8 Tensor; the digest makes a
           encoder_digest)      replica running other weights refuse instead of answering rows for another key

Addresses are taken round robin; a replica that is down, overloaded (RESOURCE_EXHAUSTED), past the deadline or not
connected within ``CONNECT_TIMEOUT_SECONDS`` is skipped for the next one, each tried at most once per image; one that
did not connect goes last for ``SLOW_REPLICA_SECONDS``. When
none answers the image part is refused with UNAVAILABLE ``ENCODER_UNAVAILABLE`` naming the encoder and its addresses
(HTTP 503), never INTERNAL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from embedmesh.core.errors import FailedPrecondition, Unavailable, from_rpc_error
from embedmesh.core.server import mesh_channel
from embedmesh.core.tensors import from_numpy
from embedmesh.imageencoder.v1 import imageencoder_pb2, imageencoder_pb2_grpc
from embedmesh.tensor.v1 import tensor_pb2

__all__ = ["RemoteEncoder", "EncodeServiceClient", "DESCRIBE_TIMEOUT_SECONDS", "ENCODE_TIMEOUT_SECONDS",
           "CONNECT_TIMEOUT_SECONDS", "SLOW_REPLICA_SECONDS"]

DESCRIBE_TIMEOUT_SECONDS = 120.0
"""GetInfo for a model builds its encoder on the service's first use (seconds; DINOv2's first conversion longer)."""
ENCODE_TIMEOUT_SECONDS = 120.0
"""One Encode, queueing included (a replica that has not built the model's encoder yet builds it first)."""
CONNECT_TIMEOUT_SECONDS = 3.0
"""How long a call waits for a replica's connection before trying the next replica. A replica whose port accepts
TCP but never speaks gRPC (hung, or not a gRPC server) would otherwise hold the call for gRPC's own connect timeout
(about 20 s, until the server's HTTP/2 SETTINGS frame fails to come) before it is skipped; a live replica connects
in milliseconds, even through TLS. A replica that refuses the connection is skipped at once, as before."""
SLOW_REPLICA_SECONDS = 30.0
"""How long a replica that did not connect within ``CONNECT_TIMEOUT_SECONDS`` goes to the end of the round-robin
order: calls start on the replicas that connected, and the slow one is tried again first after this (or at once,
when every other one fails), so a hung replica costs one call the bound, not every call whose turn it is."""
_SKIP = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
"""Answers after which the next address is tried: down, draining, overloaded, too slow."""


class RemoteEncoder:
    """One served model's encoder as the service describes it (``Encoder``'s ``name``, ``identity``,
    ``hidden_size``); ``encode_remote`` answers the rows as the service sent them, unvalidated."""

    def __init__(self, client: EncodeServiceClient, model: str, info: imageencoder_pb2.GetInfoResponse) -> None:
        self.client = client
        self.model = model
        self.name = info.encoder
        self.identity = info.model.identity
        self.digest = info.model.encoder_digest
        self.hidden_size = int(info.model.hidden_size)

    async def encode_remote(self, pixels: np.ndarray, field: str) -> tensor_pb2.Tensor:
        return (await self.client.encode(self, pixels, field)).rows


class EncodeServiceClient:
    """Round robin over the encode service's addresses (mesh channels: mTLS / the mesh token, as worker calls)."""

    def __init__(self, addresses: Sequence[str], encoder: str, max_message_bytes: int) -> None:
        """``encoder``: the encoder this preprocessor is configured for; a service running another is refused."""
        if not addresses:
            raise ValueError("the image encoder service needs at least one address")
        self.addresses = tuple(addresses)
        self.encoder = encoder
        self._channels = [mesh_channel(a, max_message_bytes) for a in self.addresses]
        self._stubs = [imageencoder_pb2_grpc.ImageEncoderServiceStub(c) for c in self._channels]
        self._next = 0
        self._slow_until = [0.0] * len(self.addresses)
        """Per replica: until when (monotonic) it goes last, having not connected within the bound."""

    def _order(self) -> list[int]:
        """Round robin, the replicas that were slow to connect lately moved last (in their round-robin order)."""
        start = self._next
        self._next = (self._next + 1) % len(self._stubs)
        now = time.monotonic()
        rotation = [(start + i) % len(self._stubs) for i in range(len(self._stubs))]
        return sorted(rotation, key=lambda i: self._slow_until[i] > now)

    def unavailable(self, field: str, why: str) -> Unavailable:
        return Unavailable(f"{field}: the image encoder {self.encoder} (service at {', '.join(self.addresses)}) is "
                           f"unavailable: {why}; retry later, or send text or prompt_embeds parts", field=field,
                           reason="ENCODER_UNAVAILABLE", retry_after_seconds=1.0)

    async def _call(self, method: str, request: Any, timeout: float, field: str) -> Any:
        """The first answer of the addresses in round-robin order; a refusal that is not about this replica's state
        is the caller's to word (re-raised as the service's error)."""
        why = "no address answered"
        for i in self._order():
            if not await self._connected(i):
                why = f"{self.addresses[i]}: not connected within {CONNECT_TIMEOUT_SECONDS:g} s"
                self._slow_until[i] = time.monotonic() + SLOW_REPLICA_SECONDS
                continue
            try:
                return await getattr(self._stubs[i], method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() not in _SKIP:
                    raise
                why = f"{self.addresses[i]}: {e.code().name} {e.details() or ''}".strip()
        raise self.unavailable(field, why)

    async def _connected(self, i: int) -> bool:
        """False when replica ``i``'s channel is still connecting after ``CONNECT_TIMEOUT_SECONDS``; True once it is
        ready, or failed (its call then fails at once and is skipped as UNAVAILABLE)."""
        channel = self._channels[i]
        waiting = (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING)
        state = channel.get_state(try_to_connect=True)
        if state not in waiting:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_TIMEOUT_SECONDS
        while state in waiting:
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), left)
            except TimeoutError:
                return False
            state = channel.get_state(try_to_connect=True)
        return True

    async def describe(self, model: str, field: str) -> RemoteEncoder:
        """The encoder the service runs for ``model`` (built there first if needed)."""
        try:
            info = await self._call("GetInfo", imageencoder_pb2.GetInfoRequest(model=model),
                                    DESCRIBE_TIMEOUT_SECONDS, field)
        except grpc.aio.AioRpcError as e:
            raise self._refused(e, field) from None
        if info.encoder != self.encoder:
            raise FailedPrecondition(f"{field}: the image encoder service at {', '.join(self.addresses)} runs "
                                     f"{info.encoder or 'nothing'}, this server is configured for {self.encoder} "
                                     "(--image-encoder)", field=field, reason="ENCODER_UNAVAILABLE")
        if not info.model.identity or info.model.hidden_size < 1:
            raise self.unavailable(field, f"its GetInfo named no encoder for model {model!r}")
        return RemoteEncoder(self, model, info)

    async def encode(self, enc: RemoteEncoder, pixels: np.ndarray, field: str) -> imageencoder_pb2.EncodeResponse:
        """The service's answer for ``pixels`` (one copy of them into the request), unchecked."""
        request = imageencoder_pb2.EncodeRequest(model=enc.model, encoder_digest=enc.digest,
                                                 pixels=from_numpy(pixels, tensor_pb2.DATA_TYPE_UINT8))
        try:
            answer = await self._call("Encode", request, ENCODE_TIMEOUT_SECONDS, field)
        except grpc.aio.AioRpcError as e:
            raise self._refused(e, field) from None
        return answer

    def _refused(self, e: grpc.aio.AioRpcError, field: str) -> Exception:
        """A replica's refusal of a request this server built: the service's own state (its encoder cannot load,
        runs other weights) or limits set apart from this server's, never the client's fault as such."""
        err = from_rpc_error(e)
        if err.reason == "ENCODER_CHANGED":
            changed = self.unavailable(field, "a replica runs other weights than the one described (restarted?); "
                                              "the next request describes it again")
            changed.reason = "ENCODER_CHANGED"
            return changed
        return FailedPrecondition(f"{field}: the image encoder {self.encoder} refused the image: {err}", field=field,
                                  reason=err.reason or "ENCODER_UNAVAILABLE")

    async def close(self) -> None:
        for c in self._channels:
            await c.close()
