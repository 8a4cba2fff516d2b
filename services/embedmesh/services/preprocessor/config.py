"""Preprocessor configuration: one typed dataclass; CLI flags and ``EMBEDMESH_*`` env vars are read here only.

Each field is a flag ``--field-name`` and a variable ``EMBEDMESH_PREPROCESSOR_<FIELD>`` (``embedmesh.core.config``;
``--help`` lists them); the older names (``EMBEDMESH_WORKERS``, ``EMBEDMESH_ROUTERS``, ``EMBEDMESH_BLOCK_SIZE``,
``REDIS_URL``, ``--upload-ttl``, ...) keep working as aliases, after the preprocessor's own variable.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedmesh.core.config import Settings, option

__all__ = ["PreprocessorConfig"]

MiB = 1024 * 1024

WORKER_STREAMS = ("all", "routed", "off")


@dataclass(frozen=True)
class PreprocessorConfig(Settings, service="preprocessor", prog="embedmesh-preprocessor",
                         description="Run the embedmesh preprocessor."):
    """The public gRPC entry: where it listens, its workers and routers, its limits and caches."""

    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 50051
    """gRPC port of the public inference API (0 = any free port)."""
    workers: tuple[str, ...] = option(("127.0.0.1:50061",), aliases=("EMBEDMESH_WORKERS",), metavar="host:port")
    """Worker addresses (host:port), comma-separated."""
    tokenizer: str = option("default", aliases=("EMBEDMESH_TOKENIZER",))
    """Model folder whose tokenizer.json is used for text prompts ("default" = the bundled SmolLM2)."""
    max_embeds_bytes: int = option(256 * MiB, aliases=("EMBEDMESH_MAX_EMBEDS_BYTES",))
    """Cap on one decoded prompt_embeds tensor, in bytes; checked before allocation."""
    max_message_bytes: int = option(512 * MiB, aliases=("EMBEDMESH_MAX_MESSAGE_BYTES",))
    """Largest gRPC message accepted or sent."""
    max_n: int = 16
    """Largest `n` (choices per prompt)."""
    max_prompts: int = 64
    """Most prompts in one request."""
    max_messages: int = 2048
    """Most messages in one chat request; checked before any is read or rendered."""
    max_images_per_request: int = 16
    """Most image parts in one chat request; checked before any image is fetched, decoded or encoded."""
    metrics_port: int = 0
    """Prometheus /metrics port (0 = none)."""
    cache_capacity_bytes: int = option(1 << 30, aliases=("EMBEDMESH_CACHE_CAPACITY_BYTES",))
    """In-process L1 of the encoder cache (decoded payloads and uploaded tensors), in bytes."""
    prompt_cache_bytes: int = 64 << 20
    """Prompt cache: token ids of rendered prompt text cut at the tokenizer's added tokens, by content, LRU (a shared
    system prompt or an earlier turn is tokenized once); per tokenizer, in bytes; 0 = off."""
    redis_url: str = option("", aliases=("REDIS_URL",))
    """Redis for the shared L2; empty = L1 only, the embedded default."""
    upload_ttl_seconds: int = option(3600, flags=("--upload-ttl",), aliases=("EMBEDMESH_UPLOAD_TTL_SECONDS",))
    """Default lifetime of tensors uploaded once and referred to by id."""
    routers: tuple[str, ...] = option((), aliases=("EMBEDMESH_ROUTERS",), metavar="host:port")
    """KV router addresses, comma-separated; empty = round robin over the workers (or --embedded-router)."""
    embedded_router: bool = False
    """Run the KV router in this process, on this port (workers give this address as their --routers): routing
    costs no network hop. One preprocessor per router: with several replicas, run the router service instead. The
    router's EMBEDMESH_ROUTER_* settings (weights, stale and approximate-block times) apply."""
    block_size: int = option(16, aliases=("EMBEDMESH_BLOCK_SIZE",))
    """Positions per block for routing hashes (must match the workers')."""
    max_inflight: int = 256
    """Requests (completions, chats, embeddings) served at once; past it a new one is refused at once with
    UNAVAILABLE ``OVERLOADED`` and a retry delay."""
    fair_share_slots: int = 0
    """Generations run at once before the rest wait and are served by their keys' weight and priority (the
    workers' batch slots in all plus a couple: a slot freed between two engine steps is filled without idling the
    batch); 0 = off, first come, first served."""
    drain_seconds: float = option(30.0, aliases=("EMBEDMESH_DRAIN_GRACE_SECONDS",))
    """On SIGTERM: how long in-flight calls may finish before the worker channels close."""

    model_tokenizers: tuple[tuple[str, str], ...] = option((), aliases=("EMBEDMESH_MODEL_TOKENIZERS",),
                                                           metavar="name=folder")
    """(served model name, folder) for models other than the default one: each model's tokenizer and chat template
    (``--model-tokenizers name=folder,...``); models not listed use ``tokenizer``."""
    tool_call_parser: str = option("hermes", aliases=("EMBEDMESH_TOOL_CALL_PARSER",))
    """How tool calls are read from the model's output: ``hermes`` (``<tool_call>{...}</tool_call>``; the parsers
    are in ``preprocessor/tools.py``; vLLM's flag name)."""
    worker_streams: str = option("all", choices=WORKER_STREAMS)
    """Which workers get small generation requests as frames on one long-lived GenerateMany stream (a frame costs a
    fraction of a call) instead of a Generate call each: ``all``; ``routed`` = only the addresses the router names,
    while the configured ``--workers`` get calls (for a proxy such as an Envoy egress that balances per call over
    several workers, where one stream would stay on one of them); ``off``."""
    lora_load_on_demand: bool = option(False, aliases=("EMBEDMESH_LORA_LOAD_ON_DEMAND",))
    """A request naming a LoRA adapter that no healthy worker holds (but one held since start) loads it on the
    least-loaded worker of its model first; off: such a request is refused."""
    image_encoder: str = option("efficientnet-lite0", choices=("efficientnet-lite0", "dinov2", "off"))
    """The encode stage for chat ``image_url`` parts (docs/images.md): ``efficientnet-lite0`` = an ImageNet
    classifier + a training-free projector into the model's own input embeddings (a soft prompt of class names, built
    from the served model's folder on the first image); ``dinov2`` = DINOv2-small's 257 patch tokens through the
    LLaVA-style projector in ``--image-projector`` (plumbing only unless that projector was trained for it);
    ``off`` = image parts are refused."""
    model_image_encoders: tuple[tuple[str, str], ...] = option((), metavar="name=kind")
    """(served model name, encoder kind) for models whose image encoder is not ``--image-encoder``'s
    (``--model-image-encoders big=dinov2,text-only=off``): each served model gets rows of its own width from its own
    tower and projector; an ``off`` model refuses image parts. With ``--image-encoder-address``, a model of another
    kind than ``--image-encoder``'s (or with its own projector) encodes in this process (the service runs that kind)."""
    model_image_projectors: tuple[tuple[str, str], ...] = option((), metavar="name=folder")
    """(served model name, projector folder) for ``dinov2`` models whose projector is not ``--image-projector``'s
    (a projector writes rows of one model's hidden size)."""
    image_encoder_address: tuple[str, ...] = option((), metavar="host:port")
    """Image encode services (``embedmesh.services.image_encoder``, comma-separated, round robin): a cache miss is
    encoded there instead of in this process (the cache key and every rule stay here; their rows are validated as
    prompt_embeds). They must run ``--image-encoder``'s encoder; empty = encode in this process."""
    image_projector: str = ""
    """For ``--image-encoder dinov2``: a folder holding ``mm_projector.safetensors`` (or ``.bin``), LLaVA's
    ``0.weight, 0.bias, 2.weight, 2.bias`` of Linear(384 -> H), GELU, Linear(H -> H), H = each served model's hidden
    size; checked at start-up."""
    max_image_bytes: int = 20 * MiB
    """Cap on one image file (after base64 decoding), checked before decoding."""
    max_image_pixels: int = 4096 * 4096
    """Cap on one image's width x height, read from its header before the pixels are decoded."""
    image_url_hosts: tuple[str, ...] = option((), metavar="host")
    """Hosts whose http(s) image URLs the preprocessor fetches (exact names, comma-separated); empty = none, only
    inline data: URLs (a server fetching any URL a client names could be made to call internal addresses)."""
    image_fetch_timeout_seconds: float = 10.0
    """Deadline for fetching one http(s) image (with --image-url-hosts)."""

    migration_limit: int = 1
    """Times one sequence whose worker was lost or drained after tokens went to the client is continued on another
    worker, from its prompt plus those tokens (the client sees one stream; ``docs/operations.md``); 0 = such a
    request ends with UNAVAILABLE ``WORKER_LOST``."""
    migration_max_positions: int = 32768
    """Most positions (prompt + tokens already sent) a continuation may prefill again; a longer sequence ends with
    ``WORKER_LOST`` instead. 0 = no limit."""

    def __post_init__(self) -> None:
        from embedmesh.services.preprocessor.tools import PARSERS

        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {list(PARSERS)}, got {self.tool_call_parser!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.embedded_router and self.routers:
            raise ValueError("--embedded-router and --routers are exclusive: route in this process or ask routers")
        if not self.workers:
            raise ValueError("at least one worker address is required")
        if self.max_embeds_bytes < 1024:
            raise ValueError("max_embeds_bytes must be >= 1024")
        if self.max_message_bytes < 4 * MiB:
            raise ValueError("max_message_bytes must be >= 4 MiB")
        if self.prompt_cache_bytes < 0:
            raise ValueError("prompt_cache_bytes must be >= 0")
        if self.cache_capacity_bytes < 0 or self.upload_ttl_seconds < 1:
            raise ValueError("cache_capacity_bytes must be >= 0 and upload_ttl_seconds >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        self._check_request_bounds()
        if self.max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        if self.fair_share_slots < 0:
            raise ValueError("fair_share_slots must be >= 0")
        if self.max_image_bytes < 1024 or self.max_image_pixels < 1:
            raise ValueError("max_image_bytes must be >= 1024 and max_image_pixels >= 1")
        if not self.image_fetch_timeout_seconds > 0:
            raise ValueError("image_fetch_timeout_seconds must be > 0")
        if self.image_encoder == "dinov2" and not self.image_projector and not self.image_encoder_address:
            raise ValueError("image_encoder dinov2 needs image_projector (a folder holding mm_projector.safetensors) "
                             "or image_encoder_address")
        self._check_model_image_encoders()
        if self.migration_limit < 0 or self.migration_max_positions < 0:
            raise ValueError("migration_limit and migration_max_positions must be >= 0")
        if not self.drain_seconds >= 0:
            raise ValueError("drain_seconds must be >= 0")

    def _check_model_image_encoders(self) -> None:
        kinds = dict(self.model_image_encoders)
        if len(kinds) != len(self.model_image_encoders):
            raise ValueError("model_image_encoders names a model twice")
        for model, kind in kinds.items():
            if kind not in ("efficientnet-lite0", "dinov2", "off"):
                raise ValueError(f"model_image_encoders: model {model!r}: kind must be one of efficientnet-lite0, "
                                 f"dinov2, off; got {kind!r}")
        projectors = dict(self.model_image_projectors)
        for model in projectors:
            if kinds.get(model, self.image_encoder) != "dinov2":
                raise ValueError(f"model_image_projectors: model {model!r} does not use dinov2 (a projector is read "
                                 "only by dinov2)")
        for model, kind in kinds.items():
            if kind == "dinov2" and not (projectors.get(model) or self.image_projector):
                raise ValueError(f"model_image_encoders: model {model!r} uses dinov2 and needs a projector: "
                                 f"--model-image-projectors {model}=<folder> or --image-projector")

    def _check_request_bounds(self) -> None:
        if self.max_n < 1 or self.max_prompts < 1:
            raise ValueError("max_n and max_prompts must be >= 1")
        if self.max_messages < 1 or self.max_images_per_request < 0:
            raise ValueError("max_messages must be >= 1 and max_images_per_request >= 0")
