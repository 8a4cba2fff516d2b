"""Gateway configuration: one typed dataclass. CLI flags and environment variables are read here and nowhere else.

Each field is a flag ``--field-name`` and a variable ``EMBEDMESH_GATEWAY_<FIELD>`` (``embedmesh.core.config``;
``--help`` lists them with their defaults). Older names keep working: ``--request-timeout`` and
``EMBEDMESH_GATEWAY_REQUEST_TIMEOUT``, ``EMBEDMESH_PREPROCESSOR_ADDR``, ``EMBEDMESH_VECTOR_STORE_ADDR``.

API keys, TLS and the mesh token are read by ``embedmesh.core.security`` (the same flags on every service); the
drain grace and HTTPS files by ``main.py``.

A flag beats its env var, which beats the default.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedmesh.core.config import Settings, option

__all__ = ["GatewayConfig"]


@dataclass(frozen=True)
class GatewayConfig(Settings, service="gateway", prog="python -m embedmesh.gateway.main",
                    description="Run the embedmesh OpenAI-compatible REST gateway."):
    """How the gateway listens and where it sends requests."""

    host: str = "127.0.0.1"
    """Interface to bind; 0.0.0.0 in containers."""
    port: int = 8000
    """HTTP port in [0, 65535]; 0 picks a free one."""
    preprocessor: str = option("127.0.0.1:50051", aliases=("EMBEDMESH_PREPROCESSOR_ADDR",))
    """host:port of the public gRPC InferenceService (the preprocessor, or an Envoy in front of its replicas)."""
    vector_store: str = option("", aliases=("EMBEDMESH_VECTOR_STORE_ADDR",))
    """host:port of the VectorStoreService; empty = none (its routes are not served)."""
    batch_db: str = ""
    """Where the Batch API keeps batches, their files and each line's result: a PostgreSQL URL
    (``postgresql://...``), a SQLite file, or empty for ``$EMBEDMESH_CACHE/batches.sqlite3``."""
    batch_secret_file: str = ""
    """A file whose contents seal the Authorization header each batch runs under (required with PostgreSQL: the
    same file on every gateway); empty with SQLite = a random key made once in ``<batch_db>.key`` (mode 0600)."""
    batch_runner_id: str = ""
    """This gateway's name in batch leases; empty = ``host:port``, so a restarted gateway takes its batches back
    at once (another gateway waits until the lease ends)."""
    batch_concurrency: int = 4
    """Batch lines this gateway runs at once, all batches together (>= 1)."""
    batch_pause_inflight: int = 1
    """Batch lines start only while fewer interactive requests than this are in flight at this gateway (lower
    priority than interactive traffic); 0 = they never wait."""
    batch_busy_concurrency: int = 1
    """Batch lines run at once while interactive requests were in flight at this gateway in the last second: 1 = the
    batch trickles, one line at a time, between them (progress under steady traffic); 0 = it waits for a quiet
    second, however long the traffic lasts (bench/bench_batch.py measures both)."""
    batch_order: str = option("prefix", choices=("prefix", "file"))
    """Order a batch's lines run in: ``prefix`` (lines sharing a prompt start back to back, for the prefix cache)
    or ``file`` (as in the file: for comparison in bench/bench_batch.py)."""
    batch_max_file_bytes: int = 100 << 20
    """Largest batch input file (``purpose=batch``), in bytes (>= 1 KiB)."""
    batch_max_lines: int = 50_000
    """Most requests in one batch input file (>= 1)."""
    max_body_bytes: int = 1 << 30
    """Largest request body accepted, in bytes (413 above it); at least 1 KiB."""
    max_messages: int = 2048
    """Most messages in one chat request, and input items in one ``/v1/responses`` request (with the stored
    conversation it continues): more is a 400 naming ``messages`` / ``input``, before any is converted
    (``body_bounds.py`` lists the other list bounds). The preprocessor's ``--max-messages`` has the same default."""
    request_timeout_seconds: float = option(600.0, flags=("--request-timeout",),
                                            aliases=("EMBEDMESH_GATEWAY_REQUEST_TIMEOUT",))
    """Deadline of each completion/embedding gRPC call, in seconds (> 0); a stream must end within it."""
    metrics_require_key: bool = False
    """Whether ``/metrics`` needs an API key too (when keys are configured)."""
    max_inflight: int = 512
    """Requests in flight at once (streams until their last byte); more get 503 + Retry-After at once. 0 = no
    limit."""
    tenant_share: float = 0.5
    """With API keys: the fraction of ``max_inflight`` one tenant may hold (its key's concurrency limit, when
    lower, wins); past it that tenant gets 429 at once, before its body is read, and the rest stay for others."""
    anon_connections_per_ip: int = 64
    """With API keys: connections one IP address may hold without having shown a valid key (a new one past it closes
    the address's oldest idle one, or serves only keyed requests); 0 = no cap (``client_caps.py``)."""
    anon_requests_per_ip: int = 32
    """With API keys: requests without a valid key in flight from one IP address; past it 429 + Retry-After at once;
    0 = no cap."""
    pieces_min_bytes: int = 8 << 20
    """Requests whose torch.save ``prompt_embeds`` payloads hold at least this many bytes of values go to the
    preprocessor as a Generate pieces stream, the values in 1 MiB pieces (``pieces_body.py``); 0 = always one
    message."""
    responses_db: str = ""
    """Where ``/v1/responses`` stores responses: a PostgreSQL URL (``postgresql://...``), a SQLite file, or empty
    for ``$EMBEDMESH_CACHE/responses.sqlite3``."""
    responses_ttl_seconds: float = 30 * 24 * 3600.0
    """How long a stored response stays readable (and continuable by ``previous_response_id``), in seconds (> 0)."""
    grpc_port: int = 0
    """Port of the Responses API over gRPC (``embedmesh.responses.v1.ResponsesService``, plaintext, on ``host``);
    0 = not served."""

    def __post_init__(self) -> None:
        if self.batch_concurrency < 1 or self.batch_pause_inflight < 0 or self.batch_max_lines < 1 \
                or self.batch_busy_concurrency < 0:
            raise ValueError("batch_concurrency and batch_max_lines must be >= 1, batch_pause_inflight and "
                             "batch_busy_concurrency >= 0")
        if self.batch_max_file_bytes < 1024:
            raise ValueError(f"batch_max_file_bytes must be >= 1024, got {self.batch_max_file_bytes}")
        if not 0 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port must be in [0, 65535], got {self.grpc_port}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.preprocessor:
            raise ValueError("preprocessor address is required (host:port)")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {self.max_messages}")
        if self.pieces_min_bytes < 0:
            raise ValueError(f"pieces_min_bytes must be >= 0, got {self.pieces_min_bytes}")
        if self.max_inflight < 0:
            raise ValueError(f"max_inflight must be >= 0, got {self.max_inflight}")
        if self.anon_connections_per_ip < 0 or self.anon_requests_per_ip < 0:
            raise ValueError("anon_connections_per_ip and anon_requests_per_ip must be >= 0, got "
                             f"{self.anon_connections_per_ip} and {self.anon_requests_per_ip}")
        if not 0 < self.tenant_share <= 1:
            raise ValueError(f"tenant_share must be in (0, 1], got {self.tenant_share}")
        if not self.responses_ttl_seconds > 0:
            raise ValueError(f"responses_ttl_seconds must be > 0, got {self.responses_ttl_seconds}")
        if not self.request_timeout_seconds > 0:
            raise ValueError(f"request_timeout_seconds must be > 0, got {self.request_timeout_seconds}")

    def __str__(self) -> str:
        return "GatewayConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.describe().items()) + ")"
