"""The encode stage: image parts -> rows, cached under a key the server computes from the pixels and the encoder."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from prometheus_client import REGISTRY

from embedmesh.core.embeds import ModelSpec
from embedmesh.core.errors import InvalidArgument
from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.vision.decode import ImageLimits
from embedmesh.vision.stage import ImageSource, VisionStage

FIELD = "messages[0].content[1].image_url"
HIDDEN = 8
SPEC = ModelSpec(hidden_size=HIDDEN, max_context_tokens=64, dtype=tensor_pb2.DATA_TYPE_FP32)


class CountingEncoder:
    """Rows from the pixels' channel means: a stand-in for the tower whose calls are counted."""

    name = "counting"
    hidden_size = HIDDEN

    def __init__(self, folder: Path) -> None:
        self.identity = f"counting:{folder}"
        self.calls = 0

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        self.calls += 1
        mean = pixels.reshape(-1, 3).mean(axis=0) / 255.0
        return np.tile(np.concatenate([mean, mean, mean[:2]]), (3, 1)).astype(np.float32)


def png(seed: int, compress_level: int = 6) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(buf, "PNG",
                                                                            compress_level=compress_level)
    return buf.getvalue()


def url(data: bytes) -> ImageSource:
    return ImageSource(url="data:image/png;base64," + base64.b64encode(data).decode())


class Harness:
    def __init__(self, **kw: object) -> None:
        self.encoders: list[CountingEncoder] = []

        def factory(folder: Path) -> CountingEncoder:
            enc = CountingEncoder(folder)
            self.encoders.append(enc)
            return enc

        folder_of = kw.pop("folder_of", lambda model: Path("/models/m"))
        self.stage = VisionStage(TieredCache(CacheConfig(capacity_bytes=1 << 20)), limits=ImageLimits(),
                                 folder_of=folder_of, factory=factory, **kw)  # type: ignore[arg-type]

    async def rows(self, source: ImageSource, spec: ModelSpec = SPEC) -> np.ndarray:
        return await self.stage.rows(source, model="m", spec=spec, field=FIELD, max_tokens=4)

    @property
    def calls(self) -> int:
        return sum(e.calls for e in self.encoders)


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name, {"encoder": "counting"}) or 0.0


async def test_a_repeated_image_is_encoded_once_and_counted() -> None:
    h = Harness()
    encodes, hits = metric("embedmesh_image_encodes_total"), metric("embedmesh_image_cache_hits_total")
    first = await h.rows(url(png(1)))
    again = await h.rows(url(png(1)))
    same_pixels_other_file = await h.rows(ImageSource(data=png(1, compress_level=0)))
    assert png(1) != png(1, compress_level=0)
    assert h.calls == 1
    assert np.array_equal(first, again) and np.array_equal(first, same_pixels_other_file)
    assert first.shape == (3, HIDDEN) and first.dtype == np.float32 and not first.flags.writeable
    other = await h.rows(url(png(2)))
    assert h.calls == 2 and not np.array_equal(other, first)
    assert metric("embedmesh_image_encodes_total") - encodes == 2
    assert metric("embedmesh_image_cache_hits_total") - hits == 2


async def test_concurrent_requests_for_one_image_share_one_encode() -> None:
    h = Harness()
    results = await asyncio.gather(*(h.rows(url(png(3))) for _ in range(5)))
    assert h.calls == 1
    assert all(np.array_equal(r, results[0]) for r in results)


async def test_key_includes_the_encoder_identity() -> None:
    """Two model folders (two encoders over different embedding matrices) never share cached rows."""
    h = Harness(folder_of=lambda model: Path(f"/models/{model}"))
    await h.stage.rows(url(png(4)), model="a", spec=SPEC, field=FIELD, max_tokens=4)
    await h.stage.rows(url(png(4)), model="b", spec=SPEC, field=FIELD, max_tokens=4)
    assert [e.calls for e in h.encoders] == [1, 1]


async def refused(h: Harness, source: ImageSource, spec: ModelSpec = SPEC) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        await h.rows(source, spec)
    assert e.value.field == FIELD and e.value.message.startswith(FIELD)
    return e.value


async def test_http_urls_are_refused_without_configured_hosts() -> None:
    e = await refused(Harness(), ImageSource(url="https://example.com/cat.png"))
    assert e.reason == "URL_NOT_ALLOWED" and "data: URL" in e.message


async def test_other_schemes_are_refused() -> None:
    for u in ("file:///etc/passwd", "ftp://x/y.png", ""):
        assert (await refused(Harness(), ImageSource(url=u))).reason == "BAD_URL"


async def test_off_refuses_every_image() -> None:
    assert (await refused(Harness(encoder="off"), url(png(1)))).reason == "IMAGES_DISABLED"


async def test_a_model_without_an_encoder_or_of_another_width_is_refused() -> None:
    assert (await refused(Harness(folder_of=lambda m: None), url(png(1)))).reason == "IMAGES_UNSUPPORTED"
    wide = ModelSpec(hidden_size=HIDDEN * 2, max_context_tokens=64, dtype=tensor_pb2.DATA_TYPE_FP32)
    assert (await refused(Harness(), url(png(1)), wide)).reason == "IMAGES_UNSUPPORTED"


async def test_rows_count_against_the_context() -> None:
    tiny = ModelSpec(hidden_size=HIDDEN, max_context_tokens=5, dtype=tensor_pb2.DATA_TYPE_FP32)
    assert (await refused(Harness(), url(png(1)), tiny)).reason == "CONTEXT_OVERFLOW"


