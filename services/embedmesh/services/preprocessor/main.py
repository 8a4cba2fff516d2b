"""Preprocessor bootstrap: config, tokenizer, worker pool, serve. SERVING once every worker has served."""

from __future__ import annotations

import asyncio
from pathlib import Path

from embedmesh.cache.v1 import cache_pb2_grpc
from embedmesh.core.logs import get_logger, setup_logging
from embedmesh.core.security import configure_from_argv
from embedmesh.core.security import describe as describe_security
from embedmesh.core.server import Access, Server, ServerOptions, run_service
from embedmesh.core.telemetry import setup_tracing
from embedmesh.inference.v1 import inference_pb2_grpc
from embedmesh.router.v1 import router_pb2_grpc
from embedmesh.services.encoder_cache.service import SERVICE_NAME as CACHE_SERVICE
from embedmesh.services.encoder_cache.service import EncoderCacheServicer
from embedmesh.services.encoder_cache.tiered import CacheConfig, TieredCache
from embedmesh.services.preprocessor.admin import MeshAdmin
from embedmesh.services.preprocessor.chat import ChatTemplate
from embedmesh.services.preprocessor.config import PreprocessorConfig
from embedmesh.services.preprocessor.fair_share import FairShare
from embedmesh.services.preprocessor.migration import MigrationLimits
from embedmesh.services.preprocessor.prompts import Tokenizer
from embedmesh.services.preprocessor.service import InferenceDomain, Limits, ServedModels
from embedmesh.services.preprocessor.servicer import InferenceServicer
from embedmesh.services.preprocessor.workers import WorkerPool
from embedmesh.services.router.config import RouterConfig
from embedmesh.services.router.local import LocalRouteClient
from embedmesh.services.router.main import build as build_router
from embedmesh.services.router.main import sweep_forever
from embedmesh.services.router.route_client import RouteClient, Routes
from embedmesh.services.router.servicer import SERVICE_NAME as ROUTER_SERVICE
from embedmesh.services.router.servicer import RouterServicer
from embedmesh.vision.decode import ImageLimits
from embedmesh.vision.remote import EncodeServiceClient
from embedmesh.vision.stage import VisionStage

log = get_logger("embedmesh.preprocessor")

SERVICE_NAME = "embedmesh.inference.v1.InferenceService"


def _tokenizer_folder(config: PreprocessorConfig):  # type: ignore[no-untyped-def]
    """The base tokenizer's folder: ``--tokenizer``; when that is the default model and its package is not installed,
    the first of ``--model-tokenizers`` (a mesh serving only local folders needs no default model)."""
    from embedmesh.models.convert import ModelNotFound, resolve_model_path

    try:
        return resolve_model_path(config.tokenizer)
    except ModelNotFound:
        if config.tokenizer not in ("", "default") or not config.model_tokenizers:
            raise
        return resolve_model_path(config.model_tokenizers[0][1])


async def _follow_health(server: Server, pool: WorkerPool) -> None:
    """Mirror the workers: SERVING once all have served and one serves now; NOT_SERVING when none does."""
    serving = False
    while True:
        await pool.changed.wait()
        pool.changed.clear()
        now = pool.all_started() if not serving else any(w.healthy for w in pool.workers)
        if now != serving:
            serving = now
            await server.set_serving(serving)
            log.info("health", extra={"serving": serving})
            if serving:
                print(f"preprocessor serving on {server.address}", flush=True)


