"""The encode stage in the preprocessor: a chat image part -> embedding rows for the served model, cached.

    ImageSource       a URL (``data:``, or ``http(s)`` from an allowed host) or the file's bytes (gRPC)
      -> bytes        ``decode.data_url_bytes`` / ``fetch.fetch_image`` (caps before allocation)
      -> pixels       ``decode.decode_image`` in a thread: allowlisted format, pixel cap from the header (a file
                      whose bytes were decoded before is not decoded again: its BLAKE3 maps to its pixel digest)
      -> encoder      one per model folder, built on first use (torch is imported then, not at start-up):
                      EfficientNet-Lite0 + the class-name projector over that model's own input embeddings, or
                      DINOv2-small + a LLaVA-style projector from a folder (``vision/dinov2.py``); or, with
                      ``--image-encoder-address``, the encode service's (``vision/remote.py``): its GetInfo gives
                      the identity, its Encode the rows on a cache miss
      -> cache        rows kept in the encoder cache (L1, Redis L2 when configured) under
                      ``v1:image:<encoder digest>:<dtype>:<pixel digest>``: computed by the server from the decoded
                      pixels and the encoder's identity, in the key space no client can write; concurrent requests
                      for one image share one encode (``TieredCache.get_or_compute``)
      -> rows         validated with the prompt_embeds rules (``core.embeds``), in the model dtype, read-only
                      (a remote encoder's answer too: its shape and dtype are never trusted)

The rows then travel exactly like a chat ``prompt_embeds`` part. Their routing block hashes are computed over the
rows (``core.block_hash``), and the rows are a function of the pixel digest alone, so a repeated image gives the
same block hashes and routes to the worker holding its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import blake3
import numpy as np

from embedmesh.core.context import ROWS, check_context
from embedmesh.core.embeds import ModelSpec, validate_embeds
from embedmesh.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from embedmesh.core.logs import get_logger
from embedmesh.core.tensors import to_numpy
from embedmesh.services.encoder_cache.keys import validated_key
from embedmesh.services.encoder_cache.tiered import CachedTensor, TieredCache
from embedmesh.tensor.v1 import tensor_pb2
from embedmesh.vision.decode import ImageLimits, data_url_bytes, decode_image
from embedmesh.vision.fetch import fetch_image, is_http_url
from embedmesh.vision.metrics import IMAGE_CACHE_HITS, IMAGE_ENCODE_SECONDS, IMAGE_ENCODES
from embedmesh.vision.pool import EncoderBroken, EncoderPool
from embedmesh.vision.remote import EncodeServiceClient, RemoteEncoder

__all__ = ["ImageSource", "Encoder", "VisionStage", "ENCODERS", "soft_prompt_encoder", "dinov2_encoder",
           "encoder_factory", "encoder_digest", "ROWS_PER_IMAGE"]

log = get_logger("vision")

_SEEN = 4096
"""Image files whose pixel digest is remembered (32 + 64 bytes each)."""

ENCODERS = ("efficientnet-lite0", "dinov2", "off")
"""``--image-encoder`` values: the EfficientNet-Lite0 soft prompt (default), DINOv2-small + the projector folder
``--image-projector`` names (plumbing only unless that projector was trained for it), or no images."""
ROWS_PER_IMAGE = {"dinov2": 257}
"""Rows per image of encoders whose count is fixed (CLS + 16 x 16 patches); the soft prompt's depends on the image."""


@dataclass(frozen=True)
class ImageSource:
    """One image part as it arrived: a URL or the file's bytes."""

    url: str = ""
    data: bytes | None = None


class Encoder(Protocol):
    identity: str
    hidden_size: int
    name: str

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """``(H, W, 3)`` uint8 -> ``(rows, hidden_size)`` float32."""
        ...