async def test_decoding_refusals_come_before_the_encoder_loads() -> None:
    h = Harness()
    e = await refused(h, ImageSource(url="data:image/png;base64,%%%"))
    assert e.reason == "BAD_BASE64" and h.encoders == []


async def test_a_repeated_file_is_not_decoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import embedmesh.vision.stage as stage

    decodes = []
    real = stage.decode_image

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        decodes.append(1)
        return real(*a, **k)

    monkeypatch.setattr(stage, "decode_image", counting)
    h = Harness()
    first = await h.rows(url(png(5)))
    again = await h.rows(url(png(5)))
    assert len(decodes) == 1 and h.calls == 1 and np.array_equal(first, again)
    h.stage.cache = TieredCache(CacheConfig(capacity_bytes=1 << 20))  # the rows evicted: decoded and encoded again
    evicted = await h.rows(url(png(5)))
    assert len(decodes) == 2 and h.calls == 2 and np.array_equal(first, evicted)


async def test_an_encoder_that_cannot_load_is_a_clear_refusal_tried_once() -> None:
    from embedmesh.core.errors import FailedPrecondition

    tries = []

    def broken(folder: Path) -> CountingEncoder:
        tries.append(folder)
        raise RuntimeError("efficientnet-lite is not installed")

    stage = VisionStage(TieredCache(CacheConfig(capacity_bytes=1 << 20)), limits=ImageLimits(),
                        folder_of=lambda model: Path("/models/m"), factory=broken)
    for _ in range(2):
        with pytest.raises(FailedPrecondition) as e:
            await stage.rows(url(png(6)), model="m", spec=SPEC, field=FIELD, max_tokens=4)
        assert e.value.field == FIELD and "not installed" in e.value.message
        assert e.value.reason == "ENCODER_UNAVAILABLE"
    assert len(tries) == 1


async def test_a_repeated_image_gives_the_same_routing_block_hashes() -> None:
    """Block hashes follow the rows, and the rows follow the pixel digest: a repeat (even another file with the same
    pixels) routes like the first; another image does not."""
    from embedmesh.core.block_hash import block_hashes

    h = Harness()
    ids = (1, 2, 3, 4)

    async def hashes(source: ImageSource) -> list[int]:
        return block_hashes([ids, await h.rows(source), ids], 2)

    first = await hashes(url(png(7)))
    assert len(first) == 5
    assert await hashes(ImageSource(data=png(7, compress_level=0))) == first
    other = await hashes(url(png(8)))
    assert other[:2] == first[:2] and other[2:] != first[2:]


async def test_a_second_replica_finds_the_rows_in_redis_and_does_not_encode() -> None:
    """With Redis as the shared L2, an image one preprocessor replica encoded costs another one a lookup."""
    from tests.support.redis_server import RedisServer

    server = RedisServer().start()
    caches = [TieredCache(CacheConfig(capacity_bytes=1 << 20, redis_url=server.url)) for _ in range(2)]
    try:
        replicas = [Harness() for _ in caches]
        for h, cache in zip(replicas, caches, strict=True):
            h.stage.cache = cache
        first = await replicas[0].rows(url(png(9)))
        second = await replicas[1].rows(url(png(9)))
        assert [h.calls for h in replicas] == [1, 0]
        assert np.array_equal(first, second)
        assert caches[1].l2 is not None and caches[1].l2.counters.hits == 1
    finally:
        for cache in caches:
            await cache.close()
        server.close()


async def test_each_served_model_has_its_own_encoder_kind() -> None:
    """``kinds``: one model with its own encoder, one without images; the others keep the default's."""
    other: list[CountingEncoder] = []

    class WideEncoder(CountingEncoder):
        name = "wide"

        def encode(self, pixels: np.ndarray) -> np.ndarray:
            self.calls += 1
            return np.full((2, HIDDEN), 0.5, np.float32)

    def own(folder: Path) -> CountingEncoder:
        enc = WideEncoder(Path(f"{folder}-own"))
        other.append(enc)
        return enc

    h = Harness(kinds={"text-only": "off", "vision": "efficientnet-lite0"}, factories={"vision": own})
    image = url(png(11))
    default = await h.stage.rows(image, model="m", spec=SPEC, field=FIELD, max_tokens=4)
    mine = await h.stage.rows(image, model="vision", spec=SPEC, field=FIELD, max_tokens=4)
    assert default.shape == (3, HIDDEN) and h.calls == 1  # the default's encoder
    assert mine.shape == (2, HIDDEN) and np.all(mine == 0.5) and [e.calls for e in other] == [1]
    assert h.stage.kind_of("m") == "efficientnet-lite0" and h.stage.kind_of("text-only") == "off"
    with pytest.raises(InvalidArgument) as e:
        await h.stage.rows(image, model="text-only", spec=SPEC, field=FIELD, max_tokens=4)
    assert e.value.reason == "IMAGES_DISABLED" and e.value.field == FIELD
    assert "--model-image-encoders text-only=off" in e.value.message
    # The default "off" with one model taking images: only that model's parts are accepted.
    h = Harness(encoder="off", kinds={"vision": "efficientnet-lite0"}, factories={"vision": own})
    assert (await h.stage.rows(image, model="vision", spec=SPEC, field=FIELD, max_tokens=4)).shape == (2, HIDDEN)
    with pytest.raises(InvalidArgument, match="--image-encoder off"):
        await h.stage.rows(image, model="m", spec=SPEC, field=FIELD, max_tokens=4)


def test_an_unknown_kind_for_a_model_fails_at_start_up_naming_it() -> None:
    with pytest.raises(ValueError, match="image encoder of model 'x' must be one of"):
        Harness(kinds={"x": "clip"})
