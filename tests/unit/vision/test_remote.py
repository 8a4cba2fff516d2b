"""The encode stage's remote mode against real gRPC servers: the cache key and the rules stay in the preprocessor,
rows are encoded on a cache miss only, a replica that is down is skipped for the next, none answering is
UNAVAILABLE naming the encoder, and rows that break a prompt_embeds rule (a lying encoder) are refused."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from embedmesh.core.embeds import ModelSpec
from embedmesh.core.errors import FailedPrecondition, ResourceExhausted, Unavailable
from embedmesh.core.server import Server, ServerOptions
from embedmesh.core.tensors import from_numpy
from embedmesh.imageencoder.v1 import imageencoder_pb2, imageencoder_pb2_grpc
from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache
from embedmesh.services.image_encoder.servicer import SERVICE_NAME, ImageEncoders, ImageEncoderServicer
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.vision import remote
from embedmesh.vision.decode import ImageLimits
from embedmesh.vision.remote import EncodeServiceClient
from embedmesh.vision.stage import ImageSource, VisionStage, encoder_digest

FIELD = "messages[0].content[1].image_url"
HIDDEN = 8
SPEC = ModelSpec(hidden_size=HIDDEN, max_context_tokens=64, dtype=tensor_pb2.DATA_TYPE_FP32)
IDENTITY = "fake-tower+fake-projector"


def good_rows(pixels: np.ndarray) -> tensor_pb2.Tensor:
    mean = pixels.reshape(-1, 3).mean(axis=0).astype(np.float32) / 255.0
    return from_numpy(np.tile(np.concatenate([mean, mean, mean[:2]]), (3, 1)).astype(np.float32))


class FakeEncoderService(imageencoder_pb2_grpc.ImageEncoderServiceServicer):
    """An encode service whose answer is ``answer(pixels)``: the honest one or a liar."""

    def __init__(self, answer: Callable[[np.ndarray], tensor_pb2.Tensor] = good_rows, encoder: str = "counting",
                 hidden: int = HIDDEN) -> None:
        self.answer = answer
        self.encoder = encoder
        self.hidden = hidden
        self.encodes = 0
        self.digests: list[str] = []
        self.identity = IDENTITY

    async def Encode(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.digests.append(request.encoder_digest)
        if request.encoder_digest != encoder_digest(self.identity):  # as the real service refuses it
            raise FailedPrecondition("other weights", field="encoder_digest", reason="ENCODER_CHANGED")
        self.encodes += 1
        px = np.frombuffer(request.pixels.data, np.uint8).reshape(tuple(request.pixels.shape))
        return imageencoder_pb2.EncodeResponse(rows=self.answer(px), encoder_digest=encoder_digest(self.identity))

    async def GetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        return imageencoder_pb2.GetInfoResponse(encoder=self.encoder, model=imageencoder_pb2.ModelEncoder(
            model=request.model, identity=self.identity, encoder_digest=encoder_digest(self.identity),
            hidden_size=self.hidden))


async def serve(servicer: FakeEncoderService) -> Server:
    server = Server("image-encoder", ServerOptions(port=0, grace_seconds=0.2))
    server.add(imageencoder_pb2_grpc.add_ImageEncoderServiceServicer_to_server, servicer, SERVICE_NAME)
    await server.start()
    return server


def png(seed: int) -> ImageSource:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(buf, "PNG")
    return ImageSource(url="data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())


def stage(*addresses: str, cache: TieredCache | None = None) -> VisionStage:
    def no_local_encoder(folder: Any) -> Any:
        raise AssertionError("remote mode must not build an encoder in this process")

    return VisionStage(cache or TieredCache(CacheConfig(capacity_bytes=1 << 20)), limits=ImageLimits(),
                       folder_of=lambda model: None, encoder="efficientnet-lite0", factory=no_local_encoder,
                       remote=EncodeServiceClient(addresses, "counting", 1 << 22))


async def rows(s: VisionStage, source: ImageSource) -> np.ndarray:
    return await s.rows(source, model="m", spec=SPEC, field=FIELD, max_tokens=4)


def free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"  # closed: nothing listens there, a connection is refused


async def test_a_miss_is_encoded_remotely_once_and_keyed_by_the_services_identity() -> None:
    fake = FakeEncoderService()
    server = await serve(fake)
    cache = TieredCache(CacheConfig(capacity_bytes=1 << 20))
    s = stage(server.address, cache=cache)
    try:
        first = await rows(s, png(1))
        again = await rows(s, png(1))
        assert fake.encodes == 1 and first is again and not first.flags.writeable
        assert fake.digests == [encoder_digest(IDENTITY)]  # the digest its key holds, for the service to check
        assert first.shape == (3, HIDDEN) and first.dtype == np.float32
        assert any(encoder_digest(IDENTITY) in k for k in cache.l1.keys())  # type: ignore[attr-defined]
    finally:
        await s.remote.close()  # type: ignore[union-attr]
        await server.drain()


async def test_a_replica_that_is_down_is_skipped_and_none_answering_is_unavailable_naming_the_encoder() -> None:
    fake = FakeEncoderService()
    server = await serve(fake)
    dead = free_address()
    s = stage(dead, server.address)
    try:
        for seed in range(3):  # round robin starts on the dead address every other time: each image still encodes
            await rows(s, png(seed))
        assert fake.encodes == 3
        await server.drain()
        with pytest.raises(Unavailable) as e:
            await rows(s, png(7))
        assert e.value.reason == "ENCODER_UNAVAILABLE" and e.value.field == FIELD
        assert "image encoder counting" in str(e.value) and dead in str(e.value) and server.address in str(e.value)
        assert (await rows(s, png(1))).shape == (3, HIDDEN)  # encoded before: served with every replica down
    finally:
        await s.remote.close()  # type: ignore[union-attr]


def _bad(rows: np.ndarray, dtype: int | None = None) -> Callable[[np.ndarray], tensor_pb2.Tensor]:
    return lambda px: from_numpy(rows, dtype)


@pytest.mark.parametrize("answer,rule", [
    (_bad(np.ones((3, HIDDEN + 1), np.float32)), "hidden size 9"),
    (_bad(np.ones((3, HIDDEN), np.int32)), "dtype int32"),
    (_bad(np.ones((2, 3, HIDDEN), np.float32)), "(1, num_tokens, hidden_size)"),
    (_bad(np.ones((0, HIDDEN), np.float32)), "zero rows"),
    (_bad(np.full((3, HIDDEN), np.nan, np.float32)), "NaN"),
    (_bad(np.ones((80, HIDDEN), np.float32)), "context"),
    (lambda px: tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FP32, shape=[3, HIDDEN], data=b"\0" * 8),
     "bytes but shape"),
])
async def test_rows_a_lying_encoder_answers_are_refused_as_unavailable_and_never_cached(answer, rule) -> None:  # type: ignore[no-untyped-def]
    fake = FakeEncoderService(answer)
    server = await serve(fake)
    s = stage(server.address)
    try:
        for _ in range(2):
            with pytest.raises(Unavailable) as e:
                await rows(s, png(3))
            assert e.value.reason == "ENCODER_BAD_ROWS" and e.value.field == FIELD
            assert rule in str(e.value), str(e.value)
        assert fake.encodes == 2  # nothing was kept: the second request asked again
    finally:
        await s.remote.close()  # type: ignore[union-attr]
        await server.drain()


async def test_a_service_running_another_encoder_or_width_is_refused() -> None:
    for fake, error, reason in ((FakeEncoderService(encoder="dinov2"), FailedPrecondition, "ENCODER_UNAVAILABLE"),
                                (FakeEncoderService(hidden=HIDDEN * 2), Exception, "IMAGES_UNSUPPORTED")):
        server = await serve(fake)
        s = stage(server.address)
        try:
            with pytest.raises(error) as e:
                await rows(s, png(4))
            assert getattr(e.value, "reason", None) == reason and fake.encodes == 0
        finally:
            await s.remote.close()  # type: ignore[union-attr]
            await server.drain()


async def test_a_replica_restarted_with_other_weights_is_described_again_and_never_mixes_keys() -> None:
    fake = FakeEncoderService()
    server = await serve(fake)
    cache = TieredCache(CacheConfig(capacity_bytes=1 << 20))
    s = stage(server.address, cache=cache)
    try:
        await rows(s, png(1))
        fake.identity = "other-tower+fake-projector"  # the service now runs other weights
        with pytest.raises(Unavailable) as e:
            await rows(s, png(2))  # asked with the old digest: refused, not answered under the old key
        assert e.value.reason == "ENCODER_CHANGED"
        await rows(s, png(2))  # described again: encoded under the new identity
        assert fake.encodes == 2 and fake.digests[-1] == encoder_digest(fake.identity)
        keys = list(cache.l1.keys())  # type: ignore[attr-defined]
        assert sum(encoder_digest(IDENTITY) in k for k in keys) == 1
        assert sum(encoder_digest(fake.identity) in k for k in keys) == 1
    finally:
        await s.remote.close()  # type: ignore[union-attr]
        await server.drain()


class OverloadedService(FakeEncoderService):
    async def Encode(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.encodes += 1
        raise ResourceExhausted("queue full", reason="OVERLOADED", retry_after_seconds=1.0)


async def test_an_overloaded_replica_is_skipped_for_the_next_and_all_overloaded_is_unavailable() -> None:
    busy, fine = OverloadedService(), FakeEncoderService()
    servers = [await serve(busy), await serve(fine)]
    s = stage(*(x.address for x in servers))
    try:
        for seed in range(2):  # whichever replica round robin starts on, the image is encoded by the free one
            assert (await rows(s, png(seed))).shape == (3, HIDDEN)
        assert fine.encodes == 2 and busy.encodes >= 1
        await servers[1].drain()
        with pytest.raises(Unavailable) as e:
            await rows(s, png(9))
        assert e.value.reason == "ENCODER_UNAVAILABLE" and "RESOURCE_EXHAUSTED" in str(e.value)
    finally:
        await s.remote.close()  # type: ignore[union-attr]
        await servers[0].drain()


class HungPort:
    """A plain asyncio server: accepts every connection and never answers a byte (a replica hung before gRPC)."""

    async def __aenter__(self) -> HungPort:
        self.accepted: list[asyncio.StreamWriter] = []

        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted.append(writer)

        self.server = await asyncio.start_server(hold, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for w in self.accepted:
            w.close()


class MeanEncoder:
    """Rows from the pixels' channel means (the real service's encoder without the tower)."""

    name = "counting"
    hidden_size = HIDDEN

    def __init__(self, folder: Path) -> None:
        self.identity = f"mean:{folder}"

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        mean = pixels.reshape(-1, 3).mean(axis=0) / 255.0
        return np.tile(np.concatenate([mean, mean, mean[:2]]), (2, 1)).astype(np.float32)


async def real_service() -> tuple[ImageEncoders, Server]:
    """The real ImageEncoderService on a free port, encoding with ``MeanEncoder`` (its encodes counted)."""
    encoders = ImageEncoders("counting", MeanEncoder, {"m": Path("/models/m")}.get, max_pixels=64 * 64, max_queue=4,
                             models=("m",))
    server = Server("image-encoder", ServerOptions(port=0, grace_seconds=0.2))
    server.add(imageencoder_pb2_grpc.add_ImageEncoderServiceServicer_to_server, ImageEncoderServicer(encoders),
               SERVICE_NAME)
    await server.start()
    return encoders, server


async def test_a_replica_that_accepts_but_never_answers_is_skipped_for_a_working_one() -> None:
    """The hung port comes first in the round robin for GetInfo, then for the second image's Encode: each call goes
    on to the working replica (the real ImageEncoderService) once the hung one did not connect in the bound, not
    after gRPC's own ~20 s connect timeout."""
    encoders, server = await real_service()
    async with HungPort() as hung:
        s = stage(hung.address, server.address)
        try:
            started = time.monotonic()
            first = await rows(s, png(1))
            second = await rows(s, png(2))
            elapsed = time.monotonic() - started
        finally:
            await s.remote.close()  # type: ignore[union-attr]
            await server.drain()
    assert hung.accepted, "the hung replica was never tried"
    assert encoders.encodes == 2 and first.shape == second.shape == (2, HIDDEN)
    assert not np.array_equal(first, second)
    assert elapsed < 15, f"{elapsed:.1f} s: a hung replica held a call for gRPC's connect timeout (~20 s)"


