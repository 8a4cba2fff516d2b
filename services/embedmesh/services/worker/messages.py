"""Protobuf <-> engine domain types for the worker. The only module here that sees ``*_pb2``."""

from __future__ import annotations

from collections.abc import Callable

from embedmesh.common.v1 import common_pb2
from embedmesh.core import tensors
from embedmesh.core.errors import InvalidArgument
from embedmesh.core.sampling import sampling_from_proto
from embedmesh.core.transport import pieces
from embedmesh.core.transport.received import Received
from embedmesh.services.worker.engines.base import (
    EmbedsSegment,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    Segment,
    TokenLogprob,
    TokenSegment,
)
from embedmesh.services.worker.validate import check_generation, check_task, embeds_from_wire
from embedmesh.worker.v1 import worker_pb2

__all__ = ["request_from_proto", "delta_to_proto", "info_to_proto", "FINISH_TO_PROTO"]

FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}

def request_from_proto(req: worker_pb2.GenerateRequest, info: ModelInfo,
                       arrival: pieces.Arrival | None = None) -> GenerationRequest:
    """Convert and check a GenerateRequest against the served model (``validate``): every engine gets only
    requests that keep the rules it relies on, whoever sent them. ``arrival``: the bytes of its data-less embeds
    tensors (``rows`` frames, ``pieces.expect``), all arrived; each tensor is read as any received one is
    (``Arrival.received``, ``Received.tensor``, ``WireTensor.read``)."""
    if not req.request_id:
        raise InvalidArgument("request_id is required", field="request_id", reason="REQUIRED")
    check_task(info)
    sampling = sampling_from_proto(req.sampling)
    if sampling.max_tokens == 0 and sampling.prompt_logprobs is None:
        raise InvalidArgument("max_tokens must be >= 1", field="max_tokens", reason="OUT_OF_RANGE")
    received = arrival.received() if arrival is not None else Received(req)
    segments: list[Segment] = []
    for i, seg in enumerate(req.segments):
        kind = seg.WhichOneof("kind")
        if kind == "token_ids":
            segments.append(TokenSegment(tuple(seg.token_ids.ids)))
        elif kind == "embeds":
            path = f"segments[{i}].embeds"
            tensor = received.tensor(path, seg.embeds)
            arr, dtype = tensor.read(path)
            # Cast to the model dtype here (a copy only when the wire dtype differs), scanned for NaN/Inf once:
            # rows the arrival scanned as they landed (the model's dtype, ``servicer._expect``) are not scanned again.
            rows = embeds_from_wire(arr, dtype, info, max_tokens=sampling.max_tokens, scanned=tensor.scanned)
            segments.append(EmbedsSegment(rows))
        else:
            raise InvalidArgument(f"segments[{i}] is empty", field=f"segments[{i}]", reason="EMPTY_SEGMENT")
    request = GenerationRequest(req.request_id, segments, sampling, req.lora_adapter, tuple(req.resume_token_ids))
    check_generation(request, info)
    return request


TokenText = Callable[[int], str]
"""A token id's text, as the engine's tokenizer decodes that one token alone."""


def _token_fields(text: str) -> tuple[str, bytes]:
    """A token's text for the proto string field and its bytes: a lone surrogate (a tokenizer that maps bytes to
    surrogates) keeps its bytes and shows as U+FFFD in the text, which protobuf would otherwise refuse."""
    raw = text.encode("utf-8", "surrogatepass")
    if text.isascii():
        return text, raw
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text), raw


def logprob_to_proto(lp: TokenLogprob, token_text: TokenText | None) -> common_pb2.TokenLogprob:
    """Domain log-probability -> proto, each token's text and UTF-8 bytes filled in by ``token_text``."""
    def text(t: int) -> str:
        return token_text(t) if token_text is not None else ""

    tok, raw = _token_fields(text(lp.token_id))
    out = common_pb2.TokenLogprob(token_id=lp.token_id, token=tok, bytes=raw)
    if lp.logprob is not None:
        out.logprob = lp.logprob
    for t, value in lp.top:
        alt, alt_raw = _token_fields(text(t))
        out.top.append(common_pb2.TopLogprob(token_id=t, token=alt, logprob=value, bytes=alt_raw))
    return out


def delta_to_proto(d: GenerationDelta, prompt_tokens: int,
                   token_text: TokenText | None = None) -> worker_pb2.GenerateResponse:
    msg = worker_pb2.GenerateResponse(
        text=d.text,
        token_ids=list(d.token_ids),
        finish_reason=FINISH_TO_PROTO[d.finish_reason],
        prompt_tokens=prompt_tokens if d.finish_reason is not None else 0,
        completion_tokens=d.completion_tokens,
    )
    if d.logprobs:
        msg.logprobs.extend(logprob_to_proto(lp, token_text) for lp in d.logprobs)
    if d.prompt_logprobs:
        msg.prompt_logprobs.extend(logprob_to_proto(lp, token_text) for lp in d.prompt_logprobs)
    return msg


def info_to_proto(info: ModelInfo, worker_id: str, resumes: bool = False) -> worker_pb2.GetInfoResponse:
    return worker_pb2.GetInfoResponse(
        model=info.model,
        engine=info.engine,
        hidden_size=info.hidden_size,
        max_context_tokens=info.max_context_tokens,
        dtype=tensors.dtype_from_name(info.dtype),
        vocab_size=info.vocab_size,
        worker_id=worker_id,
        max_batch_size=info.max_batch_size,
        task=worker_pb2.MODEL_TASK_EMBED if info.task == "embed" else worker_pb2.MODEL_TASK_GENERATE,
        embedding_size=info.embedding_size,
        supports_dimensions=info.supports_dimensions,
        resumes_generation=resumes,
    )
