"""Text -> unit vectors through the mesh's public ``InferenceService.Embed``, in batches."""

from __future__ import annotations

import grpc
import numpy as np

from embedmesh.core import tensors
from embedmesh.core.errors import InternalError, from_rpc_error
from embedmesh.core.server import insecure_channel
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc

__all__ = ["Embedder", "DimensionMismatch"]


class DimensionMismatch(InternalError):
    """The embedding model returned vectors of another size than the store's."""

    default_reason = "DIMENSION_MISMATCH"


class Embedder:
    """Calls Embed with ``batch_size`` texts at a time; rows come back L2-normalised (cosine = dot product)."""

    def __init__(self, address: str, model: str, dimensions: int, batch_size: int = 32,
                 timeout_seconds: float = 120.0) -> None:
        self.address = address
        self.model = model
        self.dimensions = dimensions
        self.batch_size = batch_size
        self.timeout = timeout_seconds
        self._channel: grpc.aio.Channel | None = None
        self._stub: inference_pb2_grpc.InferenceServiceStub | None = None
        self._max_tokens: int | None = None

    def _client(self) -> inference_pb2_grpc.InferenceServiceStub:
        if self._stub is None:
            self._channel = insecure_channel(self.address)
            self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        return self._stub

    async def embed_batch(self, texts: list[str]) -> np.ndarray:
        """One Embed call; raises the mesh's error (Unavailable, InvalidArgument, ...) as a domain error."""
        req = inference_pb2.EmbedRequest(model=self.model, inputs=[inference_pb2.EmbedInput(text=t) for t in texts])
        try:
            resp = await self._client().Embed(req, timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            err = from_rpc_error(e)
            raise type(err)(f"embedding model {self.model!r} at {self.address}: {err.message}", field=err.field,
                            reason=err.reason) from None
        arr, _ = tensors.to_numpy(resp.embeddings, field="embeddings")
        arr = np.asarray(arr, dtype=np.float32)
        if arr.ndim != 2 or arr.shape[0] != len(texts):
            raise InternalError(f"Embed returned shape {list(arr.shape)} for {len(texts)} inputs")
        if arr.shape[1] != self.dimensions:
            raise DimensionMismatch(f"embedding model {self.model!r} returned {arr.shape[1]}-d vectors but the "
                                    f"vector store is configured for {self.dimensions}")
        return normalise(arr)

    async def max_input_tokens(self) -> int:
        """The embedding model's longest input in tokens, special tokens included (``ListModels``'
        ``max_context_tokens``); 0 when the mesh does not say yet — unreachable, or the model not listed because its
        worker is still starting — and then asked again next time (only a real answer is kept)."""
        if self._max_tokens is None:
            try:
                resp = await self._client().ListModels(inference_pb2.ListModelsRequest(), timeout=self.timeout)
            except grpc.aio.AioRpcError:
                return 0
            found = next((int(m.max_context_tokens) for m in resp.models if m.id == self.model), 0)
            if not found:
                return 0
            self._max_tokens = found
        return self._max_tokens

    async def embed(self, texts: list[str]) -> np.ndarray:
        out = [await self.embed_batch(texts[i:i + self.batch_size]) for i in range(0, len(texts), self.batch_size)]
        return np.concatenate(out) if out else np.zeros((0, self.dimensions), np.float32)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


def normalise(arr: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    if not np.all(np.isfinite(arr)):
        raise InternalError("the embedding model returned NaN or Inf")
    return (arr / np.maximum(norms, 1e-12)).astype(np.float32)


