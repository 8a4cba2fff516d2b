"""``ImageEncoderService``: the encode stage as its own process (docs/images.md, "Where it runs").

    EncodeRequest  -> fields checked (model name, pixels dtype/shape/caps/size, digest form), before any copy: the
                      pixels are a view of the received message, bounded by the port's message cap
                   -> the model's encoder (built on first use, per model folder, as the preprocessor's in-process
                      stage builds it: ``vision.stage.encoder_factory``); a refused digest is ENCODER_CHANGED
                   -> the queue: at most ``max_queue`` encodes waiting or running, else RESOURCE_EXHAUSTED OVERLOADED
                   -> one encode at a time, in a thread off the event loop -> FP32 rows

The service keeps no cache and computes no key: the preprocessor does both, and validates the rows it gets back.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from embedmesh.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from embedmesh.core.logs import get_logger
from embedmesh.core.tensors import DTYPE_NAMES, format_dims, from_numpy
from embedmesh.imageencoder.v1 import imageencoder_pb2, imageencoder_pb2_grpc
from embedmesh.services.image_encoder.config import MAX_SIDE
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.vision.metrics import IMAGE_ENCODE_SECONDS, IMAGE_ENCODES
from embedmesh.vision.pool import EncoderBroken, EncoderPool
from embedmesh.vision.stage import ROWS_PER_IMAGE, Encoder, encoder_digest

__all__ = ["ImageEncoders", "ImageEncoderServicer", "SERVICE_NAME", "check_pixels", "check_model"]

SERVICE_NAME = "embedmesh.imageencoder.v1.ImageEncoderService"
MAX_MODEL_CHARS = 256
_DIGEST = re.compile(r"[0-9a-f]{32}")

log = get_logger("embedmesh.image_encoder")


def check_model(model: str, field: str = "model") -> str:
    if not 1 <= len(model) <= MAX_MODEL_CHARS or not model.isprintable():
        raise InvalidArgument(f"{field}: a served model name of 1 to {MAX_MODEL_CHARS} printable characters is "
                              f"required, got {len(model)} characters", field=field, reason="BAD_MODEL")
    return model


def check_pixels(msg: tensor_pb2.Tensor, max_pixels: int, field: str = "pixels") -> np.ndarray:
    """The request's pixels as a ``(height, width, 3)`` uint8 view, every rule checked before it is formed."""
    if msg.dtype != tensor_pb2.DATA_TYPE_UINT8:
        raise InvalidArgument(f"{field}.dtype: must be UINT8 (decoded RGB), got "
                              f"{DTYPE_NAMES.get(msg.dtype, f'type {msg.dtype}')}", field=f"{field}.dtype",
                              reason="UNSUPPORTED_DTYPE")
    shape = list(msg.shape)
    if len(shape) != 3 or shape[2] != 3:
        raise InvalidArgument(f"{field}.shape: must be [height, width, 3], got {format_dims(shape)}",
                              field=f"{field}.shape", reason="BAD_SHAPE")
    height, width = shape[0], shape[1]
    if not (1 <= height <= MAX_SIDE and 1 <= width <= MAX_SIDE):
        raise InvalidArgument(f"{field}.shape: height and width must be in [1, {MAX_SIDE}], got "
                              f"{format_dims(shape)}", field=f"{field}.shape", reason="BAD_SHAPE")
    if height * width > max_pixels:
        raise InvalidArgument(f"{field}.shape: {height} x {width} = {height * width} pixels, more than this "
                              f"service's {max_pixels} (--max-image-pixels)", field=f"{field}.shape",
                              reason="TOO_MANY_PIXELS")
    data = msg.data  # read once: each read of a bytes field copies
    if len(data) != height * width * 3:
        raise InvalidArgument(f"{field}.data: {len(data)} bytes, shape {format_dims(shape)} needs "
                              f"{height * width * 3}", field=f"{field}.data", reason="DATA_SIZE_MISMATCH")
    return np.frombuffer(data, dtype=np.uint8).reshape(height, width, 3)


