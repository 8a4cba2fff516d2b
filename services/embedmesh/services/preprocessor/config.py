"""Preprocessor configuration: one typed dataclass; CLI flags and ``EMBEDMESH_*`` env vars are read here only."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass

__all__ = ["PreprocessorConfig"]

MiB = 1024 * 1024


@dataclass(frozen=True)
class PreprocessorConfig:
    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 50051
    """gRPC port of the public inference API (0 = any free port)."""
    workers: tuple[str, ...] = ("127.0.0.1:50061",)
    """Worker addresses (host:port)."""
    tokenizer: str = "default"
    """Model folder whose tokenizer.json is used for text prompts ("default" = the bundled SmolLM2)."""
    max_embeds_bytes: int = 256 * MiB
    """Cap on one decoded prompt_embeds tensor (EMBEDMESH_MAX_EMBEDS_BYTES); checked before allocation."""
    max_message_bytes: int = 512 * MiB
    """Largest gRPC message accepted or sent."""
    max_n: int = 16
    """Largest `n` (choices per prompt)."""
    max_prompts: int = 64
    """Most prompts in one request."""
    metrics_port: int = 0
    """Prometheus /metrics port (0 = none)."""
    cache_capacity_bytes: int = 1 << 30
    """In-process L1 of the encoder cache (decoded payloads and uploaded tensors), in bytes."""
    redis_url: str = ""
    """Redis for the shared L2 (REDIS_URL); empty = L1 only, the embedded default."""
    upload_ttl_seconds: int = 3600
    """Default lifetime of tensors uploaded once and referred to by id."""
    routers: tuple[str, ...] = ()
    """KV router addresses; empty = round robin over the workers."""
    block_size: int = 16
    """Positions per block for routing hashes (must match the workers')."""
    max_inflight: int = 256
    """Requests (completions, chats, embeddings) served at once; past it a new one is refused at once with
    UNAVAILABLE ``OVERLOADED`` and a retry delay (EMBEDMESH_PREPROCESSOR_MAX_INFLIGHT)."""
    drain_seconds: float = 30.0
    """On SIGTERM: how long in-flight calls may finish before the worker channels close
    (EMBEDMESH_DRAIN_GRACE_SECONDS)."""

    model_tokenizers: tuple[tuple[str, str], ...] = ()
    """(served model name, folder) for models other than the default one: each model's tokenizer and chat template
    (``--model-tokenizers name=folder,...``); models not listed use ``tokenizer``."""
    tool_call_parser: str = "hermes"
    """How tool calls are read from the model's output (``preprocessor/tools.py``; vLLM's flag name)."""
    lora_load_on_demand: bool = False
    """A request naming a LoRA adapter that no healthy worker holds (but one held since start) loads it on the
    least-loaded worker of its model first (EMBEDMESH_LORA_LOAD_ON_DEMAND); off: such a request is refused."""

    def __post_init__(self) -> None:
        from embedmesh.services.preprocessor.tools import PARSERS

        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {list(PARSERS)}, got {self.tool_call_parser!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.workers:
            raise ValueError("at least one worker address is required")
        if self.max_embeds_bytes < 1024:
            raise ValueError("max_embeds_bytes must be >= 1024")
        if self.max_message_bytes < 4 * MiB:
            raise ValueError("max_message_bytes must be >= 4 MiB")
        if self.cache_capacity_bytes < 0 or self.upload_ttl_seconds < 1:
            raise ValueError("cache_capacity_bytes must be >= 0 and upload_ttl_seconds >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_n < 1 or self.max_prompts < 1:
            raise ValueError("max_n and max_prompts must be >= 1")
        if self.max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        if not self.drain_seconds >= 0:
            raise ValueError("drain_seconds must be >= 0")

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> PreprocessorConfig:
        env = os.environ
        p = argparse.ArgumentParser(prog="embedmesh-preprocessor", description="Run the embedmesh preprocessor.")
        p.add_argument("--host", default=env.get("EMBEDMESH_PREPROCESSOR_HOST", cls.host))
        p.add_argument("--port", type=int, default=int(env.get("EMBEDMESH_PREPROCESSOR_PORT", cls.port)))
        p.add_argument("--workers", default=env.get("EMBEDMESH_WORKERS", ",".join(cls.workers)),
                       help="comma-separated worker addresses")
        p.add_argument("--tokenizer", default=env.get("EMBEDMESH_TOKENIZER", cls.tokenizer))
        p.add_argument("--max-embeds-bytes", type=int,
                       default=int(env.get("EMBEDMESH_MAX_EMBEDS_BYTES", cls.max_embeds_bytes)))
        p.add_argument("--max-message-bytes", type=int,
                       default=int(env.get("EMBEDMESH_MAX_MESSAGE_BYTES", cls.max_message_bytes)))
        p.add_argument("--metrics-port", type=int, default=int(env.get("EMBEDMESH_PREPROCESSOR_METRICS_PORT", 0)))
        p.add_argument("--cache-capacity-bytes", type=int,
                       default=int(env.get("EMBEDMESH_CACHE_CAPACITY_BYTES", cls.cache_capacity_bytes)))
        p.add_argument("--redis-url", default=env.get("REDIS_URL", ""))
        p.add_argument("--upload-ttl", type=int, default=int(env.get("EMBEDMESH_UPLOAD_TTL_SECONDS", 3600)))
        p.add_argument("--routers", default=env.get("EMBEDMESH_ROUTERS", ""), help="comma-separated addresses")
        p.add_argument("--block-size", type=int, default=int(env.get("EMBEDMESH_BLOCK_SIZE", cls.block_size)))
        p.add_argument("--max-inflight", type=int,
                       default=int(env.get("EMBEDMESH_PREPROCESSOR_MAX_INFLIGHT", cls.max_inflight)),
                       help="requests served at once; more are refused with a retry delay")
        p.add_argument("--drain-seconds", type=float,
                       default=float(env.get("EMBEDMESH_DRAIN_GRACE_SECONDS", cls.drain_seconds)),
                       help="on SIGTERM, how long in-flight calls may finish")
        p.add_argument("--model-tokenizers", default=env.get("EMBEDMESH_MODEL_TOKENIZERS", ""),
                       help="name=folder,...: the tokenizer and chat template of each further served model")
        p.add_argument("--tool-call-parser", default=env.get("EMBEDMESH_TOOL_CALL_PARSER", cls.tool_call_parser),
                       help="format of tool calls in the model's output: hermes (<tool_call>{...}</tool_call>)")
        p.add_argument("--lora-load-on-demand", action=argparse.BooleanOptionalAction,
                       default=env.get("EMBEDMESH_LORA_LOAD_ON_DEMAND", "").lower() in ("1", "true", "yes"),
                       help="load a known LoRA adapter on the least-loaded worker when a request names it and "
                            "no worker holds it")
        a = p.parse_args(argv)
        workers = tuple(w.strip() for w in a.workers.split(",") if w.strip())
        model_tokenizers = []
        for item in (x.strip() for x in a.model_tokenizers.split(",") if x.strip()):
            name, sep, folder = item.partition("=")
            if not sep or not name or not folder:
                p.error(f"--model-tokenizers: {item!r} is not name=folder")
            model_tokenizers.append((name, folder))
        try:
            return cls(a.host, a.port, workers, a.tokenizer, a.max_embeds_bytes, a.max_message_bytes,
                       metrics_port=a.metrics_port, cache_capacity_bytes=a.cache_capacity_bytes,
                       redis_url=a.redis_url, upload_ttl_seconds=a.upload_ttl,
                       routers=tuple(r.strip() for r in a.routers.split(",") if r.strip()), block_size=a.block_size,
                       max_inflight=a.max_inflight, drain_seconds=a.drain_seconds,
                       tool_call_parser=a.tool_call_parser, model_tokenizers=tuple(model_tokenizers),
                       lora_load_on_demand=a.lora_load_on_demand)
        except ValueError as e:  # a bad value: argparse's usage + message, exit status 2, no traceback
            p.error(str(e))

    def describe(self) -> dict[str, object]:
        return asdict(self)
