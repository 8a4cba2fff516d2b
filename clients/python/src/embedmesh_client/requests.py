"""Request builders shared by the sync and async clients (pure functions, no I/O)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from embedmesh.cache.v1 import cache_pb2
from embedmesh.common.v1 import common_pb2
from embedmesh.inference.v1 import inference_pb2
from embedmesh_client.tensors import tensor_parts, to_tensor

__all__ = ["completion_params", "chat_params", "embed_request", "put_messages", "chunk_messages", "fill_rows",
           "CHUNK_BYTES", "CHUNKED_MIN"]

CHUNK_BYTES = 1 << 20
CHUNKED_MIN = 1 << 20
"""Generations whose raw tensors hold at least this many bytes send them as rows after the Generate header, in
CHUNK_BYTES pieces (no message size limit to raise anywhere on the way); smaller ones go as one message."""
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs", "min_tokens")


def _sampling(kw: dict[str, Any]) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    for name in _SAMPLING:
        if kw.get(name) is not None:
            setattr(s, name, kw[name])
    stop = kw.get("stop")
    if stop:
        s.stop.extend([stop] if isinstance(stop, str) else stop)
    for token, bias in (kw.get("logit_bias") or {}).items():
        s.logit_bias[int(token)] = float(bias)
    schema = kw.get("json_schema")
    if schema is not None:  # a dict or JSON text: the output is one JSON value valid against it
        s.structured.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
    if kw.get("regex") is not None:
        s.structured.regex = kw["regex"]
    if kw.get("choice") is not None:
        s.structured.choice.values.extend(kw["choice"])
    unknown = set(kw) - set(_SAMPLING) - {"stop", "logit_bias", "json_schema", "regex", "choice"}
    if unknown:
        raise TypeError(f"unknown sampling arguments: {sorted(unknown)}")
    return s


def _embeds(value: Any, rows: list[memoryview] | None = None) -> inference_pb2.PromptEmbeds:
    """A PromptEmbeds entry; with ``rows``, a tensor's bytes are appended there instead of set as its ``data``."""
    if isinstance(value, str):
        return inference_pb2.PromptEmbeds(cache_id=value)
    if rows is None:
        return inference_pb2.PromptEmbeds(tensor=to_tensor(value))
    head, data = tensor_parts(value)
    rows.append(data)
    return inference_pb2.PromptEmbeds(tensor=head)


def completion_params(model: str, prompt: str | Sequence[str] | None = None, embeds: Any = None,
                      token_ids: Sequence[Sequence[int]] | None = None, prefix: Any = None, n: int | None = None,
                      rows: list[memoryview] | None = None, **sampling: Any) -> inference_pb2.CompletionParams:
    """``embeds``: an array/tensor, an upload id (str), or a list of those (one choice each). With ``rows``, the
    tensors carry no ``data``: their bytes are appended to ``rows`` in the order Generate sends them."""
    p = inference_pb2.CompletionParams(model=model, sampling=_sampling(sampling))
    if prompt is not None:
        p.prompts.extend([prompt] if isinstance(prompt, str) else prompt)
    if embeds is not None:
        items = embeds if isinstance(embeds, list | tuple) else [embeds]
        p.prompt_embeds.extend(_embeds(e, rows) for e in items)
    for ids in token_ids or ():
        p.prompt_token_ids.append(inference_pb2.TokenIds(ids=list(ids)))
    if prefix is not None:
        p.prefix.CopyFrom(_embeds(prefix, rows))
    if n is not None:
        p.n = n
    return p


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def chunk_messages(request: bytes, rows: Sequence[memoryview]) -> Iterator[bytes]:
    """A Generate stream as message bytes: ``request`` (a serialized GenerateHeader whose tensors carry no data),
    then ``rows`` in ``CHUNK_BYTES`` pieces, each copied once, as it is sent (field 1 ``request``, field 2 ``rows``
    of GenerateRequest)."""
    yield b"\x0a" + _varint(len(request)) + request
    for view in rows:
        for i in range(0, len(view), CHUNK_BYTES):
            piece = view[i:i + CHUNK_BYTES]
            yield b"".join((b"\x12", _varint(len(piece)), piece))


