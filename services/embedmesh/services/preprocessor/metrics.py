"""Every Prometheus metric the preprocessor exports, in one place (names and labels are part of the operators'
dashboards: change none of them). Those with labels keep their children (``telemetry.CachedCounter``...): several
are labelled on every request."""

from __future__ import annotations

from prometheus_client import Gauge

from embedmesh.core.telemetry import CachedCounter, CachedGauge, CachedHistogram

__all__ = ["INFLIGHT", "REJECTED", "GENERATE_CALLS", "TTFT", "PROMPT_TOKENS", "GENERATED_TOKENS", "WORKER_RETRIES",
           "WORKER_FAILURES", "REQUEST_TOKENS_PER_SECOND", "FAIR_SHARE_WAITING"]

# --- admission (servicer.Admission) ---------------------------------------------------------------------------
INFLIGHT = Gauge("embedmesh_preprocessor_inflight_requests", "Requests the preprocessor is serving now")
REJECTED = CachedCounter("embedmesh_preprocessor_rejected_total", "Requests refused at once because the "
                         "preprocessor was at --max-inflight", ["rpc"])
GENERATE_CALLS = CachedCounter("embedmesh_preprocessor_generate_total", "Generate calls taken past admission, by "
                               "task (completion, chat), stream (true, false) and how the prompt tensors' bytes "
                               "came: in the header message (message) or as rows after it (pieces)",
                               ["task", "stream", "transport"])

# --- fair share (fair_share.FairShare) ---------------------------------------------------------------------
FAIR_SHARE_WAITING = CachedGauge("embedmesh_preprocessor_fair_share_waiting", "Requests waiting for a generation "
                                 "slot (--fair-share-slots), by the priority of their key", ["priority"])

# --- completions (pipeline.run_job) ---------------------------------------------------------------------------
TTFT = CachedHistogram("embedmesh_time_to_first_token_seconds", "Request start to the first generated text, per "
                       "model", ["model"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
PROMPT_TOKENS = CachedCounter("embedmesh_prompt_tokens_total", "Prompt positions (text tokens + embedding rows)",
                              ["model", "kind"])
GENERATED_TOKENS = CachedCounter("embedmesh_generated_tokens_total", "Tokens generated, per model", ["model"])
WORKER_RETRIES = CachedCounter("embedmesh_worker_retries_total", "Sequences sent to a second worker because the "
                               "first failed, refused or aborted them before any output", ["reason"])
WORKER_FAILURES = CachedCounter("embedmesh_worker_call_failures_total", "Calls to workers that failed, by gRPC code",
                                ["code"])
REQUEST_TOKENS_PER_SECOND = CachedHistogram("embedmesh_request_tokens_per_second", "Decode speed seen by one "
                                            "request", ["model"],
                                            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000))