async def test_only_hung_replicas_is_unavailable_naming_them_and_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "CONNECT_TIMEOUT_SECONDS", 0.3)
    async with HungPort() as a, HungPort() as b:
        s = stage(a.address, b.address)
        try:
            with pytest.raises(Unavailable) as e:
                await rows(s, png(3))
        finally:
            await s.remote.close()  # type: ignore[union-attr]
        assert a.accepted and b.accepted
    assert e.value.reason == "ENCODER_UNAVAILABLE" and e.value.field == FIELD
    assert a.address in str(e.value) and f"{b.address}: not connected within 0.3 s" in str(e.value)


@pytest.mark.parametrize(("slow_seconds", "waits"), [(30.0, 1), (0.0, 2)])
async def test_a_replica_slow_to_connect_goes_last_for_a_while(monkeypatch: pytest.MonkeyPatch, slow_seconds: float,
                                                               waits: int) -> None:
    """GetInfo and three Encodes over [hung, working]: the round robin starts on the hung replica twice. Moved last
    after its first timeout, it costs the bound once; with no cool-down (the old order) every turn of it costs it."""
    monkeypatch.setattr(remote, "CONNECT_TIMEOUT_SECONDS", 0.3)
    monkeypatch.setattr(remote, "SLOW_REPLICA_SECONDS", slow_seconds)
    timed_out: list[int] = []
    real = remote.EncodeServiceClient._connected

    async def counting(self: remote.EncodeServiceClient, i: int) -> bool:
        ok = await real(self, i)
        if not ok:
            timed_out.append(i)
        return ok

    monkeypatch.setattr(remote.EncodeServiceClient, "_connected", counting)
    encoders, server = await real_service()
    async with HungPort() as hung:
        s = stage(hung.address, server.address)
        try:
            for seed in (21, 22, 23):
                assert (await rows(s, png(seed))).shape == (2, HIDDEN)
        finally:
            await s.remote.close()  # type: ignore[union-attr]
            await server.drain()
    assert encoders.encodes == 3
    assert timed_out == [0] * waits