def fill_rows(params: Any, rows: Sequence[memoryview]) -> None:
    """Put ``rows`` back as the ``data`` of the tensors they were taken from (``completion_params`` /
    ``chat_params`` with ``rows``), for a request sent as one message."""
    if isinstance(params, inference_pb2.CompletionParams):
        tensors = [pe.tensor for pe in params.prompt_embeds if pe.WhichOneof("source") == "tensor"]
        if params.HasField("prefix") and params.prefix.WhichOneof("source") == "tensor":
            tensors.append(params.prefix.tensor)
    else:
        tensors = [part.prompt_embeds.tensor for m in params.messages for part in m.parts
                   if part.WhichOneof("kind") == "prompt_embeds"
                   and part.prompt_embeds.WhichOneof("source") == "tensor"]
    for tensor, data in zip(tensors, rows, strict=True):
        tensor.data = data.tobytes()


def chat_params(model: str, messages: Sequence[dict[str, Any]], n: int | None = None,
                tools: Sequence[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
                rows: list[memoryview] | None = None, **sampling: Any) -> inference_pb2.ChatParams:
    """Messages as in OpenAI's API; content parts ``{"type": "prompt_embeds", "tensor": array}`` or ``"id": ...``,
    images as ``{"type": "image", "data": file_bytes}`` or OpenAI's ``image_url`` part. With ``rows``, as
    ``completion_params``."""
    p = inference_pb2.ChatParams(model=model, sampling=_sampling(sampling))
    for m in messages:
        msg = inference_pb2.ChatMessage(role=m["role"], name=m.get("name", ""))
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else (content or [])
        for part in parts:
            if part["type"] == "text":
                msg.parts.append(inference_pb2.ChatContentPart(text=part["text"]))
            elif part["type"] == "prompt_embeds":
                source = part.get("id") or part.get("tensor")
                msg.parts.append(inference_pb2.ChatContentPart(prompt_embeds=_embeds(source, rows)))
            elif part["type"] in ("image", "image_url"):
                msg.parts.append(inference_pb2.ChatContentPart(image=_image(part)))
            else:
                raise ValueError(f"unknown content part type {part['type']!r}")
        p.messages.append(msg)
    for t in tools or ():
        fn = t.get("function", t)
        p.tools.append(inference_pb2.Tool(name=fn["name"], description=fn.get("description", ""),
                                          parameters_json=json.dumps(fn.get("parameters") or {})))
    if isinstance(tool_choice, str):
        p.tool_choice.mode = tool_choice
    elif tool_choice is not None:
        p.tool_choice.function = tool_choice.get("function", tool_choice)["name"]
    if n is not None:
        p.n = n
    return p


def _image(part: dict[str, Any]) -> inference_pb2.ImageInput:
    """``{"type": "image", "data": <PNG/JPEG/WebP file bytes>}`` (sent as they are, no base64), or OpenAI's
    ``{"type": "image_url", "image_url": {"url": "data:..." | "https://..."}}``."""
    if part["type"] == "image":
        data = part.get("data")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError('an "image" part needs "data": the image file\'s bytes')
        return inference_pb2.ImageInput(data=bytes(data))
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise ValueError('an "image_url" part needs "image_url": {"url": "data:image/png;base64,..."}')
    return inference_pb2.ImageInput(url=url)


def embed_request(model: str, inputs: str | Sequence[str] | Sequence[Sequence[int]],
                  dimensions: int | None = None) -> inference_pb2.EmbedRequest:
    req = inference_pb2.EmbedRequest(model=model)
    for item in [inputs] if isinstance(inputs, str) else inputs:
        if isinstance(item, str):
            req.inputs.append(inference_pb2.EmbedInput(text=item))
        else:
            req.inputs.append(inference_pb2.EmbedInput(token_ids=inference_pb2.TokenIds(ids=list(item))))
    if dimensions is not None:
        req.dimensions = dimensions
    return req


def put_messages(tensor: Any, ttl_seconds: int | None = None) -> Iterator[cache_pb2.PutRequest]:
    """A Put stream: header, then ~1 MiB chunks of the raw bytes (no message ever near gRPC's size limits)."""
    t, data = tensor_parts(tensor)  # the bytes as a view of the array: each chunk is its only copy
    header = cache_pb2.PutHeader(dtype=t.dtype, shape=t.shape)
    if ttl_seconds is not None:
        header.ttl_seconds = ttl_seconds
    yield cache_pb2.PutRequest(header=header)
    for i in range(0, len(data), CHUNK_BYTES):
        yield cache_pb2.PutRequest(chunk=bytes(data[i:i + CHUNK_BYTES]))
