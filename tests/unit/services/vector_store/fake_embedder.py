"""Test double of the mesh's ``InferenceService.Embed``: a hashed bag-of-words embedder in a real gRPC server.

Each lower-cased word maps (blake2b) to one dimension and a sign; a text's vector is the normalised sum, so texts
that share words are close and the same text always gets the same vector. Not a model: it only makes retrieval
deterministic and checkable in tests.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from concurrent import futures

import grpc
import numpy as np

from embedmesh.core import tensors
from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc

__all__ = ["FakeEmbedder", "bag_of_words"]

_WORD = re.compile(r"\w+")


def bag_of_words(text: str, dim: int = 384) -> np.ndarray:
    v = np.zeros(dim, dtype=np.float32)
    for w in _WORD.findall(text.lower()):
        h = hashlib.blake2b(w.encode(), digest_size=8).digest()
        v[int.from_bytes(h[:4], "little") % dim] += 1.0 if h[4] & 1 else -1.0
    n = float(np.linalg.norm(v))
    if n == 0.0:
        v[0] = 1.0
        return v
    return v / n


class _Servicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, owner: FakeEmbedder) -> None:
        self.owner = owner

    def Embed(self, request: inference_pb2.EmbedRequest, context: grpc.ServicerContext):  # noqa: N802
        o = self.owner
        with o.lock:
            o.calls += 1
            o.texts += len(request.inputs)
        if o.delay_seconds:
            time.sleep(o.delay_seconds)
        if o.fail_with is not None:
            context.abort(o.fail_with, "fake embedder told to fail")
        rows = np.stack([bag_of_words(i.text, o.dim) for i in request.inputs])
        return inference_pb2.EmbedResponse(model=request.model, embeddings=tensors.from_numpy(rows))


class FakeEmbedder:
    """Start with ``FakeEmbedder().start()``; ``address`` is host:port. ``dim``, ``delay_seconds`` and ``fail_with``
    may be changed while it runs."""

    def __init__(self, dim: int = 384, delay_seconds: float = 0.0) -> None:
        self.dim = dim
        self.delay_seconds = delay_seconds
        self.fail_with: grpc.StatusCode | None = None
        self.calls = 0
        self.texts = 0
        self.lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FakeEmbedder:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)
