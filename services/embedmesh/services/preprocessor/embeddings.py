"""The preprocessor's side of /v1/embeddings: validate inputs, serve repeats from the encoder cache, send the rest
to an embedding worker in one call, and assemble the vectors in input order.

Cache entries are keyed by (model, dimensions, input); the value holds the vector and, as its last element, the
input's token count (usage counts cached inputs too, as OpenAI's does).
"""

from __future__ import annotations

import blake3
import grpc
import numpy as np

from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument, from_rpc_error
from embedmesh.services.encoder_cache.tiered import CachedTensor, TieredCache
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2

__all__ = ["MAX_INPUTS", "embed_inputs"]

MAX_INPUTS = 2048
"""Most inputs in one request (OpenAI's own limit)."""


def _key(model: str, dimensions: int | None, item: str | list[int]) -> str:
    h = blake3.blake3(f"{model}\0{dimensions}\0".encode())
    h.update(b"T" + item.encode() if isinstance(item, str) else b"I" + np.asarray(item, "<i8").tobytes())
    return "embed:" + h.hexdigest(16)


def validate_inputs(inputs: list[str | list[int]]) -> None:
    if not inputs:
        raise InvalidArgument("input: must not be empty", field="input", reason="EMPTY")
    if len(inputs) > MAX_INPUTS:
        raise InvalidArgument(f"input: at most {MAX_INPUTS} inputs per request, got {len(inputs)}", field="input",
                              reason="TOO_MANY_INPUTS")
    for i, item in enumerate(inputs):
        field = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise InvalidArgument(f"{field}: empty string", field=field, reason="EMPTY")
        else:
            if not item:
                raise InvalidArgument(f"{field}: empty token list", field=field, reason="EMPTY")
            if any(t < 0 for t in item):
                raise InvalidArgument(f"{field}: token ids must be >= 0", field=field, reason="TOKEN_OUT_OF_RANGE")


async def embed_inputs(pool: WorkerPool, cache: TieredCache, model: str, inputs: list[str | list[int]],
                       dimensions: int | None, timeout: float = 120) -> tuple[np.ndarray, int]:
    """Vectors (len(inputs), dim) in input order and the prompt tokens over all inputs."""
    validate_inputs(inputs)
    keys = [_key(model, dimensions, item) for item in inputs]
    found: list[CachedTensor | None] = [await cache.get(k) for k in keys]
    missing = [i for i, v in enumerate(found) if v is None]
    if missing:
        worker = pool.pick(model)
        req = worker_pb2.EmbedRequest(inputs=[
            worker_pb2.EmbedInput(text=inputs[i]) if isinstance(inputs[i], str)
            else worker_pb2.EmbedInput(token_ids=worker_pb2.TokenIds(ids=inputs[i]))  # type: ignore[arg-type]
            for i in missing
        ])
        if dimensions is not None:
            req.dimensions = dimensions
        try:
            resp = await worker.stub.Embed(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            err = from_rpc_error(e)
            # The worker numbers the inputs it was sent; name them as the client numbered them.
            if err.field and err.field.startswith("input[") and len(inputs) > 1:
                sent = int(err.field[6:-1])
                err.field = f"input[{missing[sent]}]"
                err.message = err.message.replace(f"input[{sent}]", err.field, 1)
            elif err.field == "input" and len(inputs) > 1:
                err.field = f"input[{missing[0]}]"
                err.message = err.message.replace("input", err.field, 1)
            raise err from None
        vectors, _ = tensors.to_numpy(resp.embeddings, field="embeddings")
        for j, i in enumerate(missing):
            packed = np.concatenate([vectors[j], np.float32([resp.input_tokens[j]])]).astype(np.float32)
            value = CachedTensor(packed, tensor_pb2.DATA_TYPE_FP32)
            found[i] = value
            await cache.put(keys[i], value)
    rows = [v.array for v in found if v is not None]
    out = np.stack([r[:-1] for r in rows]).astype(np.float32)
    tokens = int(sum(int(r[-1]) for r in rows))
    return out, tokens