class SoftPromptEncoder:
    """EfficientNet-Lite0 + the class-name projector over one language model's input embeddings."""

    name = "efficientnet-lite0"

    def __init__(self, folder: Path, threads: int = 1) -> None:
        from embedmesh.services.preprocessor.prompts import Tokenizer
        from embedmesh.vision.efficientnet import EfficientNetLite0, imagenet_class_names
        from embedmesh.vision.projector import ClassNameProjector

        self.tower = EfficientNetLite0(threads=threads)
        tokenizer = Tokenizer(folder, 0)  # class names are tokenized once: no prompt cache
        self.projector = ClassNameProjector(input_embeddings(folder), lambda t: tokenizer.encode(t, False),
                                            imagenet_class_names())
        self.hidden_size = self.projector.hidden_size
        self.identity = f"{self.tower.identity}+{self.projector.identity}"

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        return self.projector.rows(self.tower.classify(pixels))


def input_embeddings(folder: Path) -> np.ndarray:
    """The language model's ``(vocab, hidden)`` input embedding matrix from its safetensors, as float32."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key.endswith(("embed_tokens.weight", "wte.weight", "word_embeddings.weight")):
                    return np.asarray(st.get_tensor(key).float().numpy())
    raise RuntimeError(f"{folder} holds no input embedding matrix (embed_tokens.weight) in *.safetensors")


def soft_prompt_encoder(folder: Path) -> Encoder:
    return SoftPromptEncoder(folder)


def dinov2_encoder(projector: Path) -> Callable[[Path], Encoder]:
    """The factory of DINOv2-small + the LLaVA-style projector in ``projector`` (``vision/dinov2.py``)."""

    def build(folder: Path) -> Encoder:
        from embedmesh.vision.dinov2 import Dinov2Encoder

        return Dinov2Encoder(folder, projector)

    return build


def encoder_factory(encoder: str, projector: str | Path = "",
                    model_folders: Sequence[Path] = ()) -> Callable[[Path], Encoder]:
    """Model folder -> encoder for ``--image-encoder`` (not ``off``). ``dinov2``: the projector folder is checked
    here against each of ``model_folders``' hidden size (start-up fails on a wrong file, naming it and the rule;
    the weights load on the first image)."""
    if encoder == "dinov2":
        from embedmesh.vision.dinov2 import model_hidden_size, read_projector_shapes

        if not str(projector):
            raise ValueError("--image-encoder dinov2 needs --image-projector: a folder holding "
                             "mm_projector.safetensors (or .bin)")
        for folder in model_folders or [None]:
            read_projector_shapes(Path(projector), None if folder is None else model_hidden_size(Path(folder)))
        return dinov2_encoder(Path(projector))
    if encoder != "efficientnet-lite0":
        raise ValueError(f"image encoder must be one of {list(ENCODERS[:-1])}, got {encoder!r}")
    return soft_prompt_encoder


def encoder_digest(identity: str) -> str:
    """The encoder part of an image's cache key: BLAKE3 of its identity, 32 hex digits (in process or remote, the
    same encoder gives the same digest, so both share Redis L2 entries)."""
    return blake3.blake3(identity.encode()).hexdigest()[:32]


class VisionStage:
    """Image parts -> rows for the model that serves the request (see the module docstring)."""

    def __init__(self, cache: TieredCache, *, limits: ImageLimits, folder_of: Callable[[str], Path | None],
                 encoder: str = "efficientnet-lite0", hosts: Sequence[str] = (), fetch_timeout_seconds: float = 10.0,
                 factory: Callable[[Path], Encoder] | None = None, projector: str | Path = "",
                 model_folders: Sequence[Path] = (), remote: EncodeServiceClient | None = None,
                 kinds: Mapping[str, str] | None = None, projectors: Mapping[str, str | Path] | None = None,
                 factories: Mapping[str, Callable[[Path], Encoder]] | None = None) -> None:
        """``encoder``: the kind of every served model not in ``kinds`` (served model -> kind, its own encoder, e.g.
        ``dinov2`` for one model and the soft prompt for the others, or ``off`` for one that takes no images).
        ``projector``: the folder of ``dinov2``'s projector (``projectors``: per model), checked here against the
        hidden size of each model it serves (start-up fails on a wrong file, naming it and the rule; the weights load
        on the first image). ``remote``: encode the default kind through the encode service instead (no weights in
        this process; models of another kind still encode here). ``factories``: per-model encoder builders (tests)."""
        self.kinds = dict(kinds or {})
        for model, kind in [("", encoder), *self.kinds.items()]:
            if kind not in ENCODERS:
                raise ValueError(f"image encoder{f' of model {model!r}' if model else ''} must be one of "
                                 f"{list(ENCODERS)}, got {kind!r}")
        projectors = dict(projectors or {})
        if factory is None and encoder != "off" and remote is None:
            own = {m for m, k in self.kinds.items() if k != encoder or m in projectors}
            theirs = {folder_of(m) for m in own}  # a model with its own encoder is not checked against this one
            factory = encoder_factory(encoder, projector, [f for f in model_folders if f not in theirs])
        self._factories: dict[str, Callable[[Path], Encoder]] = {"": factory or soft_prompt_encoder}
        """Encoder builders by recipe: "" for the default kind, a model's name for a model with its own."""
        for model, kind in self.kinds.items():
            if model in (factories or {}):
                self._factories[model] = factories[model]  # type: ignore[index]
            elif kind != "off" and (kind != encoder or model in projectors):
                folder = folder_of(model)
                self._factories[model] = encoder_factory(kind, projectors.get(model, projector),
                                                         [folder] if folder is not None else [])
        self.remote = remote
        self._remotes: dict[str, RemoteEncoder] = {}
        """Served model -> the service's encoder for it (described once; dropped when the service fails)."""
        self.cache = cache
        self.limits = limits
        self.folder_of = folder_of
        self.encoder = encoder
        self.hosts = tuple(hosts)
        self.fetch_timeout_seconds = fetch_timeout_seconds
        self._encoders: EncoderPool[tuple[str, Path], Encoder] = EncoderPool(
            lambda key: self._factories[key[0]](key[1]), logger=log)
        """Each (recipe, folder)'s encoder; one that failed to load (missing packages, no embedding matrix) refused
        at once."""
        self._running = asyncio.Lock()  # one encode at a time: the tower uses its own threads
        self._seen: OrderedDict[bytes, str] = OrderedDict()
        """BLAKE3 of an image file's bytes -> its pixel digest, for files decoded before (LRU, ``_SEEN``)."""

    def kind_of(self, model: str) -> str:
        """The image encoder kind that serves ``model`` (``off``: its image parts are refused)."""
        return self.kinds.get(model, self.encoder)

    async def _remote_for(self, model: str, field: str) -> RemoteEncoder:
        assert self.remote is not None
        enc = self._remotes.get(model)
        if enc is None:
            enc = self._remotes[model] = await self.remote.describe(model, field)
        return enc

    async def _encoder_for(self, model: str, spec: ModelSpec, field: str) -> Encoder | RemoteEncoder:
        if self.remote is not None and self.kind_of(model) == self.encoder and model not in self._factories:
            remote = await self._remote_for(model, field)
            if remote.hidden_size != spec.hidden_size:
                raise InvalidArgument(f"{field}: the image encoder gives rows of {remote.hidden_size} values, model "
                                      f"{model!r} takes {spec.hidden_size}", field=field, reason="IMAGES_UNSUPPORTED")
            return remote
        folder = self.folder_of(model) if self.kind_of(model) != "off" else None
        if folder is None:
            raise InvalidArgument(f"{field}: this server has no image encoder for model {model!r}; send text or "
                                  "prompt_embeds parts", field=field, reason="IMAGES_UNSUPPORTED")
        try:
            enc = await self._encoders.get((model if model in self._factories else "", folder))
        except EncoderBroken as e:
            raise FailedPrecondition(f"{field}: the image encoder for model {model!r} is not available on this "
                                     f"server ({e.why}); send text or prompt_embeds parts", field=field,
                                     reason="ENCODER_UNAVAILABLE") from None
        if enc.hidden_size != spec.hidden_size:
            raise InvalidArgument(f"{field}: the image encoder gives rows of {enc.hidden_size} values, model "
                                  f"{model!r} takes {spec.hidden_size}", field=field, reason="IMAGES_UNSUPPORTED")
        return enc

    async def image_bytes(self, source: ImageSource, field: str) -> bytes:
        if source.data is not None:
            return source.data
        url = source.url
        if url[:5].lower() == "data:":
            return data_url_bytes(url, field, self.limits)
        if is_http_url(url):
            return await asyncio.to_thread(fetch_image, url, field, hosts=self.hosts, max_bytes=self.limits.max_bytes,
                                           timeout_seconds=self.fetch_timeout_seconds)
        raise InvalidArgument(f"{field}: must be a data: URL (data:image/png;base64,...) or an http(s) URL",
                              field=field, reason="BAD_URL")

    async def rows(self, source: ImageSource, *, model: str, spec: ModelSpec, field: str,
                   max_tokens: int) -> np.ndarray:
        """Validated ``(rows, hidden)`` in the model dtype for one image part, checked against the context."""
        if self.kind_of(model) == "off":
            setting = f"--model-image-encoders {model}=off" if model in self.kinds else "--image-encoder off"
            raise InvalidArgument(f"{field}: images are not accepted for model {model!r} on this server ({setting})",
                                  field=field, reason="IMAGES_DISABLED")
        data = await self.image_bytes(source, field)
        # Bytes decoded here before map to their pixel digest: a repeated file skips decoding (the digest is the
        # server's own, from a file that passed every rule under these limits).
        file_digest = blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()
        digest = self._seen.get(file_digest)
        image = None
        if digest is None:
            image = await asyncio.to_thread(decode_image, data, field, self.limits)
            digest = image.digest
            self._seen[file_digest] = digest
            if len(self._seen) > _SEEN:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(file_digest)
        enc = await self._encoder_for(model, spec, field)
        key = validated_key(f"image:{encoder_digest(enc.identity)}:{spec.dtype}", digest)
        computed = False

        async def encode() -> CachedTensor:
            nonlocal computed, image
            computed = True
            if image is None:  # the file was seen, its rows since evicted
                image = await asyncio.to_thread(decode_image, data, field, self.limits)
            started = time.perf_counter()
            if isinstance(enc, RemoteEncoder):
                rows = await self._remote_rows(enc, model, image.pixels, spec, field)
            else:
                async with self._running:
                    started = time.perf_counter()
                    out = await asyncio.to_thread(enc.encode, image.pixels)
                rows = validate_embeds(out, tensor_pb2.DATA_TYPE_FP32, spec, field=field, max_tokens=0)
            IMAGE_ENCODE_SECONDS.labels(enc.name).observe(time.perf_counter() - started)
            IMAGE_ENCODES.labels(enc.name).inc()
            rows.setflags(write=False)
            return CachedTensor(rows, spec.dtype)

        rows = (await self.cache.get_or_compute(key, encode)).array
        if not computed:
            IMAGE_CACHE_HITS.labels(enc.name).inc()
        check_context(int(rows.shape[0]), max_tokens, spec.max_context_tokens, field=field, wording=ROWS)
        return rows

    async def _remote_rows(self, enc: RemoteEncoder, model: str, pixels: np.ndarray, spec: ModelSpec,
                           field: str) -> np.ndarray:
        """The service's rows for ``pixels``, held to every prompt_embeds rule (dtype, rank, width, rows, finite,
        the context) as a client's would be; a service that breaks one is refused as unavailable, not trusted."""
        try:
            answer = await enc.encode_remote(pixels, field)
        except Unavailable as e:
            # Described again next time when a replica runs other weights now; while replicas are merely down the
            # description stays, so images already cached are still served.
            if e.reason == "ENCODER_CHANGED":
                self._remotes.pop(model, None)
            raise
        try:
            arr, dtype = to_numpy(answer, field=field, data=memoryview(answer.data))
            return validate_embeds(arr, dtype, spec, field=field, max_tokens=0)
        except InvalidArgument as e:
            raise Unavailable(f"{field}: the image encoder {enc.name} (service at {', '.join(enc.client.addresses)}) "
                              f"answered rows this server refuses: {e}", field=field, reason="ENCODER_BAD_ROWS",
                              retry_after_seconds=1.0) from None