async def serve(config: PreprocessorConfig) -> None:
    folder = _tokenizer_folder(config)
    tokenizer = Tokenizer(folder, config.prompt_cache_bytes)
    template = ChatTemplate(folder)
    pool = WorkerPool(config.workers, config.max_message_bytes, lora_load_on_demand=config.lora_load_on_demand,
                      worker_streams=config.worker_streams,
                      migration=MigrationLimits(config.migration_limit, config.migration_max_positions))
    router: Routes | None = None
    embedded: RouterServicer | None = None
    router_config = RouterConfig.from_args([]) if config.embedded_router else None  # EMBEDMESH_ROUTER_* variables
    if router_config is not None:
        embedded = build_router(router_config)
        router = LocalRouteClient(embedded.router, config.block_size)
    elif config.routers:
        router = RouteClient(config.routers, config.block_size)
    cache = TieredCache(CacheConfig(capacity_bytes=config.cache_capacity_bytes, redis_url=config.redis_url,
                                    default_ttl_seconds=config.upload_ttl_seconds))
    server = Server("preprocessor", ServerOptions(host=config.host, port=config.port,
                                                  max_message_bytes=public_message_cap(config),
                                                  metrics_port=config.metrics_port, public=True,
                                                  grace_seconds=config.drain_seconds))
    # One tokenizer and chat template per served model (the default pair for models not listed).
    texts = {name: (Tokenizer(Path(f), config.prompt_cache_bytes), ChatTemplate(Path(f)))
             for name, f in config.model_tokenizers}
    models = ServedModels(pool, tokenizer, template, texts=texts)
    domain = InferenceDomain(pool, cache, models, Limits(max_n=config.max_n, max_prompts=config.max_prompts,
                                                         max_embeds_bytes=config.max_embeds_bytes,
                                                         max_messages=config.max_messages,
                                                         max_images=config.max_images_per_request), router,
                             FairShare(config.fair_share_slots), vision_stage(config, cache, folder))
    # The public port: API keys (or the mesh token) for inference; cache statistics are for operators only.
    server.add(inference_pb2_grpc.add_InferenceServiceServicer_to_server,
               InferenceServicer(domain, MeshAdmin(pool, config.routers), config.max_inflight), SERVICE_NAME,
               access=Access.PUBLIC, methods={"GetMeshHealth": Access.OPEN, "LoadLoraAdapter": Access.ADMIN,
                                              "UnloadLoraAdapter": Access.ADMIN, "SleepWorkers": Access.ADMIN,
                                              "WakeUpWorkers": Access.ADMIN, "IsSleeping": Access.ADMIN})
    # The encoder cache's API on the same port, over the same in-process cache: an upload is an L1 hit here.
    server.add(cache_pb2_grpc.add_EncoderCacheServiceServicer_to_server,
               EncoderCacheServicer(cache, config.max_embeds_bytes), CACHE_SERVICE,
               access=Access.PUBLIC, methods={"Stats": Access.ADMIN})
    if embedded is not None:
        # Workers stream registrations, loads and KV events here (mesh callers only, as on the router service).
        server.add(router_pb2_grpc.add_RouterServiceServicer_to_server, embedded, ROUTER_SERVICE)
    server.on_drain(cache.close)
    if domain.vision is not None and domain.vision.remote is not None:
        server.on_drain(domain.vision.remote.close)
    if router is not None:
        server.on_drain(router.close)
    server.on_drain(pool.close)
    await server.start()
    server.install_signal_handlers()
    print(f"preprocessor listening on {server.address} (waiting for workers {', '.join(config.workers)})",
          flush=True)
    pool.start()
    follower = asyncio.create_task(_follow_health(server, pool))
    sweeper = asyncio.create_task(sweep_forever(embedded.registry, router_config.sweep_seconds)) \
        if embedded is not None and router_config is not None else None
    await server.wait_for_termination()
    follower.cancel()
    if sweeper is not None:
        sweeper.cancel()


def vision_stage(config: PreprocessorConfig, cache: TieredCache, default_folder: Path) -> VisionStage:
    """The encode stage for image parts: each served model's folder (the one its tokenizer comes from) gives the
    input embeddings the projector writes into; built on the first image, so start-up loads no vision weights."""
    folders = {name: Path(f) for name, f in config.model_tokenizers}
    remote = None
    if config.image_encoder_address and config.image_encoder != "off":
        # Pixels at the cap go out, rows at the prompt_embeds cap come back: nothing larger is read from a replica.
        remote = EncodeServiceClient(config.image_encoder_address, config.image_encoder,
                                     max(config.max_image_pixels * 3, config.max_embeds_bytes) + 1024 * 1024)
    return VisionStage(cache, limits=ImageLimits(max_bytes=config.max_image_bytes, max_pixels=config.max_image_pixels),
                       folder_of=lambda model: folders.get(model, Path(default_folder)), encoder=config.image_encoder,
                       hosts=config.image_url_hosts, fetch_timeout_seconds=config.image_fetch_timeout_seconds,
                       projector=config.image_projector, model_folders=[Path(default_folder), *folders.values()],
                       remote=remote, kinds=dict(config.model_image_encoders),
                       projectors=dict(config.model_image_projectors))


def public_message_cap(config: PreprocessorConfig) -> int:
    """The public port's message cap: one prompt tensor at its cap plus room for the request around it (16 MiB),
    never more than ``max_message_bytes`` — smaller than the internal ports' cap (512 MiB), so a public caller
    cannot make the preprocessor buffer more than one request can legitimately need."""
    return min(config.max_message_bytes, config.max_embeds_bytes + 16 * 1024 * 1024)


def main(argv: list[str] | None = None) -> None:
    config = PreprocessorConfig.from_args(configure_from_argv(argv, prog="embedmesh-preprocessor"))
    setup_logging("preprocessor")
    setup_tracing("preprocessor")
    log.info("config", extra={"config": config.describe(), "security": describe_security()})
    run_service(serve(config))


if __name__ == "__main__":
    main()
