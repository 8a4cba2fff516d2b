"""ImageEncoderService over real gRPC (an in-process server): every request field checked and refused by name and
rule, the queue cap answered RESOURCE_EXHAUSTED at once, a digest of other weights refused, counters in GetInfo."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from embedmesh.core.errors import from_rpc_error
from embedmesh.core.server import Server, ServerOptions, mesh_channel
from embedmesh.core.tensors import from_numpy
from embedmesh.imageencoder.v1 import imageencoder_pb2, imageencoder_pb2_grpc
from embedmesh.services.image_encoder.servicer import SERVICE_NAME, ImageEncoders, ImageEncoderServicer
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.vision.stage import encoder_digest

HIDDEN = 8


class MeanEncoder:
    """Rows from the pixels' channel means; ``gate`` (when set) holds every encode until released."""

    name = "efficientnet-lite0"
    hidden_size = HIDDEN

    def __init__(self, folder: Path, gate: threading.Event | None = None) -> None:
        self.identity = f"mean:{folder}"
        self.gate = gate

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        if self.gate is not None:
            self.gate.wait(30)
        mean = pixels.reshape(-1, 3).mean(axis=0) / 255.0
        return np.tile(np.concatenate([mean, mean, mean[:2]]), (2, 1)).astype(np.float32)


def broken(folder: Path) -> MeanEncoder:
    raise RuntimeError("efficientnet-lite-pytorch is not installed")


class Service:
    def __init__(self, encoders: ImageEncoders) -> None:
        self.encoders = encoders

    async def __aenter__(self) -> imageencoder_pb2_grpc.ImageEncoderServiceStub:
        self.server = Server("image-encoder", ServerOptions(port=0, max_message_bytes=1 << 20, grace_seconds=0.5))
        self.server.add(imageencoder_pb2_grpc.add_ImageEncoderServiceServicer_to_server,
                        ImageEncoderServicer(self.encoders), SERVICE_NAME)
        await self.server.start()
        self.channel = mesh_channel(f"127.0.0.1:{self.server.port}")
        return imageencoder_pb2_grpc.ImageEncoderServiceStub(self.channel)

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.drain()


def encoders(factory=None, *, max_queue: int = 4, max_pixels: int = 64 * 64) -> ImageEncoders:  # type: ignore[no-untyped-def]
    folders = {"m": Path("/models/m")}
    return ImageEncoders("efficientnet-lite0", factory or MeanEncoder, folders.get, max_pixels=max_pixels,
                         max_queue=max_queue, models=tuple(folders))


@pytest.fixture
async def stub() -> AsyncIterator[imageencoder_pb2_grpc.ImageEncoderServiceStub]:
    async with Service(encoders()) as s:
        yield s


def pixels(h: int = 4, w: int = 6) -> tensor_pb2.Tensor:
    return from_numpy(np.arange(h * w * 3, dtype=np.uint8).reshape(h, w, 3), tensor_pb2.DATA_TYPE_UINT8)


