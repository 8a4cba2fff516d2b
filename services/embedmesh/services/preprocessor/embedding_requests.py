"""The preprocessor's side of /v1/embeddings: validate the inputs, serve repeats from the encoder cache, fan the
rest out to the model's embedding workers, and assemble the vectors in input order.

Rules checked here, before any worker is called (each a 400 naming the field as the client spelled it):
- at least one input and at most ``MAX_INPUTS`` (2048, OpenAI's own cap) per request;
- no empty string and no empty token list (``input`` for a single input, ``input[i]`` in a list);
- token ids in ``[0, vocab_size)`` and at most the model's ``max_context_tokens`` ids per input (text is tokenized
  and length-checked by the worker, whose errors are renamed to the client's numbering);
- ``dimensions`` in ``[1, embedding_size]``, and below ``embedding_size`` only for models that allow shortened
  vectors (``supports_dimensions``).

Caching: one entry per (model, dimensions, input), where ``dimensions`` equal to the model's size counts as unset.
The value is one ``CachedTensor`` per input written by ``pack_entry`` and read by ``unpack_entries`` (the float32
vector and the input's token count, which usage counts for cached inputs too, as OpenAI's does; the count rides as
one more float32, exact below 2**24 tokens, so the entry stays one tensor in the L1 and the Redis L2 alike).
Identical inputs inside one request are computed once, and concurrent requests for the same missing input share one
computation (single flight); a request that waited on another one's failed computation computes its inputs itself,
so an error always names the caller's own input.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import grpc
import numpy as np

from embedmesh.core import tensors
from embedmesh.core.errors import EmbedmeshError, InvalidArgument, Unavailable, from_rpc_error
from embedmesh.core.model_rules import check_dimensions
from embedmesh.services.encoder_cache.keys import validated_key
from embedmesh.services.encoder_cache.tiered import CachedTensor, TieredCache
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.worker.v1 import worker_pb2

__all__ = ["MAX_INPUTS", "INPUTS_PER_CALL", "EmbedModelSpec", "validate_inputs", "cache_key", "embed_inputs"]

MAX_INPUTS = 2048
"""Most inputs in one request (OpenAI's limit)."""
INPUTS_PER_CALL = 256
"""Most inputs sent to one worker in one call; a larger request is split across the model's workers."""

Input = str | list[int]


@dataclass(frozen=True)
class EmbedModelSpec:
    """What the preprocessor needs to know of an embedding model (from the worker's GetInfo)."""

    name: str
    vocab_size: int
    max_tokens: int
    embedding_size: int
    supports_dimensions: bool

    @classmethod
    def from_info(cls, info: worker_pb2.GetInfoResponse) -> EmbedModelSpec:
        return cls(info.model, info.vocab_size, info.max_context_tokens, info.embedding_size,
                   info.supports_dimensions)


def _field(i: int, n: int) -> str:
    return "input" if n == 1 else f"input[{i}]"


def validate_inputs(inputs: Sequence[Input], dimensions: int | None, spec: EmbedModelSpec) -> int | None:
    """Check the request; returns ``dimensions`` with the model's full size folded into None."""
    if not inputs:
        raise InvalidArgument("input: must not be empty", field="input", reason="EMPTY_INPUT")
    if len(inputs) > MAX_INPUTS:
        raise InvalidArgument(f"input: at most {MAX_INPUTS} inputs per request, got {len(inputs)}", field="input",
                              reason="TOO_MANY_INPUTS")
    for i, item in enumerate(inputs):
        name = _field(i, len(inputs))
        if isinstance(item, str):
            if not item:
                raise InvalidArgument(f"{name}: empty string", field=name, reason="EMPTY_INPUT")
            continue
        if not item:
            raise InvalidArgument(f"{name}: empty token list", field=name, reason="EMPTY_INPUT")
        bad = next((t for t in item if t < 0 or t >= spec.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"{name}: token id {bad} is outside the vocabulary [0, {spec.vocab_size})",
                                  field=name, reason="TOKEN_OUT_OF_RANGE")
        if spec.max_tokens and len(item) > spec.max_tokens:
            raise InvalidArgument(f"{name}: {len(item)} tokens; {spec.name} accepts at most {spec.max_tokens} per "
                                  "input (inputs are never truncated)", field=name, reason="INPUT_TOO_LONG")
    return check_dimensions(dimensions, spec.name, spec.embedding_size, spec.supports_dimensions)


def cache_key(model: str, dimensions: int | None, item: Input) -> str:
    """Content address of one input's vector; text and token ids never collide (a kind byte is hashed first). In
    the validated key space (``v1:embed:…``): only the server writes these entries, never a cache RPC."""
    h = blake3.blake3(f"embed\0{model}\0{dimensions or 0}\0".encode())
    if isinstance(item, str):
        h.update(b"T" + item.encode())
    else:
        h.update(b"I" + np.asarray(item, "<i8").tobytes())
    return validated_key("embed", h.hexdigest())


_Inflight = dict[str, "asyncio.Future[CachedTensor]"]
_INFLIGHT: weakref.WeakKeyDictionary[TieredCache, _Inflight] = weakref.WeakKeyDictionary()
"""Per cache: the keys some request is computing now, and the future its waiters share."""


async def embed_inputs(pool: WorkerPool, cache: TieredCache, model: str, inputs: Sequence[Input],
                       dimensions: int | None, timeout: float = 120) -> tuple[np.ndarray, int]:
    """Vectors (len(inputs), dim) in input order and the prompt tokens over all inputs."""
    spec = EmbedModelSpec.from_info(pool.spec(model))
    dimensions = validate_inputs(inputs, dimensions, spec)
    keys = [cache_key(model, dimensions, item) for item in inputs]
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)  # duplicates inside the request are computed once
    values: dict[str, CachedTensor] = {}
    waiting: dict[str, asyncio.Future[CachedTensor]] = {}
    mine: list[int] = []
    inflight = _INFLIGHT.setdefault(cache, {})
    for k, i in first.items():
        hit = await cache.get(k)
        if hit is not None:
            values[k] = hit
        elif k in inflight:
            waiting[k] = inflight[k]
        else:
            mine.append(i)
    if mine:
        await _compute(pool, cache, inflight, model, inputs, keys, mine, dimensions, len(inputs), timeout, values)
    retry: list[int] = []
    for k, fut in waiting.items():
        try:
            values[k] = await asyncio.shield(fut)
        except EmbedmeshError:
            retry.append(first[k])
    if retry:
        await _compute(pool, cache, {}, model, inputs, keys, retry, dimensions, len(inputs), timeout, values)
    return unpack_entries([values[k] for k in keys])


MAX_CACHED_TOKENS = 1 << 24
"""Token counts a cache entry holds exactly (float32 integers)."""


def pack_entry(vector: np.ndarray, tokens: int) -> CachedTensor:
    """One input's cache entry: its vector and its token count."""
    if not 0 <= tokens < MAX_CACHED_TOKENS:
        raise ValueError(f"a cached embedding holds token counts below {MAX_CACHED_TOKENS}, got {tokens}")
    entry = np.empty(vector.shape[-1] + 1, np.float32)
    entry[:-1] = vector
    entry[-1] = tokens
    return CachedTensor(entry, tensor_pb2.DATA_TYPE_FP32)


def unpack_entries(entries: Sequence[CachedTensor]) -> tuple[np.ndarray, int]:
    """Vectors (len(entries), dim) and the token count summed over the entries (``pack_entry``'s inverse)."""
    vectors = np.stack([e.array[:-1] for e in entries]).astype(np.float32, copy=False)
    return vectors, int(sum(int(e.array[-1]) for e in entries))


async def _compute(pool: WorkerPool, cache: TieredCache, inflight: _Inflight, model: str, inputs: Sequence[Input],
                   keys: list[str], todo: list[int], dimensions: int | None, n_inputs: int, timeout: float,
                   values: dict[str, CachedTensor]) -> None:
    """Embed ``inputs[i] for i in todo`` on the workers (chunks in parallel), cache and publish each result."""
    loop = asyncio.get_running_loop()
    futures = {keys[i]: loop.create_future() for i in todo}
    inflight.update(futures)
    try:
        chunks = [todo[s:s + INPUTS_PER_CALL] for s in range(0, len(todo), INPUTS_PER_CALL)]
        results: list[tuple[np.ndarray, list[int]] | BaseException]
        if len(chunks) == 1:  # the usual case: called here, no task to gather
            results = [await _call(pool, model, inputs, chunks[0], dimensions, n_inputs, timeout)]
        else:
            results = await asyncio.gather(
                *(_call(pool, model, inputs, chunk, dimensions, n_inputs, timeout) for chunk in chunks),
                return_exceptions=True,
            )
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            raise error
        for chunk, result in zip(chunks, results, strict=True):
            assert not isinstance(result, BaseException)
            vectors, counts = result
            for j, i in enumerate(chunk):
                value = pack_entry(vectors[j], counts[j])
                values[keys[i]] = value
                await cache.put(keys[i], value)
                futures[keys[i]].set_result(value)
    except BaseException as e:
        for fut in futures.values():
            if not fut.done():
                fut.set_exception(e if isinstance(e, EmbedmeshError) else Unavailable("shared computation failed"))
                fut.exception()  # waiters re-raise it; nobody else must see it as unretrieved
        raise
    finally:
        for k, fut in futures.items():
            if inflight.get(k) is fut:
                del inflight[k]


async def _call(pool: WorkerPool, model: str, inputs: Sequence[Input], chunk: list[int], dimensions: int | None,
                n_inputs: int, timeout: float) -> tuple[np.ndarray, list[int]]:
    worker = pool.pick(model)
    req = worker_pb2.EmbedRequest(inputs=[
        worker_pb2.EmbedInput(text=item) if isinstance(item, str)
        else worker_pb2.EmbedInput(token_ids=worker_pb2.TokenIds(ids=item))
        for item in (inputs[i] for i in chunk)
    ])
    if dimensions is not None:
        req.dimensions = dimensions
    worker.inflight += 1
    try:
        resp = await worker.stub.Embed(req, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        err = from_rpc_error(e)
        if e.code() == grpc.StatusCode.UNAVAILABLE and not err.reason:
            # gRPC's own text names the worker's address: the client gets a plain retryable error instead.
            if hasattr(pool, "mark_lost"):
                pool.mark_lost(worker)
            err = Unavailable("the embedding worker could not be reached; retry shortly", reason="WORKER_LOST",
                              retry_after_seconds=1.0)
        raise _renamed(err, chunk, n_inputs) from None
    finally:
        worker.inflight -= 1
    vectors, _ = tensors.to_numpy(resp.embeddings, field="embeddings")
    counts = list(resp.input_tokens) or [resp.prompt_tokens // max(len(chunk), 1)] * len(chunk)
    return vectors.reshape(len(chunk), -1), counts


def _renamed(err: EmbedmeshError, chunk: list[int], n_inputs: int) -> EmbedmeshError:
    """The worker numbers the inputs it was sent; name them as the client numbered them."""
    sent: int | None = None
    if err.field == "input" and len(chunk) == 1:
        sent = 0
    elif err.field and err.field.startswith("input[") and err.field.endswith("]"):
        sent = int(err.field[6:-1])
    if sent is None or sent >= len(chunk):
        return err
    name = _field(chunk[sent], n_inputs)
    if err.field and err.message.startswith(err.field):
        err.message = name + err.message[len(err.field):]
    err.field = name
    return err
