"""Image encode service configuration: one typed dataclass; CLI flags and ``EMBEDMESH_IMAGE_ENCODER_*`` env vars are
read here only (``embedmesh.core.config``; ``--help`` lists them)."""

from __future__ import annotations

from dataclasses import dataclass

from embedmesh.core.config import Settings, option

__all__ = ["ImageEncoderConfig", "ENCODERS"]

MiB = 1024 * 1024
ENCODERS = ("efficientnet-lite0", "dinov2")
MAX_SIDE = 16384
"""The longest side Encode accepts (the preprocessor's decoding cap, ``vision.decode.ImageLimits.max_side``)."""


@dataclass(frozen=True)
class ImageEncoderConfig(Settings, service="image_encoder", prog="embedmesh-image-encoder",
                         description="Run the embedmesh image encode service (decoded pixels -> embedding rows)."):
    """Where it listens, which encoder it runs for which model folders, and its limits."""

    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 50111
    """gRPC port (0 = any free port). Internal: mesh callers only (mesh certificate or mesh token)."""
    metrics_port: int = 0
    """Prometheus /metrics port (0 = none)."""
    encoder: str = option("efficientnet-lite0", choices=ENCODERS)
    """The encoder it runs (the preprocessor's ``--image-encoder`` must name the same): ``efficientnet-lite0`` (the
    class-name soft prompt) or ``dinov2`` (DINOv2-small + the projector in ``--image-projector``)."""
    image_projector: str = ""
    """For ``dinov2``: a folder holding ``mm_projector.safetensors`` (or ``.bin``); checked at start-up against each
    model folder's hidden size."""
    tokenizer: str = "default"
    """Model folder for served models not in ``--model-tokenizers`` ("default" = the bundled SmolLM2; empty = such
    models are refused), as the preprocessor's ``--tokenizer``: the projector writes into its embedding matrix."""
    model_tokenizers: tuple[tuple[str, str], ...] = option((), metavar="name=folder")
    """(served model name, folder) for the other models, as the preprocessor's ``--model-tokenizers``."""
    max_image_pixels: int = 4096 * 4096
    """Largest height x width of the pixels one Encode carries (at least the preprocessor's --max-image-pixels)."""
    max_queue: int = 16
    """Encodes waiting or running at once (one runs at a time, one torch thread); past it Encode is refused at once with
    RESOURCE_EXHAUSTED ``OVERLOADED`` (the preprocessor tries another replica)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {list(ENCODERS)}, got {self.encoder!r}")
        if self.encoder == "dinov2" and not self.image_projector:
            raise ValueError("encoder dinov2 needs image_projector: a folder holding mm_projector.safetensors")
        if not 1 <= self.max_image_pixels <= MAX_SIDE * MAX_SIDE:
            raise ValueError(f"max_image_pixels must be in [1, {MAX_SIDE * MAX_SIDE}]")
        if not 1 <= self.max_queue <= 4096:
            raise ValueError("max_queue must be in [1, 4096]")
        if not self.tokenizer and not self.model_tokenizers:
            raise ValueError("give --tokenizer or --model-tokenizers: the model folders the rows are for")

    @property
    def max_message_bytes(self) -> int:
        """One Encode's pixels at the cap, with room for the rest of the message."""
        return self.max_image_pixels * 3 + MiB