class ImageEncoders:
    """One encoder kind for every model folder it serves, each built on first use; encodes queued, one at a time."""

    def __init__(self, name: str, factory: Callable[[Path], Encoder], folder_of: Callable[[str], Path | None], *,
                 max_pixels: int, max_queue: int, models: tuple[str, ...] = ()) -> None:
        self.name = name
        self.factory = factory
        self.folder_of = folder_of
        self.max_pixels = max_pixels
        self.max_queue = max_queue
        self.models = models
        self.encodes = 0
        self.queued = 0
        self._encoders: EncoderPool[Path, Encoder] = EncoderPool(factory, logger=log)
        """Each folder's encoder; one that failed to load is refused at once after (restart the service to retry)."""
        self._running = asyncio.Lock()  # one encode at a time: the tower uses its own threads

    async def encoder_for(self, model: str, field: str = "model") -> Encoder:
        folder = self.folder_of(model)
        if folder is None:
            raise InvalidArgument(f"{field}: this service encodes for no model {model!r} (its --model-tokenizers: "
                                  f"{', '.join(self.models) or 'none'}, and no --tokenizer for others)",
                                  field=field, reason="UNKNOWN_MODEL")
        try:
            return await self._encoders.get(folder)
        except EncoderBroken as e:
            raise FailedPrecondition(f"{field}: the image encoder {self.name} for model {model!r} cannot load "
                                     f"({e.why})", field=field, reason="ENCODER_UNAVAILABLE") from None

    async def encode(self, model: str, pixels: np.ndarray, digest: str) -> tuple[np.ndarray, str, float]:
        """``(rows, encoder digest, seconds)``; refused at once when the queue is full."""
        if self.queued >= self.max_queue:
            raise ResourceExhausted(f"the image encoder {self.name} has {self.queued} encodes queued (--max-queue "
                                    f"{self.max_queue}); retry later or on another replica", reason="OVERLOADED",
                                    retry_after_seconds=1.0)
        self.queued += 1
        try:
            enc = await self.encoder_for(model)
            mine = encoder_digest(enc.identity)
            if digest and digest != mine:
                raise FailedPrecondition(f"encoder_digest: {digest} is not this service's encoder for model "
                                         f"{model!r} ({mine}); describe it again with GetInfo", field="encoder_digest",
                                         reason="ENCODER_CHANGED")
            async with self._running:
                started = time.perf_counter()
                rows = await asyncio.to_thread(enc.encode, pixels)
                seconds = time.perf_counter() - started
        finally:
            self.queued -= 1
        self.encodes += 1
        IMAGE_ENCODES.labels(self.name).inc()
        IMAGE_ENCODE_SECONDS.labels(self.name).observe(seconds)
        return np.ascontiguousarray(rows, dtype=np.float32), mine, seconds


class ImageEncoderServicer(imageencoder_pb2_grpc.ImageEncoderServiceServicer):
    """Thin adapter: protobuf in, ``ImageEncoders`` call, protobuf out."""

    def __init__(self, encoders: ImageEncoders) -> None:
        self.encoders = encoders

    async def Encode(self, request: imageencoder_pb2.EncodeRequest,  # noqa: N802 - gRPC method name
                     context: Any) -> imageencoder_pb2.EncodeResponse:
        model = check_model(request.model)
        if not request.HasField("pixels"):
            raise InvalidArgument("pixels: required (the decoded RGB image as a UINT8 [height, width, 3] tensor)",
                                  field="pixels", reason="MISSING_PIXELS")
        pixels = check_pixels(request.pixels, self.encoders.max_pixels)
        if request.encoder_digest and not _DIGEST.fullmatch(request.encoder_digest):
            raise InvalidArgument("encoder_digest: 32 lowercase hex digits (GetInfo's) or empty",
                                  field="encoder_digest", reason="BAD_DIGEST")
        rows, digest, seconds = await self.encoders.encode(model, pixels, request.encoder_digest)
        return imageencoder_pb2.EncodeResponse(rows=from_numpy(rows, tensor_pb2.DATA_TYPE_FP32), encoder_digest=digest,
                                               encode_seconds=seconds)

    async def GetInfo(self, request: imageencoder_pb2.GetInfoRequest,  # noqa: N802 - gRPC method name
                      context: Any) -> imageencoder_pb2.GetInfoResponse:
        e = self.encoders
        out = imageencoder_pb2.GetInfoResponse(encoder=e.name, models=list(e.models), encodes=e.encodes,
                                               max_image_pixels=e.max_pixels, queued=e.queued, max_queue=e.max_queue)
        if request.model:
            model = check_model(request.model)
            enc = await e.encoder_for(model)
            out.model.CopyFrom(imageencoder_pb2.ModelEncoder(
                model=model, identity=enc.identity, encoder_digest=encoder_digest(enc.identity),
                hidden_size=enc.hidden_size, rows_per_image=ROWS_PER_IMAGE.get(e.name, 0)))
        return out