async def refused(call) -> tuple[grpc.StatusCode, str | None, str | None, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    err = from_rpc_error(e.value)
    return e.value.code(), err.field, err.reason, str(err)


async def test_encode_answers_fp32_rows_and_the_digest_getinfo_names(stub) -> None:  # type: ignore[no-untyped-def]
    info = await stub.GetInfo(imageencoder_pb2.GetInfoRequest(model="m"))
    assert info.encoder == "efficientnet-lite0" and list(info.models) == ["m"] and info.encodes == 0
    assert info.model.identity == "mean:/models/m" and info.model.hidden_size == HIDDEN
    assert info.model.encoder_digest == encoder_digest("mean:/models/m") and info.model.rows_per_image == 0
    answer = await stub.Encode(imageencoder_pb2.EncodeRequest(model="m", pixels=pixels(),
                                                              encoder_digest=info.model.encoder_digest))
    assert answer.rows.dtype == tensor_pb2.DATA_TYPE_FP32 and list(answer.rows.shape) == [2, HIDDEN]
    rows = np.frombuffer(answer.rows.data, np.float32).reshape(2, HIDDEN)
    expected = np.arange(72, dtype=np.float64).reshape(-1, 3).mean(axis=0) / 255.0  # the channel means by hand
    assert np.allclose(rows[0, :3], expected) and answer.encoder_digest == info.model.encoder_digest
    assert (await stub.GetInfo(imageencoder_pb2.GetInfoRequest())).encodes == 1


@pytest.mark.parametrize("mutate,field,reason", [
    (lambda r: r.ClearField("pixels"), "pixels", "MISSING_PIXELS"),
    (lambda r: setattr(r.pixels, "dtype", tensor_pb2.DATA_TYPE_FP32), "pixels.dtype", "UNSUPPORTED_DTYPE"),
    (lambda r: r.pixels.shape.__setitem__(2, 4), "pixels.shape", "BAD_SHAPE"),
    (lambda r: r.pixels.shape.append(1), "pixels.shape", "BAD_SHAPE"),
    (lambda r: r.pixels.shape.__setitem__(0, 0), "pixels.shape", "BAD_SHAPE"),
    (lambda r: r.pixels.shape.__setitem__(0, -4), "pixels.shape", "BAD_SHAPE"),
    (lambda r: r.pixels.shape.__setitem__(1, 20000), "pixels.shape", "BAD_SHAPE"),
    (lambda r: r.pixels.shape.__setitem__(0, 2**40), "pixels.shape", "BAD_SHAPE"),
    (lambda r: r.pixels.CopyFrom(pixels(65, 64)), "pixels.shape", "TOO_MANY_PIXELS"),  # cap: 64 x 64
    (lambda r: setattr(r.pixels, "data", r.pixels.data[:-1]), "pixels.data", "DATA_SIZE_MISMATCH"),
    (lambda r: setattr(r, "model", ""), "model", "BAD_MODEL"),
    (lambda r: setattr(r, "model", "m" * 257), "model", "BAD_MODEL"),
    (lambda r: setattr(r, "model", "m\x00"), "model", "BAD_MODEL"),
    (lambda r: setattr(r, "model", "other"), "model", "UNKNOWN_MODEL"),
    (lambda r: setattr(r, "encoder_digest", "xyz"), "encoder_digest", "BAD_DIGEST"),
])
async def test_every_field_is_checked_and_refused_by_name(stub, mutate, field, reason) -> None:  # type: ignore[no-untyped-def]
    request = imageencoder_pb2.EncodeRequest(model="m", pixels=pixels())
    mutate(request)
    code, got_field, got_reason, message = await refused(stub.Encode(request))
    assert (code, got_field, got_reason) == (grpc.StatusCode.INVALID_ARGUMENT, field, reason), message
    assert (await stub.GetInfo(imageencoder_pb2.GetInfoRequest())).encodes == 0


async def test_a_digest_of_other_weights_is_refused_not_answered(stub) -> None:  # type: ignore[no-untyped-def]
    code, field, reason, _ = await refused(stub.Encode(imageencoder_pb2.EncodeRequest(
        model="m", pixels=pixels(), encoder_digest="0" * 32)))
    assert (code, field, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "encoder_digest", "ENCODER_CHANGED")


async def test_an_encoder_that_cannot_load_is_failed_precondition_naming_why() -> None:
    async with Service(encoders(broken)) as stub:
        for call in (stub.GetInfo(imageencoder_pb2.GetInfoRequest(model="m")),
                     stub.Encode(imageencoder_pb2.EncodeRequest(model="m", pixels=pixels()))):
            code, field, reason, message = await refused(call)
            assert (code, field, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "model", "ENCODER_UNAVAILABLE")
            assert "not installed" in message


async def test_past_the_queue_cap_encode_is_refused_at_once_as_overloaded() -> None:
    gate = threading.Event()
    async with Service(encoders(lambda folder: MeanEncoder(folder, gate), max_queue=2)) as stub:
        request = imageencoder_pb2.EncodeRequest(model="m", pixels=pixels())
        held = [asyncio.ensure_future(stub.Encode(request)) for _ in range(2)]
        for _ in range(200):
            if (await stub.GetInfo(imageencoder_pb2.GetInfoRequest())).queued == 2:
                break
            await asyncio.sleep(0.01)
        code, _, reason, message = await refused(stub.Encode(request))
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED") and "--max-queue 2" in message
        gate.set()
        assert all(list(a.rows.shape) == [2, HIDDEN] for a in await asyncio.gather(*held))
        info = await stub.GetInfo(imageencoder_pb2.GetInfoRequest())
        assert (info.encodes, info.queued, info.max_queue) == (2, 0, 2)
