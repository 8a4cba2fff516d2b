"""Image encode service bootstrap: ``python -m embedmesh.services.image_encoder.main --port N
[--encoder efficientnet-lite0|dinov2] [--image-projector DIR] [--tokenizer DIR] [--model-tokenizers name=DIR,...]``.

SERVING at once: the encoder of a model folder is built on its first GetInfo or Encode (seconds), as the
preprocessor's in-process stage builds it; the port is internal (mesh certificate or mesh token, as worker RPCs).
"""

from __future__ import annotations

from pathlib import Path

from embedmesh.core.logs import get_logger, setup_logging
from embedmesh.core.security import configure_from_argv
from embedmesh.core.server import Server, ServerOptions, run_service
from embedmesh.core.telemetry import setup_tracing
from embedmesh.imageencoder.v1 import imageencoder_pb2_grpc
from embedmesh.services.image_encoder.config import ImageEncoderConfig
from embedmesh.services.image_encoder.servicer import SERVICE_NAME, ImageEncoders, ImageEncoderServicer
from embedmesh.vision.stage import encoder_factory

__all__ = ["build", "start", "serve", "main"]

log = get_logger("embedmesh.image_encoder")


def build(config: ImageEncoderConfig) -> ImageEncoders:
    """The encoders (none loaded yet): the model folders resolved and, for dinov2, the projector checked against
    each one's hidden size (start-up fails naming the file and the rule)."""
    from embedmesh.models.convert import resolve_model_path

    folders = {name: Path(f) for name, f in config.model_tokenizers}
    default = Path(resolve_model_path(config.tokenizer)) if config.tokenizer else None
    factory = encoder_factory(config.encoder, config.image_projector,
                              [*([default] if default else []), *folders.values()])
    return ImageEncoders(config.encoder, factory, lambda model: folders.get(model, default),
                         max_pixels=config.max_image_pixels, max_queue=config.max_queue, models=tuple(folders))


async def start(config: ImageEncoderConfig) -> Server:
    """Build, bind and start serving (used by ``serve`` and by in-process tests)."""
    encoders = build(config)
    server = Server("image-encoder", ServerOptions(host=config.host, port=config.port,
                                                   max_message_bytes=config.max_message_bytes,
                                                   metrics_port=config.metrics_port))
    # Default access: mesh callers (certificate / mesh token) and admin keys, as every internal port.
    server.add(imageencoder_pb2_grpc.add_ImageEncoderServiceServicer_to_server, ImageEncoderServicer(encoders),
               SERVICE_NAME)
    await server.start()
    await server.set_serving(True)
    return server


async def serve(config: ImageEncoderConfig) -> None:
    server = await start(config)
    server.install_signal_handlers()
    print(f"image-encoder listening on {server.address} ({config.encoder})", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    config = ImageEncoderConfig.from_args(configure_from_argv(argv, prog="embedmesh-image-encoder"))
    setup_logging("image-encoder")
    setup_tracing("image-encoder")
    log.info("config", extra={"config": config.describe()})
    run_service(serve(config))


if __name__ == "__main__":
    main()
